"""What a scanned layer stacks, chosen by cost: the frontier and the rewrites of its points."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmem
from jaxmem._src import _compat
from jaxmem._src.estimate.devices import device_profile
from jaxmem._src.ir.scan_remat import (ScanPair, forward_body, scan_pairs, traced_step,
                                       with_scan_residuals_recomputed)
from jaxmem._src.planners.scan_policy import scan_frontier

PROFILE = device_profile("h100-sxm")


def _layered(ops: tuple[str, ...], width: int = 32, batch: int = 16, layers: int = 6):
  """A loss whose scanned layer applies ``ops`` in turn ("dot", "tanh", "sin", "mul", "sum")."""
  def layer(h, w):
    for op in ops:
      if op == "dot":
        h = h @ w
      elif op == "tanh":
        h = jnp.tanh(h)
      elif op == "sin":
        h = jnp.sin(h) * h
      elif op == "mul":
        h = h * (h @ w)
      elif op == "norm":
        h = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1.0)
    return h, None

  def step(ws, x):
    def loss(ws, x):
      h, _ = jax.lax.scan(layer, x, ws)
      return jnp.sum(h * h)
    return jax.grad(loss)(ws, x)

  ws = jax.random.normal(jax.random.key(0), (layers, width, width)) * 0.2
  x = jax.random.normal(jax.random.key(1), (batch, width))
  return step, (ws, x)


def _stack_bytes(closed: _compat.ClosedJaxpr) -> int:
  """Bytes of the stacks every forward scan hands its backward scan."""
  total = 0
  for p in scan_pairs(closed.jaxpr):
    eqn = closed.jaxpr.eqns[p.forward]
    num_carry = int(eqn.params["num_carry"])
    total += sum(_compat.aval_nbytes(eqn.outvars[num_carry + j].aval) for j in p.residuals)
  return total


def test_the_frontier_runs_from_recomputing_everything_to_recomputing_nothing():
  step, args = _layered(("dot", "tanh", "mul", "sin"))
  closed, pairs, _ = traced_step(step, args)
  points = scan_frontier(closed.jaxpr, pairs, PROFILE)
  assert len(points) >= 3
  assert points[0].saved == ((),) and points[-1].recompute_s == 0.0
  for a, b in zip(points, points[1:]):
    assert a.stacked_bytes < b.stacked_bytes and a.recompute_s > b.recompute_s
  # The last point stacks what JAX's own residuals are made of: no more bytes.
  assert points[-1].stacked_bytes <= _stack_bytes(closed)


def _backward_dots(closed: _compat.ClosedJaxpr) -> int:
  """Matmuls in the backward scan's body (nested calls inlined)."""
  (pair,) = scan_pairs(closed.jaxpr)
  backward = forward_body(closed.jaxpr, ScanPair(pair.backward, pair.backward, ()))
  return sum(e.primitive.name == "dot_general" for e in backward.jaxpr.eqns)


def test_the_first_value_kept_spares_the_recomputation_its_matmul():
  # A matmul output costs 2*width FLOPs per element to recompute, the tanh and
  # sin after it a few: the first value the greedy keeps is one past the
  # matmul, so that the backward body no longer recomputes it.
  step, args = _layered(("dot", "tanh", "sin"))
  closed, pairs, _ = traced_step(step, args)
  points = scan_frontier(closed.jaxpr, pairs, PROFILE)
  nothing = traced_step(with_scan_residuals_recomputed(step, saved=points[0].saved), args)[0]
  first = traced_step(with_scan_residuals_recomputed(step, saved=points[1].saved), args)[0]
  assert _backward_dots(nothing) == _backward_dots(closed) + 1
  assert _backward_dots(first) == _backward_dots(closed)


def test_each_point_stacks_what_it_says_and_keeps_the_results():
  step, args = _layered(("dot", "norm", "tanh", "mul"))
  closed, pairs, _ = traced_step(step, args)
  points = scan_frontier(closed.jaxpr, pairs, PROFILE)
  ref = jax.jit(step)(*args)
  for point in points:
    rewritten = with_scan_residuals_recomputed(step, saved=point.saved)
    after, _, _ = traced_step(rewritten, args)
    assert _stack_bytes(after) == point.stacked_bytes
    np.testing.assert_allclose(jax.jit(rewritten)(*args), ref, rtol=2e-6, atol=1e-7)


@settings(max_examples=12, deadline=None)
@given(ops=st.lists(st.sampled_from(["dot", "tanh", "sin", "mul", "norm"]), min_size=1,
                    max_size=5).map(tuple),
       pick=st.floats(0, 1))
def test_any_point_of_any_layer_keeps_gradients_and_stacks_no_more(ops, pick):
  step, args = _layered(ops, width=8, batch=4, layers=3)
  closed, pairs, _ = traced_step(step, args)
  if not pairs:
    return   # nothing stacked (a layer whose backward needs no residual)
  points = scan_frontier(closed.jaxpr, pairs, PROFILE)
  point = points[min(len(points) - 1, int(pick * len(points)))]
  rewritten = with_scan_residuals_recomputed(step, saved=point.saved)
  np.testing.assert_allclose(jax.jit(rewritten)(*args), jax.jit(step)(*args), rtol=1e-5,
                             atol=1e-6)
  after, _, _ = traced_step(rewritten, args)
  assert _stack_bytes(after) == point.stacked_bytes <= max(_stack_bytes(closed),
                                                           points[0].stacked_bytes)


def test_saved_indexes_are_checked():
  step, args = _layered(("dot", "tanh"))
  closed, pairs, _ = traced_step(step, args)
  with pytest.raises(ValueError, match="equation indexes"):
    jax.make_jaxpr(with_scan_residuals_recomputed(step, saved=[(10_000,)]))(*args)
  with pytest.raises(ValueError, match="one per pair"):
    with_scan_residuals_recomputed(step, saved=[(), ()])(*args)
  with pytest.raises(ValueError, match="not both"):
    ScanPair(0, 1, (0,), save_dots=True, saved=(0,))


def test_fit_keeps_the_cheapest_stacking_that_fits():
  # A scanned layer of two matmuls and elementwise work: at 0.6 of its peak
  # `fit` keeps some of the body's values (not nothing, as nothing_saveable
  # would) and stacks less than JAX's residuals.
  step, args = _layered(("dot", "tanh", "mul", "sin"), width=128, batch=512, layers=8)
  fitted = jaxmem.fit(0.6)(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  assert res.scans.startswith("recomputed by cost"), res.scans
  assert " 0 body values kept" not in res.scans
  np.testing.assert_allclose(fitted(*args), jax.jit(step)(*args), rtol=2e-6, atol=1e-7)


def test_the_point_that_stacks_least_computes_what_nn_remat_nothing_saveable_does():
  # The examples' GPT with its blocks as one `nn.scan`: the frontier's first
  # point recomputes each block from its input, as `nn.remat(nothing_saveable)`
  # on the scanned block does, with the same arithmetic: bit-identical to it.
  import transformer
  kw = dict(batch_size=4, seq_len=16, vocab=32, dim=32, heads=2, layers=3, scan_layers=True)
  step, args = transformer.build(**kw)
  closed, pairs, _ = traced_step(step, args)
  points = scan_frontier(closed.jaxpr, pairs, PROFILE)
  ours = jax.jit(with_scan_residuals_recomputed(step, saved=points[0].saved))(*args)
  by_hand = jax.jit(transformer.build(**kw, remat_policy="nothing_saveable")[0])(*args)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(by_hand)):
    np.testing.assert_array_equal(a, b)


def test_fit_of_a_scanned_gpt_keeps_its_gradients_to_float32_rounding():
  # Part of each block recomputed: XLA:CPU fuses the recomputed values into
  # other kernels and sums some gradients in another order.
  import transformer
  from _common import cross_entropy
  kw = dict(batch_size=8, seq_len=32, vocab=32, dim=64, heads=2, layers=4, scan_layers=True)
  _, (params, _, tokens) = transformer.build(**kw)
  model = transformer.GPT(32, 64, 2, 4, 32, None, True)

  def grads(params, tokens):
    return jax.grad(lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(params)

  fitted = jaxmem.fit(0.6)(grads)
  res = fitted.fit_result(params, tokens)
  assert res.peak_bytes <= res.budget_bytes and res.scans.startswith("recomputed by cost")
  for a, b in zip(jax.tree.leaves(fitted(params, tokens)),
                  jax.tree.leaves(jax.jit(grads)(params, tokens))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
