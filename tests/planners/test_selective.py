"""Selective recomputation (Korthikanti et al. §4.2): cheapest bytes first; plans fit, results hold."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.plan.decisions import Action
from jaxmem._src.planners.auto import AutoDiagnostics
from jaxmem._src.planners.common import Pricer
from jaxmem._src.planners.greedy import greedy
from jaxmem._src.planners.selective import selective


@pytest.fixture(scope="module")
def small_gpt():
  import transformer
  step, args = transformer.build(batch_size=8, seq_len=64, dim=64, heads=2, layers=3)
  return step, args, jaxmem.analyze(step, *args)


def _two_kinds_loss(w, x):
  # Per layer two values of one size span the backward: a matmul output
  # (expensive to rebuild) and an exp of it (one cheap elementwise op away).
  for _ in range(3):
    h = x @ w
    e = jnp.exp(-h * h)
    x = jnp.tanh(h) * e
  return jnp.sum(x * x)


def test_cost_rank_recomputes_the_cheapest_bytes_and_no_matmul():
  w = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) / 16
  x = jax.random.normal(jax.random.PRNGKey(1), (1024, 256))
  prog = jaxmem.analyze(jax.grad(_two_kinds_loss), w, x)
  budget = int(0.85 * prog.peak_bytes)
  plan = greedy(prog, budget, "h100-pcie", rank="cost", allow_offload=False, pinned=False)
  assert plan.estimated_peak_bytes <= budget
  assert plan.decisions and all(d.action is Action.REMAT for d in plan.decisions)
  assert not plan.pinned
  pricer = Pricer(prog, "h100-pcie")
  # No decision recomputes a matmul: every value freed was one elementwise
  # chain away from what is kept, the cheapest bytes there are.
  assert all(prog.ops[k].primitive != "dot_general" for d in plan.decisions for k in d.recompute)
  per_byte = [d.cost_s / d.nbytes for d in plan.decisions]
  assert max(per_byte) <= min(pricer.op_seconds(op.index) / prog.vars[op.outputs[0]].nbytes
                              for op in prog.ops if op.primitive == "dot_general"
                              and prog.vars[op.outputs[0]].nbytes >= 1 << 20)


def test_a_bad_rank_or_share_names_the_argument(small_gpt):
  _, _, prog = small_gpt
  with pytest.raises(ValueError, match="`rank="):
    greedy(prog, prog.peak_bytes, "h100-pcie", rank="bytes")
  with pytest.raises(ValueError, match="`shares`"):
    selective(prog, prog.peak_bytes, "h100-pcie", shares=(1.0,))
  with pytest.raises(ValueError, match="`shares`"):
    selective(prog, prog.peak_bytes, "h100-pcie", shares=())


def test_capped_segment_plans_leave_selection_alone(small_gpt):
  _, _, prog = small_gpt
  plan = selective(prog, int(0.8 * prog.peak_bytes), "h100-pcie", shares=(0.5,), cap_s=0.0)
  assert plan.planner == "selective" and not plan.pinned


@pytest.mark.parametrize("frac", [0.8, 0.6])
def test_selective_beats_whole_segments_on_a_transformer(small_gpt, frac):
  """On a GPT, the values cheapest per byte (attention scores, softmax) go first
  and the plan costs less simulated time than recomputing whole segments."""
  _, _, prog = small_gpt
  budget = int(frac * prog.peak_bytes)
  sel = selective(prog, budget, "h100-pcie")
  seg = jaxmem.get_planner("segments")(prog, budget, "h100-pcie")
  assert sel.estimated_peak_bytes <= budget
  assert sel.planner in ("selective", "segments+selective")
  assert sel.num_remat and not sel.num_offload
  assert (jaxmem.simulate(sel, "h100-pcie").step_time_s
          < jaxmem.simulate(seg, "h100-pcie").step_time_s)


def test_auto_compares_selective_and_fit_keeps_the_results(small_gpt):
  step, args, prog = small_gpt
  plan = jaxmem.get_planner("auto")(prog, int(0.8 * prog.peak_bytes), "h100-pcie")
  rows = {row[0] for row in plan.diagnostic(AutoDiagnostics).rows}
  assert rows & {"selective", "segments+selective"}
  fitted = jaxmem.fit(0.8, planner="selective", device="h100-pcie")(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  # Recomputed elementwise ops fused with other neighbours may change the
  # last bit (as jax.checkpoint's do); the values are otherwise the same.
  for got, want in zip(jax.tree.leaves(fitted(*args)), jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("frac", [0.8, 0.6])
def test_a_time_to_beat_prunes_nothing_that_would_win(small_gpt, frac):
  """`beat_s` (what `auto` passes: its fastest plan's time) skips shares whose
  segments alone are slower and stops selections priced past it; a time just
  above selective's own best returns that same plan, and one below every
  plan returns none that fits."""
  _, _, prog = small_gpt
  budget = int(frac * prog.peak_bytes)
  free = selective(prog, budget, "h100-pcie")
  t = jaxmem.simulate(free, "h100-pcie").step_time_s
  assert free.estimated_peak_bytes <= budget
  bounded = selective(prog, budget, "h100-pcie", beat_s=t * (1 + 1e-9))
  assert bounded.decisions == free.decisions and bounded.planner == free.planner
  from jaxmem._src.plan.simulate import program_time
  hopeless = selective(prog, budget, "h100-pcie", beat_s=program_time(prog, "h100-pcie"))
  assert hopeless.estimated_peak_bytes > budget


def test_greedy_gives_up_past_its_cost_bound(small_gpt):
  """`max_cost_s`: the selection stops once what it added is priced over the
  bound, returning the plan it estimated last (its peak is that plan's)."""
  _, _, prog = small_gpt
  budget = int(0.8 * prog.peak_bytes)
  opts = dict(rank="cost", allow_offload=False, pinned=False)
  full = greedy(prog, budget, "h100-pcie", **opts)
  spent = sum(d.cost_s for d in full.decisions)
  assert full.estimated_peak_bytes <= budget and spent > 0
  cut = greedy(prog, budget, "h100-pcie", max_cost_s=spent / 2, **opts)
  assert cut.estimated_peak_bytes > budget
  assert sum(d.cost_s for d in cut.decisions) <= spent / 2
  assert cut.decisions == full.decisions[:len(cut.decisions)]
  from jaxmem._src.planners import common
  again = common.finish(prog, cut.decisions, budget, "again", ())
  assert again.estimated_peak_bytes == cut.estimated_peak_bytes


def _normalized_loss(w, x):
  # A batch norm and a ReLU per layer: XLA fuses `h - mean` into its readers
  # (no buffer of its own) and stores `h` and the ReLU's output.
  for _ in range(3):
    h = x @ w
    c = h - jnp.mean(h, axis=0)
    x = jax.nn.relu(c * jax.lax.rsqrt(jnp.mean(c * c, axis=0) + 1e-5))
  return jnp.sum(x * x)


def test_xla_lifetimes_chains_rebuild_fused_values_from_stored_ones():
  """With `xla_lifetimes` (selective recomputation's chains), a ReLU after a batch
  norm is rebuilt from the stored `h`, not from the fused `h - mean`: reading that
  would make XLA store it over the gap, as many bytes as the decision frees.
  (Estimated for a GPU, whose compiler fuses `h - mean` into its readers.)"""
  from jaxmem._src.estimate.analysis import analyze_program
  from jaxmem._src.ir.trace import trace
  from jaxmem._src.planners import common
  from jaxmem._src.planners.chains import ChainState, find_chain
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
  prog = jaxmem.Program.of(analyze_program(trace(jax.grad(_normalized_loss), (w, x),
                                                 backend="gpu")))
  virtual = prog.profile.virtual
  pricer = Pricer(prog, "h100-pcie")
  relus = [g for g in common.candidate_gaps(prog)
           if prog.ops[prog.vars[g.var].defined_by].primitive == "max" and g.end - g.start > 8]
  assert relus
  area = {}
  for xla in (False, True):
    decisions = []
    for g in relus:
      chain = find_chain(ChainState(prog, xla_lifetimes=xla), g.var, g.end, 16)
      assert chain
      decisions.append(common.Decision(g.var, Action.REMAT, g.start, g.end, chain, g.nbytes,
                                       pricer.remat_seconds(chain)))
      reads_fused = any(virtual[i] for i in common.chain_inputs(prog, chain)
                        if not prog.vars[i].is_input)
      assert reads_fused is not xla
    plan = common.finish(prog, decisions, prog.peak_bytes, "relus", ())
    area[xla] = int(plan.schedule().profile().live_bytes.sum())
  # Bytes x positions held: the ReLUs' gaps no longer hold `h - mean` instead.
  assert area[True] < area[False]


def test_selective_plans_of_a_normalized_net_compute_the_same():
  w = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) / 16
  x = jax.random.normal(jax.random.PRNGKey(1), (1024, 256))
  step = jax.grad(_normalized_loss)
  fitted = jaxmem.fit(0.75, planner="selective", device="h100-pcie")(step)
  res = fitted.fit_result(w, x)
  assert res.plan.decisions and res.peak_bytes <= res.budget_bytes
  np.testing.assert_array_equal(fitted(w, x), jax.jit(step)(w, x))


def test_auto_runs_selective_recomputation_both_ways(small_gpt):
  """`auto` compares selective recomputation with the program's lifetimes and with
  XLA's (`xla_lifetimes`): neither wins everywhere (docs/design.md)."""
  _, _, prog = small_gpt
  budget = int(0.5 * prog.peak_bytes)
  plan = jaxmem.get_planner("auto")(prog, budget, "h100-pcie")
  names = [row[0] for row in plan.diagnostic(AutoDiagnostics).rows]
  assert any(n.startswith(("selective", "segments+selective")) and "(xla)" not in n
             for n in names), names
  assert any(n.endswith("selective(xla)") for n in names), names
  xla = selective(prog, budget, "h100-pcie", xla_lifetimes=True)
  assert xla.planner.endswith("(xla)") and xla.estimated_peak_bytes <= budget
