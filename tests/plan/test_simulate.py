"""`jaxmem.simulate`: compute and copy streams, stalls, overhead (AutoSwap, Zhang et al. §IV-E)."""

from __future__ import annotations

import pytest

import jaxmem
import models
from jaxmem._src.plan.schedule import StepKind, build_schedule
from jaxmem._src.planners.greedy import greedy

SLOW_LINK = jaxmem.DeviceProfile("slow-link", 1e12, 1e9, 1e12, 1e11, 1e11, None, 0.0, True, "test")
SHARED_ENGINE = jaxmem.DeviceProfile("one-engine", 1e12, 1e9, 1e12, 1e11, 1e11, None, 0.0, False,
                                     "test")


@pytest.fixture(scope="module")
def program():
  grad, args = models.tanh_mlp(depth=6, width=256, batch=2048)
  return jaxmem.analyze(grad, *args)


def test_no_plan_no_overhead(program):
  plan = greedy(program, program.peak_bytes)
  sim = jaxmem.simulate(plan, "h100-pcie")
  assert sim.stall_s == 0 and sim.recompute_s == 0 and sim.copied_bytes == 0
  assert sim.step_time_s == pytest.approx(sim.unplanned_time_s, rel=0.02)
  assert len(sim.step_start_s) == len(plan.schedule().steps) + 1
  assert "simulated on h100-pcie" in str(sim)


def test_sync_copies_stall_for_their_full_time(program):
  plan = greedy(program, int(program.peak_bytes * 0.6), SLOW_LINK, allow_remat=False)
  assert plan.num_offload > 0
  sched = build_schedule(program, plan.decisions, plan.pinned, copies="sync")
  sim = jaxmem.simulate(None, SLOW_LINK, schedule=sched)
  # Every copy blocks the compute stream: the stall is the copies' time (2 per round trip).
  assert sim.copied_bytes == plan.offloaded_bytes
  assert sim.stall_s == pytest.approx(2 * plan.offloaded_bytes / 1e9, rel=1e-6)
  copies = [e for e in sim.timeline if e.kind == "copy"]
  assert {e.stream for e in copies} == {"d2h", "h2d"}
  assert sim.step_time_s == pytest.approx(sim.unplanned_time_s + sim.stall_s, rel=0.05)


def test_async_copies_overlap_and_one_engine_serializes(program):
  budget = int(program.peak_bytes * 0.6)
  plan = greedy(program, budget, SLOW_LINK, allow_remat=False)
  sync = jaxmem.simulate(None, SLOW_LINK, schedule=build_schedule(
      program, plan.decisions, plan.pinned, copies="sync"))
  sched = build_schedule(program, plan.decisions, plan.pinned, copies="async", window=64.0,
                         budget=None)
  kinds = {st.kind for st in sched.steps}
  assert StepKind.OFFLOAD_START in kinds and StepKind.OFFLOAD_DONE in kinds
  duplex = jaxmem.simulate(None, SLOW_LINK, schedule=sched)
  shared = jaxmem.simulate(None, SHARED_ENGINE, schedule=sched)
  assert duplex.stall_s < sync.stall_s
  assert shared.stall_s >= duplex.stall_s
  # On one engine no two copies overlap in time.
  copies = sorted((e for e in shared.timeline if e.kind == "copy"), key=lambda e: e.start_s)
  assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(copies, copies[1:]))
  # A fetch never starts before its value's offload has finished.
  off = {e.name.split(" ", 1)[1]: e.end_s for e in duplex.timeline if e.name.startswith("offload")}
  assert all(e.start_s >= off[e.name.split(" ", 1)[1]] - 1e-12
             for e in duplex.timeline if e.name.startswith("fetch") and e.kind == "copy")


def test_accessed_bytes_count_what_is_stored_and_what_recomputation_adds(program):
  """The unplanned step moves its stored values' bytes; a recomputation moves more."""
  import numpy as np

  unplanned = jaxmem.simulate(greedy(program, program.peak_bytes), "h100-pcie")
  virtual = program.profile.virtual
  stored_ops = [op.index for op in program.ops
                if not (op.outputs and all(virtual[o] for o in op.outputs))]
  expected = float(np.sum(program.costs.nbytes[stored_ops]))
  assert unplanned.accessed_bytes == pytest.approx(expected, rel=0.05)
  remat = jaxmem.simulate(greedy(program, int(0.6 * program.peak_bytes), "h100-pcie"),
                          "h100-pcie")
  assert remat.recompute_s > 0
  assert remat.accessed_bytes > unplanned.accessed_bytes


def test_the_flops_profile_prices_a_plan_by_its_extra_flops(program):
  """On ``flops`` a remat plan's overhead is the FLOPs its recomputation adds."""
  plan = greedy(program, int(program.peak_bytes * 0.7), "flops", allow_offload=False)
  assert plan.num_remat > 0
  sim = jaxmem.simulate(plan, "flops")
  flops = program.costs.flops
  ran = sum(flops[sim.schedule.steps[e.step].op] for e in sim.timeline
            if e.kind in ("compute", "recompute"))
  recomputed = sum(flops[sim.schedule.steps[e.step].op] for e in sim.timeline
                   if e.kind == "recompute")
  assert recomputed > 0
  assert sim.unplanned_time_s == pytest.approx(flops.sum() / 1e12, rel=1e-9)
  assert sim.step_time_s == pytest.approx(ran / 1e12, rel=1e-9)
  assert sim.recompute_s == pytest.approx(recomputed / 1e12, rel=1e-9)
