"""The estimate of a traced program: XLA's model applied, lifetimes measured, roles refined.

:func:`analyze_program` takes the :class:`~jaxmem._src.ir.program.Program`
that :func:`~jaxmem._src.ir.trace.trace` built and returns an
:class:`AnalyzedProgram`: the same program with what jaxmem knows about it
before compiling anything (the memory model of every op, the profile of live
bytes, the refined roles, the device-independent costs). Every later stage
reads it; nothing changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxmem._src.estimate import xla_model
from jaxmem._src.estimate.cost import OpCosts, op_costs
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.estimate.lifetimes import Flow, Profile, estimate
from jaxmem._src.estimate.xla_model import CseKey, OpMemory
from jaxmem._src.ir import primitives
from jaxmem._src.ir.program import Phase, Program, Role, VarInfo


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class AnalyzedProgram(Program):
  """A :class:`~jaxmem._src.ir.program.Program` with its estimate (built by :func:`analyze_program`).

  Attributes:
    profile: estimated live bytes at every program position under XLA's model.
    memory: per op, what XLA adds to it as plain ``jax.jit`` compiles it
      (:func:`~jaxmem._src.estimate.xla_model.op_memory_model`).
    planned_memory: the same as a planned schedule runs it (lowering
      substitutions applied).
    cse_keys: per op, its key for XLA's common-subexpression elimination
      (:func:`~jaxmem._src.estimate.xla_model.cse_keys`) as a small int: ops
      with equal keys share it (an int hashes at once; the estimate of every
      schedule hashes every step's key); ``None``: never merged.
    hoisted: constant-like values XLA computes at the program start.
    movable: per op, XLA may run it as soon as its inputs exist (the
      optimizer update after the backward pass).
    costs: the device-independent part of every op's roofline time.
    dead: per op, nothing reads its results and it has no effects (XLA
      removes it).
    fused: per op, XLA fuses all its results into their consumers (they are
      virtual in the profile): it costs its arithmetic only.
    rematerializable: per op, a recomputation may re-execute it: no effects,
      no body of its own, and a primitive the registry allows
      (:attr:`~jaxmem._src.ir.primitives.PrimitiveFacts.rematerializable`).
    operand_fusions: per op, the compiler fuses elementwise producers into
      its operands (:func:`~jaxmem._src.estimate.xla_model.operand_fusions`).
    donation_copies: donated arguments XLA copies before updating them in
      place, and the op that updates each
      (:func:`~jaxmem._src.estimate.xla_model.donation_copies`).
    epilogues: per op, whether the compiler fuses it into its elementwise
      epilogue (:func:`~jaxmem._src.estimate.xla_model.epilogue_fusions`).
    forwards: per op, its results that store nothing of their own
      (:func:`~jaxmem._src.estimate.xla_model.shard_map_forwards`).
    indexing: per op, how a fusion it is in indexes its operands
      (:func:`~jaxmem._src.estimate.xla_model.indexing_kinds`; ``()`` when the
      compiler's code-duplication limit is not modelled).
    in_place: per op, the position among its value inputs of the operand
      whose buffer it writes, or -1
      (:func:`~jaxmem._src.estimate.xla_model.in_place_operands`).
  """
  profile: Profile
  memory: tuple[OpMemory, ...]
  planned_memory: tuple[OpMemory, ...]
  cse_keys: tuple[int | None, ...]
  hoisted: frozenset[int]
  movable: tuple[bool, ...]
  costs: OpCosts
  dead: tuple[bool, ...]
  fused: tuple[bool, ...]
  rematerializable: tuple[bool, ...]
  operand_fusions: tuple[int, ...]
  donation_copies: Mapping[int, int] = dataclasses.field(default_factory=dict)
  forwards: tuple[xla_model.Forwards, ...] = ()
  epilogues: tuple[bool, ...] = ()
  indexing: tuple[int, ...] = ()
  in_place: tuple[int, ...] = ()

  @property
  def peak_bytes(self) -> int:
    """Estimated peak live bytes (arguments + outputs + temporaries)."""
    return self.profile.peak_bytes

  def op_seconds(self, device: DeviceLike = None) -> np.ndarray:
    """Roofline time of every op of the unplanned program on ``device``.

    Ops XLA removes cost nothing; ops whose results XLA fuses into their
    consumers cost their arithmetic only.
    """
    dev = device_profile(device)
    out = np.where(np.asarray(self.fused, dtype=bool), self.costs.seconds(dev, fused=True),
                   self.costs.seconds(dev, fused=False))
    out[np.asarray(self.dead, dtype=bool)] = 0.0
    return out

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(ops={self.num_ops}, vars={len(self.vars)}, "
            f"peak_bytes={self.peak_bytes})")


def analyze_program(program: Program) -> AnalyzedProgram:
  """The estimate of ``program`` (see :class:`AnalyzedProgram`)."""
  memory, planned = xla_model.op_memory_models(program)
  interned: dict[CseKey, int] = {}
  keys = tuple(None if k is None else interned.setdefault(k, len(interned))
               for k in xla_model.cse_keys(program))
  hoisted = xla_model.hoisted_constants(program) | xla_model.scan_stacks_at_start(program)
  movable = xla_model.movable_ops(program)
  fusing = xla_model.operand_fusions(program)
  copies = xla_model.donation_copies(program)
  forwards = xla_model.shard_map_forwards(program)
  epilogues = xla_model.epilogue_fusions(program)
  indexing = xla_model.indexing_kinds(program)
  in_place = xla_model.in_place_operands(program)
  profile = estimate(_unplanned_flow(program, memory, keys, hoisted, movable, fusing, copies,
                                     forwards, epilogues, indexing, in_place))[0]
  outs = program.output_ids
  dead = tuple(bool(op.outputs) and not op.eqn.effects
               and not any(program.vars[o].uses or o in outs for o in op.outputs)
               for op in program.ops)
  remat = tuple(primitives.facts(op.primitive).rematerializable and not op.eqn.effects
                and not op.has_body for op in program.ops)
  virtual = profile.virtual
  fused = tuple(virtual is not None and bool(op.outputs) and all(virtual[o] for o in op.outputs)
                for op in program.ops)
  fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(Program)}
  fields["vars"] = refine_roles(program, profile)
  return AnalyzedProgram(**fields, profile=profile, memory=memory, planned_memory=planned,
                         cse_keys=keys, hoisted=hoisted, movable=movable,
                         costs=op_costs([(op.eqn, op.has_body) for op in program.ops]), dead=dead,
                         fused=fused, rematerializable=remat, operand_fusions=fusing,
                         donation_copies=copies, forwards=forwards, epilogues=epilogues,
                         indexing=indexing, in_place=in_place)


def _unplanned_flow(program: Program, memory: tuple[OpMemory, ...],
                    keys: tuple[int | None, ...], hoisted: frozenset[int],
                    movable: tuple[bool, ...], fusing: tuple[int, ...],
                    copies: Mapping[int, int], forwards: tuple[xla_model.Forwards, ...],
                    epilogues: tuple[bool, ...], indexing: tuple[int, ...] = (),
                    in_place: tuple[int, ...] = ()) -> Flow:
  """The unplanned program as the lifetime estimator sees it: one step per op."""
  starts, ends = zip(*(program.interval(v.id) for v in program.vars)) if program.vars else ((), ())
  stored = xla_model.stored_var_bytes(program)
  early = [[(op.inputs[pos], b, t) for pos, b, t in m.early] for op, m in zip(program.ops, memory)]
  if any(early):
    ends = list(ends)
    # An operand read through an early layout copy is not kept alive by
    # that read (`Flow.early_copies`): its interval ends at its last other use.
    copied = {(op.index, x) for op, reads in zip(program.ops, early) for x, _, _ in reads}
    for op, reads in zip(program.ops, early):
      for x, _, _ in reads:
        v = program.vars[x]
        if ends[x] == op.index and ends[x] < program.num_ops:
          ends[x] = max((u for u in v.uses if (u, x) not in copied), default=starts[x])
  return Flow(
      num_steps=program.num_ops,
      step_kind=[m.kind for m in memory],
      step_inputs=[op.input_ids() for op in program.ops],
      step_outputs=[list(op.outputs) for op in program.ops],
      transient=[m.transient for m in memory],
      hoisted=[m.hoisted for m in memory],
      start=list(starts), end=list(ends),
      nbytes=[0 if v.id in program.donation_aliases else stored[v.id]
              for v in program.vars],
      materialized=frozenset(v.id for v in program.vars if v.is_input or v.is_output),
      hoist_to_start=hoisted,
      shared_reads=[[(op.inputs[pos], b) for pos, b in m.shared]
                    for op, m in zip(program.ops, memory)],
      movable=movable, cse_keys=keys, on_chip=xla_model.on_chip_bytes(program),
      fuses_operands=fusing, copies=copies,
      forwarded={o: src for op, fw in zip(program.ops, forwards)
                 for o, src in xla_model.forwarded_values(fw, op.inputs, op.outputs).items()},
      epilogues=epilogues, early_copies=early if any(early) else (),
      in_place=list(in_place) if any(k >= 0 for k in in_place) else None,
      indexing=indexing or None)


def refine_roles(program: Program, profile: Profile) -> tuple[VarInfo, ...]:
  """The program's values with the roles the estimate reveals.

  A forward value kept alive into the backward pass by a fused use is an
  activation: XLA recomputes a fused ReLU mask in the backward pass from the
  matmul output, so that output is what is saved for backward.
  """
  ivs = profile.intervals
  backward = [op.index for op in program.ops if op.phase is Phase.BACKWARD]
  if ivs is None or not backward:
    return program.vars
  first_backward = backward[0]
  return tuple(
      dataclasses.replace(v, role=Role.ACTIVATION)
      if (v.role is Role.TEMPORARY and not v.is_input
          and program.ops[v.defined_by].phase is Phase.FORWARD
          and first_backward <= ivs[v.id][1] < program.num_ops) else v
      for v in program.vars)


def allocation_instance(program: AnalyzedProgram, *,
                        return_ids: bool = False) -> tuple[np.ndarray, ...]:
  """The offline allocation (DSA) instance of a program: its stored intermediate values.

  Takes every value defined by an op (not arguments or constants) that XLA
  does not fuse away (``program.profile.virtual``) and that has bytes, with
  its lifetime from ``program.profile.intervals`` (jaxmem's estimate after the
  XLA model). Those intervals are closed, ``[start, end]`` in op positions;
  the instance uses half-open ``[start, end + 1)``, the format of
  :func:`jaxmem.dsa.solve`.

  Args:
    program: from :func:`jaxmem.analyze`.
    return_ids: also return the value ids (indices into ``program.vars``).

  Returns:
    ``(lower, upper, size)`` int64 arrays, plus ``ids`` when ``return_ids``.

  Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> prog = jaxmem.analyze(lambda x: jnp.sin(x @ x.T).sum(), jnp.ones((64, 32)))
    >>> lower, upper, size = jaxmem.dsa.from_program(prog)
    >>> jaxmem.dsa.solve(lower, upper, size).footprint >= jaxmem.dsa.max_load(lower, upper, size)
    True
  """
  prof = program.profile
  intervals = prof.intervals
  if intervals is None:
    raise ValueError("the program's profile has no per-value intervals")
  virtual = prof.virtual if prof.virtual is not None else np.zeros(len(intervals), dtype=bool)
  rows = []
  for v in program.vars:
    if v.is_input or v.nbytes <= 0 or v.id >= len(intervals) or virtual[v.id]:
      continue
    start, end = intervals[v.id]
    if start < 0:
      continue
    rows.append((v.id, start, max(end, start) + 1, v.nbytes))
  table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
  out = (table[:, 1].copy(), table[:, 2].copy(), table[:, 3].copy())
  return (*out, table[:, 0].copy()) if return_ids else out


__all__ = ["AnalyzedProgram", "allocation_instance", "analyze_program", "refine_roles"]
