"""The flat program of a traced step: its ops, its values, and who they are.

A :class:`Program` is built once by :func:`jaxmem._src.ir.trace.trace` and
never changed afterwards: every later stage (the estimate, the planners, the
backends) reads it, and a stage that knows more about it (the estimate refines
the roles of values kept for the backward pass) returns a new value.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from collections.abc import Mapping
from typing import Any

from jaxmem._src import _compat
from jaxmem._src.ir.blocks import Block
from jaxmem._src.ir.sharding import DeviceLayout


class Role(str, enum.Enum):
  """What a variable is, for reports and for the planners."""
  PARAMETER = "parameter"
  OPTIMIZER_STATE = "optimizer_state"
  INPUT = "input"              # other step arguments: batch, labels, rng, step count
  CONSTANT = "constant"        # constants captured by the traced program
  ACTIVATION = "activation"    # forward value saved for the backward pass
  GRADIENT = "gradient"        # value computed by the backward pass
  TEMPORARY = "temporary"      # everything else
  OUTPUT = "output"            # a non-gradient result of the step (new params, loss)


class Phase(str, enum.Enum):
  """Which pass an op belongs to, from its name stack (``jvp(...)``, ``transpose(...)``)."""
  FORWARD = "forward"
  BACKWARD = "backward"
  OTHER = "other"


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
  """One equation of the flat program.

  Attributes:
    index: position in program order.
    eqn: the JAX equation (primitive and params) to re-bind when rewriting.
    inputs: variable ids, or ``Literal`` objects for inline literals.
    outputs: variable ids.
    phase: forward / backward (under ``transpose``) / other.
    name_stack: JAX name stack, joined across inlined calls.
    source: ``file:line`` of the user code that emitted it.
    transient_bytes: working memory inside an opaque block beyond its inputs
      and outputs (0 for plain primitives), per device.
    module: module path: flax linen's name stack without transformations,
      else the ``__call__`` classes on the stack (flax nnx, equinox).
    has_body: the equation holds jaxprs in its params (a loop body, ``cond``
      branches, a remat body, a scalar combiner): looked up once here, read by
      every stage.
  """
  index: int
  eqn: _compat.JaxprEqn
  inputs: tuple[int | _compat.Literal, ...]
  outputs: tuple[int, ...]
  phase: Phase
  name_stack: _compat.NameStack
  source: str
  transient_bytes: int = 0
  module: str = ""
  has_body: bool = False

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def module_path(self) -> str:
    """The same as :attr:`module` (the name the public ``Op`` had for it before)."""
    return self.module

  def input_ids(self) -> list[int]:
    return [x for x in self.inputs if isinstance(x, int)]


@dataclasses.dataclass(frozen=True)
class VarInfo:
  """One variable (buffer) of the program.

  Attributes:
    id: index into ``Program.vars``.
    aval: abstract value (shape, dtype).
    nbytes: bytes per device: the local shard's size when the step is sharded
      over several devices (:mod:`jaxmem._src.ir.sharding`), else the whole value.
    defined_by: index of the defining op; -1 for arguments and constants.
    uses: indices of the ops that read it, ascending.
    role: see :class:`Role`.
    name: argument path for inputs (``params['Dense_0']['kernel']``), module path otherwise.
    source: ``file:line`` where it was made (the argument path for inputs).
    is_output: returned by the step.
    global_nbytes: bytes of the whole (unsharded) value; equals ``nbytes``
      unless the value is split over devices.
  """
  id: int
  aval: _compat.AbstractValue
  nbytes: int
  defined_by: int
  uses: tuple[int, ...]
  role: Role
  name: str
  source: str
  is_output: bool
  global_nbytes: int = -1

  def __post_init__(self) -> None:
    if self.global_nbytes < 0:     # not given: an unsharded value
      object.__setattr__(self, "global_nbytes", self.nbytes)

  @property
  def is_input(self) -> bool:
    return self.defined_by < 0

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self.aval, "shape", ()))

  @property
  def dtype(self) -> str:
    return str(getattr(self.aval, "dtype", "?"))

  @property
  def type_str(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """The flat program of a traced step (built by :func:`~jaxmem._src.ir.trace.trace`).

  Attributes:
    ops: the equations in program order.
    vars: every variable, indexed by id.
    invars: ids of the flat step arguments.
    outvars: ids (or ``Literal``) of the flat results.
    consts: constant values by id.
    donated: ids of donated arguments (their buffers may be reused).
    constant_like: per value, whether it is computed from literals and
      constants only (iota, zeros broadcasts): XLA may compute such values
      anywhere, so they never order a copy or a fence.
    blocks: the opaque control-flow and remat ops (``scan``, ``while``,
      ``cond``, ``checkpoint``) with what is inside them, in program order.
    backend: the XLA backend whose compiled program the estimate models (``cpu``,
      ``gpu``, ``tpu``): the local one, or an ahead-of-time target's.
    target: the target the step is planned for (``"local"``, ``"tpu:v5e"``;
      :mod:`jaxmem._src.estimate.targets`).
    num_devices: devices the step is spread over (1 when unsharded); every
      ``VarInfo.nbytes`` is then bytes per device, as ``memory_analysis()``
      of the compiled step reports them.
    device_layout: per-value shard counts, or None when unsharded.
    device_fraction: per op, the share of its operands' and results' bytes
      that one device holds (None when unsharded): XLA temporaries sized from
      global shapes are scaled by it.
    in_tree: the pytree structure of the step's arguments.
    out_tree: the pytree structure of its results (None when the program was
      built from an already traced jaxpr: it cannot be rewritten then).
    closed_jaxpr: the step's jaxpr.
  """
  ops: tuple[Op, ...]
  vars: tuple[VarInfo, ...]
  invars: tuple[int, ...]
  outvars: tuple[int | _compat.Literal, ...]
  consts: Mapping[int, Any]
  donated: frozenset[int]
  constant_like: tuple[bool, ...]
  blocks: tuple[Block, ...]
  backend: str
  num_devices: int
  device_layout: DeviceLayout | None
  device_fraction: tuple[float, ...] | None
  in_tree: _compat.PyTreeDef
  out_tree: _compat.PyTreeDef | None
  closed_jaxpr: _compat.ClosedJaxpr
  target: str = "local"

  @property
  def num_ops(self) -> int:
    return len(self.ops)

  @property
  def output_ids(self) -> frozenset[int]:
    """Ids of the values the step returns (literal results have none)."""
    return frozenset(x for x in self.outvars if isinstance(x, int))

  @functools.cached_property
  def donation_aliases(self) -> Mapping[int, int]:
    """``{output id: donated argument id}``: the results XLA writes into a donated argument's buffer.

    jax pairs them as ``jax.jit`` does (``pxla._set_up_aliases``): each result,
    in order, takes the first unpaired donated argument of the same shape and
    dtype. ``memory_analysis()`` counts such a pair once (``- alias``), so the
    estimate does too: the argument's buffer is held for the whole step and
    the result adds nothing of its own (:meth:`interval`,
    :meth:`stored_bytes`).
    """
    return dict(p for p in self._donation_pairs if not self.vars[p[0]].is_input)

  @functools.cached_property
  def _donation_pairs(self) -> tuple[tuple[int, int], ...]:
    """``(result id, donated argument id)`` for every result jax pairs, in order.

    A returned argument is paired too (it takes a donated buffer as any
    result does), but it adds no value of its own: it is left out of
    :attr:`donation_aliases`.
    """
    free: dict[tuple[Any, Any], collections.deque[int]] = collections.defaultdict(
        collections.deque)
    for vid in self.invars:
      if vid in self.donated:
        aval = self.vars[vid].aval
        free[(tuple(aval.shape), aval.dtype)].append(vid)
    pairs = []
    for x in self.outvars:
      if not isinstance(x, int):
        continue
      aval = self.vars[x].aval
      queue = free.get((tuple(aval.shape), aval.dtype))
      if queue:
        pairs.append((x, queue.popleft()))
    return tuple(pairs)

  def stored_bytes(self, vid: int) -> int:
    """Bytes value ``vid`` adds to the peak: 0 for a result written into a donated argument."""
    return 0 if vid in self.donation_aliases else self.vars[vid].nbytes

  def interval(self, vid: int) -> tuple[int, int]:
    """``[start, end]`` op positions where variable ``vid`` is live in the jaxpr.

    Position ``num_ops`` is the step's exit, where outputs and non-donated
    arguments are still held. Outputs are held from the start: the compiled
    peak we verify against (``memory_analysis()``: argument + output + temp -
    alias) reserves the output buffers for the whole step. A donated argument
    dies at its last use, unless a result is written into its buffer
    (:attr:`donation_aliases`): that buffer is held to the exit.
    """
    v = self.vars[vid]
    end_of_program = self.num_ops
    if v.is_input:
      if self.freed_at_last_use(vid):
        return 0, (v.uses[-1] if v.uses else 0)
      return 0, end_of_program
    if v.is_output:
      return 0, end_of_program
    return v.defined_by, (v.uses[-1] if v.uses else v.defined_by)

  def freed_at_last_use(self, vid: int) -> bool:
    """Argument ``vid``'s buffer is free after its last use.

    It is donated, not returned, and no result is written into it
    (:attr:`aliased_arguments`).
    """
    return (vid in self.donated and not self.vars[vid].is_output
            and vid not in self.aliased_arguments)

  @functools.cached_property
  def aliased_arguments(self) -> frozenset[int]:
    """Ids of the donated arguments a result is written into (returned arguments included)."""
    return frozenset(i for _, i in self._donation_pairs)

  def __repr__(self) -> str:
    return f"{type(self).__name__}(ops={self.num_ops}, vars={len(self.vars)})"


__all__ = ["Op", "Phase", "Program", "Role", "VarInfo"]
