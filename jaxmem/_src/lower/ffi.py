"""The ``ffi`` backend: a schedule executed under tracing, with jaxmem's native ops inserted.

The program's equations are re-bound one by one (like ``jax.core.eval_jaxpr``),
with their source info kept, and the schedule's fences, offloads and fetches
(synchronous, or the start/done halves of asynchronous copies) bound as
jaxmem's XLA FFI calls (:mod:`jaxmem._src.native.ops`). The result is an
ordinary JAX function of the flat step arguments; ``jax.jit`` compiles it.
Our own ops make every plan verifiable on the CPU, where XLA erases
``jax.checkpoint`` and memory kinds (``docs/design.md``, "Why native ops").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._src import _compat
from jaxmem._src.ir import substitutions
from jaxmem._src.native import ops as native
from jaxmem._src.plan.schedule import Schedule, StepKind

# A pin orders after nothing in particular: a 1-byte constant is its `dep`.
_PIN_DEP = np.zeros((), np.uint8)


def schedule_function(schedule: Schedule,
                      substitute: bool = True) -> Callable[..., list[jax.Array]]:
  """``f(*flat_args) -> flat_outputs`` running ``schedule``.

  With ``substitute``, equations with a registered lowering substitution
  (:mod:`jaxmem._src.ir.substitutions`) are computed by it.
  """
  program = schedule.program

  def run(*flat_args: jax.Array) -> list[jax.Array]:
    env: dict[int, Any] = dict(program.consts)   # arrays, tracers and constant values
    env.update(zip(program.invars, flat_args))

    def read(x: int | _compat.Literal) -> Any:
      return x.val if isinstance(x, _compat.Literal) else env[x]

    for step in schedule.steps:
      ins = [read(x) for x in step.inputs]
      if step.literal_dep is not None:
        dep = env[step.literal_dep]
        ins = [native.fence(np.asarray(x.val, x.aval.dtype), dep) if isinstance(x, _compat.Literal) else v
               for x, v in zip(step.inputs, ins)]
      if step.kind is StepKind.COMPUTE:
        op = program.ops[step.op]
        outs = None
        if substitute:
          with _compat.eqn_context(op.eqn, op.name_stack):
            outs = substitutions.substitute(op.eqn, ins)
        if outs is None:
          outs = _compat.bind_eqn(op.eqn, ins, op.name_stack)
      elif step.kind is StepKind.OFFLOAD:
        outs = [native.offload(ins[0])]
      elif step.kind is StepKind.FETCH:
        aval = program.vars[step.var].aval
        outs = [native.fetch(ins[0], ins[1], shape=aval.shape, dtype=aval.dtype)]
      elif step.kind is StepKind.OFFLOAD_START:
        outs = [native.offload_start(ins[0])]
      elif step.kind is StepKind.OFFLOAD_DONE:
        outs = [native.offload_done(ins[0], ins[1], ins[2] if len(ins) > 2 else None)]
      elif step.kind is StepKind.FETCH_START:
        aval = program.vars[step.var].aval
        outs = list(native.fetch_start(ins[0], ins[1], shape=aval.shape, dtype=aval.dtype))
      elif step.kind is StepKind.FETCH_DONE:
        outs = [native.fetch_done(ins[0], ins[1], ins[2])]
      elif step.kind is StepKind.FENCE:
        outs = [native.fence(ins[0], ins[1])]
      elif step.kind is StepKind.PIN:
        outs = [native.fence(ins[0], _PIN_DEP)]
      else:  # pragma: no cover
        raise AssertionError(step.kind)
      env.update(zip(step.outputs, outs))
    return [read(x) for x in schedule.outputs]

  return run


class FfiBackend:
  """Plans expressed with jaxmem's own XLA FFI ops (fences, host copies); CPU, and CUDA builds."""
  name = "ffi"

  def step_function(self, schedule: Schedule) -> Callable[..., list[jax.Array]]:
    return schedule_function(schedule)


__all__ = ["FfiBackend", "schedule_function"]
