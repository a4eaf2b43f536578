"""Segment recomputation (Chen et al. 2016): shared restore points recompute once, plans fit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.lower.backend import jit_plan
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.schedule import StepKind, build_schedule
from jaxmem._src.planners import auto as auto_mod
from jaxmem._src.planners import common
from jaxmem._src.planners import segments as segments_mod
from jaxmem._src.planners.auto import AutoDiagnostics


def chain_loss(w, x, depth=6):
  for _ in range(depth):
    x = jnp.tanh(x @ w) * 1.5
  return jnp.sum(x * x)


@pytest.fixture(scope="module")
def chain():
  w = jax.random.normal(jax.random.PRNGKey(0), (128, 128)) / 12
  x = jax.random.normal(jax.random.PRNGKey(1), (512, 128))
  step = jax.grad(chain_loss)
  return step, (w, x), jaxmem.analyze(step, w, x)


def test_forward_cuts_are_layer_boundaries(chain):
  _, _, prog = chain
  cuts = segments_mod.forward_cuts(prog)
  assert cuts
  # After each cut exactly one large value flows on: the layer's output.
  for p in cuts:
    crossing = [v for v in prog.vars if not v.is_input and v.defined_by <= p
                and v.nbytes >= 512 * 128 * 4 // 2
                and any(p < u <= max(cuts) + 1 for u in v.uses)]
    assert len(crossing) >= 1


def skip_loss(w, x, depth=5):
  skip = jnp.tanh(x @ w)
  h = skip
  for _ in range(depth):
    h = jnp.tanh(h @ w) * 1.5
  return jnp.sum((h + skip) ** 2)


def test_a_long_skip_does_not_stop_the_cuts():
  """A UNet-like skip crosses every layer boundary; it is part of the checkpoint, not a reason to skip the cut."""
  w = jax.random.normal(jax.random.PRNGKey(0), (128, 128)) / 12
  x = jax.random.normal(jax.random.PRNGKey(1), (512, 128))
  prog = jaxmem.analyze(jax.grad(skip_loss), w, x)
  cuts = segments_mod.forward_cuts(prog)
  last_fwd = max(op.index for op in prog.ops if op.phase.name == "FORWARD")
  skip = next(v for v in prog.vars if v.nbytes == 512 * 128 * 4 and not v.is_input
              and prog.ops[v.defined_by].primitive == "tanh")
  spanned = [p for p in cuts if skip.defined_by < p < max(u for u in skip.uses if u <= last_fwd)]
  assert len(spanned) >= 3, (cuts, skip.defined_by)
  # Recomputing the segments between the cuts fits a budget the skip alone would not stop.
  plan = segments_mod.segments(prog, int(0.6 * prog.peak_bytes), "h100-pcie", fill=False)
  assert plan.num_remat >= 3


def test_restores_at_one_point_recompute_their_chains_once(chain):
  """Remats restored before the same op share their recomputation."""
  import dataclasses
  _, _, prog = chain
  segs = segments_mod.find_segments(prog, "h100-pcie", group=4)
  seg = max(segs, key=lambda s: len(s.decisions))
  assert len(seg.decisions) >= 2 and len({d.end for d in seg.decisions}) == 1
  union = sorted({k for d in seg.decisions for k in d.recompute})
  # The planner hands each decision only the ops it adds; give every decision
  # the whole union (what independent chains would repeat) instead.
  overlapping = [dataclasses.replace(d, recompute=tuple(union)) for d in seg.decisions]
  for decisions in (seg.decisions, overlapping):
    sched = build_schedule(prog, decisions)
    recomputed = [st.op for st in sched.steps if st.kind is StepKind.COMPUTE and st.recompute]
    assert sorted(recomputed) == union


def test_merged_restore_is_bit_identical(chain):
  """Running the union once computes the same values as the unplanned step."""
  step, args, prog = chain
  segs = segments_mod.find_segments(prog, "h100-pcie", group=2)
  decisions = [d for s in segs for d in s.decisions]
  plan = common.finish(prog, decisions, prog.peak_bytes, "segments")
  assert plan.num_remat
  # The plan itself, rewritten by the CPU's backend (a `fit` whose budget the
  # unplanned step meets would never apply it).
  np.testing.assert_array_equal(jit_plan(plan)(*args), jax.jit(step)(*args))


@pytest.mark.parametrize("frac", [0.85, 0.7])
def test_segments_fit_the_budget_and_keep_gradients(chain, frac):
  step, args, prog = chain
  fitted = jaxmem.fit(frac, planner="segments", device="h100-pcie")(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  assert res.plan.planner.startswith("segments")
  assert res.plan.num_remat and not res.plan.num_offload
  # XLA fuses a recomputed elementwise op with different neighbours, which may
  # change the last bit (jax.checkpoint does the same); everything else is equal.
  np.testing.assert_allclose(fitted(*args), jax.jit(step)(*args), rtol=2e-6, atol=0)


def test_segments_are_cheaper_than_per_value_remat_on_a_fast_device():
  """On a GPU profile, recomputing segments costs less than greedy's per-value chains."""
  import transformer
  step, args = transformer.build(batch_size=8, seq_len=64, dim=64, heads=2, layers=3)
  prog = jaxmem.analyze(step, *args)
  budget = int(0.7 * prog.peak_bytes)
  seg = jaxmem.get_planner("segments")(prog, budget, "h100-pcie")
  gr = jaxmem.get_planner("greedy")(prog, budget, "h100-pcie")
  assert seg.estimated_peak_bytes <= budget
  s_seg = jaxmem.simulate(seg, "h100-pcie")
  s_gr = jaxmem.simulate(gr, "h100-pcie")
  assert s_seg.overhead < s_gr.overhead, (s_seg.overhead, s_gr.overhead)


def test_simulate_skips_a_computation_nobody_reads(chain):
  """A value remat'd from its definition is computed at its restore, not twice."""
  _, _, prog = chain
  v = next(v for v in prog.vars if v.uses and not v.is_input and not v.is_output
           and all(prog.ops[u].phase.value == "backward" for u in v.uses)
           and prog.ops[v.defined_by].phase.value == "forward")
  d = Decision(v.id, Action.REMAT, v.defined_by, min(v.uses), (v.defined_by,), v.nbytes)
  plan = common.finish(prog, [d], prog.peak_bytes, "one")
  sim = jaxmem.simulate(plan, "h100-pcie")
  assert sim.recompute_s > 0
  # Moved, not duplicated: the forward instance (read by nobody now) is not run.
  sched = plan.schedule()
  fwd = [i for i, st in enumerate(sched.steps)
         if st.kind is StepKind.COMPUTE and st.op == v.defined_by and not st.recompute]
  assert fwd and not [e for e in sim.timeline if e.step in fwd]


@pytest.fixture(scope="module")
def resnet18():
  import resnet
  step, args = resnet.build(batch_size=16, depth=18, image_size=64, classes=10, abstract=True)
  return jaxmem.analyze(step, *args)


def test_auto_is_the_fastest_fitting_plan(resnet18):
  budget = int(0.7 * resnet18.peak_bytes)
  plan = jaxmem.get_planner("auto")(resnet18, budget, "k40")
  assert plan.estimated_peak_bytes <= budget and plan.planner.startswith("auto(")
  rows = plan.diagnostic(AutoDiagnostics).rows
  fastest = min(t for _, peak, t, _ in rows if peak <= budget)
  assert jaxmem.simulate(plan, "k40").step_time_s == pytest.approx(fastest)
  assert len(rows) >= 2


@pytest.mark.parametrize("frac", [0.6, 0.55])
def test_the_offload_bound_is_a_lower_bound(resnet18, frac):
  """The bound `auto` skips offload-only planners on is below their simulated overhead.

  (At 0.7 the bound is 0 since the estimate stores BatchNorm's ``x - mean``:
  the budgets here are ones where it is not trivially true.)
  """
  budget = int(frac * resnet18.peak_bytes)
  bound = auto_mod.offload_overhead_bound(resnet18, budget, "h100-pcie")
  assert bound > 0.1
  for name in ("vdnn", "window", "layrub"):
    plan = jaxmem.get_planner(name)(resnet18, budget, "h100-pcie")
    assert plan.estimated_peak_bytes <= budget, name
    assert jaxmem.simulate(plan, "h100-pcie").overhead >= bound, name


def test_auto_skips_offloading_that_cannot_win():
  """ResNet-50 at half its peak on an H100: copying the activations over PCIe
  takes longer than recomputing them, so the offload-only planners are not run."""
  import resnet
  step, args = resnet.build(batch_size=32, depth=50, image_size=224, abstract=True)
  prog = jaxmem.analyze(step, *args)
  plan = jaxmem.get_planner("auto")(prog, prog.peak_bytes // 2, "h100-pcie")
  assert plan.estimated_peak_bytes <= prog.peak_bytes // 2
  skipped = plan.diagnostic(AutoDiagnostics).skipped
  assert {name for name, _ in skipped} - {"segments"} == set(auto_mod.OFFLOAD_ONLY)
  assert not set(auto_mod.OFFLOAD_ONLY) & {row[0] for row in plan.diagnostic(AutoDiagnostics).rows}


def test_segments_within_a_cap_finds_no_costlier_plan(resnet18):
  """`segments_within` searches only plans cheaper than the cap: the same plan
  with no cap, ``None`` under a cap below any recomputation, and never a
  fitting plan that costs more than the cap."""
  budget = int(0.6 * resnet18.peak_bytes)
  plan = segments_mod.segments(resnet18, budget, "h100-pcie")
  assert plan.estimated_peak_bytes <= budget and plan.num_remat
  recompute_s = jaxmem.simulate(plan, "h100-pcie").recompute_s
  for cap in (float("inf"), 2 * recompute_s):      # what `auto` passes: twice the overhead
    same = segments_mod.segments_within(resnet18, budget, "h100-pcie", cap)
    assert same is not None and same.decisions == plan.decisions
  for cap in (0.0, 0.5 * recompute_s):
    assert segments_mod.segments_within(resnet18, budget, "h100-pcie", cap) is None


def test_auto_skips_segments_that_cannot_beat_a_cheaper_plan():
  """With the `cpu` profile host copies cost what memory copies do: offloading
  ResNet-50 to half its peak costs a few percent, its least recomputation more,
  so `auto` does not search segments (the search was most of its time)."""
  import resnet
  step, args = resnet.build(batch_size=32, depth=50, image_size=224, abstract=True)
  prog = jaxmem.analyze(step, *args)
  budget = prog.peak_bytes // 2
  plan = jaxmem.get_planner("auto")(prog, budget, "cpu")
  report = plan.diagnostic(AutoDiagnostics)
  assert "segments" in {name for name, _ in report.skipped}
  assert "segments" not in {row[0] for row in report.rows}
  alone = segments_mod.segments(prog, budget, "cpu")
  assert alone.estimated_peak_bytes <= budget
  assert (jaxmem.simulate(alone, "cpu").step_time_s
          > jaxmem.simulate(plan, "cpu").step_time_s)


def _two_block_step():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      x = x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(2 * x.shape[-1])(h)))
      h = nn.LayerNorm()(x)
      return x + nn.Dense(x.shape[-1])(h)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(3):
        x = Block(name=f"Block_{i}")(x)
      return x

  x = jax.random.normal(jax.random.PRNGKey(1), (256, 64))
  params = Net().init(jax.random.PRNGKey(0), x)
  step = jax.grad(lambda p, x: jnp.sum(Net().apply(p, x) ** 2))
  return step, (params, x)


def test_module_cuts_are_the_blocks_boundaries():
  step, args = _two_block_step()
  prog = jaxmem.analyze(step, *args)
  cuts = segments_mod.forward_cuts(prog)
  blocks = segments_mod.module_cuts(prog, cuts, depth=2)
  assert len(cuts) > len(blocks)
  # One cut per block: the last inside it, where the next block begins.
  scopes = ["/".join(prog.ops[c].module.split("/")[:2]) for c in blocks]
  assert [s for s in scopes if "Block_" in s] == ["Net/Block_0", "Net/Block_1", "Net/Block_2"]
  for c in blocks[:-1]:
    nxt = min(k for k in cuts if k > c)
    assert prog.ops[c].module.split("/")[:2] != prog.ops[nxt].module.split("/")[:2]


def test_module_segments_plan_fits_and_keeps_gradients():
  step, args = _two_block_step()
  prog = jaxmem.analyze(step, *args)
  plan = jaxmem.plan(step, *args, budget=0.8, planner="segments-modules")
  assert plan.decisions
  # Every decision restores at one point per segment, and segments follow the blocks.
  segs = segments_mod.find_segments(prog, depth=2)
  assert {d.end for d in plan.decisions} <= {s.restore for s in segs}
  assert plan.estimated_peak_bytes <= plan.target_bytes
  got, want = jit_plan(plan)(*args), jax.jit(step)(*args)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("group", [0, -1, True, "blocks", 1.5])
def test_a_bad_group_is_refused(chain, group):
  _, _, prog = chain
  with pytest.raises(ValueError, match="`group`"):
    segments_mod.segments(prog, prog.peak_bytes // 2, group=group)


def test_checkpoints_are_offloaded_when_recomputing_every_segment_is_not_enough(chain):
  """``segments-offload``: the checkpoints recomputation starts from go to host until their restore."""
  # With the loss returned: under `jax.grad` alone XLA (and the trace) drop the
  # loss's forward arithmetic, and the remat-only plan of that step compiles
  # to the same peak with or without the offloads.
  _, args, _ = chain
  step = jax.value_and_grad(chain_loss)
  prog = jaxmem.analyze(step, *args)
  remat = jaxmem.get_planner("segments-remat")(prog, 0, "h100-pcie")
  plan = jaxmem.get_planner("segments-offload")(prog, 0, "h100-pcie")
  assert remat.num_remat and not remat.num_offload
  assert plan.planner == "segments+offload" and plan.num_offload
  assert {d.var for d in plan.decisions if d.action is Action.REMAT} == {
      d.var for d in remat.decisions}
  remats = [d for d in plan.decisions if d.action is Action.REMAT]
  virtual = prog.profile.virtual
  for d in plan.decisions:
    if d.action is Action.OFFLOAD:
      # A stored value that a segment's recomputation reads, fetched just
      # before that restore point.
      readers = [r for r in remats if r.end == d.end
                 and any(d.var in prog.ops[k].input_ids() for k in r.recompute)]
      assert readers and not virtual[d.var] and not prog.vars[d.var].is_input
  assert plan.estimated_peak_bytes < remat.estimated_peak_bytes
  # Rewritten by the CPU's backend: the same values (the fetched copy is exact),
  # and a compiled peak below the remat-only plan's.
  got = jit_plan(plan).lower(*args).compile()
  for a, b in zip(jax.tree.leaves(got(*args)), jax.tree.leaves(jit_plan(remat)(*args))):
    np.testing.assert_array_equal(a, b)
  base = jit_plan(remat).lower(*args).compile()
  assert (jaxmem.compiled_memory(got).peak_bytes < jaxmem.compiled_memory(base).peak_bytes)


def test_checkpoint_offloads_are_only_added_when_remat_does_not_fit(chain):
  _, _, prog = chain
  loose = int(0.9 * prog.peak_bytes)
  a = jaxmem.get_planner("segments-offload")(prog, loose, "h100-pcie")
  b = jaxmem.get_planner("segments-remat")(prog, loose, "h100-pcie")
  assert not a.num_offload and [d.var for d in a.decisions] == [d.var for d in b.decisions]



def test_auto_keeps_pins_only_where_they_pay(resnet18):
  """Every fitting plan's decisions are also tried without Layrub's pins, and the fastest kept."""
  budget = int(0.5 * resnet18.peak_bytes)
  # Without `selective`, which plans without pins from the start (it wins
  # here), so that the winner is a pinned plan.
  pinned_planners = tuple(p for p in auto_mod.FAST if p != "selective")
  plan = jaxmem.get_planner("auto")(resnet18, budget, "h100-pcie", planners=pinned_planners)
  rows = plan.diagnostic(AutoDiagnostics).rows
  unpinned_rows = {r[0] for r in rows if r[0].endswith("/unpinned")}
  fitting = {r[0] for r in rows if r[1] <= budget and not r[0].endswith("/unpinned")}
  assert unpinned_rows <= {f"{name}/unpinned" for name in fitting}
  # Not only the fastest: here several pinned plans fit (segments, vDNN, the window...).
  assert len(unpinned_rows) >= 2
  winner = min((r for r in rows if r[1] <= budget), key=lambda r: r[2])
  assert plan.planner == f"auto({winner[0]})"
  bare = auto_mod.unpinned(plan, budget)
  assert bare.pinned == () and bare.decisions == plan.decisions
  if plan.planner.endswith("/unpinned)"):
    assert plan.pinned == ()


def test_the_unpinned_segment_search_estimates_every_prefix_without_pins(resnet18):
  """`segments_within(pinned=False)` plans without Layrub's pins; `auto` compares it too."""
  budget = int(0.7 * resnet18.peak_bytes)
  found = segments_mod.segments_within(resnet18, budget, "h100-pcie", float("inf"),
                                       pinned=False)
  assert found is not None and found.pinned == ()
  assert found.planner == "segments(unpinned)"
  assert found.estimated_peak_bytes <= budget
  pinned = segments_mod.segments(resnet18, budget, "h100-pcie")
  assert pinned.pinned != ()
  rows = jaxmem.get_planner("auto")(resnet18, budget, "h100-pcie").diagnostic(
      AutoDiagnostics).rows
  assert "segments(unpinned)" in [r[0] for r in rows]


def test_segmentations_are_cut_once_per_program_and_device(resnet18):
  """`auto` asks for the same segmentations three times; they are cut once, and
  a caller editing the returned list does not change what the next one gets."""
  first = segments_mod.segmentations(resnet18, "h100-pcie")
  first.append([])
  again = segments_mod.segmentations(resnet18, "h100-pcie")
  assert again == first[:-1] and all(segs for segs in again)
  assert segments_mod.segmentations(resnet18, "h100-pcie", group=2) != again


def test_auto_searches_pinned_segments_only_where_the_unpinned_search_misses(resnet18):
  """Where the unpinned segment search fits, the pinned one is not run: its plan
  would be the same decisions with pins, which `auto` only keeps where they pay."""
  budget = int(0.6 * resnet18.peak_bytes)
  plan = jaxmem.get_planner("auto")(resnet18, budget, "h100-pcie")
  report = plan.diagnostic(AutoDiagnostics)
  names = [r[0] for r in report.rows]
  assert "segments(unpinned)" in names and "segments" not in names
  assert ("segments", "pinned: the unpinned segment search fits") in report.skipped
  pinned = segments_mod.segments_within(resnet18, budget, "h100-pcie", float("inf"))
  assert pinned is not None and pinned.estimated_peak_bytes <= budget
  assert (jaxmem.simulate(plan, "h100-pcie").step_time_s
          <= jaxmem.simulate(pinned, "h100-pcie").step_time_s)
