"""Control-flow blocks: ``scan``, ``while``, ``cond``, ``checkpoint`` and their inner peak.

The flat :class:`~jaxmem._src.ir.program.Program` keeps higher-order primitives opaque: a
``scan`` over 48 layers is one op whose inner working set is charged to it as
``Op.transient_bytes``. This module says what is inside: for every such op a
:class:`Block` with the working set of its bodies and, for ``scan``, the
per-iteration live bytes next to the stacked inputs and outputs, so that a
report can tell "the loop body is large" apart from "the stacked residuals are
large". Blocks nested in a body are its ``children``.

The walk over a body is a plain jaxpr liveness walk (a value lives from the
equation that makes it to its last use), not XLA's schedule; it is the same
walk that sets ``Op.transient_bytes`` (:func:`inner_working_bytes`, called by
:mod:`~jaxmem._src.ir.trace`), so a block's ``inner_peak_bytes`` is exactly
what the profile charges for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from jaxmem._src import _compat
from jaxmem._src.ir import primitives
from jaxmem._src.ir.primitives import Body, Fusion

# Inner peaks of equations already walked, by ``id(eqn)``; the equation is kept
# in the value so that its id cannot be reused while the memo lives.
Memo = dict[int, tuple[_compat.JaxprEqn, int]]


@dataclasses.dataclass(frozen=True)
class Block:
  """One opaque control-flow or remat op and what is inside it.

  Bytes are per device. Fields that do not apply to the primitive are ``None``.

  Attributes:
    op_index: index into ``Program.ops`` of the op; for a nested block, of the
      top-level op that contains it.
    primitive: JAX primitive name: ``scan``, ``while``, ``cond``, ``remat2``
      (``jax.checkpoint``), or another primitive with a body of its own (not
      the scalar combiner of a ``scatter-add`` or ``reduce``).
    source: ``file:line`` of the user code that emitted it.
    module: flax module path from the name stack, transformations stripped.
    inner_peak_bytes: working set inside the block beyond its own inputs and
      outputs: the most over its sub-jaxprs (one iteration of a loop body, the
      largest ``cond`` branch). This is what the profile charges to the op.
    depth: 0 for ops of the flat program, 1 for blocks in their bodies, ...
    region: which sub-jaxpr of the parent block holds it (``body``, ``cond``,
      ``branch 1``, ...); ``""`` at depth 0.
    length: ``scan``: number of iterations.
    reverse: ``scan``: iterates from the last slice to the first.
    carry_bytes: ``scan``, ``while``: bytes of the loop carry (one copy).
    consts_bytes: ``scan``: bytes of the loop-invariant operands.
    xs_bytes: ``scan``: bytes of the stacked inputs (all iterations).
    stacked_output_bytes: ``scan``: bytes of the stacked outputs ``ys`` (all
      iterations; the non-carry results of the op).
    per_iteration_bytes: ``scan``, ``while``: peak live bytes during one
      iteration of the body, its inputs (consts, carry, one slice of each
      ``xs``) and outputs (new carry, one slice of each ``ys``) included.
    branch_peaks: ``cond``: inner peak of each branch, by branch index
      (``lax.cond(pred, true_fun, false_fun)`` has branches false, true).
    cond_peak_bytes: ``while``: inner peak of the loop condition.
    body_peak_bytes: ``while``: inner peak of the loop body.
    children: blocks inside the bodies, in program order (calls such as a
      nested ``jit`` or ``custom_jvp`` are looked through, as the flat program
      inlines them).
  """
  op_index: int
  primitive: str
  source: str
  module: str
  inner_peak_bytes: int
  depth: int = 0
  region: str = ""
  length: int | None = None
  reverse: bool | None = None
  carry_bytes: int | None = None
  consts_bytes: int | None = None
  xs_bytes: int | None = None
  stacked_output_bytes: int | None = None
  per_iteration_bytes: int | None = None
  branch_peaks: tuple[int, ...] | None = None
  cond_peak_bytes: int | None = None
  body_peak_bytes: int | None = None
  children: tuple[Block, ...] = ()

  def walk(self) -> Iterator[Block]:
    """This block, then its descendants, depth first in program order."""
    yield self
    for c in self.children:
      yield from c.walk()

  def to_json(self) -> dict[str, Any]:
    """JSON-serialisable form (the ``blocks`` items of ``jaxmem.program/1``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == "children":
        v = [c.to_json() for c in v]
      elif isinstance(v, tuple):
        v = list(v)
      out[f.name] = v
    return out


# -- liveness walks over a sub-jaxpr -------------------------------------------


def inner_working_bytes(eqn: _compat.JaxprEqn, memo: Memo | None = None) -> int:
  """Working set of an opaque block beyond its own inputs and outputs.

  The most over the equation's sub-jaxprs (they never run at the same time:
  loop condition and body alternate, one ``cond`` branch runs); 0 without any.
  """
  if memo is not None and id(eqn) in memo:
    return memo[id(eqn)][1]
  best = 0
  for jaxpr in _compat.sub_jaxprs(eqn):
    best = max(best, peak_minus_io(jaxpr, memo))
  if memo is not None:
    memo[id(eqn)] = (eqn, best)
  return best


# One equation of a flattened body: the equation, the keys of its operands
# (None for literals) and of its results, with their bytes and whether dropped.
_Key = Any   # (inlining, Var) or (inlining, Var, step): hashable, opaque
_Step = tuple[_compat.JaxprEqn, list[_Key | None], list[tuple[_Key, int, bool]]]


def _flatten(jaxpr: _compat.Jaxpr) -> tuple[list[_Step], list[_Key | None]]:
  """The equations of ``jaxpr`` with nested calls (``jit``, ``custom_jvp``...) inlined.

  XLA inlines such calls, and so does the flat program: walking a call as one
  equation would count its result twice (as the call's output and inside its
  body). Values are keyed ``(inlining, Var)`` so that a body inlined twice
  (a cached jitted layer called twice) keeps its two sets of values apart.

  Returns:
    The steps in order and the keys of the jaxpr's results (None for literals).
  """
  steps: list[_Step] = []
  inlinings = [0]

  def go(jaxpr: _compat.Jaxpr, env: dict[_compat.Var, _Key], tag: int) -> list[_Key | None]:
    def read(a: _compat.Atom) -> _Key | None:
      if not isinstance(a, _compat.Var):
        return None                       # a literal: no buffer
      return env.get(a, (tag, a))

    for e in jaxpr.eqns:
      ins = [read(a) for a in e.invars]
      call = _compat.body_of(e)
      if call is not None:
        inlinings[0] += 1
        res = go(call.jaxpr, dict(zip(call.jaxpr.invars, ins)), inlinings[0])
        for v, r in zip(e.outvars, res):
          if not isinstance(v, _compat.DropVar):
            env[v] = r
        continue
      outs = [((tag, v, len(steps)) if isinstance(v, _compat.DropVar) else (tag, v),
               _compat.aval_nbytes(v.aval), isinstance(v, _compat.DropVar)) for v in e.outvars]
      steps.append((e, ins, outs))
    return [read(a) for a in jaxpr.outvars]

  return steps, go(jaxpr, {}, 0)


def _last_uses(steps: list[_Step]) -> dict[_Key, int]:
  last: dict[_Key, int] = {}
  for i, (_, ins, _) in enumerate(steps):
    for k in ins:
      if k is not None:
        last[k] = i
  return last


def peak_minus_io(jaxpr: _compat.Jaxpr, memo: Memo | None = None) -> int:
  """Peak bytes made inside one evaluation of ``jaxpr`` beyond its inputs.

  The jaxpr's own inputs are not counted (the enclosing op holds them); a
  result it returns is counted while it is made and while later equations
  read it (the enclosing op's own outputs are counted by the program), so
  this is the body's working set on top of the op's operands and results.

  The body is fused as XLA fuses every computation, a loop's or a branch's
  as the step's own (:func:`_fuse_elementwise`): an
  elementwise value read only by elementwise ops and reductions (and not
  returned) stores nothing, its operands living until its readers' last one
  instead, and a transpose read only by dots is folded into them. Measured on
  the backward body of tensor-parallel MLP blocks written with ``shard_map``
  (4 CPU devices): ``g * d + g * d * c`` counted as three stored values made
  the estimate +29% of the compiled peak; on a k-means ``fori_loop`` body the
  plain count held the distances, their one-hot and its transpose (three
  ``[points, clusters]`` buffers) where XLA stores one: +52.7% of the
  compiled peak, -1.0% fused and scheduled as below.

  The peak is the lesser of the body's own order and the order XLA's list
  scheduler would pick (:func:`_memory_order`).
  """
  steps, results = _flatten(jaxpr)
  steps = _fuse_elementwise(steps, {k for k in results if k is not None})
  inner = [inner_working_bytes(e, memo) for e, _, _ in steps]
  peak = _order_peak(steps, inner)
  if len(steps) <= MEMORY_ORDER_MAX_STEPS:
    order = _memory_order(steps)
    if order != list(range(len(steps))):
      peak = min(peak, _order_peak([steps[i] for i in order], [inner[i] for i in order]))
  return max(0, peak)


# `_memory_order` is quadratic in a body's equations: longer bodies keep the
# program's order alone.
MEMORY_ORDER_MAX_STEPS = 1000


def _order_peak(steps: list[_Step], inner: list[int]) -> int:
  """Peak bytes made inside while ``steps`` run in this order (``inner``: each one's own working set)."""
  last = _last_uses(steps)
  made: dict[_Key, int] = {}       # bytes of the live values made inside
  live = 0
  peak = 0
  for i, (_, ins, outs) in enumerate(steps):
    live += sum(nb for _, nb, _ in outs)
    peak = max(peak, live + inner[i])
    for key, nb, dropped in outs:
      # Never read again (dropped, or only returned): gone after this equation.
      if dropped or key not in last:
        live -= nb
      else:
        made[key] = nb
    for key in {k for k in ins if k is not None and last[k] == i and k in made}:
      live -= made.pop(key)
  return peak


def _memory_order(steps: list[_Step]) -> list[int]:
  """An order of ``steps`` chosen as XLA's list scheduler chooses one.

  XLA schedules a computation with each of its memory schedulers (list,
  depth-first, post-order) and keeps the one of least memory
  (``DefaultMemoryScheduler``); the list scheduler runs, of the equations
  whose operands exist, the one that frees most bytes net of what it makes,
  the earliest on ties. The program's order is the post-order one, so the
  body's peak is the lesser of the two (:func:`peak_minus_io`). Seen on a
  k-means ``fori_loop`` body: the ``min`` that is the distances' last reader
  runs before the one-hot of their ``argmin`` is made, so the two
  ``[points, clusters]`` buffers are never live together.
  """
  producer: dict[_Key, int] = {}
  for i, (_, _, outs) in enumerate(steps):
    for key, _, _ in outs:
      producer[key] = i
  nbytes = {key: nb for _, _, outs in steps for key, nb, dropped in outs if not dropped}
  waiting = [len({producer[k] for k in ins if k is not None and k in producer})
             for _, ins, _ in steps]
  dependents: dict[int, set[int]] = {}
  readers_left: dict[_Key, int] = {}
  for i, (_, ins, _) in enumerate(steps):
    for k in {k for k in ins if k is not None and k in producer}:
      dependents.setdefault(producer[k], set()).add(i)
      readers_left[k] = readers_left.get(k, 0) + 1

  def gain(i: int) -> tuple[int, int]:
    """Bytes step ``i`` frees net of those it makes, and the earlier step first on ties."""
    _, ins, outs = steps[i]
    freed = sum(nbytes.get(k, 0) for k in {k for k in ins if k is not None}
                if readers_left.get(k) == 1)
    return (freed - sum(nb for _, nb, dropped in outs if not dropped), -i)

  ready = {i for i, w in enumerate(waiting) if w == 0}
  order: list[int] = []
  while ready:
    i = max(ready, key=gain)
    ready.discard(i)
    order.append(i)
    for k in {k for k in steps[i][1] if k is not None and k in readers_left}:
      readers_left[k] -= 1
    for j in dependents.get(i, ()):
      waiting[j] -= 1
      if waiting[j] == 0:
        ready.add(j)
  return order


def _stores_nothing(e: _compat.JaxprEqn, key: _Key, steps: list[_Step],
                    readers: dict[_Key, list[int]], returned: set[_Key]) -> bool:
  """Whether XLA fuses ``e``'s one result ``key`` into its readers (:func:`_fuse_elementwise`)."""
  rs = readers.get(key, [])
  if not rs or key in returned:
    return False
  if e.primitive.name == "transpose":
    return all(steps[r][0].primitive.name == "dot_general" for r in rs)
  facts = primitives.facts(e.primitive.name)
  if not facts.elementwise or facts.fusion not in (Fusion.CHEAP, Fusion.EXPENSIVE):
    return False
  if facts.fusion is Fusion.EXPENSIVE and len(set(rs)) > 1:
    return False
  reading = [primitives.facts(steps[r][0].primitive.name) for r in rs]
  return all(f.fusion in primitives.FUSIBLE_CONSUMERS
             and (f.elementwise or f.fusion is Fusion.REDUCE) for f in reading)


def _fuse_elementwise(steps: list[_Step], returned: set[_Key]) -> list[_Step]:
  """``steps`` with every fusible value made free and read through.

  Fusible: an elementwise value read only by elementwise ops and reductions
  (XLA's loop and input fusions; an expensive one only by a single reader),
  and a transpose read only by dots (XLA's ``TransposeFolding`` puts it in the
  dot's dimension numbers). A fused value's step makes it with 0 bytes; each
  reader of it reads the fused value's own operands as well, so they live as
  long as it is read.
  """
  readers: dict[_Key, list[int]] = {}
  for i, (_, ins, _) in enumerate(steps):
    for k in ins:
      if k is not None:
        readers.setdefault(k, []).append(i)
  free: dict[_Key, list[_Key]] = {}      # fused value -> what its readers read in its place
  out: list[_Step] = list(steps)
  for i, (e, ins, outs) in enumerate(steps):
    if len(outs) != 1 or not _stores_nothing(e, outs[0][0], steps, readers, returned):
      continue
    key = outs[0][0]
    free[key] = [y for k in ins if k is not None for y in free.get(k, [k])]
    out[i] = (e, ins, [(key, 0, outs[0][2])])
  if not free:
    return out
  return [(e, [y for k in ins for y in ([k] if k is None else free.get(k, [k]))], outs)
          for e, ins, outs in out]


def live_peak(jaxpr: _compat.Jaxpr, memo: Memo | None = None) -> int:
  """Peak live bytes during one evaluation of ``jaxpr``, inputs and outputs included.

  Inputs are held throughout (the loop machinery owns the carry and the
  stacked operands the slices come from); each result is held from the
  equation that makes it to the end; other values die after their last use.
  """
  steps, results = _flatten(jaxpr)
  last = _last_uses(steps)
  keep = {k for k in results if k is not None}
  live = sum(_compat.aval_nbytes(v.aval) for v in {*jaxpr.invars, *jaxpr.constvars})
  made: dict[_Key, int] = {}
  peak = live
  for i, (e, ins, outs) in enumerate(steps):
    live += sum(nb for _, nb, _ in outs)
    peak = max(peak, live + inner_working_bytes(e, memo))
    for key, nb, dropped in outs:
      if dropped or (key not in last and key not in keep):
        live -= nb
      elif key not in keep:
        made[key] = nb
    for key in {k for k in ins if k is not None and last[k] == i and k in made}:
      live -= made.pop(key)
  return peak


# -- blocks --------------------------------------------------------------------

def is_block(eqn: _compat.JaxprEqn) -> bool:
  """Whether an equation is a block: it has a body of its own (see :class:`Block`).

  Not a primitive whose sub-jaxpr is a per-element combiner (``scatter-add``'s
  update, ``reduce``'s monoid, ``select_and_scatter``'s select,
  :attr:`~jaxmem._src.ir.primitives.Body.COMBINER`): it runs on scalars
  inside the op, holds no working set worth a block, and would only crowd the
  reports of models that index or pool.
  """
  if not _compat.sub_jaxprs(eqn):
    return False
  return primitives.eqn_facts(eqn).body is not Body.COMBINER


def _nbytes(atoms: Sequence[_compat.Atom]) -> int:
  return sum(_compat.atom_nbytes(a) for a in atoms)


def make_block(eqn: _compat.JaxprEqn, op_index: int, source: str, name_stack: _compat.NameStack,
               *, depth: int = 0, region: str = "", memo: Memo | None = None) -> Block:
  """The :class:`Block` of one equation with sub-jaxprs.

  Args:
    eqn: the equation (``scan``, ``while``, ``cond``, ``remat2``, ...).
    op_index: index of the enclosing top-level op in ``Program.ops``.
    source: ``file:line`` to report for it.
    name_stack: its full name stack (joined across enclosing bodies and calls).
    depth: nesting depth (0: an op of the flat program).
    region: the parent's sub-jaxpr that holds it (``""`` at depth 0).
    memo: inner peaks already computed, shared across one program.

  Returns:
    The block, with its nested blocks as ``children``.
  """
  memo = {} if memo is None else memo
  prim = eqn.primitive.name
  fields: dict[str, Any] = {}
  if prim == "scan":
    body, nconsts, ncarry, length, reverse = _compat.scan_params(eqn)
    fields.update(
        length=length, reverse=reverse,
        carry_bytes=_nbytes(body.invars[nconsts:nconsts + ncarry]),
        consts_bytes=_nbytes(eqn.invars[:nconsts]),
        xs_bytes=_nbytes(eqn.invars[nconsts + ncarry:]),
        stacked_output_bytes=_nbytes(eqn.outvars[ncarry:]),
        per_iteration_bytes=live_peak(body, memo))
    regions = [("body", body)]
  elif prim == "while":
    cond, body, _, body_nconsts = _compat.while_params(eqn)
    fields.update(
        carry_bytes=_nbytes(body.invars[body_nconsts:]),
        per_iteration_bytes=live_peak(body, memo),
        cond_peak_bytes=peak_minus_io(cond, memo),
        body_peak_bytes=peak_minus_io(body, memo))
    regions = [("cond", cond), ("body", body)]
  elif prim == "cond":
    branches = _compat.cond_branches(eqn)
    fields.update(branch_peaks=tuple(peak_minus_io(b, memo) for b in branches))
    regions = [(f"branch {i}", b) for i, b in enumerate(branches)]
  else:
    subs = _compat.sub_jaxprs(eqn)
    regions = [("body" if len(subs) == 1 else f"jaxpr {i}", j) for i, j in enumerate(subs)]
  children = tuple(child for name, jaxpr in regions
                   for child in _blocks_in(jaxpr, name, op_index, source, name_stack,
                                           depth + 1, memo))
  return Block(op_index=op_index, primitive=prim, source=source,
               module=_compat.module_path(str(name_stack)),
               inner_peak_bytes=inner_working_bytes(eqn, memo), depth=depth, region=region,
               children=children, **fields)


def _blocks_in(jaxpr: _compat.Jaxpr, region: str, op_index: int, outer_source: str,
               outer_ns: _compat.NameStack, depth: int, memo: Memo) -> Iterator[Block]:
  """Blocks among the equations of a body, looking through inlinable calls."""
  for e in jaxpr.eqns:
    ns = _compat.join_name_stacks(outer_ns, _compat.name_stack_of(e))
    frame = _compat.user_frame(e)
    # As in the flat program: a body without a traceback of its own is
    # attributed to the line that made the enclosing call.
    source = f"{frame[0]}:{frame[1]}" if frame else outer_source
    call = _compat.body_of(e)
    if call is not None:
      # A nested jit / custom_jvp is inlined at the top level; here too, so
      # that a scan inside a jitted layer is a child, not a grandchild of a call.
      yield from _blocks_in(call.jaxpr, region, op_index, source, ns, depth, memo)
    elif is_block(e):
      yield make_block(e, op_index, source, ns, depth=depth, region=region, memo=memo)


class _OpLike(Protocol):
  """What :func:`program_blocks` reads of a program op (:class:`~jaxmem._src.ir.program.Op`)."""
  index: int
  eqn: _compat.JaxprEqn
  source: str
  name_stack: _compat.NameStack
  has_body: bool


def program_blocks(ops: Sequence[_OpLike], memo: Memo | None = None) -> tuple[Block, ...]:
  """The blocks among a program's ops: those with a body, in program order.

  ``memo``: the inner peaks the trace computed already for ``Op.transient_bytes``
  (:func:`inner_working_bytes` with the same memo), so no body is walked twice.
  """
  memo = {} if memo is None else memo
  return tuple(make_block(op.eqn, op.index, op.source, op.name_stack, memo=memo)
               for op in ops if op.has_body and is_block(op.eqn))


__all__ = ["Block", "inner_working_bytes", "is_block", "live_peak", "make_block",
           "peak_minus_io", "program_blocks"]
