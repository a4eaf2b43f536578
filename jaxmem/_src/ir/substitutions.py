"""Lowering substitutions: the same values, computed in a way XLA stores more cheaply.

A registry ``primitive name -> (applies(eqn), rule(eqn, invals) -> outputs)``.
The backends (:mod:`jaxmem._src.lower`) compute an equation by its rule where
it applies, and the estimate (:mod:`jaxmem._src.estimate.xla_model`) prices
the planned program with the substitute's memory; both read this registry, so
it sits with the program. A rule must produce exactly the values of the
original primitive.

``select_and_scatter_add`` (the gradient of ``max_pool``): XLA:CPU expands it
into a variadic ``reduce_window`` plus ``scatter``, with index arrays of the
operand's shape per window dimension that it hoists to the program start and
keeps alive until the backward pass — five times the pooled input's bytes for
the whole step, more than the activations themselves on a small CNN. For
non-overlapping windows (window == stride, no padding) the same gradient is a
reshape, an ``argmax`` over each window and a ``select``: each input element
receives either its window's cotangent (if it is the first maximum in the
window's row-major order, which is what ``select_prim=ge`` picks) or zero.
This is the pooling analogue of Layrub §4.2's memory-efficient layers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem._src import _compat

Rule = Callable[[_compat.JaxprEqn, list[jax.Array]], list[jax.Array]]
Applies = Callable[[_compat.JaxprEqn], bool]
SUBSTITUTIONS: dict[str, tuple[Applies, Rule]] = {}


def register_substitution(name: str, applies: Applies) -> Callable[[Rule], Rule]:
  """Registers ``rule(eqn, invals) -> outputs`` for equations where ``applies(eqn)``."""
  def deco(rule: Rule) -> Rule:
    SUBSTITUTIONS[name] = (applies, rule)
    return rule
  return deco


def _nonoverlapping_windows(eqn: _compat.JaxprEqn) -> bool:
  p = eqn.params
  operand = eqn.invars[1].aval
  windows = tuple(p["window_dimensions"])
  return (p["select_prim"] is lax.ge_p and windows == tuple(p["window_strides"])
          and all(tuple(pad) == (0, 0) for pad in p["padding"])
          and not any(d % w for d, w in zip(operand.shape, windows))
          and bool(jnp.issubdtype(operand.dtype, jnp.floating)))


@register_substitution("select_and_scatter_add", _nonoverlapping_windows)
def _nonoverlapping_max_pool_grad(eqn: _compat.JaxprEqn, invals: list[jax.Array]) -> list[jax.Array]:
  source, operand = invals
  windows = tuple(eqn.params["window_dimensions"])
  rank = operand.ndim
  split = []
  for d, w in zip(operand.shape, windows):
    split += [d // w, w]
  outer = tuple(range(0, 2 * rank, 2))
  inner = tuple(range(1, 2 * rank, 2))
  x = operand.reshape(split).transpose(outer + inner)
  out_shape = tuple(d // w for d, w in zip(operand.shape, windows))
  x = x.reshape(out_shape + (int(np.prod(windows)),))
  first_max = jnp.argmax(x, axis=-1)
  hit = lax.broadcasted_iota(first_max.dtype, x.shape, x.ndim - 1) == first_max[..., None]
  contrib = jnp.where(hit, source[..., None], jnp.zeros((), source.dtype))
  contrib = contrib.reshape(out_shape + windows)
  inverse = np.argsort(outer + inner)
  return [contrib.transpose(tuple(inverse)).reshape(operand.shape)]


def applies(eqn: _compat.JaxprEqn) -> bool:
  """Whether a registered substitution replaces ``eqn``."""
  entry = SUBSTITUTIONS.get(eqn.primitive.name)
  return entry is not None and entry[0](eqn)


def substitute(eqn: _compat.JaxprEqn, invals: list[jax.Array]) -> list[jax.Array] | None:
  """The substituted outputs of ``eqn`` on ``invals``, or ``None``."""
  if not applies(eqn):
    return None
  return SUBSTITUTIONS[eqn.primitive.name][1](eqn, invals)
