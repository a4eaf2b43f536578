"""Rewrite backends: how a planned schedule becomes a program XLA compiles.

A :class:`Backend` turns a :class:`~jaxmem._src.plan.schedule.Schedule` into
``f(*flat_args) -> flat_outputs``, a JAX function of the step's flat arguments
that runs the schedule; :func:`jit_plan` wraps it as a ``jax.jit`` step with
the original step's argument and result structure. Two backends: ``ffi``
(:mod:`jaxmem._src.lower.ffi`: our own fence and host-copy ops, which every
XLA backend keeps, the CPU's included) and ``xla``
(:mod:`jaxmem._src.lower.xla`: ``optimization_barrier`` fences and host memory
kinds, which XLA:TPU and XLA:GPU honour and XLA:CPU erases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, Protocol

import jax

from jaxmem._src.lower.ffi import FfiBackend
from jaxmem._src.native import extension
from jaxmem._src.lower.xla import XlaBackend
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import Schedule


class Backend(Protocol):
  """Expresses a planned schedule as a JAX function of the step's flat arguments."""
  name: str

  def step_function(self, schedule: Schedule) -> Callable[..., list[jax.Array]]: ...


#: The backends by name.
BACKENDS: Mapping[str, Backend] = MappingProxyType({"ffi": FfiBackend(), "xla": XlaBackend()})


#: What a ``backend=`` argument takes.
BackendChoice = Literal["auto", "ffi", "xla"]


def resolve_backend(backend: BackendChoice | str, platform: str) -> str:
  """The backend a plan for ``platform`` (``cpu``, ``gpu``, ``tpu``) is expressed in.

  ``"auto"`` picks ``ffi`` on the CPU (XLA:CPU erases barriers and memory
  kinds, ``docs/design.md``), ``xla`` on TPU (custom calls cannot exist there)
  and on a GPU unless jaxmem's CUDA handlers are built and loaded the CUDA
  runtime (``jaxmem.native.CUDA_STATUS``).

  Example:
    >>> resolve_backend("auto", "cpu"), resolve_backend("auto", "tpu")
    ('ffi', 'xla')
  """
  cuda_handlers = extension.CUDA_STATUS.startswith("loaded")
  if backend == "auto":
    if platform == "cpu":
      return "ffi"
    if platform == "gpu" and cuda_handlers:
      return "ffi"
    return "xla"
  if backend not in BACKENDS:
    raise ValueError(f"`backend`={backend!r} is not a known backend; use 'auto' or one of "
                     f"{sorted(BACKENDS)}.")
  if backend == "ffi" and platform == "gpu" and not cuda_handlers:
    raise ValueError("`backend='ffi'` cannot express a plan for a GPU here: jaxmem's CUDA "
                     f"handlers are not registered ({extension.CUDA_STATUS}). Use "
                     "`backend='xla'` or 'auto' (on a GPU machine, jax's CUDA plugin loads "
                     "them).")
  if backend == "ffi" and platform == "tpu":
    raise ValueError("`backend='ffi'` cannot express a plan for a TPU: jaxmem's FFI ops have "
                     "no TPU implementation (XLA:TPU runs no custom calls of ours). Use "
                     "`backend='xla'` or 'auto'.")
  return backend


def get_backend(backend: str | Backend) -> Backend:
  """Looks up a backend by name, or returns a backend object unchanged."""
  if not isinstance(backend, str):
    return backend
  try:
    return BACKENDS[backend]
  except KeyError:
    raise ValueError(f"`backend`={backend!r} is not a known backend; use one of "
                     f"{sorted(BACKENDS)}.") from None


def jit_plan(plan: Plan, *, donate_argnums: Sequence[int] = (),
             compiler_options: Mapping[str, Any] | None = None,
             backend: str | Backend = "ffi") -> Any:
  """``jax.jit`` of the step rewritten by ``plan``, taking the step's (dynamic) arguments.

  Returns:
    The jitted function (``.lower(*args).compile()`` as usual).
  """
  program = plan.program
  if program.out_tree is None:
    raise ValueError("this program was built from a jaxpr traced elsewhere (no output "
                     "structure): it cannot be rewritten. Analyze the step function instead.")
  run = get_backend(backend).step_function(plan.schedule())
  out_tree = program.out_tree

  def planned(*dyn: Any) -> Any:
    return jax.tree_util.tree_unflatten(out_tree, run(*jax.tree_util.tree_leaves(dyn)))

  return jax.jit(planned, donate_argnums=tuple(donate_argnums),
                 compiler_options=dict(compiler_options) if compiler_options else None)


__all__ = ["BACKENDS", "Backend", "BackendChoice", "get_backend", "jit_plan", "resolve_backend"]
