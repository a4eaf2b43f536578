"""Planners beside greedy: the MILP (`optimal`) and the shared planning pieces."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

optimal_mod = importlib.import_module("jaxmem._src.planners.optimal")
greedy_mod = importlib.import_module("jaxmem._src.planners.greedy")
common = importlib.import_module("jaxmem._src.planners.common")


@pytest.fixture(scope="module")
def mlp_program():
  import mlp
  step, args = mlp.build(batch_size=1024, width=256, depth=6)
  return jaxmem.analyze(step, *args), step, args


@pytest.mark.parametrize("frac", [0.8, 0.7])
def test_optimal_meets_the_target_at_no_more_cost_than_greedy(mlp_program, frac):
  prog, _, _ = mlp_program
  target = int(prog.peak_bytes * frac)
  opt = optimal_mod.optimal(prog, target, time_limit_s=10)
  gr = greedy_mod.greedy(prog, target)
  assert opt.planner == "optimal"
  assert opt.estimated_peak_bytes <= target
  assert optimal_mod.LAST.proven
  cost = lambda p: sum(d.cost_s for d in p.decisions)  # noqa: E731
  assert cost(opt) <= cost(gr) * (1 + 1e-9)


def test_optimal_plan_runs_and_matches_jit(mlp_program):
  prog, step, args = mlp_program
  target = int(prog.peak_bytes * 0.75)
  fitted = jaxmem.fit(0.75, planner=lambda p, b, d=None: optimal_mod.optimal(p, b, d))(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  for got, want in zip(jax.tree.leaves(fitted(*args)), jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_array_equal(got, want)
  assert target > 0


def test_gaps_and_freed_bytes_on_a_fused_value():
  """`a = x * 2` is fused into its backward consumer: dropping it frees `x`."""
  def f(x):
    h = jnp.tanh(x)
    a = h * 2.0
    return jnp.sum(jnp.sin(a))
  prog = jaxmem.analyze(jax.grad(f), jnp.ones((256, 256)))
  gaps = common.candidate_gaps(prog)
  assert gaps and all(g.end - g.start >= 2 for g in gaps)
  assert all(common.freed_bytes(prog, g) >= 0 for g in gaps)
