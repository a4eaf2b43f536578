"""Reverse delete (`prune`): a fitting plan loses the decisions its budget does not need."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.lower.backend import jit_plan
from jaxmem._src.plan.decisions import Action
from jaxmem._src.plan.schedule import StepKind
from jaxmem._src.planners import common
from jaxmem._src.planners.auto import AutoDiagnostics
from jaxmem._src.planners.prune import PruneDiagnostics, prune
from jaxmem._src.planners.segments import segments


def attention_loss(params, x, depth=3):
  for wq, wk, w1, w2 in params:
    q, k = x @ wq, x @ wk
    p = jax.nn.softmax(q @ k.T / 8.0, axis=-1)
    x = x + p @ x
    x = x + jax.nn.gelu(x @ w1) @ w2
  return jnp.sum(x * x)


@pytest.fixture(scope="module")
def attention():
  keys = jax.random.split(jax.random.PRNGKey(0), 13)
  d, n = 64, 256
  params = [tuple(jax.random.normal(keys[4 * i + j], s) / np.sqrt(s[0])
                  for j, s in enumerate(((d, d), (d, d), (d, 4 * d), (4 * d, d))))
            for i in range(3)]
  x = jax.random.normal(keys[12], (n, d))
  step = jax.grad(attention_loss)
  return step, (params, x), jaxmem.analyze(step, params, x)


@pytest.mark.parametrize("frac", [0.7, 0.55])
def test_a_pruned_segment_plan_fits_is_faster_and_computes_the_same(attention, frac):
  step, args, prog = attention
  budget = int(frac * prog.peak_bytes)
  plan = segments(prog, budget, "h100-sxm")
  assert plan.estimated_peak_bytes <= budget and plan.num_remat
  pruned = prune(plan, budget, "h100-sxm")
  assert pruned.estimated_peak_bytes <= budget
  assert len(pruned.decisions) <= len(plan.decisions)
  if pruned is plan:
    pytest.skip("nothing to prune at this budget")
  assert pruned.planner == f"{plan.planner}/pruned"
  diag = pruned.diagnostic(PruneDiagnostics)
  assert diag is not None and diag.removed == len(plan.decisions) - len(pruned.decisions)
  before, after = diag.step_s
  assert after < before
  assert jaxmem.simulate(pruned, "h100-sxm").step_time_s == pytest.approx(after)
  # Every remaining remat still restores its value (the schedule would fail
  # on a chain that no longer makes it), and recomputes fewer ops.
  steps = pruned.schedule().steps
  assert sum(s.kind is StepKind.COMPUTE and s.recompute for s in steps) < sum(
      s.kind is StepKind.COMPUTE and s.recompute for s in plan.schedule().steps)
  got, want = jit_plan(pruned)(*args), jax.jit(step)(*args)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_chain_still_needed_by_another_value_at_its_point_is_kept(attention):
  """Removing one of several values restored at one point keeps the ops the others read."""
  _, _, prog = attention
  budget = int(0.55 * prog.peak_bytes)
  plan = segments(prog, budget, "h100-sxm")
  pruned = prune(plan, prog.peak_bytes, "h100-sxm")   # a budget that needs none of them
  remats = [d for d in pruned.decisions if d.action is Action.REMAT]
  for d in remats:
    made = {o for e in remats if e.end == d.end for k in e.recompute
            for o in prog.ops[k].outputs}
    assert d.var in made
  pruned.schedule()   # builds: every chain's inputs are made or live


def test_a_plan_over_its_budget_or_without_decisions_is_returned_as_is(attention):
  _, _, prog = attention
  plan = segments(prog, int(0.55 * prog.peak_bytes), "h100-sxm")
  assert prune(plan, plan.estimated_peak_bytes - 1, "h100-sxm") is plan
  none = common.finish(prog, (), prog.peak_bytes, "none", ())
  assert prune(none, prog.peak_bytes, "h100-sxm") is none
  assert prune(plan, plan.estimated_peak_bytes, "h100-sxm", max_estimates=0) is plan
  with pytest.raises(ValueError, match="`max_estimates`"):
    prune(plan, plan.estimated_peak_bytes, "h100-sxm", max_estimates=-1)


def test_auto_keeps_the_pruned_plan_only_where_it_is_faster(attention):
  _, _, prog = attention
  budget = int(0.55 * prog.peak_bytes)
  plan = jaxmem.get_planner("auto")(prog, budget, "h100-sxm")
  rows = plan.diagnostic(AutoDiagnostics).rows
  fitting = [r for r in rows if r[1] <= budget]
  winner = min(fitting, key=lambda r: r[2])
  assert plan.planner == f"auto({winner[0]})"
  without = jaxmem.get_planner("auto")(prog, budget, "h100-sxm", prune_estimates=0)
  assert not any(r[0].endswith("/pruned") for r in without.diagnostic(AutoDiagnostics).rows)
  assert (jaxmem.simulate(plan, "h100-sxm").step_time_s
          <= jaxmem.simulate(without, "h100-sxm").step_time_s)


def test_auto_prunes_the_fastest_plan_and_its_close_runner_ups(attention):
  from jaxmem._src.planners.auto import MAX_PRUNED, PRUNE_RUNNER_UP, worth_pruning
  _, _, prog = attention
  budget = int(0.7 * prog.peak_bytes)
  a = segments(prog, budget, "h100-sxm")
  b = a.replace(decisions=a.decisions[:-1], planner="other")
  assert frozenset(a.decisions) != frozenset(b.decisions)
  base = 1.0
  # Fastest first; a copy of a plan's decisions is pruned once; a plan that
  # does not fit (inf) never; a runner-up past the factor is left out.
  timed = [(1.12, b), (float("inf"), b), (1.1, a), (1.1, a.replace(planner="copy"))]
  assert worth_pruning(timed, base) == [a, b]
  far = [(1.1, a), (base + 0.1 * PRUNE_RUNNER_UP * 1.01, b)]
  assert worth_pruning(far, base) == [a]
  assert len(a.decisions) >= MAX_PRUNED + 1
  many = [(1.1, a.replace(decisions=a.decisions[:k])) for k in range(1, MAX_PRUNED + 2)]
  assert len(worth_pruning(many, base)) == MAX_PRUNED
  assert worth_pruning([(float("inf"), a)], base) == []
