"""Checkmate's exact MILP: optimal on graphs small enough to enumerate, and a bound on every planner."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmem
from jaxmem._src.planners import checkmate as cm


def brute_force(graph: cm.RematGraph, budget: int) -> float | None:
  """The least extra cost of any valid schedule within ``budget``, by enumerating R and S."""
  n = graph.n
  cells = [(t, i) for t in range(n) for i in range(t)]
  best = None
  for r_bits in itertools.product((False, True), repeat=len(cells)):
    R = np.eye(n, dtype=bool)
    for (t, i), b in zip(cells, r_bits):
      R[t, i] = b
    for s_bits in itertools.product((False, True), repeat=len(cells)):
      S = np.zeros((n, n), dtype=bool)
      for (t, i), b in zip(cells, s_bits):
        S[t, i] = b
      try:
        cm.check(graph, R, S)
      except ValueError:
        continue
      if cm.memory_peak(graph, R, S) <= budget:
        c = cm.schedule_cost(graph, R)
        best = c if best is None else min(best, c)
  return best


@st.composite
def small_graphs(draw):
  n = draw(st.integers(2, 4))
  deps = []
  for k in range(n):
    deps.append(tuple(sorted(draw(st.sets(st.integers(0, k - 1), max_size=2))) if k else ()))
  costs = tuple(draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=n, max_size=n)))
  sizes = tuple(draw(st.lists(st.integers(1, 9), min_size=n, max_size=n)))
  keep = frozenset({n - 1}) if draw(st.booleans()) else frozenset()
  return cm.RematGraph(costs, sizes, tuple(deps), keep, draw(st.integers(0, 3)))


@settings(max_examples=12, deadline=None)
@given(small_graphs(), st.floats(0.3, 1.0))
def test_the_milp_finds_the_enumerated_optimum(graph, frac):
  R, S = cm.checkpoint_all(graph)
  cm.check(graph, R, S)
  full = cm.memory_peak(graph, R, S)
  budget = int(graph.fixed_bytes + frac * (full - graph.fixed_bytes))
  want = brute_force(graph, budget)
  sol = cm.solve(graph, budget, time_limit_s=30)
  if want is None:
    assert sol is None
    return
  assert sol is not None and sol.proven
  cm.check(graph, sol.R, sol.S)
  assert sol.peak_bytes <= budget
  assert sol.extra_s == pytest.approx(want, abs=1e-9)


def test_recomputing_nothing_is_the_optimum_at_the_full_peak():
  g = cm.RematGraph((1.0, 2.0, 1.0, 1.0), (4, 4, 4, 4), ((), (0,), (1,), (2, 0)))
  R, S = cm.checkpoint_all(g)
  sol = cm.solve(g, cm.memory_peak(g, R, S))
  assert sol is not None and sol.extra_s == 0.0 and sol.proven


def test_invalid_schedules_and_graphs_are_refused():
  g = cm.RematGraph((1.0,) * 3, (1,) * 3, ((), (0,), (1,)))
  R, S = cm.checkpoint_all(g)
  bad = S.copy()
  bad[2, 1] = False                              # stage 2 runs node 2 without node 1
  with pytest.raises(ValueError, match="without its input 1"):
    cm.check(g, R, bad)
  with pytest.raises(ValueError, match=r"R\[t, t\] = 1"):
    cm.check(g, np.zeros_like(R), S)
  with pytest.raises(ValueError, match=r"`RematGraph.deps\[1\]`"):
    cm.RematGraph((1.0, 1.0), (1, 1), ((), (1,)))
  with pytest.raises(ValueError, match="one cost, size and deps per node"):
    cm.RematGraph((1.0,), (1, 1), ((),))


def _mlp_program():
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return (x ** 2).sum()

  def step(ws, x):
    return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws, x))]

  ws = [jnp.full((64, 64), 0.01) for _ in range(3)]   # 38 ops: proven in about a second
  return jaxmem.analyze(step, ws, jnp.ones((256, 64)))


def test_no_planner_beats_the_reference_in_its_model():
  """A remat plan read as a Checkmate schedule is valid, and costs at least the optimum at its peak."""
  prog = _mlp_program()
  g = cm.graph_of(prog, "h100-sxm")
  assert g.n == prog.num_ops and g.fixed_bytes > 0 and g.keep
  plan = jaxmem.get_planner("greedy")(prog, int(0.8 * prog.peak_bytes), "h100-sxm",
                                      allow_offload=False)
  assert plan.num_remat > 0
  R, S = cm.rs_of_plan(g, plan)
  cm.check(g, R, S)
  peak = cm.memory_peak(g, R, S)
  sol = cm.solve(g, peak, time_limit_s=60)
  assert sol is not None and sol.proven and sol.peak_bytes <= peak
  assert sol.extra_s <= cm.schedule_cost(g, R) + 1e-12


def test_offload_plans_have_no_checkmate_form():
  prog = _mlp_program()
  plan = jaxmem.get_planner("greedy")(prog, int(0.8 * prog.peak_bytes), "h100-sxm",
                                      allow_remat=False)
  assert plan.num_offload > 0
  with pytest.raises(ValueError, match="remat-only"):
    cm.rs_of_plan(cm.graph_of(prog, "h100-sxm"), plan)
