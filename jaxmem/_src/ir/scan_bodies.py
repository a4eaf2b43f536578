"""A scan's body as a program of its own: the loop of a step that runs whole passes per iteration.

Gradient accumulation writes a train step as a ``lax.scan`` over
micro-batches whose body computes the loss *and its gradient* of one
micro-batch and adds the gradient into the carry. Such a scan is not
differentiated (no backward scan reads stacks of it: :func:`scan_pairs`
finds no pair), so the per-iteration rewrites of :mod:`.scan_remat` do not
apply, and to the planners of the step the scan is one op whose working set
is the body's peak: the forward activations of one micro-batch, kept for its
backward pass. That working set is a program like any train step's, and is
planned as one: :func:`body_function` gives the body as a function of its
flat operands (loop-invariant ones, the carry, one slice of each ``xs``),
which ``jaxmem.fit`` traces, plans and lowers like a step, and
:func:`with_scan_bodies_replaced` rebuilds the step around the lowered body.

The body runs once per iteration exactly as its plan says; a value the plan
recomputes or stages is recomputed or staged in every iteration. Nothing
crosses iterations, so the iterations' order and the carry are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxmem._src import _compat
from jaxmem._src.ir.scan_remat import ScanPair, traced_again, traced_step


def body_scans(jaxpr: _compat.Jaxpr, pairs: Sequence[ScanPair]) -> list[int]:
  """Indexes of ``jaxpr``'s top-level ``scan`` equations in no pair of :func:`scan_pairs`.

  A scan of a pair is rewritten per iteration by :mod:`.scan_remat`; the
  others run their body as a program of its own.
  """
  paired = {p.forward for p in pairs} | {p.backward for p in pairs}
  return [i for i, eqn in enumerate(jaxpr.eqns)
          if eqn.primitive.name == "scan" and i not in paired]


def body_function(eqn: _compat.JaxprEqn) -> tuple[Callable[..., list[Any]],
                                                  list[jax.ShapeDtypeStruct]]:
  """A ``scan`` equation's body as ``f(*consts, *carry, *x_slices) -> [*carry, *y_slices]``.

  Returns the function and shape-only arguments to trace it with.
  """
  body = eqn.params["jaxpr"]

  def run(*args: Any) -> list[Any]:
    return list(_compat.eval_jaxpr(body.jaxpr, body.consts, *args))

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in body.jaxpr.invars]
  return run, avals


def _bind_scan(eqn: _compat.JaxprEqn, body: Callable[..., Sequence[Any]],
               invals: Sequence[Any]) -> list[Any]:
  """``eqn`` bound again as ``lax.scan`` of ``body`` (same operands, same results)."""
  params = eqn.params
  nc, nk = params["num_consts"], params["num_carry"]
  consts, init, xs = list(invals[:nc]), list(invals[nc:nc + nk]), list(invals[nc + nk:])

  def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
    outs = list(body(*consts, *carry, *x))
    return outs[:nk], outs[nk:]

  with _compat.source_of(eqn):          # the scan keeps the user's line, for the reports
    carry, ys = jax.lax.scan(step, init, xs, length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
  return [*carry, *ys]


def with_scan_bodies_replaced(fun: Callable[..., Any], bodies: Mapping[int, Callable[..., Any]],
                              *, traced: tuple[_compat.ClosedJaxpr, list[ScanPair], Any]
                              | None = None) -> Callable[..., Any]:
  """``fun`` whose scans at ``bodies``' equation indexes run those functions as their bodies.

  ``bodies``: per index of a ``scan`` in the jaxpr of :func:`traced_step`
  (:func:`body_scans`), a function with the signature of
  :func:`body_function` of that scan (a planned, lowered body). ``traced``:
  that :func:`traced_step` of ``fun``, made already. The result can be
  traced, jitted and analyzed like ``fun`` (same pytrees in and out).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, xs):
    ...   g, _ = jax.lax.scan(lambda g, x: (g + jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
    ...                                     None), jnp.zeros_like(w), xs)
    ...   return w - 0.1 * g
    >>> w, xs = jnp.full((4, 4), 0.1), jnp.ones((3, 2, 4))
    >>> closed, pairs, _ = traced_step(step, (w, xs))
    >>> (i,) = body_scans(closed.jaxpr, pairs)
    >>> body, _ = body_function(closed.jaxpr.eqns[i])
    >>> same = with_scan_bodies_replaced(step, {i: body})
    >>> bool((jax.jit(same)(w, xs) == jax.jit(step)(w, xs)).all())
    True
  """
  @functools.wraps(fun)
  def wrapped(*args: Any) -> Any:
    leaves, (closed, _, out_tree) = traced_again(fun, args, traced)
    jaxpr = closed.jaxpr
    for i in bodies:
      if not 0 <= i < len(jaxpr.eqns) or jaxpr.eqns[i].primitive.name != "scan":
        raise ValueError(f"`with_scan_bodies_replaced`: equation {i} is not a `scan` of the "
                         "step's jaxpr; pass indexes from `body_scans`.")
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, leaves))
    read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]  # noqa: E731
    for i, eqn in enumerate(jaxpr.eqns):
      invals = [read(v) for v in eqn.invars]
      outs = (_bind_scan(eqn, bodies[i], invals) if i in bodies
              else _compat.bind_eqn(eqn, invals))
      env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, _compat.DropVar))
    return jax.tree_util.tree_unflatten(out_tree, [read(v) for v in jaxpr.outvars])

  return wrapped


__all__ = ["body_function", "body_scans", "with_scan_bodies_replaced"]
