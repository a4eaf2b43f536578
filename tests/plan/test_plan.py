"""The Plan: counts, summary, the diagnostics its planner leaves on it, immutability."""

from __future__ import annotations

import dataclasses

import pytest

import jaxmem
import models
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.planners.auto import AutoDiagnostics
from jaxmem._src.planners.optimal import MILPDiagnostics


@pytest.fixture(scope="module")
def program():
  grad, args = models.tanh_mlp(depth=4, width=64, batch=512)
  return jaxmem.analyze(grad, *args)


def _plan(program, decisions, **kw):
  return Plan(program, tuple(decisions), program.peak_bytes, program.peak_bytes,
              program.peak_bytes, "by hand", **kw)


def test_counts_follow_the_decisions(program):
  acts = [v for v in program.vars if v.role.value == "activation"][:3]
  ds = [Decision(acts[0].id, Action.REMAT, 1, 20, (acts[0].defined_by,), acts[0].nbytes),
        Decision(acts[1].id, Action.OFFLOAD, 2, 21, (), acts[1].nbytes),
        Decision(acts[2].id, Action.OFFLOAD, 3, 22, (), acts[2].nbytes)]
  plan = _plan(program, ds)
  assert (plan.num_remat, plan.num_offload, plan.recomputed_ops) == (1, 2, 1)
  assert plan.offloaded_bytes == acts[1].nbytes + acts[2].nbytes
  text = plan.summary(top=2)
  assert text.startswith("Plan (by hand): 3 decisions") and "... and 1 more" in text


def test_a_plan_is_immutable_and_its_schedule_follows_its_settings(program):
  plan = _plan(program, ())
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.copies = "async"
  assert plan.schedule().copies == "sync"
  assert dataclasses.replace(plan, copies="async").schedule().copies == "async"


def test_a_plan_builds_its_schedule_once_and_replace_keeps_it_while_it_holds(program):
  acts = [v for v in program.vars if v.role.value == "activation"]
  plan = _plan(program, [Decision(acts[0].id, Action.OFFLOAD, acts[0].defined_by,
                                  program.num_ops - 2, (), acts[0].nbytes)])
  sched = plan.schedule()
  assert plan.schedule() is sched
  prof = sched.profile()
  assert sched.profile() is prof
  with pytest.raises(ValueError):            # shared between plans: never edited
    prof.live_bytes[0] = 0
  relabelled = plan.replace(planner="relabelled", estimated_peak_bytes=1)
  assert relabelled.planner == "relabelled" and relabelled.schedule() is sched
  other = plan.replace(copies="async")
  assert other.schedule() is not sched and other.schedule().copies == "async"
  assert plan.replace(decisions=()).schedule().steps != sched.steps
  with pytest.raises(TypeError, match="unknown fields"):
    plan.replace(budget=1)


def test_diagnostics_are_read_by_type(program):
  plan = jaxmem.get_planner("auto")(program, int(program.peak_bytes * 0.8), "h100-pcie")
  auto = plan.diagnostic(AutoDiagnostics)
  assert auto is not None and plan.planner == f"auto({auto.chosen})"
  assert any(row[0] == auto.chosen for row in auto.rows)
  assert plan.diagnostic(MILPDiagnostics) is None or plan.planner == "auto(optimal)"
  assert _plan(program, ()).diagnostic(AutoDiagnostics) is None
  # Two calls, two independent records: nothing is kept between calls.
  other = jaxmem.get_planner("auto")(program, int(program.peak_bytes * 0.9), "k40")
  assert other.diagnostic(AutoDiagnostics) is not auto


def test_to_perfetto_is_the_simulated_schedule(program, tmp_path):
  plan = jaxmem.get_planner("greedy")(program, int(program.peak_bytes * 0.7), "k40")
  trace = plan.to_perfetto(tmp_path / "t.json", device="k40")
  assert (tmp_path / "t.json").exists()
  assert trace["otherData"]["step_time_s"] == jaxmem.simulate(plan, "k40").step_time_s
