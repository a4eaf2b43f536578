"""The ``ffi`` backend: a schedule executed under tracing, with jaxmem's native ops inserted.

The program's equations are re-bound one by one (like ``jax.core.eval_jaxpr``),
with their source info kept, and the schedule's fences, offloads and fetches
(synchronous, or the start/done halves of asynchronous copies) bound as
jaxmem's XLA FFI calls (:mod:`jaxmem._src.native.ops`). The result is an
ordinary JAX function of the flat step arguments; ``jax.jit`` compiles it.
Our own ops make every plan verifiable on the CPU, where XLA erases
``jax.checkpoint`` and memory kinds (``docs/design.md``, "Why native ops").
In a step spread over several devices each op works on every device's own
shard (:mod:`jaxmem._src.lower.per_device`). On one device the host copies go
to a planned layout (:mod:`jaxmem._src.lower.host_layout`: SmartPool's
offline allocation of the schedule's host buffers), each into its slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._src import _compat
from jaxmem._src.ir import substitutions
from jaxmem._src.lower.host_layout import HostLayout, host_layout
from jaxmem._src.lower.per_device import PerDevice, new_key
from jaxmem._src.native import ops as native
from jaxmem._src.plan.schedule import Schedule, Step, StepKind

# A pin orders after nothing in particular: a 1-byte constant is its `dep`.
_PIN_DEP = np.zeros((), np.uint8)


def schedule_function(schedule: Schedule, substitute: bool = True,
                      planned_host: bool = True) -> Callable[..., list[jax.Array]]:
  """``f(*flat_args) -> flat_outputs`` running ``schedule``.

  With ``substitute``, equations with a registered lowering substitution
  (:mod:`jaxmem._src.ir.substitutions`) are computed by it. With
  ``planned_host`` (and one device), each offload goes to its slot of the
  schedule's planned host layout (:func:`~jaxmem._src.lower.host_layout.host_layout`),
  else to the host store's arena.
  """
  program = schedule.program
  layout = program.device_layout
  per_device = None
  if program.num_devices > 1:
    if layout is None or layout.mesh is None:
      raise ValueError(
          "the `ffi` backend runs its ops on each device's shard of the step's "
          "`jax.sharding.Mesh`, and this step's shardings name none: shard its arguments with "
          "`jax.sharding.NamedSharding(mesh, spec)`.")
    per_device = PerDevice(layout.mesh)
  # Ops computed again: their first and later results are tied (split alike).
  tied = {st.op for st in schedule.steps if st.recompute} if per_device is not None else set()
  layout = host_layout(schedule) if planned_host and per_device is None else None

  def run(*flat_args: jax.Array) -> list[jax.Array]:
    env: dict[int, Any] = dict(program.consts)   # arrays, tracers and constant values
    env.update(zip(program.invars, flat_args))

    def read(x: int | _compat.Literal) -> Any:
      return x.val if isinstance(x, _compat.Literal) else env[x]

    fence = native.fence if per_device is None else per_device.fence
    planned = _PlannedCopies(layout) if layout is not None else None
    keys: dict[int, int] = {}   # handle value -> its round trip's key (per device only)
    groups: dict[int, int] = {}   # original variable -> its Shardy sharding group

    def split_like_original(outs: list[Any], ids: tuple[int, ...]) -> list[Any]:
      # A recomputed or fetched value is split as its original was, so the
      # partitioner cannot reduce it in another order (per_device docstring).
      if per_device is None:
        return outs
      return [_compat.sharding_group(o, groups.setdefault(var, _compat.new_sharding_group()))
              if var is not None and np.ndim(o) else o
              for o, var in ((o, schedule.value_var[v]) for o, v in zip(outs, ids))]

    for index, step in enumerate(schedule.steps):
      ins = [read(x) for x in step.inputs]
      if step.literal_dep is not None:
        dep = env[step.literal_dep]
        ins = [fence(np.asarray(x.val, x.aval.dtype), dep) if isinstance(x, _compat.Literal) else v
               for x, v in zip(step.inputs, ins)]
      kind = step.kind
      if kind is StepKind.COMPUTE:
        op = program.ops[step.op]
        outs = None
        if substitute:
          with _compat.eqn_context(op.eqn, op.name_stack):
            outs = substitutions.substitute(op.eqn, ins)
        if outs is None:
          outs = _compat.bind_eqn(op.eqn, ins, op.name_stack)
        if step.op in tied:
          outs = split_like_original(list(outs), step.outputs)
      elif kind is StepKind.FENCE:
        outs = [fence(ins[0], ins[1])]
      elif kind is StepKind.PIN:
        outs = [fence(ins[0], _PIN_DEP)]
      elif per_device is None and layout is not None:
        outs = planned.copy(index, step, ins, program)
      elif per_device is None:
        outs = _copy_step(step, ins, program)
      else:
        if kind in (StepKind.OFFLOAD, StepKind.OFFLOAD_START):
          # The value joins its variable's group, which its fetch will join.
          ins = split_like_original(ins[:1], step.inputs[:1]) + ins[1:]
        outs = _copy_step_per_device(per_device, step, ins, program, keys)
        if kind in (StepKind.FETCH, StepKind.FETCH_DONE):
          outs = split_like_original(outs, step.outputs)
      env.update(zip(step.outputs, outs))
    return [read(x) for x in schedule.outputs]

  return run


def _copy_step(step: Step, ins: list[Any], program: Any) -> list[jax.Array]:
  kind = step.kind
  if kind is StepKind.OFFLOAD:
    return [native.offload(ins[0])]
  if kind is StepKind.OFFLOAD_START:
    return [native.offload_start(ins[0])]
  if kind is StepKind.OFFLOAD_DONE:
    return [native.offload_done(ins[0], ins[1], ins[2] if len(ins) > 2 else None)]
  aval = program.vars[step.var].aval
  if kind is StepKind.FETCH:
    return [native.fetch(ins[0], ins[1], shape=aval.shape, dtype=aval.dtype)]
  if kind is StepKind.FETCH_START:
    return list(native.fetch_start(ins[0], ins[1], shape=aval.shape, dtype=aval.dtype))
  if kind is StepKind.FETCH_DONE:
    return [native.fetch_done(ins[0], ins[1], ins[2])]
  raise AssertionError(kind)  # pragma: no cover


class _PlannedCopies:
  """The copies of a planned host layout, each taking its slot after the slots it reuses are freed.

  The layout is solved for the order of the schedule's copies; XLA may run
  copies that do not depend on each other in another order, or at once
  (XLA:CPU's thunk executor). So a copy into a slot that reuses bytes of
  earlier ones (``HostLayout.waits``) also depends on their frees: its
  ``dep`` operand is a one-byte fence after each of their fetches. Copies
  whose bytes no earlier slot used are left free to move.
  """

  def __init__(self, layout: HostLayout):
    self.layout = layout
    self.freed: dict[int, Any] = {}   # slot -> a one-byte array ready once it is freed
    # Only the frees a later copy waits for get that array: a fence nobody
    # reads still reads the fetched value, and XLA may run it late, keeping
    # the value alive (measured: +18% compiled peak on a step).
    self.awaited = {a for wait in layout.waits for a in wait}

  def copy(self, index: int, step: Step, ins: list[Any], program: Any) -> list[jax.Array]:
    kind = step.kind
    if kind in (StepKind.OFFLOAD, StepKind.OFFLOAD_START):
      slot = self.layout.slots[index]
      dep = None
      for earlier in self.layout.waits[slot]:
        token = self.freed[earlier]
        dep = token if dep is None else native.fence(dep, token)
      op = native.offload if kind is StepKind.OFFLOAD else native.offload_start
      return [op(ins[0], slot=(self.layout.key, slot), dep=dep)]
    outs = _copy_step(step, ins, program)
    slot = self.layout.frees.get(index)   # a fetch or fetch_done: its slot is free after it
    if slot in self.awaited:
      self.freed[slot] = native.fence(_PIN_DEP, outs[0])
    return outs


def _copy_step_per_device(ops: PerDevice, step: Step, ins: list[Any], program: Any,
                          keys: dict[int, int]) -> list[jax.Array]:
  """A copy step on every device's shard; ``keys`` pairs each fetch with its offload."""
  kind = step.kind
  if kind is StepKind.OFFLOAD:
    keys[step.outputs[0]] = key = new_key()
    return [ops.offload(ins[0], key)]
  if kind is StepKind.OFFLOAD_START:
    return [ops.offload_start(ins[0])]
  if kind is StepKind.OFFLOAD_DONE:
    keys[step.outputs[0]] = key = new_key()
    dep = ins[2] if len(ins) > 2 else _PIN_DEP
    return [ops.offload_done(ins[0], ins[1], dep, key)]
  aval = program.vars[step.var].aval
  if kind is StepKind.FETCH:
    return [ops.fetch(ins[0], ins[1], keys[step.inputs[0]], aval.shape, aval.dtype)]
  if kind is StepKind.FETCH_START:
    return list(ops.fetch_start(ins[0], ins[1], keys[step.inputs[0]], aval.shape, aval.dtype))
  if kind is StepKind.FETCH_DONE:
    return [ops.fetch_done(ins[0], ins[1], ins[2])]
  raise AssertionError(kind)  # pragma: no cover


class FfiBackend:
  """Plans expressed with jaxmem's own XLA FFI ops (fences, host copies); CPU, and CUDA builds."""
  name = "ffi"

  def step_function(self, schedule: Schedule) -> Callable[..., list[jax.Array]]:
    return schedule_function(schedule)


__all__ = ["FfiBackend", "schedule_function"]
