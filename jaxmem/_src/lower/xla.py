"""The ``xla`` backend: a schedule in JAX's own terms, for compilers that honour them.

The same :class:`~jaxmem._src.plan.schedule.Schedule` the ``ffi`` backend runs,
with every inserted step expressed by JAX primitives that XLA:TPU and XLA:GPU
keep (``docs/design.md``, "Targets and backends"):

* a **fence** ``fence(x, dep) -> x`` (a remat's ordering point) is
  ``jax.lax.optimization_barrier((x, dep))[0]``: the barrier's outputs exist
  only once all its inputs do, so the recomputation that reads the fenced
  value cannot be hoisted above ``dep``, and XLA's CSE cannot merge it with
  the forward pass (its operand is a different value). This is how JAX's own
  ``jax.checkpoint`` keeps recomputation apart on accelerators
  (``prevent_cse=True`` lowers to the same barrier);
* a **pin** (materialize a value XLA would otherwise fuse) is
  ``optimization_barrier(x)``;
* an **offload** is ``jax.device_put(x, jax.memory.Space.Host)``, a **fetch**
  ``jax.device_put(optimization_barrier((h, dep))[0], jax.memory.Space.Device)``:
  host memory kinds, which XLA:TPU and XLA:GPU compile to buffers in host
  memory (``S(5)`` in the compiled HLO) and copy-start/copy-done pairs that
  their schedulers overlap with computation. The barrier on the handle is what
  keeps the fetch where the plan put it; without it XLA may issue the copy back
  right after the copy out, and the device buffer would live through the gap.
* the halves of an asynchronous copy (``copies="async"``) map to the same
  primitives at the start/done positions the window scheduler chose: the copy
  out is issued at ``offload_start``, the copy back at ``fetch_start`` (its
  ``dep`` the window's start), and the dones are identities. XLA's own
  latency-hiding scheduler then overlaps the transfer.

XLA:CPU erases both forms (it removes optimization barriers and treats memory
kinds as a no-op), so on the CPU this backend computes exactly the unplanned
step's values, which is what the tests compare bit for bit; its memory is
verified on a target compiler (:mod:`jaxmem._src.verify.targets`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._src import _compat
from jaxmem._src.plan.schedule import Schedule, StepKind

# The ticket of an asynchronous copy: a placeholder value, read by nothing
# that computes (the dones below ignore it).
_TICKET = np.zeros((), np.uint8)


def _barrier(x: Any, dep: Any) -> Any:
  """``x``, available only once ``dep`` is (``fence`` in JAX's terms)."""
  return jax.lax.optimization_barrier((x, dep))[0]


def _to_host(x: jax.Array) -> jax.Array:
  return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
  return jax.device_put(x, jax.memory.Space.Device)


def schedule_function(schedule: Schedule) -> Callable[..., list[jax.Array]]:
  """``f(*flat_args) -> flat_outputs`` running ``schedule`` with JAX primitives only.

  The program's equations are re-bound one by one with their source info and
  name stacks (so ``jax.named_scope`` paths and ``file:line`` survive into
  the compiled HLO's metadata). Lowering substitutions
  (:mod:`jaxmem._src.ir.substitutions`) are not applied: they work around
  XLA:CPU's expansions, and on an accelerator the original primitive is
  what the compiler is tuned for.
  """
  program = schedule.program

  def run(*flat_args: jax.Array) -> list[jax.Array]:
    env: dict[int, Any] = dict(program.consts)
    env.update(zip(program.invars, flat_args))

    def read(x: int | _compat.Literal) -> Any:
      return x.val if isinstance(x, _compat.Literal) else env[x]

    for step in schedule.steps:
      ins = [read(x) for x in step.inputs]
      kind = step.kind
      if step.literal_dep is not None:
        dep = env[step.literal_dep]
        ins = [_barrier(np.asarray(x.val, x.aval.dtype), dep)
               if isinstance(x, _compat.Literal) else v
               for x, v in zip(step.inputs, ins)]
      if kind is StepKind.COMPUTE:
        outs = _compat.bind_eqn(program.ops[step.op].eqn, ins, program.ops[step.op].name_stack)
      elif kind is StepKind.FENCE:
        outs = [_barrier(ins[0], ins[1])]
      elif kind is StepKind.PIN:
        outs = [jax.lax.optimization_barrier(ins[0])]
      elif kind in (StepKind.OFFLOAD, StepKind.OFFLOAD_START):
        outs = [_to_host(ins[0])]
      elif kind is StepKind.OFFLOAD_DONE:
        # (x, host_copy, [dep]) -> handle: the copy was issued at the start.
        outs = [ins[1]]
      elif kind is StepKind.FETCH:
        outs = [_to_device(_barrier(ins[0], ins[1]))]
      elif kind is StepKind.FETCH_START:
        outs = [_to_device(_barrier(ins[0], ins[1])), _TICKET]
      elif kind is StepKind.FETCH_DONE:
        # (buf, ticket, dep) -> x: the value is the buffer fetched at the start.
        outs = [ins[0]]
      else:  # pragma: no cover
        raise AssertionError(kind)
      env.update(zip(step.outputs, outs))
    return [read(x) for x in schedule.outputs]

  return run


class XlaBackend:
  """Plans in JAX's own terms: ``optimization_barrier`` fences, host memory kinds (TPU, GPU)."""
  name = "xla"

  def step_function(self, schedule: Schedule) -> Callable[..., list[jax.Array]]:
    return schedule_function(schedule)


__all__ = ["XlaBackend", "schedule_function"]
