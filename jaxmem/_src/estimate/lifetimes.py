"""Lifetimes: live bytes at every program point, the peak and its holders.

A variable is live from the op that defines it through its last use (arguments
from the start; results and non-donated arguments through the exit point).
Opaque blocks add their inner working set at their own position. XLA's effects
(:mod:`jaxmem._src.estimate.xla_model`) are applied to a :class:`Flow`, the
program (or a planned :class:`~jaxmem._src.plan.schedule.Schedule`) as steps
and values: the same routine prices both, so the planner and the report agree
on what "live" means.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxmem._src.estimate.xla_model import (ALLOWED_CODE_DUPLICATION, FUSES_ANY, FUSES_SOLE,
                                            INDEX_BRANCHES, INDEX_BROADCAST, INDEX_SAME)
from jaxmem._src.ir.primitives import FUSIBLE_CONSUMERS, Fusion
from jaxmem._src.native import lifetimes as native_lifetimes


@dataclasses.dataclass(frozen=True)
class Profile:
  """Estimated memory over program order.

  Attributes:
    live_bytes: live bytes at each position (the last position is the exit).
    peak_bytes: ``max(live_bytes)``.
    peak_index: first position reaching the peak.
    holders: ids of the values live at the peak, largest first.
    holder_bytes: their sizes.
    intervals: per value id, its estimated ``(start, end)`` after the XLA
      model (a fused-away value's inputs live until its last use); ``None``
      for profiles built from raw intervals.
    virtual: per value id, whether XLA stores no buffer of its own for it (fused
      away, or merged into an identical earlier value by CSE).
    stored_broadcasts: ``(value id, bytes, first, last)`` of the full-size
      broadcasts of operands the estimate counts as stored
      (``Flow.shared_reads``), live from their first reader to the last
      reduction fusion reading them.
    hidden_at_peak: ``(kind, bytes)`` of the buffers at the peak that are
      no value of the program (XLA's own, kinds in :data:`HIDDEN_KINDS`;
      those kept on chip count negative), for each kind with any.
  """
  live_bytes: np.ndarray
  peak_bytes: int
  peak_index: int
  holders: tuple[int, ...]
  holder_bytes: tuple[int, ...]
  intervals: tuple[tuple[int, int], ...] | None = None
  virtual: np.ndarray | None = None
  stored_broadcasts: tuple[tuple[int, int, int, int], ...] = ()
  hidden_at_peak: tuple[tuple[str, int], ...] = ()


#: The kinds of :attr:`Profile.hidden_at_peak`: XLA's buffers that are no value
#: of the program, in the order the estimate adds them.
HIDDEN_KINDS = ("index arrays built up front", "copies of arguments the step overwrites",
                "layout copies for convolutions and dots", "broadcasts stored for reductions",
                "working buffers of single ops", "temporaries kept on chip")


def profile_from_intervals(num_positions: int, starts: Sequence[int], ends: Sequence[int],
                           nbytes: Sequence[int], transient: Sequence[int] | None = None) -> Profile:
  """Live-bytes profile of values live on closed intervals ``[start, end]``."""
  live = _live_curve(num_positions, starts, ends, nbytes)
  if transient is not None and len(transient):
    live = live + np.asarray(transient, dtype=np.int64)
  return _profile_of(live, starts, ends, nbytes)


def _live_curve(num_positions: int, starts: Sequence[int], ends: Sequence[int],
                nbytes: Sequence[int]) -> np.ndarray:
  """Bytes live at each position of values live on closed intervals ``[start, end]``."""
  diff = np.zeros(num_positions + 1, dtype=np.int64)
  np.add.at(diff, np.asarray(starts, dtype=np.int64), np.asarray(nbytes, dtype=np.int64))
  np.add.at(diff, np.asarray(ends, dtype=np.int64) + 1, -np.asarray(nbytes, dtype=np.int64))
  return np.cumsum(diff[:-1])


def _profile_of(live: np.ndarray, starts: Sequence[int], ends: Sequence[int],
                nbytes: Sequence[int]) -> Profile:
  """The :class:`Profile` of a live-bytes curve: its peak and the values live there."""
  starts_a = np.asarray(starts, dtype=np.int64)
  ends_a = np.asarray(ends, dtype=np.int64)
  bytes_a = np.asarray(nbytes, dtype=np.int64)
  peak_index = int(np.argmax(live)) if len(live) else 0
  peak = int(live[peak_index]) if len(live) else 0
  at_peak = np.nonzero((starts_a <= peak_index) & (ends_a >= peak_index) & (bytes_a > 0))[0]
  order = at_peak[np.argsort(-bytes_a[at_peak], kind="stable")]
  return Profile(live, peak, peak_index, tuple(int(i) for i in order),
                 tuple(int(bytes_a[i]) for i in order))


@dataclasses.dataclass(frozen=True)
class Flow:
  """A program (or a planned schedule) as the lifetime estimator sees it.

  Positions ``0..num_steps-1`` are the steps, ``num_steps`` the exit.

  Attributes:
    num_steps: number of steps.
    step_kind: per step, its :class:`~jaxmem._src.ir.primitives.Fusion` kind.
    step_inputs: per step, the value ids it reads.
    step_outputs: per step, the value ids it writes.
    transient: per step, extra bytes live only during it.
    hoisted: per step, extra bytes live from the start until it.
    start, end: per value, first and last live position (``-1``: unused id).
    nbytes: per value, its size.
    materialized: values XLA must store (step results, arguments).
    hoist_to_start: values XLA computes at the program start.
    shared_reads: per step, ``(value id, bytes)`` of full-size broadcasts of
      its operands that XLA stores (see
      :func:`~jaxmem._src.estimate.xla_model.shared_broadcasts`); each pair
      is live from its first reading step to its last.
    movable: per step, XLA may run it as soon as its inputs exist
      (:func:`~jaxmem._src.estimate.xla_model.movable_ops`).
    cse_keys: per step, its key for XLA's CSE (None: never merged).
    on_chip: bytes of temporaries the compiler may keep in on-chip memory
      instead of device memory (a TPU's VMEM): at every position, live
      temporaries up to this many bytes are not counted. Arguments, outputs,
      constants and any buffer larger than the on-chip memory always count.
    fuses_operands: per step, whether the compiler fuses elementwise
      producers into it although its own result is stored: wherever they
      are read (``FUSES_ANY``: XLA:TPU's dot fusions) or where it alone
      reads them (``FUSES_SOLE``: XLA:CPU's library fusions); see
      :func:`~jaxmem._src.estimate.xla_model.operand_fusions`.
    copies: ``{value id: step}``: a donated argument XLA copies at the start
      before writing its new value in place, the copy live until that step
      (:func:`~jaxmem._src.estimate.xla_model.donation_copies`).
    epilogues: per step, whether the compiler may fuse the step into its
      elementwise consumer, storing only the consumer's result (XLA:CPU's
      YNNPACK dot fusions: see
      :func:`~jaxmem._src.estimate.xla_model.epilogue_fusions`).
    forwarded: ``{value id: source value ids}``: values that store nothing of
      their own, their sources living as long as they do (a ``shard_map``
      result that is its argument's buffer, or fused into its readers:
      :func:`~jaxmem._src.estimate.xla_model.shard_map_forwards`).
    early_copies: per step, ``(value id, bytes, layout)`` of operands it
      reads through a layout copy made where the operand is made
      (:func:`~jaxmem._src.estimate.xla_model.early_layout_copies`): the copy
      is live from the operand's start to the step, and the step does not
      keep the operand itself alive. Steps reading one value in one layout
      (``layout``, an integer naming it, 0 for most) share one copy.
    in_place: per step, the position among its inputs of the operand
      whose buffer it writes its result into where that is the operand's
      last read, so the two are never live together (-1: none; a scatter's
      first operand, :func:`~jaxmem._src.estimate.xla_model.in_place_operands`).
    indexing: per step, how a fusion it is in indexes its operands
      (``xla_model.INDEX_*``, :func:`~jaxmem._src.estimate.xla_model.indexing_kinds`):
      a producer XLA would emit too many times in its readers' fusions is
      stored. ``None``: no limit (compilers other than XLA:CPU).
  """
  num_steps: int
  step_kind: Sequence[Fusion]
  step_inputs: Sequence[Sequence[int]]
  step_outputs: Sequence[Sequence[int]]
  transient: Sequence[int]
  hoisted: Sequence[int]
  start: Sequence[int]
  end: Sequence[int]
  nbytes: Sequence[int]
  materialized: frozenset[int]
  hoist_to_start: frozenset[int]
  shared_reads: Sequence[Sequence[tuple[int, int]]] = ()
  movable: Sequence[bool] | None = None
  cse_keys: Sequence[Hashable | None] | None = None
  on_chip: int = 0
  fuses_operands: Sequence[int] | None = None
  copies: Mapping[int, int] = dataclasses.field(default_factory=dict)
  forwarded: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  epilogues: Sequence[bool] | None = None
  early_copies: Sequence[Sequence[tuple[int, int, int]]] = ()
  indexing: Sequence[int] | None = None
  in_place: Sequence[int] | None = None


def merge_common_subexpressions(flow: Flow) -> tuple[Flow, dict[int, int]]:
  """``flow`` with every repeated step merged into its first occurrence (XLA's HLO CSE).

  A step whose key (``Flow.cse_keys``, see
  :func:`~jaxmem._src.estimate.xla_model.cse_keys`) and operands equal an earlier
  step's computes nothing: its readers read the earlier step's results, whose
  lifetimes stretch to cover them. Steps with a ``None`` key (recomputations
  behind a fence, effects) are never merged; nor is a step whose results are
  stored for their own sake (step outputs, arguments). Also returns the
  merged values, each mapped to the value that stands for it.
  """
  if not flow.cse_keys:
    return flow, {}
  alias: dict[int, int] = {}
  seen: dict[tuple[Hashable, tuple[int, ...]], int] = {}
  # Shallow copies: a step's lists are replaced, never edited, so the
  # flow's own lists are shared until a merge renames an input.
  inputs = list(flow.step_inputs)
  outputs = list(flow.step_outputs)
  start, end = list(flow.start), list(flow.end)
  materialized = flow.materialized
  keys = flow.cse_keys
  gone: set[int] = set()          # the steps merged away
  for s in range(flow.num_steps):
    ins = inputs[s]
    if alias and not alias.keys().isdisjoint(ins):
      ins = inputs[s] = [alias.get(x, x) for x in ins]
    key = keys[s]
    if key is None or not materialized.isdisjoint(outputs[s]):
      continue
    full = (key, tuple(ins))
    first = seen.setdefault(full, s)
    if first == s:
      continue
    for o, keep in zip(outputs[s], outputs[first]):
      alias[o] = keep
      end[keep] = max(end[keep], end[o])
      start[o] = end[o] = -1
    inputs[s], outputs[s] = [], []
    gone.add(s)
  if not alias:
    return flow, {}
  early = list(flow.early_copies)       # per step, or empty when no step has any
  if early:
    for s in gone:
      early[s] = []
  return dataclasses.replace(flow, step_inputs=inputs, step_outputs=outputs, start=start, end=end,
                             shared_reads=[[(alias.get(x, x), b) for x, b in reads] if reads
                                           else reads for reads in flow.shared_reads],
                             early_copies=[[(alias.get(x, x), b, t) for x, b, t in copies]
                                           if copies
                                           else copies for copies in early]), alias


def _positions(flow: Flow) -> list[int]:
  """Where XLA's scheduler runs each step: its own index, or earlier for a movable step.

  A movable step (the optimizer update after the backward pass) runs as soon
  as its inputs exist: XLA:CPU's memory-minimizing scheduler updates each
  parameter right after its gradient is complete, so that gradient is freed
  there instead of living until the end of the backward pass (measured on a
  ResNet-50 step, where parameter gradients are a third of the peak).
  """
  n = flow.num_steps
  pos = list(range(n + 1))
  if not flow.movable or not any(flow.movable):
    return pos
  # Each value's first defining step (reversed: an earlier step overwrites).
  made_at = {o: s for s in range(n - 1, -1, -1) for o in flow.step_outputs[s]}
  for s in range(n):
    if flow.movable[s]:
      pos[s] = max([pos[made_at[x]] for x in flow.step_inputs[s] if x in made_at], default=0)
  return pos


def _through_aliases(flow: Flow, consumers: list[list[int]], o: int) -> list[int]:
  """The steps that read ``o``, looking through aliases (views of one operand: ``name``, reshapes).

  A view stores nothing of its own; whether its producer can be fused away
  depends on who reads the view: a matmul reading ``checkpoint_name(tanh(x))``
  needs the ``tanh`` stored.
  """
  kinds = flow.step_kind
  view = Fusion.VIEW
  for c in consumers[o]:
    if kinds[c] is view:
      break
  else:
    return consumers[o]               # no view to look through (most values)
  out: list[int] = []
  stack = list(consumers[o])
  seen: set[int] = set()
  while stack:
    c = stack.pop()
    if c in seen:
      continue
    seen.add(c)
    if (flow.step_kind[c] is Fusion.VIEW and len(flow.step_inputs[c]) == 1
        and len(flow.step_outputs[c]) == 1 and consumers[flow.step_outputs[c][0]]
        and flow.step_outputs[c][0] not in flow.materialized):
      stack.extend(consumers[flow.step_outputs[c][0]])
    else:
      out.append(c)
  return out


def _ends_in_stored_epilogue(flow: Flow, consumers: list[list[int]], virtual: Sequence[bool],
                             o: int, split: set[int] | frozenset[int] = frozenset()) -> bool:
  """Whether ``o``'s only reader starts a chain of cheap elementwise steps whose result is stored.

  Such a chain is an epilogue the compiler fuses into the step that makes
  ``o`` (a matmul and the ``- 2 x.c + |c|^2`` around it): the chain's result
  is the one buffer stored, and ``o`` is never written on its own. A chain
  through a value fused elsewhere, or a reader that is not a cheap
  elementwise step of ``o``'s size, stores ``o``.

  One value of the chain may also have a second reader, a reduction whose
  result comes back into the chain through small cheap steps: a softmax's
  row maximum, ``exp(x @ w + b - max(...))``. XLA:CPU's YNNPACK fusion
  takes the matmul, the reduction and the chain up to the ``exp``, which is
  stored (seen in the compiled HLO of a classifier's cross-entropy, whose
  logits the estimate counted beside their ``exp``).
  """
  x = o
  through_reduction = False
  for _ in range(64):                     # chains are short; bound the walk
    cs = consumers[x]
    if len(cs) == 2 and not through_reduction:
      c = _back_from_reduction(flow, consumers, cs)
      if c is None:
        return False
      through_reduction = True
    elif len(cs) != 1:
      return False
    else:
      c = cs[0]
    kind = flow.step_kind[c]
    if len(flow.step_outputs[c]) != 1:
      return False
    if kind is not Fusion.CHEAP and not (through_reduction and kind is Fusion.EXPENSIVE):
      return False
    x = flow.step_outputs[c][0]
    if flow.nbytes[x] != flow.nbytes[o]:
      return False
    if not virtual[x]:
      # (A stored result XLA also recomputes in other fusions is read there
      # from `o`: `o` is stored too.)
      return (bool(consumers[x]) or x in flow.materialized) and x not in split
    if kind is not Fusion.CHEAP:
      return False                        # (an expensive step is stored or ends nothing)
  return False


def _back_from_reduction(flow: Flow, consumers: list[list[int]], readers: Sequence[int]) -> int | None:
  """Of two readers, the one a reduction's result comes back to (the other is the reduction).

  The reduction's result must reach that reader through cheap or view steps
  with one reader each (a broadcast, a ``stop_gradient``), and nowhere else.
  """
  for red, other in (readers, readers[::-1]):
    if flow.step_kind[red] is not Fusion.REDUCE or len(flow.step_outputs[red]) != 1:
      continue
    y = flow.step_outputs[red][0]
    for _ in range(8):
      cs = consumers[y]
      if len(cs) != 1:
        break
      if cs[0] == other:
        return other
      if (flow.step_kind[cs[0]] not in (Fusion.CHEAP, Fusion.VIEW)
          or len(flow.step_outputs[cs[0]]) != 1):
        break
      y = flow.step_outputs[cs[0]][0]
  return None


def _reductions_come_back(flow: Flow, consumers: list[list[int]], groups: Mapping[int, _Groups],
                          readers: Sequence[int]) -> bool:
  """Whether XLA:CPU's YNNPACK fusion of reductions takes all of a value's ``readers``.

  True when every reader but one is in the fusion of a reduction (the
  reduction itself, or fused into it) whose result, large enough for
  YNNPACK to grow the fusion into the arithmetic on it (``_YNN_MIN_BYTES``),
  comes back to that one reader through cheap steps
  (:func:`_back_from_reduction`): the reductions, that reader and the
  value are then one fusion, and the value is never stored. Measured on a
  LayerNorm's backward pass (a message-passing step's edge MLPs): ``g *
  (rsqrt * scale)`` is read by its row sum and by the sum's broadcast added
  back to it, all inside one YNNPACK fusion, which reads ``rsqrt * scale``
  as a stored operand kept from the forward pass.
  """
  if len(readers) < 2:
    return False
  outputs = flow.step_outputs
  reductions: list[int] = []
  other = None
  for c in readers:
    roots = [c] if flow.step_kind[c] is Fusion.REDUCE else sorted(_fusion_roots(outputs, groups, c))
    if len(roots) == 1 and flow.step_kind[roots[0]] is Fusion.REDUCE:
      reductions.append(roots[0])
    elif other is None:
      other = c
    else:
      return False
  if other is None:
    return False
  for r in reductions:
    outs = outputs[r]
    if len(outs) != 1 or flow.nbytes[outs[0]] < _YNN_MIN_BYTES:
      return False
    if _back_from_reduction(flow, consumers, [r, other]) != other:
      return False
  return True


def _fusion_roots(outputs: Sequence[Sequence[int]], groups: Mapping[int, _Groups],
                  c: int) -> set[int]:
  """The steps whose stored results end the fusions step ``c`` is in (``c`` itself if stored)."""
  roots: set[int] = set()
  for y in outputs[c]:
    found = groups.get(y)
    if found is None:
      roots.add(c)
    elif isinstance(found[0], tuple):
      roots.add(found[0][0])
    else:
      roots.update(found[0])
  return roots


def _closed_readers(flow: Flow, readers: Sequence[int], groups: Mapping[int, _Groups],
                    closed_roots: set[int]) -> list[int]:
  """Of several readers of one value, those XLA:CPU has closed into reduction fusions.

  XLA:CPU forms its YNNPACK fusions (a reduction with the elementwise ops
  around it) before its loop fusion, and a value read by more than one
  fusion is not pulled into a YNNPACK fusion: it is that fusion's operand,
  stored. So a value read in two or more fusions, one of which is a
  reduction's, is stored for the reduction (measured on a Dense, LayerNorm
  and max-over-points step: the LayerNorm input read by its statistics and
  by the normalisation, ``rsqrt * scale`` read by the forward pass and by
  the scale gradient's sum, and the product both backward sums read, each a
  full-size buffer in XLA's assignment). A reduction's fusion also takes
  the elementwise ops that read its result when that result has no other
  reader (a LayerNorm gradient's row sums and the arithmetic after them):
  ``closed_roots`` holds the fusions, named by their roots, that contain a
  reduction either way. Empty when every reader is in one fusion (XLA fuses
  the value into it) or no reader is in a reduction's.
  """
  outputs = flow.step_outputs
  per_reader = [_fusion_roots(outputs, groups, c) for c in readers]
  roots = set().union(*per_reader)
  if len(roots) < 2:
    return []
  return [c for c, rs in zip(readers, per_reader) if not closed_roots.isdisjoint(rs)]


def _effectively_unary(flow: Flow, s: int, made_at: Mapping[int, int],
                       indexing: Sequence[int]) -> bool:
  """Whether XLA duplicates step ``s`` into its readers' fusions (``EffectivelyAtMostUnary``).

  XLA's fusion duplicates a producer that reads at most one operand of its
  own rank (broadcasts, and operands with fewer elements, such as a bias
  or a per-row statistic, do not count) or that reads no more bytes than it
  writes; any other producer is fused only where every reader can take it.
  """
  outs = flow.step_outputs[s]
  if len(outs) != 1:
    return False
  out_bytes = flow.nbytes[outs[0]]
  full = 0
  total = 0
  for x in flow.step_inputs[s]:
    total += flow.nbytes[x]
    p = made_at.get(x)
    if p is not None and indexing[p] == INDEX_BROADCAST:
      continue
    # (Four times: a boolean operand of a float op still has its shape.)
    if flow.nbytes[x] * 4 >= out_bytes:
      full += 1
  return full <= 1 or total <= out_bytes


def _horizon(flow: Flow, virtual: Sequence[bool], end: Sequence[int], pos: Sequence[int],
             c: int) -> int:
  """The last position at which step ``c`` reads its operands: where its fused results end."""
  last = pos[c]
  for y in flow.step_outputs[c]:
    if virtual[y]:
      last = max(last, end[y])
  return last


#: The smallest reduction result, in bytes, whose fusion YNNPACK grows into
#: the steps after it (``kMinElements`` float32 elements).
_YNN_MIN_BYTES = 4096 * 4


# Per fused value: per fusion it is fused into (named by the step whose
# stored result ends that fusion), the steps that index it there with how
# many times each is emitted; and the most times the value is emitted in any
# one fusion. Most fused values are emitted once, in one fusion, for one
# indexing user: those are kept as a ``(root, user)`` pair, the others as
# ``{root: {user: times}}``.
_Groups = tuple[tuple[int, int] | dict[int, dict[int, int]], int]


def _indexing_groups(readers: Sequence[int], outputs: Sequence[Sequence[int]],
                     indexing: Sequence[int], groups: Mapping[int, _Groups]) -> _Groups:
  """Per fusion a value is fused into, its indexing users there and how often XLA emits it.

  After XLA's ``FusionNodeIndexingEvaluation``, which counts per fusion: a
  reader that keeps the value's index (elementwise, transpose) passes on its
  own indexing users; any other reader is an indexing user itself, emitted
  as many times as its results are; a reader whose result is stored ends a
  fusion, emitted once (as does a reader fused by a rule of its own: an
  epilogue, a value read through a layout copy). Sets, not sums: two
  elementwise paths that meet again index the value once. A step with
  several results (an ``unstack``) stands for as many slices. Readers in
  different fusions each get a copy of the value (XLA duplicates a cheap
  producer into each), counted apart.
  """
  if len(readers) == 1:                 # most values: one reader, nothing to merge
    c = readers[0]
    outs = outputs[c]
    if len(outs) == 1:
      found = groups.get(outs[0])
      if found is None:                 # stored (or fused by a rule of its own):
        return (c, c), 1                # the fusion ends in it
      elif indexing[c] == INDEX_SAME:
        return found                    # (shared, never edited)
      elif isinstance(found[0], tuple):
        return (found[0][0], c), 1
      else:
        return ({root: {c: sum(us.values())} for root, us in found[0].items()},
                max((sum(us.values()) for us in found[0].values()), default=1))
  acc: dict[int, dict[int, int]] = {}
  for c in readers:
    outs = outputs[c]
    if len(outs) == 1 and indexing[c] == INDEX_SAME and outs[0] in groups:
      g = groups[outs[0]][0]
      if isinstance(g, tuple):
        acc.setdefault(g[0], {})[g[1]] = 1
      else:
        for root, us in g.items():
          acc.setdefault(root, {}).update(us)
      continue
    per_root: dict[int, int] = {}
    for y in outs:
      if y in groups:
        g = groups[y][0]
        if isinstance(g, tuple):
          per_root[g[0]] = per_root.get(g[0], 0) + 1
        else:
          for root, us in g.items():
            per_root[root] = per_root.get(root, 0) + sum(us.values())
      else:                             # stored, or fused by a rule of its own
        per_root[c] = per_root.get(c, 0) + 1
    for root, n in per_root.items():
      acc.setdefault(root, {})[c] = n
  most = max((sum(us.values()) for us in acc.values()), default=1)
  if len(acc) == 1 and most == 1:
    ((root, us),) = acc.items()
    return (root, next(iter(us))), 1
  return acc, most


def _reuse_copied_arguments(flow: Flow, pos: Sequence[int], ids: Sequence[int],
                            starts: Sequence[int], ends: Sequence[int], sizes: list[int]) -> None:
  """Places temporaries in the buffers of the donated arguments XLA copies (``Flow.copies``).

  Once XLA has copied a donated argument at the start, every read is of the
  copy, and the argument's own buffer (counted among the arguments for the
  whole step) holds nothing until the step that writes the new value into
  it. XLA's buffer assignment puts temporaries there (``BufferAssigner``:
  values, largest first, go to an existing writable allocation that is
  large enough and holds nothing else over their lifetime, one value at a
  time at offset 0), and those cost nothing beyond the argument. Measured
  on a conv VAE, whose donated dense kernels hold the forward activations
  until their update (estimate +15% of the compiled peak without this),
  and an MLP VAE, whose kernels hold smaller activations and then their own
  gradients (+7%). Departure: a value goes to the smallest buffer that
  takes it, not to the first in XLA's allocation order. Sets the ``sizes``
  of the values placed to 0, in place.
  """
  index = {v: i for i, v in enumerate(ids)}
  slots: list[tuple[int, int, list[tuple[int, int]]]] = []   # (capacity, last free, taken)
  for x, s in flow.copies.items():
    if x in index and pos[s] > 1:
      slots.append((flow.nbytes[x], pos[s] - 1, []))
  if not slots:
    return
  slots.sort(key=lambda slot: slot[0])
  capacities = [cap for cap, _, _ in slots]
  materialized = flow.materialized
  order = sorted((i for i, v in enumerate(ids)
                  if 0 < sizes[i] <= capacities[-1] and v not in materialized and starts[i] >= 1),
                 key=lambda i: -sizes[i])
  for i in order:
    b, e = starts[i], ends[i]
    for k in range(bisect.bisect_left(capacities, sizes[i]), len(slots)):
      _, hi, taken = slots[k]
      if e <= hi and all(e < tb or te < b for tb, te in taken):
        taken.append((b, e))
        sizes[i] = 0
        break


def _share_operand_buffers(flow: Flow, pos: Sequence[int], start: Sequence[int], end: list[int],
                           virtual: Sequence[bool], indexing: Sequence[int],
                           ynn_roots: set[int]) -> None:
  """Lets a stored elementwise result take the buffer of an operand of its size that dies there.

  XLA's buffer assignment gives a loop fusion's result the buffer of an
  operand it reads elementwise, of the same shape, whose last read it is
  (``HloDataflowAnalysis::CanShareOperandBufferWithUser``): the two are
  never live together. The fusion's operands are the stored values the step
  reads through the fused values it computes again (elementwise ones only:
  a reshape, slice or broadcast reads with another index). Seen in XLA:CPU's
  buffer assignment of a UNet, whose ReLU gradients are written over the
  convolution gradients they mask. Not for a step that ends a YNNPACK
  fusion of a reduction (``ynn_roots``): XLA:CPU's YNNPACK fusions are
  custom calls, whose results share no operand's buffer (counting them
  shared put PointNet 13% under its compiled peak). Ends such operands one
  position before the step, in place.
  """
  made_at = {}
  for s, outs in enumerate(flow.step_outputs):
    for o in outs:
      made_at.setdefault(o, s)
  kinds = flow.step_kind
  taken: set[int] = set()
  for s in range(flow.num_steps):
    if (kinds[s] not in (Fusion.CHEAP, Fusion.EXPENSIVE) or indexing[s] != INDEX_SAME
        or s in ynn_roots):
      continue
    outs = flow.step_outputs[s]
    if len(outs) != 1 or virtual[outs[0]]:
      continue
    size = flow.nbytes[outs[0]]
    p = pos[s]
    stack, seen = list(flow.step_inputs[s]), set()
    while stack:
      x = stack.pop()
      if x in seen:
        continue
      seen.add(x)
      if virtual[x]:
        m = made_at.get(x)
        if m is not None and kinds[m] in (Fusion.CHEAP, Fusion.EXPENSIVE) and (
            indexing[m] == INDEX_SAME):
          stack.extend(flow.step_inputs[m])
        continue
      if (flow.nbytes[x] == size and x not in flow.materialized and x not in taken
          and end[x] == p and 0 <= start[x] < p):
        end[x] = p - 1               # its buffer is the result's from here on
        taken.add(x)
        break


def estimate(flow: Flow) -> tuple[Profile, np.ndarray]:
  """Live-bytes profile of a :class:`Flow` under the XLA model.

  Virtual values (fused away, see :mod:`jaxmem._src.estimate.xla_model`) take no bytes;
  their inputs live until their last use instead. Returns the profile (holders
  are value ids; hidden XLA temporaries count in the totals, not as holders)
  and the per-value ``virtual`` mask.
  """
  flow, merged = merge_common_subexpressions(flow)
  native = _native_lifetimes()
  found = (native(flow, merged) if native is not None and flow.num_steps >= _NATIVE_MIN_STEPS
           else _lifetimes(flow, merged))
  return _profile_of_lifetimes(flow, merged, found)


@dataclasses.dataclass(frozen=True)
class _Lifetimes:
  """What the XLA model makes of a flow's values (:func:`_lifetimes`), before they are summed.

  Attributes:
    pos: per step, the position XLA's scheduler runs it at (and the exit).
    start, end: per value, its first and last live position (``-1``: never live).
    virtual: per value, whether XLA stores no buffer of its own for it.
    copy_last: ``(value, bytes, last reader's position)`` of each early layout
      copy, in the order first met.
    stored_broadcasts: ``(value, bytes, first, last)`` of the broadcasts
      counted as stored (:attr:`Profile.stored_broadcasts`).
  """
  pos: Sequence[int]
  start: Sequence[int]
  end: Sequence[int]
  virtual: Sequence[bool]
  copy_last: Sequence[tuple[int, int, int]]
  stored_broadcasts: Sequence[tuple[int, int, int, int]]


#: Flows shorter than this are estimated in Python: below it the columns
#: cost more to build than the rules take to run.
_NATIVE_MIN_STEPS = 64

# `Fusion` as `ffi/lifetimes.h` numbers it.
_KIND_CODES = {Fusion.CHEAP: 0, Fusion.EXPENSIVE: 1, Fusion.VIEW: 2, Fusion.REDUCE: 3,
               Fusion.MATERIALIZED: 4}


def _native_lifetimes() -> Callable[[Flow, Mapping[int, int]], _Lifetimes] | None:
  """:func:`_lifetimes` run by the native extension, or ``None`` where it cannot be.

  ``None`` when the extension predates ``estimate_lifetimes`` or the
  environment sets ``JAXMEM_NATIVE_ESTIMATE=0`` (the Python rules then run:
  the reference, and a way to rule the port out when an estimate looks wrong).
  """
  if native_lifetimes.estimate_lifetimes is None or os.environ.get(
      "JAXMEM_NATIVE_ESTIMATE", "1") == "0":
    return None
  return _lifetimes_native


def _rows(rows: Sequence[Sequence[Any]], n: int, width: int = 1) -> tuple[np.ndarray,
                                                                          np.ndarray]:
  """Per-step lists as compressed rows (``ptr``, ``idx``).

  ``width`` > 1: each entry is a tuple of that many ints, flattened.
  """
  lens = np.zeros(n, np.int64)
  lens[:len(rows)] = np.fromiter(map(len, rows), np.int64, len(rows))
  if width > 1:
    lens *= width
  ptr = np.zeros(n + 1, np.int64)
  np.cumsum(lens, out=ptr[1:])
  flat: Iterable[int] = itertools.chain.from_iterable(rows)
  if width > 1:
    flat = itertools.chain.from_iterable(flat)
  return ptr, np.fromiter(flat, np.int64, int(ptr[-1]))


def _mask(values: Iterable[int], size: int) -> np.ndarray:
  out = np.zeros(size, np.int64)
  idx = np.fromiter(values, np.int64)
  out[idx] = 1
  return out


def _lifetimes_native(flow: Flow, merged: Mapping[int, int]) -> _Lifetimes:
  """:func:`_lifetimes` by ``_native.estimate_lifetimes`` (``ffi/lifetimes.cc``)."""
  n = flow.num_steps
  nvals = len(flow.nbytes)
  cols: dict[str, np.ndarray] = {}
  cols["kind"] = np.fromiter(map(_KIND_CODES.__getitem__, flow.step_kind), np.int64, n)
  cols["in_ptr"], cols["in_idx"] = _rows(flow.step_inputs, n)
  cols["out_ptr"], cols["out_idx"] = _rows(flow.step_outputs, n)
  cols["start"] = np.asarray(flow.start, np.int64)
  cols["end"] = np.asarray(flow.end, np.int64)
  cols["nbytes"] = np.asarray(flow.nbytes, np.int64)
  cols["materialized"] = _mask(flow.materialized, nvals)
  cols["hoist"] = np.fromiter(flow.hoist_to_start, np.int64)
  cols["merged"] = _mask(merged, nvals)
  if flow.movable and any(flow.movable):
    cols["movable"] = np.asarray(flow.movable, np.int64)
  if flow.fuses_operands:
    cols["fuses"] = np.asarray(flow.fuses_operands, np.int64)
  if flow.epilogues:
    cols["epilogues"] = np.asarray(flow.epilogues, np.int64)
  if flow.indexing:
    cols["indexing"] = np.asarray(flow.indexing, np.int64)
  if flow.in_place:
    cols["in_place"] = np.asarray(flow.in_place, np.int64)
  if flow.forwarded:
    cols["fwd_mask"] = _mask(flow.forwarded, nvals)
    cols["fwd_ptr"], cols["fwd_idx"] = _rows(
        [flow.forwarded.get(v, ()) for v in range(nvals)], nvals)
  if any(flow.early_copies):
    cols["ec_ptr"], cols["ec_idx"] = _rows(flow.early_copies, n, width=3)
  if any(flow.shared_reads):
    cols["sr_ptr"], cols["sr_idx"] = _rows(flow.shared_reads, n, width=2)
  assert native_lifetimes.estimate_lifetimes is not None
  pos, start, end, virtual, copy_last, broadcasts = native_lifetimes.estimate_lifetimes(n, cols)
  return _Lifetimes(pos, start, end, virtual.astype(bool),
                    [tuple(r) for r in copy_last.reshape(-1, 3).tolist()],
                    [tuple(r) for r in broadcasts.reshape(-1, 4).tolist()])


def _lifetimes(flow: Flow, merged: Mapping[int, int]) -> _Lifetimes:
  """The XLA model applied to a flow whose common subexpressions are merged (:func:`estimate`).

  The reference the native extension's ``estimate_lifetimes`` is tested
  against (``tests/estimate/test_native_lifetimes.py``): both return the same
  lifetimes for every flow.
  """
  nvals = len(flow.nbytes)
  pos = _positions(flow)
  start = [pos[s] if s >= 0 else s for s in flow.start]
  end = [pos[e] if e >= 0 else e for e in flow.end]
  consumers: list[list[int]] = [[] for _ in range(nvals)]
  # Early layout copies: the steps that read each value through one, and the
  # last reader of each copy (one per value, size and layout, however many
  # steps read it: XLA's CSE merges the transposes).
  copiers: dict[int, set[int]] = {}
  copy_last: dict[tuple[int, int, int], int] = {}
  for s, copies in enumerate(flow.early_copies):
    for key in copies:
      copiers.setdefault(key[0], set()).add(s)
      copy_last[key] = max(copy_last.get(key, pos[s]), pos[s])
  for s, ins in enumerate(flow.step_inputs):
    p = pos[s]
    for x in ins:
      cx = consumers[x]
      if not cx or cx[-1] != s:
        cx.append(s)
        # (Through an early layout copy: the copy, not x, lives until s.)
        if start[x] >= 0 and end[x] < p and not (copiers and s in copiers.get(x, ())):
          end[x] = p
  # (A list while it is filled in: indexing one is several times faster.)
  virtual = [False] * nvals
  # Per step: may a producer fuse into it (a fusible kind, or a step that
  # fuses its operands although its own result is stored)?
  fuses = flow.fuses_operands
  fusible = [k in FUSIBLE_CONSUMERS or bool(fuses and fuses[c] == FUSES_ANY)
             for c, k in enumerate(flow.step_kind)]
  # XLA's code-duplication limit (`Flow.indexing`): per fused value, per
  # fusion, the readers that index it anew and how often it is emitted.
  indexing = flow.indexing or None
  outputs = flow.step_outputs
  groups: dict[int, _Groups] = {}
  # Stored values XLA also duplicates into some of their readers (see
  # `_closed_readers`): never the stored end of a matmul's epilogue.
  split: set[int] = set()
  # Each value's defining step, built the first time a split is considered
  # (most estimates are of schedules that never need it: a hot path).
  made_at: dict[int, int] | None = None
  # Fusions that contain a reduction (`_closed_readers`), named by their
  # roots: the reductions, the steps that read a reduction's only-read
  # result, and (below) the roots those steps are fused into.
  closed_roots: set[int] = set()
  reads_reduction: set[int] = set()
  # Those of them XLA:CPU hands to YNNPACK with the reduction (a custom call
  # whose result shares no operand's buffer: `_share_operand_buffers`).
  # YNNPACK grows a reduction's fusion into the arithmetic on its result
  # only where that result is large enough (`IsInstructionPreferredByYnn`:
  # 4096 elements, counted as float32 bytes); a classifier's row sums over
  # 512 rows end their fusion, and the softmax gradient after them is a
  # loop fusion written over the label scatter it adds to.
  ynn_roots: set[int] = set()
  reads_big_reduction: set[int] = set()
  if indexing is not None:
    for s in range(flow.num_steps):
      if flow.step_kind[s] is Fusion.REDUCE:
        closed_roots.add(s)
        ynn_roots.add(s)
        for y in outputs[s]:
          cs = _through_aliases(flow, consumers, y)
          if len(cs) == 1:
            reads_reduction.add(cs[0])
            if flow.nbytes[y] >= _YNN_MIN_BYTES:
              reads_big_reduction.add(cs[0])
    closed_roots |= reads_reduction
    ynn_roots |= reads_big_reduction
  for s in range(flow.num_steps - 1, -1, -1):
    kind = flow.step_kind[s]
    for o in flow.step_outputs[s]:
      if o in flow.materialized or not consumers[o]:
        continue
      if o in flow.forwarded:
        virtual[o] = True
        for x in flow.forwarded[o]:
          end[x] = max(end[x], end[o])
        continue
      if kind is Fusion.CHEAP and o in copiers:
        # An elementwise value read through an early layout copy: XLA
        # recomputes it inside the copy and inside its fusible readers, from
        # its own inputs; it is stored only for its other readers (a forward
        # convolution), until the last of them.
        others = [c for c in consumers[o] if c not in copiers[o]]
        # (Not into a reduction among several readers, as for fusion.)
        dup = [fusible[c] and not (flow.step_kind[c] is Fusion.REDUCE and len(others) > 1)
               for c in others]
        hard = [pos[c] for c, d in zip(others, dup) if not d]
        soft = [pos[c] for c, d in zip(others, dup) if d]
        if soft:
          for x in flow.step_inputs[s]:
            end[x] = max(end[x], *soft)
          if hard:
            end[o] = max(start[o], *hard)
          else:
            virtual[o] = True
          continue
      if kind is Fusion.VIEW and flow.step_inputs[s]:
        pass                                          # a bitcast: always an alias
      elif kind is Fusion.CHEAP or (kind is Fusion.EXPENSIVE and len(consumers[o]) == 1):
        cs = _through_aliases(flow, consumers, o)
        # A step that fuses an operand only where it alone reads it (XLA:CPU's
        # library fusions, `xla_model.operand_fusions`) takes an elementwise
        # one only: a concatenate or a broadcast feeding the matmul is stored.
        if not all(map(fusible.__getitem__, cs)) and not (
            fuses and len(cs) == 1 and fuses[cs[0]] == FUSES_SOLE and consumers[o] == cs
            and indexing is not None and indexing[s] == INDEX_SAME):
          continue
        one_fusion = indexing is not None and _reductions_come_back(flow, consumers, groups, cs)
        if indexing is not None and len(cs) > 1 and not one_fusion:
          closed = _closed_readers(flow, cs, groups, closed_roots)
          if closed:
            # Stored for the readers XLA:CPU has already closed into
            # reduction fusions; duplicated into the others when it is
            # (effectively) unary, as XLA's fusion duplicates such a
            # producer, its inputs then living until those readers.
            if made_at is None:
              made_at = {y: t for t in range(flow.num_steps) for y in outputs[t]}
            if kind is Fusion.CHEAP and _effectively_unary(flow, s, made_at, indexing):
              others = [c for c in cs if c not in closed]
              end[o] = max(start[o], max(_horizon(flow, virtual, end, pos, c) for c in closed))
              if others:
                last = max(_horizon(flow, virtual, end, pos, c) for c in others)
                for x in flow.step_inputs[s]:
                  end[x] = max(end[x], last)
                split.add(o)
            continue
        ckinds = [flow.step_kind[c] for c in cs]
        if Fusion.REDUCE in ckinds and len(ckinds) > 1 and not one_fusion:
          continue        # XLA does not duplicate a producer into a reduction
      elif not (flow.epilogues and flow.epilogues[s]
                and _ends_in_stored_epilogue(flow, consumers, virtual, o, split)):
        continue
      if indexing is not None:
        found = _indexing_groups(consumers[o], outputs, indexing, groups)
        times = found[1]
        ind = indexing[s]
        # (A pad or concatenate read twice is already stored: on the CPU it
        # is `Fusion.EXPENSIVE`, fused into one reader only.)
        if kind is not Fusion.VIEW and ind != INDEX_BROADCAST and (
            times > ALLOWED_CODE_DUPLICATION or (ind == INDEX_BRANCHES and times > 1)):
          if kind is Fusion.CHEAP and ind != INDEX_BRANCHES and isinstance(found[0], dict):
            # The limit is per fusion: XLA still duplicates the value into
            # the fusions that emit it few enough times, and stores it for
            # the others (a sum of pads read through an `unstack` whose
            # slices reach one fusion all together and others a few each).
            few = {r: us for r, us in found[0].items()
                   if sum(us.values()) <= ALLOWED_CODE_DUPLICATION}
            if few:
              many = [pos[r] for r in found[0] if r not in few]
              end[o] = max(start[o], *many)
              last = max(pos[r] for r in few)
              for x in flow.step_inputs[s]:
                end[x] = max(end[x], last)
              split.add(o)
              few.setdefault(s, {s: 1})       # (and its own stored fusion)
              groups[o] = few, max(sum(us.values()) for us in few.values())
          continue          # XLA would emit it too many times: stored
        if kind is Fusion.EXPENSIVE and isinstance(found[0], dict) and len(found[0]) > 1:
          # Its one reader is duplicated into several fusions (a sum of pads
          # read by slices in several fusions), and XLA duplicates no
          # expensive producer, nor a pad or a concatenate, whose code
          # branches: each copy of the reader reads it from its buffer.
          continue
        groups[o] = found
        if s in reads_reduction:
          closed_roots.update(_fusion_roots(outputs, groups, s))
          if s in reads_big_reduction:
            ynn_roots.update(_fusion_roots(outputs, groups, s))
      virtual[o] = True
      for x in flow.step_inputs[s]:
        end[x] = max(end[x], end[o])
  for v in flow.hoist_to_start:
    if not virtual[v] and v not in merged:
      start[v] = 0
  if flow.in_place:
    for s, at in enumerate(flow.in_place):
      ins = flow.step_inputs[s]
      if 0 <= at < len(ins):
        x = ins[at]
        if (x not in flow.materialized and not virtual[x] and end[x] == pos[s]
            and start[x] < pos[s]):
          end[x] = pos[s] - 1       # its buffer is the result's from here on
  if indexing is not None:
    _share_operand_buffers(flow, pos, start, end, virtual, indexing, ynn_roots)
  readers_of: dict[tuple[int, int], list[int]] = {}
  for s, reads in enumerate(flow.shared_reads):
    for key in reads:
      readers_of.setdefault(key, []).append(s)
  stored_broadcasts = []
  for key, readers in readers_of.items():
    first = min(pos[c] for c in readers)
    if indexing is not None:
      # Stored where XLA:CPU's reduction fusions read it among other
      # fusions (`_closed_readers`), and kept until the last of those: the
      # loop fusions among its readers broadcast it again inline. XLA makes
      # the buffer early, by its first reader of any kind. Measured: a
      # LayerNorm's `rsqrt` broadcast, made in the forward pass, lives until
      # the scale gradient's sum in the backward one (a message-passing
      # step's edge MLPs); a graph attention vector's [E,H,F] broadcast,
      # read by the forward score's sum and by a backward multiply, is freed
      # after the sum (the multiply fuses its own).
      closed = _closed_readers(flow, sorted(set(readers)), groups, closed_roots)
      if not closed:
        continue
      last = max(_horizon(flow, virtual, end, pos, c) for c in closed)
    else:
      last = max(_horizon(flow, virtual, end, pos, c) for c in readers)
      if last <= first:        # one reader: fused into it, nothing stored
        continue
    stored_broadcasts.append((key[0], key[1], first, last))
  return _Lifetimes(pos, start, end, virtual,
                    [(x, nbytes, last) for (x, nbytes, _), last in copy_last.items()],
                    stored_broadcasts)


def _profile_of_lifetimes(flow: Flow, merged: Mapping[int, int],
                          found: _Lifetimes) -> tuple[Profile, np.ndarray]:
  """:func:`estimate`'s profile of the lifetimes :func:`_lifetimes` found."""
  pos = np.asarray(found.pos, np.int64)
  start_a = np.asarray(found.start, np.int64)
  end_a = np.maximum(np.asarray(found.end, np.int64), start_a)
  virtual_a = np.asarray(found.virtual, bool)
  nbytes_a = np.asarray(flow.nbytes, np.int64)
  ids_a = np.flatnonzero(start_a >= 0)
  parts_s, parts_e, parts_b = [start_a[ids_a]], [end_a[ids_a]], [np.where(virtual_a, 0, nbytes_a)[ids_a]]
  if flow.copies:
    ids = ids_a.tolist()
    sizes = parts_b[0].tolist()
    _reuse_copied_arguments(flow, pos.tolist(), ids, parts_s[0].tolist(), parts_e[0].tolist(),
                            sizes)
    parts_b[0] = np.asarray(sizes, np.int64)
  n_ids = len(ids_a)
  # Where each kind of `HIDDEN_KINDS` starts among the intervals.
  kind_starts = [n_ids]
  hoisted = np.asarray(flow.hoisted, np.int64)
  at = np.flatnonzero(hoisted)
  parts_s.append(np.zeros(len(at), np.int64))
  parts_e.append(pos[at])
  parts_b.append(hoisted[at])
  kind_starts.append(kind_starts[-1] + len(at))
  if flow.copies:
    xs = np.fromiter(flow.copies.keys(), np.int64, len(flow.copies))
    steps = np.fromiter(flow.copies.values(), np.int64, len(flow.copies))
    parts_s.append(np.zeros(len(xs), np.int64))
    parts_e.append(pos[steps])
    parts_b.append(nbytes_a[xs])
  kind_starts.append(kind_starts[-1] + len(flow.copies))
  copies = [(x, b, last) for x, b, last in found.copy_last if start_a[x] >= 0]
  if copies:                 # from the operand's start to the last reader
    xs, bs, lasts = (np.asarray(c, np.int64) for c in zip(*copies))
    parts_s.append(np.minimum(start_a[xs], lasts))
    parts_e.append(lasts)
    parts_b.append(bs)
  kind_starts.append(kind_starts[-1] + len(copies))
  stored_broadcasts = [tuple(map(int, b)) for b in found.stored_broadcasts]
  if stored_broadcasts:
    _, bs, firsts, lasts = (np.asarray(c, np.int64) for c in zip(*stored_broadcasts))
    parts_s.append(firsts)
    parts_e.append(lasts)
    parts_b.append(bs)
  starts, ends, sizes = (np.concatenate(p) for p in (parts_s, parts_e, parts_b))
  transient = np.zeros(flow.num_steps + 1, np.int64)
  if len(flow.transient):
    np.add.at(transient, pos[:len(flow.transient)], np.asarray(flow.transient, np.int64))
  live = _live_curve(flow.num_steps + 1, starts, ends, sizes) + transient
  on_chip = None
  if flow.on_chip > 0:
    # Arguments, outputs and constants stay in device memory, and so does a
    # buffer larger than the on-chip memory; of the other temporaries, up to
    # `on_chip` bytes at any position are on chip and off the count.
    mat = np.zeros(len(sizes), bool)
    if flow.materialized:
      in_mat = np.zeros(len(nbytes_a), bool)
      in_mat[np.fromiter(flow.materialized, np.int64, len(flow.materialized))] = True
      mat[:n_ids] = in_mat[ids_a]
    fits = _live_curve(flow.num_steps + 1, starts, ends,
                       np.where((sizes <= flow.on_chip) & ~mat, sizes, 0))
    fits = fits + transient
    on_chip = np.minimum(fits, flow.on_chip)
    live = live - on_chip
  prof = _profile_of(live, starts, ends, sizes)
  holders = [(int(ids_a[i]), b) for i, b in zip(prof.holders, prof.holder_bytes) if i < n_ids]
  hidden = [0] * len(HIDDEN_KINDS)
  for i, b in zip(prof.holders, prof.holder_bytes):
    if i >= n_ids:
      hidden[bisect.bisect_right(kind_starts, i) - 1] += b
  hidden[4] = int(transient[prof.peak_index]) if prof.peak_index < len(transient) else 0
  if on_chip is not None and prof.peak_index < len(on_chip):
    hidden[5] = -int(on_chip[prof.peak_index])
  if merged:                           # stored by the value it was merged into
    gone = np.fromiter(merged.keys(), np.int64, len(merged))
    keep = np.fromiter(merged.values(), np.int64, len(merged))
    start_a[gone], end_a[gone] = start_a[keep], end_a[keep]
    virtual_a = virtual_a.copy()
    virtual_a[gone] = True
  intervals = tuple(zip(start_a.tolist(), end_a.tolist()))
  virtual = virtual_a
  return dataclasses.replace(prof, holders=tuple(h for h, _ in holders),
                             holder_bytes=tuple(b for _, b in holders), intervals=intervals,
                             virtual=virtual,
                             stored_broadcasts=tuple(stored_broadcasts),
                             hidden_at_peak=tuple((k, int(b)) for k, b in zip(HIDDEN_KINDS, hidden)
                                                  if b)), virtual
