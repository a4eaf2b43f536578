"""Lowering substitutions compute exactly the original primitive's values."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.ir import substitutions
from jaxmem._src.lower.ffi import schedule_function


def _rewritten_grad(f, x):
  prog = jaxmem.analyze(jax.grad(f), x)
  return prog, jax.jit(schedule_function(jaxmem.Plan(prog, (), 0, 0, 0, "none").schedule()))(x)[0]


@pytest.mark.parametrize("window,stride,shape", [
    ((2, 2), (2, 2), (4, 8, 8, 3)),
    ((2, 1), (2, 1), (2, 6, 4, 5)),
    ((4, 4), (4, 4), (1, 8, 8, 2)),
    ((3, 3), (2, 2), (2, 9, 9, 3)),   # overlapping: not substituted, still exact
])
def test_max_pool_gradient_is_bit_identical_with_ties(window, stride, shape):
  weights = jnp.arange(1.0, shape[-1] + 1)

  def f(x):
    return (nn.max_pool(jax.nn.relu(x), window, strides=stride) ** 2 * weights).sum()

  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  # Ties inside one window (ReLU zeros make many more): the first maximum wins.
  x = x.at[0, 0, 0, 1].set(5.0).at[0, 1, 0, 1].set(5.0).at[0, 1, 1, 1].set(5.0)
  prog, got = _rewritten_grad(f, x)
  want = jax.jit(jax.grad(f))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  n = sum(substitutions.applies(op.eqn) for op in prog.ops)
  assert n == (0 if window != stride else 1)


def test_substitution_removes_hoisted_index_arrays():
  """The compiled temp of a max-pool gradient shrinks by the index arrays."""
  def f(x):
    return nn.max_pool(x, (2, 2), strides=(2, 2)).sum()
  x = jnp.ones((32, 32, 32, 16))
  prog = jaxmem.analyze(jax.grad(f), x)
  plain = jax.jit(jax.grad(f)).lower(x).compile().memory_analysis().temp_size_in_bytes
  run = schedule_function(jaxmem.Plan(prog, (), 0, 0, 0, "none").schedule())
  subst = jax.jit(run).lower(x).compile().memory_analysis().temp_size_in_bytes
  assert subst < plain
