"""Every use of JAX internals (``jax.core``, ``jax.extend``, ``jax._src``) lives here.

JAX's internal APIs move between releases; keeping them behind one module means a
JAX upgrade touches one file. Measured against jax/jaxlib 0.10.2.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator

import numpy as np

import jax
from jax import extend as jex
from jax._src import core as _core
from jax._src import source_info_util as _siu

Var = jex.core.Var
Literal = jex.core.Literal
ClosedJaxpr = jex.core.ClosedJaxpr
Jaxpr = jex.core.Jaxpr
JaxprEqn = jex.core.JaxprEqn
DropVar = jex.core.DropVar

# Call-like primitives whose body is inlined into the flat program (DESIGN.md,
# "Program"). Maps primitive name -> params key of the body jaxpr.
INLINE_BODIES: dict[str, str] = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def make_jaxpr(fun: Any, *args: Any) -> ClosedJaxpr:
  return jax.make_jaxpr(fun)(*args)


def body_of(eqn: JaxprEqn) -> ClosedJaxpr | None:
  """The inlinable body of a call-like equation, as a ClosedJaxpr, else None."""
  key = INLINE_BODIES.get(eqn.primitive.name)
  if key is None or key not in eqn.params:
    return None
  body = eqn.params[key]
  if isinstance(body, ClosedJaxpr):
    return body
  if isinstance(body, Jaxpr):
    return ClosedJaxpr(body, ())
  return None


def sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
  """All jaxprs nested in an equation's params (scan/while/cond bodies...)."""
  return [j.jaxpr if isinstance(j, ClosedJaxpr) else j
          for j in jex.core.jaxprs_in_params(eqn.params)]


def bind_eqn(eqn: JaxprEqn, invals: list[Any], name_stack: Any = None) -> list[Any]:
  """Binds ``eqn``'s primitive on new inputs, keeping its source info.

  ``name_stack`` is the equation's full name stack when it was inlined from a
  nested call (default: its own).
  """
  params = eqn.primitive.get_bind_params(eqn.params)
  if name_stack is None:
    name_stack = eqn.source_info.name_stack
  name_stack = _siu.current_name_stack() + name_stack
  with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), \
       eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def name_stack_of(eqn: JaxprEqn) -> Any:
  return eqn.source_info.name_stack


def join_name_stacks(outer: Any, inner: Any) -> Any:
  return outer + inner if outer is not None else inner


def empty_name_stack() -> Any:
  return _siu.NameStack()


def user_frame(eqn: JaxprEqn) -> tuple[str, int, str] | None:
  """``(file, line, function)`` of the user code that emitted ``eqn``.

  The innermost frame outside JAX and outside installed libraries (flax,
  optax, ... under ``site-packages``): "which line of *my* model made it".
  Falls back to JAX's own notion of the user frame.
  """
  return _user_frame(eqn.source_info.traceback)


_LIBRARY_DIRS = ("/site-packages/", "/dist-packages/")


@functools.lru_cache(maxsize=4096)
def _user_frame(traceback: Any) -> tuple[str, int, str] | None:
  first = None
  for frame in _siu.user_frames(traceback):
    if first is None:
      first = frame
    if not any(d in frame.file_name for d in _LIBRARY_DIRS):
      return frame.file_name, frame.start_line, frame.function_name
  if first is None:
    return None
  return first.file_name, first.start_line, first.function_name


@contextlib.contextmanager
def eqn_context(eqn: JaxprEqn, name_stack: Any = None) -> Iterator[None]:
  """Source info of ``eqn`` for ops bound in its place."""
  name_stack = _siu.current_name_stack() + (
      eqn.source_info.name_stack if name_stack is None else name_stack)
  with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
    yield


def aval_nbytes(aval: Any) -> int:
  """Bytes of one value of abstract value ``aval`` (per device, unsharded)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:   # tokens, refs and other non-arrays
    return 0
  size = math.prod(shape)
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    # Typed PRNG keys: stored as their base representation.
    impl = getattr(dtype, "_impl", None)
    key_shape = getattr(impl, "key_shape", (2,))
    return size * math.prod(key_shape) * 4
  return size * np.dtype(dtype).itemsize


def is_plain_array_aval(aval: Any) -> bool:
  """True for dense arrays of a numpy dtype (what the native store can copy)."""
  dtype = getattr(aval, "dtype", None)
  if dtype is None or not hasattr(aval, "shape"):
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return False
  return isinstance(aval, _core.ShapedArray)
