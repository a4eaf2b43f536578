"""Rewrite: execute a :class:`Schedule` under tracing, inserting the native ops.

The program's equations are re-bound one by one (like ``jax.core.eval_jaxpr``),
with their source info kept, and the schedule's fences, offloads and fetches
(synchronous, or the start/done halves of asynchronous copies) bound as jaxmem
FFI calls. The result is an ordinary JAX function of the flat
step arguments; ``jax.jit`` compiles it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxmem._src import _compat, native, substitutions
from jaxmem._src.schedule import Schedule, StepKind

# A pin orders after nothing in particular: a 1-byte constant is its `dep`.
_PIN_DEP = np.zeros((), np.uint8)


def schedule_function(schedule: Schedule, substitute: bool = True) -> Callable[..., list[Any]]:
  """``f(*flat_args) -> flat_outputs`` running ``schedule``.

  With ``substitute``, equations with a registered lowering substitution
  (:mod:`jaxmem._src.substitutions`) are computed by it.
  """
  program = schedule.program

  def run(*flat_args: Any) -> list[Any]:
    env: dict[int, Any] = dict(program.consts)
    env.update(zip(program.invars, flat_args))

    def read(x: Any) -> Any:
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
