"""Schedule: a program with a plan applied, as a flat list of steps.

The planner prices a schedule with the same lifetime rule as the report, and
the backends (:mod:`jaxmem._src.lower`) execute exactly this list, so the
estimate describes the program that is compiled.

Placement (``docs/design.md``, "The plan"): an offload is issued right after the last use
before the gap; its fetch, and a remat's fences and recomputation, are issued
just before the next use. Fetches and fences take a ``dep`` operand — the most
recently produced input of that next use — so XLA can neither hoist them (nor
CSE a recomputation with the forward pass) above the point where they are needed.

Copies are synchronous (``copies="sync"``: one ``offload`` and one ``fetch``
custom call each) or windowed (``copies="async"``, :func:`async_copies`): each
becomes a start and a done whose distance is the window in which the copy
overlaps computation, placed after Hayakawa et al.'s window-based scheduling
(*Out-of-core training for extremely large-scale neural networks with adaptive
window-based scheduling*, §3).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import weakref
from collections.abc import Sequence
from typing import Literal

import numpy as np

from jaxmem._src import _compat
from jaxmem._src.estimate import lifetimes, xla_model
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.ir import primitives
from jaxmem._src.ir.primitives import Fusion
from jaxmem._src.plan.decisions import Action, Decision

HANDLE_BYTES = 8
# Ops computed from literals only that are at least this large get their
# literals fenced (see Step.literal_dep): XLA would hoist or CSE them.
DECORRELATE_MIN_BYTES = 64 * 1024


#: ``copies=`` values: one blocking custom call per copy, or a start and a done.
COPY_MODES = ("sync", "async")
CopyMode = Literal["sync", "async"]
#: An asynchronous copy's window: ``int`` bytes, ``float`` a multiple of the
#: bytes copied, ``None`` the default (:data:`DEFAULT_WINDOW`).
Window = int | float | None
#: Default window of an asynchronous copy, as a multiple of the bytes it moves
#: (see :func:`async_copies`).
DEFAULT_WINDOW = 1.0


class StepKind(str, enum.Enum):
  COMPUTE = "compute"
  OFFLOAD = "offload"
  FETCH = "fetch"
  FENCE = "fence"
  PIN = "pin"
  OFFLOAD_START = "offload_start"
  OFFLOAD_DONE = "offload_done"
  FETCH_START = "fetch_start"
  FETCH_DONE = "fetch_done"


#: Steps whose first output is their first input's buffer (an XLA alias): the
#: input is live through the step, the output from the next one.
ALIASING_KINDS = frozenset({StepKind.FETCH_DONE})


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of a schedule.

  Attributes:
    kind: compute / offload / fetch / fence / pin (a fence right after the
      definition that makes XLA materialize this value instead of fusing its
      producer into later consumers; see :func:`build_schedule`), or one half
      of an asynchronous copy: offload_start ``(x) -> ticket``,
      offload_done ``(x, ticket, dep) -> handle``, fetch_start
      ``(handle, dep) -> (buf, ticket)``, fetch_done ``(buf, ticket, dep) -> x``.
    anchor: position in the original program (half positions for inserted steps).
    inputs: value ids (or literals) read.
    outputs: value ids written.
    op: for compute steps, the original op index.
    var: the original variable moved, fenced or restored.
    recompute: a remat re-execution of ``op``.
    literal_dep: for a compute step of a large op computed from literals only
      (a zeros broadcast, an iota), a value its literal operands are fenced
      after. XLA would otherwise hoist it to the program start, or CSE it with
      an identical op far earlier, and keep the buffer alive until this use.
  """
  kind: StepKind
  anchor: float
  inputs: tuple[int | _compat.Literal, ...]
  outputs: tuple[int, ...]
  op: int | None = None
  var: int | None = None
  recompute: bool = False
  literal_dep: int | None = None


@dataclasses.dataclass(frozen=True)
class CopyWindow:
  """Where one asynchronous round trip of a value sits in a schedule.

  A half that stayed synchronous has equal start and done indices (both the
  index of its ``offload`` / ``fetch`` step).

  Attributes:
    var: the original variable copied.
    nbytes: bytes copied each way.
    offload_start, offload_done, fetch_start, fetch_done: step indices.
    window_bytes: the window asked for (bytes of computed values).
    offload_cover_bytes: bytes computed between offload_start and offload_done.
    fetch_cover_bytes: bytes computed between fetch_start and fetch_done.
    offload_budget_bound: the done was pulled in because keeping the source
      longer would exceed the budget (Hayakawa et al. §3: swap-out completion
      is bounded by the budget), not because the window was covered.
    fetch_budget_bound: likewise for the fetch's start.
  """
  var: int
  nbytes: int
  offload_start: int
  offload_done: int
  fetch_start: int
  fetch_done: int
  window_bytes: int
  offload_cover_bytes: int
  fetch_cover_bytes: int
  offload_budget_bound: bool
  fetch_budget_bound: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """Steps plus the table of values they define.

  ``value_var[i]`` is the original variable a value is a version of (``None``
  for copy handles and tickets); values ``< len(program.vars)`` are the
  originals. ``copies`` is ``"sync"`` or ``"async"``; ``windows`` lists the
  asynchronous round trips.
  """
  program: AnalyzedProgram
  steps: tuple[Step, ...]
  value_var: tuple[int | None, ...]
  outputs: tuple[int | _compat.Literal, ...]
  copies: CopyMode = "sync"
  windows: tuple[CopyWindow, ...] = ()

  def value_bytes(self, vid: int) -> int:
    var = self.value_var[vid]
    return HANDLE_BYTES if var is None else self.program.vars[var].nbytes

  def profile(self) -> lifetimes.Profile:
    """Estimated live bytes per step (the last position is the exit), XLA model applied.

    Fences, pins, offloads and fetches are custom calls: XLA stores what they
    read and write, which is how a pin keeps a mask from being fused away. An
    asynchronous copy's source is live until its offload_done (which reads
    it) and its destination from its fetch_start (which writes it); the
    aliased output of a fetch_done takes over its input's buffer from the
    next step, so the bytes are not counted twice.
    """
    # Computed once per schedule: the planners' `finish` and the simulator
    # ask for the same schedule's profile (its arrays are made read-only).
    found = self.__dict__.get("_profile_memo")
    if found is None and "_same_steps_as" in self.__dict__:
      # The same steps as a schedule built before (`async_copies` without a
      # round trip): the profile depends on the steps alone.
      found = self.__dict__["_same_steps_as"].profile()
      object.__setattr__(self, "_profile_memo", found)
    if found is None:
      found = self._profile()
      for arr in (found.live_bytes, found.virtual):
        if isinstance(arr, np.ndarray):
          arr.flags.writeable = False
      object.__setattr__(self, "_profile_memo", found)
    return found

  def _profile(self) -> lifetimes.Profile:
    prog = self.program
    model = prog.planned_memory
    n = len(self.steps)
    nvals = len(self.value_var)
    start = [-1] * nvals
    end = [-1] * nvals
    for vid in (*prog.invars, *prog.consts):
      start[vid] = 0
    hoist = set(prog.hoisted)
    # Values a custom call of the plan reads (an offload, a fetch's or a
    # fence's ordering operand): XLA hands the call a buffer, so a view
    # that remaps indices (a transpose, a slice) is written as a copy of its
    # own instead of being fused into its readers. Measured on an unrolled
    # LSTM whose fetches waited for a split of a weight gradient: XLA:CPU
    # stored each slice and the transposed gradient (+1.9 MiB at the peak).
    custom_read = {x for st in self.steps if st.kind is not StepKind.COMPUTE
                   for x in st.inputs if isinstance(x, int)}
    # A fenced argument is copied (the fence aliases its operand, which the
    # caller still owns), and the copy reads nothing but the argument:
    # XLA:CPU's scheduler runs it near the program start, not at the fence.
    # Measured on an unrolled LSTM whose recomputed gate-kernel
    # concatenations were fenced on their kernels: sixteen 144 KiB copies
    # live from position 67 to their fences at 805 (+2.3 MiB at the peak).
    copied_args = frozenset(prog.invars) if prog.backend == "cpu" else frozenset()
    orig_steps, orig_rows = _original_steps(prog).steps, _original_rows(prog)
    compute = StepKind.COMPUTE
    # One row per step (`_StepRow`), transposed into the flow's columns below.
    rows: list[_StepRow] = []
    for i, st in enumerate(self.steps):
      op = st.op
      if st.kind is compute:
        # An op of the program as it stands (most steps of any plan) has the
        # same row in every schedule of the program (`_original_rows`).
        row, ins_kept, relayout = (orig_rows[op] if st is orig_steps[op]
                                   else _step_row(prog, st, model[op]))
        if relayout and not custom_read.isdisjoint(st.outputs):
          # Stored for the custom call, fused into the others.
          row = (row[0], row[1], Fusion.CHEAP, *row[3:])
        if st.literal_dep is not None:   # fenced literals: created where it stands
          hoist.difference_update(st.outputs)
        if row[6] and any(t == xla_model.DUPLICATE and x in custom_read for x, _, t in row[6]):
          # A product XLA duplicates into its readers is stored once where a
          # custom call of the plan reads it (an offload, a pin), and its
          # other readers read that buffer: no copy of their own. Measured on
          # a DP-SGD step whose per-example gradient a plan offloads from its
          # norm to the weighted sum: 0.59 of the unplanned compiled peak.
          kept = tuple(c for c in row[6] if not (c[2] == xla_model.DUPLICATE
                                                  and c[0] in custom_read))
          row = (*row[:6], kept, *row[7:])
          copied = {x for x, _, _ in kept}
          ins_kept = tuple(x for x in row[0] if x not in copied)
      else:
        ins_kept = tuple(x for x in st.inputs if isinstance(x, int))
        row = (ins_kept, st.outputs, Fusion.MATERIALIZED, 0, 0, (), (), False, None, False,
               False, xla_model.INDEX_NEW, -1)
      for x in ins_kept:
        end[x] = i
      for o in st.outputs:
        start[o] = i
        if end[o] < i:
          end[o] = i
      if st.kind is not compute:
        if st.kind in ALIASING_KINDS:
          start[st.outputs[0]] = i + 1
        elif st.kind is StepKind.FENCE and st.inputs[0] in copied_args:
          start[st.outputs[0]] = 0
      rows.append(row)
    (inputs, outputs, kinds, transient, hoisted, shared, early, movable, cse, fuses,
     epilogues, indexing, in_place) = ((list(c) for c in zip(*rows)) if rows
                                       else ([] for _ in range(13)))
    for vid in prog.invars:
      if not prog.freed_at_last_use(vid):
        end[vid] = n
    for vid in prog.consts:
      end[vid] = n
    outs = frozenset(x for x in self.outputs if isinstance(x, int))
    for x in outs:
      start[x] = 0   # reserved for the whole step, as memory_analysis() counts them
      end[x] = n
    materialized = frozenset(prog.invars) | frozenset(prog.consts) | outs
    nbytes = list(_var_bytes(prog))
    widened = _var_bytes(prog)
    nbytes.extend(HANDLE_BYTES if var is None else widened[var]
                  for var in self.value_var[len(nbytes):])
    for x in outs:
      if self.value_var[x] in prog.donation_aliases:
        nbytes[x] = 0
    flow = lifetimes.Flow(n, kinds, inputs, outputs, transient, hoisted, start, end, nbytes,
                          materialized, frozenset(hoist), shared, movable, cse,
                          xla_model.on_chip_bytes(prog), fuses,
                          _copy_steps(prog.donation_copies, self.steps),
                          self._forwarded(), epilogues if prog.epilogues else None,
                          early if any(early) else (), indexing if prog.indexing else None,
                          in_place if any(k >= 0 for k in in_place) else None)
    return lifetimes.estimate(flow)[0]

  def _forwarded(self) -> dict[int, tuple[int, ...]]:
    """:attr:`~jaxmem._src.estimate.lifetimes.Flow.forwarded` of the schedule's values.

    A ``shard_map`` result that stores nothing of its own in the unplanned
    program stores nothing here either, unless a step of the plan (an
    offload, a pin) reads it: that step needs it stored.
    """
    forwards = self.program.forwards
    if not any(forwards):
      return {}
    planned_readers = {x for st in self.steps if st.kind is not StepKind.COMPUTE
                       for x in st.inputs if isinstance(x, int)}
    out: dict[int, tuple[int, ...]] = {}
    for st in self.steps:
      if st.kind is not StepKind.COMPUTE or st.recompute or not forwards[st.op]:
        continue
      out.update((o, src) for o, src in xla_model.forwarded_values(
          forwards[st.op], st.inputs, st.outputs).items() if o not in planned_readers)
    return out

  def anchor_of(self, index: int) -> float:
    return self.steps[index].anchor if index < len(self.steps) else float(self.program.num_ops)


def choose_dep(program: AnalyzedProgram, before: int, exclude: set[int]) -> int | None:
  """The original variable that orders a restore before op ``before``.

  The most recently defined non-argument input of that op which is not itself
  being restored there (typically the incoming gradient); ``None`` means "the
  last value computed so far". Values computed from constants only are never
  chosen: XLA hoists them to the start, and the copy would follow. On the
  CPU, an input that is a slice or transpose XLA fuses into all its readers
  is replaced by the stored value it views: our custom call reading it
  would make XLA store it (:func:`stored_source`). Only on the CPU: a first
  version of the rule, which also looked through fused elementwise values,
  made a planned MLP's offloads free nothing on XLA:TPU (whose plans order
  copies with ``optimization_barrier`` s); the narrower rule was not
  measured there.
  """
  best, best_def = None, -1
  for x in program.ops[before].input_ids():
    v = program.vars[x]
    if x in exclude or v.is_input or program.constant_like[x]:
      continue
    if program.backend == "cpu":
      x = stored_source(program, x)
    if x in exclude:
      continue
    if program.vars[x].defined_by > best_def:
      best, best_def = x, program.vars[x].defined_by
  return best


def stored_source(program: AnalyzedProgram, x: int) -> int:
  """``x``, or the stored value it is a slice or a transpose of.

  A slice or transpose XLA fuses into all of its readers has no buffer; our
  custom call reading it (ordering a copy after it) would make XLA write it
  as a copy of its own, whereas the value it views is computed at the same
  point and stored anyway (flax's LSTM cell gradient: a matmul, its
  transpose, its split into gates, each gate added to its running sum).
  A view a library call reads is stored anyway and stays the order: the
  copy then waits as late as it did (a UNet's split of a convolution's
  gradient, read by the next convolution: ordered after the convolution
  instead, its fetches ran early, +0.6 MiB compiled). Other values fused
  away (elementwise ones) are left as they are: the latest stored value
  they come from may be much older, and a copy ordered after it would run
  early (a WaveNet step: its fetches ran a layer ahead, four 270 KiB
  buffers per layer live at the peak).
  """
  virtual = program.profile.virtual
  kinds = program.memory
  y = x
  # A view that a library call reads (a slice a convolution reads) is stored
  # whatever the plan does; the copy may as well wait for it, as late as it is.
  while (virtual is not None and virtual[y]
         and all(kinds[u].kind is not Fusion.MATERIALIZED for u in program.vars[y].uses)):
    op = program.ops[program.vars[y].defined_by]
    ins = op.input_ids()
    if not primitives.facts(op.primitive).relayout or len(ins) != 1:
      return x      # a bitcast (reshape) reads its operand's buffer: no copy to avoid
    y = ins[0]
    if program.vars[y].is_input or program.constant_like[y]:
      return x
  return y


def _copy_steps(copies: Mapping[int, int], steps: Sequence[Step]) -> dict[int, int]:
  """``copies`` (donated argument -> updating op) with each op's step in ``steps`` instead."""
  if not copies:
    return {}
  step_of = {st.op: i for i, st in enumerate(steps)
             if st.kind is StepKind.COMPUTE and not st.recompute}
  return {x: step_of[op] for x, op in copies.items() if op in step_of}


def fence_points(program: AnalyzedProgram, chain: Sequence[int]) -> list[int]:
  """Values to fence so that every op of a remat ``chain`` runs after ``dep``.

  Each op of the chain whose inputs all come from outside the chain gets one of
  them fenced: an activation if it has one (fencing renames it, so the alias
  costs no copy), else its smallest argument (XLA copies a fenced argument).
  Every recomputed op then depends on a fence, so XLA can neither hoist it nor
  CSE it with the forward pass. Ops with no array inputs (iota, constant
  broadcasts) are left alone: merging those is harmless. So are ops that read
  only values computed from constants (a causal mask and its ``convert``):
  XLA recomputes those inside every consumer, and a fence would make it store
  one (XLA:TPU kept a ``f32[128,1,256,256]`` mask, 32 MiB, live from the
  forward pass to the end of a GPT's backward pass for a fence on it).
  """
  made = {o for k in chain for o in program.ops[k].outputs}
  fenced: list[int] = []
  for k in chain:
    ins = [x for x in program.ops[k].input_ids() if not program.constant_like[x]]
    if not ins or any(x in made for x in ins) or any(x in fenced for x in ins):
      continue
    acts = [x for x in ins if not program.vars[x].is_input]
    pick = (max(acts, key=lambda x: program.vars[x].nbytes) if acts else
            min(ins, key=lambda x: program.vars[x].nbytes))
    fenced.append(pick)
  return fenced


@dataclasses.dataclass(frozen=True)
class _OriginalSteps:
  """Per op of a program, what :func:`build_schedule` needs for every plan of it.

  ``steps[i]``: op ``i``'s compute step when none of its inputs was renamed by
  the plan (most ops of any plan); ``reads[i]``: the variables it reads;
  ``stored[i]``: its first output XLA stores, or ``None``;
  ``last_stored[i]``: the last of ``stored[:i]`` that is not ``None`` (the
  last value computed before op ``i``); ``literals``: the ops that make a
  large constant-like value from nothing (fenced behind the last value).
  """
  steps: tuple[Step, ...]
  reads: tuple[frozenset[int], ...]
  stored: tuple[int | None, ...]
  last_stored: tuple[int | None, ...] = ()
  literals: tuple[int, ...] = ()


# Planners build schedules of one program dozens of times (``segments`` tries
# each segmentation at several prefix lengths): its unchanged steps are made
# once per program, and die with it.
_ORIGINAL_STEPS: weakref.WeakKeyDictionary[AnalyzedProgram, _OriginalSteps] = (
    weakref.WeakKeyDictionary())


def _original_steps(program: AnalyzedProgram) -> _OriginalSteps:
  found = _ORIGINAL_STEPS.get(program)
  if found is None:
    virtual = program.profile.virtual if program.backend == "cpu" else None
    constant_like = program.constant_like
    reads = tuple(frozenset(op.input_ids()) for op in program.ops)
    stored = tuple(next((o for o in op.outputs if not constant_like[o]
                         and (virtual is None or not virtual[o])), None) for op in program.ops)
    last: list[int | None] = [None]
    for x in stored:
      last.append(x if x is not None else last[-1])
    found = _OriginalSteps(
        tuple(Step(StepKind.COMPUTE, float(op.index), tuple(op.inputs), op.outputs, op=op.index)
              for op in program.ops),
        reads, stored, tuple(last),
        tuple(op.index for op in program.ops
              if op.outputs and constant_like[op.outputs[0]] and not reads[op.index]
              and sum(program.vars[o].nbytes for o in op.outputs) >= DECORRELATE_MIN_BYTES))
    _ORIGINAL_STEPS[program] = found
  return found


_VAR_BYTES: weakref.WeakKeyDictionary[AnalyzedProgram, tuple[int, ...]] = (
    weakref.WeakKeyDictionary())


def _var_bytes(program: AnalyzedProgram) -> tuple[int, ...]:
  """Bytes XLA stores for each of the program's variables (the first values of every schedule)."""
  found = _VAR_BYTES.get(program)
  if found is None:
    found = _VAR_BYTES[program] = xla_model.stored_var_bytes(program)
  return found


# What `Schedule.profile` records per step, in the order of the flow's
# columns: value inputs, outputs, fusion kind, transient bytes, hoisted bytes,
# shared reads, early layout copies, movable, CSE key, fuses its operands,
# epilogue, indexing kind, the input it writes in place (-1: none).
_StepRow = tuple[Sequence[int], tuple[int, ...], Fusion, int, int, Sequence[tuple[int, int]],
                 Sequence[tuple[int, int]], bool, "xla_model.CseKey | None", bool, bool, int, int]
# Per op of a program: its original step's row, the inputs that step keeps
# alive (not those read through an early layout copy), and whether it is a
# relayout view (stored where a custom call reads it). Every schedule of the
# program shares them: tuples, never edited.
_ORIGINAL_ROWS: weakref.WeakKeyDictionary[
    AnalyzedProgram, tuple[tuple[_StepRow, tuple[int, ...], bool], ...]] = (
        weakref.WeakKeyDictionary())


def _step_row(program: AnalyzedProgram, st: Step, m: xla_model.OpMemory
              ) -> tuple[_StepRow, tuple[int, ...], bool]:
  """A compute step's row, the inputs it keeps alive (not those read through an
  early layout copy), and whether its op is a relayout view (stored where a
  custom call reads it). A recomputation is never moved or merged (it sits
  behind fences, see `fence_points`); it fuses its operands as the original does.
  """
  k = st.op
  ins = tuple(x for x in st.inputs if isinstance(x, int))
  copies = tuple((st.inputs[pos], b, t) for pos, b, t in m.early)  # type: ignore[misc]
  copied = {x for x, _, _ in copies}
  row = (ins, st.outputs, m.kind, m.transient, m.hoisted,
         tuple((st.inputs[pos], b) for pos, b in m.shared),  # type: ignore[misc]
         copies, not st.recompute and program.movable[k],
         None if st.recompute else program.cse_keys[k], program.operand_fusions[k],
         bool(program.epilogues) and program.epilogues[k],
         program.indexing[k] if program.indexing else xla_model.INDEX_NEW,
         _in_place_input(program, st, k))
  return (row, tuple(x for x in ins if x not in copied) if copied else ins,
          m.kind is Fusion.VIEW and primitives.facts(program.ops[k].primitive).relayout)


def _in_place_input(program: AnalyzedProgram, st: Step, k: int) -> int:
  """The position among ``st``'s value inputs of the one it writes in place (-1: none).

  The op's own (``AnalyzedProgram.in_place``), where the step reads what the
  op reads at that position (a planned step may read a fetched copy).
  """
  at = program.in_place[k] if program.in_place else -1
  if at < 0:
    return -1
  original = program.ops[k].input_ids()
  values = [x for x in st.inputs if isinstance(x, int)]
  if len(values) != len(original):
    return -1
  return at


def _original_rows(program: AnalyzedProgram) -> tuple[tuple[_StepRow, tuple[int, ...], bool], ...]:
  """`_step_row` of every op's original step, made once per program."""
  found = _ORIGINAL_ROWS.get(program)
  if found is None:
    found = _ORIGINAL_ROWS[program] = tuple(
        _step_row(program, st, m)
        for st, m in zip(_original_steps(program).steps, program.planned_memory))
  return found


def build_schedule(program: AnalyzedProgram, decisions: Sequence[Decision],
                   pinned: Sequence[int] = (), *, copies: CopyMode = "sync",
                   window: Window = None,
                   budget: int | None = None) -> Schedule:
  """Applies ``decisions`` to ``program`` (see the module docstring).

  With ``copies="async"`` the synchronous schedule is then rewritten by
  :func:`async_copies` with ``window`` and ``budget``.

  ``pinned`` variables get a fence right after their definition and later uses
  read the fenced value. Without it XLA's fusion may duplicate a cheap producer
  into a backward consumer and keep the producer's (larger) inputs alive
  instead: a kept ``bool`` ReLU mask becomes its ``float32`` pre-activation, 4x
  the bytes (Layrub §4.2's memory-efficient ReLU, enforced on the compiled
  program).
  """
  if copies not in COPY_MODES:
    raise ValueError(f"`copies` must be one of {COPY_MODES}, got {copies!r}")
  decisions, pinned = tuple(decisions), tuple(pinned)
  # (The budget bounds only asynchronous copy windows.)
  key = (decisions, pinned, copies, window, budget if copies == "async" else None)
  if copies == "async":
    window_bytes(window, 0)      # a bad `window` is named before it is hashed
  recent = program.__dict__.get("_recent_schedules")
  if recent is None:
    recent = collections.OrderedDict()
    object.__setattr__(program, "_recent_schedules", recent)
  found = recent.get(key)
  if found is not None:
    recent.move_to_end(key)
    return found
  if copies == "async":
    # The synchronous schedule (cached too: its profile places the windows).
    sched = async_copies(build_schedule(program, decisions, pinned), window, budget)
  else:
    sched = _build_sync(program, decisions, pinned)
  recent[key] = sched
  if len(recent) > _RECENT_SCHEDULES:
    recent.popitem(last=False)
  return sched


# Schedules recently built per program, by what they are built from. Planners
# build the same schedule more than once (the pinned empty plan starts Layrub,
# vDNN and `auto`'s offload bound; greedy's result is simulated again by
# `auto`; an asynchronous schedule is placed on its synchronous one): measured
# on ResNet-50 under `auto`, 7 of 49 schedule estimates were repeats, about
# 0.1 s each there. A cached schedule carries its memoized profile. Schedules
# are immutable; the last 16 per program (ResNet-50: about 4 MiB each) are
# kept on the program (a weak mapping would never let go: each schedule
# refers to its program).
_RECENT_SCHEDULES = 16


def _build_sync(program: AnalyzedProgram, decisions: tuple[Decision, ...],
                pinned: tuple[int, ...]) -> Schedule:
  """:func:`build_schedule` with synchronous copies, not cached."""
  pinned_set = set(pinned)
  value_var: list[int | None] = list(range(len(program.vars)))
  cur: list[int] = list(range(len(program.vars)))
  steps: list[Step] = []
  after: dict[int, list[Decision]] = {}
  before: dict[int, list[Decision]] = {}
  for d in decisions:
    if d.action is Action.KEEP:
      continue
    before.setdefault(d.end, []).append(d)
    if d.action is Action.OFFLOAD:
      after.setdefault(d.start, []).append(d)
  handles: dict[int, int] = {}
  last_value: int | None = None    # the last stored value computed (a fallback dep)
  # Not on XLA:TPU: there a fence ties a large value to the program point and
  # breaks the fusions around it. Measured on the ResNet-18 step of
  # bench/gpu_bench.py compiled for a v5e through the `xla` backend, with no
  # decision at all: 18 fenced literals made 7.71 GB accessed and 464 MiB of
  # temporaries, against `jax.jit`'s 6.79 GB and 444 MiB; unfenced, the same
  # as `jax.jit` (XLA:GPU compiled the same 764 MiB either way).
  fence_literals = program.backend != "tpu"
  original = _original_steps(program)
  renamed: set[int] = set()        # the variables with cur[x] != x

  def fresh(var: int | None) -> int:
    value_var.append(var)
    return len(value_var) - 1

  # Only the ops the plan touches are visited one by one: those with a
  # restore, an offload or a pin, the literals fenced behind the last value,
  # and the readers of a renamed variable (queued when it is renamed); the
  # steps of the ops between them are the program's own, appended in runs.
  # (The recomputed chains' steps are what is left of the build's time.)
  ops = program.ops
  n = len(ops)
  events = set(before) | set(after) | {program.vars[x].defined_by for x in pinned_set}
  if fence_literals:
    events.update(original.literals)
  static = sorted(e for e in events if 0 <= e < n)
  dirty: list[int] = []            # a heap of ops reading a renamed variable
  queued: set[int] = set()

  def rename(x: int, at: int) -> None:
    renamed.add(x)
    for u in program.vars[x].uses:
      if u > at and u not in queued:
        queued.add(u)
        heapq.heappush(dirty, u)

  next_static = 0
  i = 0
  while True:
    while next_static < len(static) and static[next_static] < i:
      next_static += 1
    nxt = static[next_static] if next_static < len(static) else n
    while dirty and dirty[0] < i:
      heapq.heappop(dirty)
    if dirty and dirty[0] < nxt:
      nxt = dirty[0]
    if nxt > i:
      steps.extend(original.steps[i:nxt])
    if nxt >= n:
      break
    i = nxt
    op = ops[i]
    last_value = original.last_stored[i]
    restores = before.get(i, ())
    if restores:
      restored = {d.var for d in restores}
      dep_var = choose_dep(program, i, restored)
      anchor = i - 0.5
      # What every restore here waits for (fetches leave it unchanged: it is
      # never one of the restored values).
      if dep_var is not None:
        dep = cur[dep_var]
      elif last_value is not None:
        dep = cur[last_value]
      else:
        dep = cur[program.ops[i].input_ids()[0]]
      # Fetches first: a remat chain may read a value fetched at the same point.
      for d in restores:
        if d.action is not Action.OFFLOAD:
          continue
        new = fresh(d.var)
        steps.append(Step(StepKind.FETCH, anchor, (handles.pop(id(d)), dep), (new,), var=d.var))
        cur[d.var] = new
        rename(d.var, i)
      # All remats restored here share one recomputation: the union of their
      # chains, run once in program order (a segment's residuals rebuilt from
      # its checkpoint, Chen et al. 2016 §3, instead of one chain per value
      # repeating the shared prefix). Program order is a topological order, and
      # a chain that reads another restored value finds it made by the union.
      remats = [d for d in restores if d.action is Action.REMAT]
      if remats:
        chain = sorted({k for d in remats for k in d.recompute})
        fenced = fence_points(program, chain)
        local: dict[int, int] = {}
        for x in fenced:
          new = fresh(x)
          steps.append(Step(StepKind.FENCE, anchor, (cur[x], dep), (new,), var=x))
          if program.vars[x].is_input:
            local[x] = new   # a fenced argument is a copy: only the chain reads it
          else:
            cur[x] = new     # later uses read the fenced value, so the alias is free
            rename(x, i)
        owner = {program.vars[d.var].defined_by: d.var for d in remats}
        for k in chain:
          kop = program.ops[k]
          ins = tuple(local.get(x, cur[x]) if isinstance(x, int) else x for x in kop.inputs)
          outs = tuple(fresh(o) for o in kop.outputs)
          local.update(zip(kop.outputs, outs))
          steps.append(Step(StepKind.COMPUTE, anchor, ins, outs, op=k,
                            var=owner.get(k, remats[0].var), recompute=True))
        for d in remats:
          cur[d.var] = local[d.var]
          rename(d.var, i)
    literal_dep = None
    if (fence_literals and op.outputs and program.constant_like[op.outputs[0]]
        and last_value is not None
        and not original.reads[i]
        and sum(program.vars[o].nbytes for o in op.outputs) >= DECORRELATE_MIN_BYTES):
      literal_dep = cur[last_value]
    if literal_dep is None and renamed.isdisjoint(original.reads[i]):
      steps.append(original.steps[i])
    else:
      ins = tuple(cur[x] if isinstance(x, int) else x for x in op.inputs)
      steps.append(Step(StepKind.COMPUTE, float(i), ins, op.outputs, op=i,
                        literal_dep=literal_dep))
    for o in op.outputs:
      if o in pinned_set:
        new = fresh(o)
        steps.append(Step(StepKind.PIN, i + 0.25, (o,), (new,), var=o))
        cur[o] = new
        rename(o, i)
    for d in after.get(i, ()):
      h = fresh(None)
      steps.append(Step(StepKind.OFFLOAD, i + 0.5, (cur[d.var],), (h,), var=d.var))
      handles[id(d)] = h
    i += 1
  outputs = tuple(cur[x] if isinstance(x, int) else x for x in program.outvars)
  return Schedule(program, tuple(steps), tuple(value_var), outputs)


def window_bytes(window: Window, nbytes: int) -> int:
  """The window of a copy of ``nbytes`` bytes: ``int`` bytes, or ``float`` x ``nbytes``."""
  if window is None:
    window = DEFAULT_WINDOW
  if isinstance(window, bool) or not isinstance(window, (int, float)) or window < 0:
    raise ValueError(f"`window` must be a non-negative int (bytes) or float (a multiple of "
                     f"the bytes copied), got {window!r}")
  return int(window) if isinstance(window, int) else int(window * nbytes)


def _materialized_output(sched: Schedule, virtual: np.ndarray, index: int) -> int | None:
  """A value computed by step ``index`` that XLA stores anyway (a safe ``dep``)."""
  st = sched.steps[index]
  if st.kind is not StepKind.COMPUTE:
    return None
  for o in st.outputs:
    var = sched.value_var[o]
    if var is not None and not virtual[o] and not sched.program.constant_like[var]:
      return o
  return None


def async_copies(sched: Schedule, window: Window = None,
                 budget: int | None = None) -> Schedule:
  """Splits every offload/fetch of a synchronous schedule into a start and a done.

  Placement follows Hayakawa et al. §3, with the paper's single
  hyperparameter, a window measured in bytes over the value sequence:

  * ``offload_start`` stays where the offload was (right after the last use
    before the gap). ``offload_done`` goes as late as the window allows: after
    the compute steps that follow have produced ``window`` bytes -- on the
    paper's assumption that compute and copy times are both roughly
    proportional to the bytes involved -- but no later than the first step
    where keeping the source would push the estimated live bytes over
    ``budget`` ("swap-out completion bounded by the budget").
  * ``fetch_start`` looks ahead the same way: it is issued before the use by
    as many steps as it takes to cover ``window`` computed bytes, again only
    over steps where the extra destination buffer fits the budget, and never
    before the offload's done. ``fetch_done`` stays where the fetch was,
    right before the use.

  The memory bound is the smaller of ``budget`` and the synchronous
  schedule's own estimated peak: windows only use memory that is free under
  the peak anyway, so the plan's estimate does not grow. Measured on the CPU,
  a window that raises the peak costs more than its overlap saves: XLA:CPU
  maps a fresh temp arena for every execution, and first-touch page faults
  on the extra bytes (about 0.7 ms per MiB on our VMs) outweigh a memcpy
  (about 0.08 ms per MiB).

  ``window``: an ``int`` is a number of bytes (the paper's schedule-window); a
  ``float`` is a multiple of the bytes the copy moves; ``None`` means
  :data:`DEFAULT_WINDOW`. A half of a round trip whose window would hold no
  computation (``window=0``, or the budget allows none) stays one synchronous
  ``offload`` / ``fetch`` step: splitting it would only let XLA's scheduler
  move the halves apart.
  Windows are placed in offload order, each seeing the bytes the earlier
  ones added. The offload_done reads the source (which is what keeps it
  allocated) and a ``dep``, the latest value a compute step inside the window
  stores anyway; the fetch_start's ``dep`` is the latest stored value inside
  the window that the use itself is computed from (see ``ancestor_dep``), so
  XLA cannot hoist the fetch, and its destination buffer, above the window.
  Nothing after a done or a fetch_start needs its result soon, so each is
  also pinned from above: a small input of the next compute step is fenced
  on it (``pin_before``). The estimate is a model of XLA's schedule and
  buffer packing: measured, the compiled peak with windows can still exceed
  the synchronous one by part of a window (MLP, batch 65536, width 128,
  budget 0.4: 198 -> 211 MiB), which ``jaxmem.fit`` verifies against the
  budget like any other plan.

  Args:
    sched: a synchronous schedule (from :func:`build_schedule`).
    window: see above.
    budget: estimated live bytes the windows may not push a step above
      (``None``: only the schedule's own peak bounds them).

  Returns:
    A new :class:`Schedule` with ``copies="async"`` and its :class:`CopyWindow` s.
  """
  steps = sched.steps
  n = len(steps)
  offloaded = {st.inputs[0] for st in steps if st.kind is StepKind.FETCH}
  if not any(st.kind is StepKind.OFFLOAD and st.outputs[0] in offloaded for st in steps):
    # No round trip to split (a remat-only plan): the same steps, and no
    # profile to estimate (the costliest part of a plan's schedule).
    out = Schedule(sched.program, steps, sched.value_var, sched.outputs, "async")
    object.__setattr__(out, "_same_steps_as", sched)
    return out
  prof = sched.profile()
  live = np.asarray(prof.live_bytes, dtype=np.int64)
  virtual = prof.virtual if prof.virtual is not None else np.zeros(len(sched.value_var), bool)
  produced = np.zeros(n, dtype=np.int64)
  for i, st in enumerate(steps):
    if st.kind is StepKind.COMPUTE:
      produced[i] = sum(sched.value_bytes(o) for o in st.outputs if not virtual[o])
  fetch_at = {st.inputs[0]: i for i, st in enumerate(steps) if st.kind is StepKind.FETCH}
  extra = np.zeros(n + 1, dtype=np.int64)
  value_var = list(sched.value_var)

  def fresh(var: int | None) -> int:
    value_var.append(var)
    return len(value_var) - 1

  # Windows fill the valleys under the plan's own peak: never above it, never
  # above the budget (see the docstring).
  cap = prof.peak_bytes if budget is None else min(int(budget), prof.peak_bytes)

  def fits(p: int, nbytes: int) -> bool:
    # (With the copy's handle, live from its start to its done.)
    return live[p] + extra[p] + nbytes + HANDLE_BYTES <= cap

  def anchor_before(q: int) -> float:
    lo = steps[q - 1].anchor if q > 0 else -1.0
    hi = steps[q].anchor if q < n else float(sched.program.num_ops)
    return (lo + hi) / 2

  def dep_before(q: int, lo: int) -> int | None:
    for p in range(q - 1, lo, -1):
      dep = _materialized_output(sched, virtual, p)
      if dep is not None:
        return dep
    return None

  producer: dict[int, int] = {}
  for i, st in enumerate(steps):
    for o in st.outputs:
      producer[o] = i
  args = frozenset(sched.program.invars)

  def ancestor_dep(value: int | _compat.Literal, r: int, lo: int) -> int | None:
    """The latest stored value at a step in ``(lo, r]`` that ``value`` is computed from.

    A fetch_start runs as early as XLA can schedule it after its ``dep``. A
    value the use itself waits for (the fetch's own dep, typically the
    incoming gradient, and its producers) is computed late in any order XLA
    picks; an unrelated value from the same stretch (an optimizer update of
    another layer) may be computed much earlier and drag the fetch, and its
    destination buffer, up with it.
    """
    best = None
    seen: set[int] = set()
    stack = [value]
    while stack:
      v = stack.pop()
      p = producer.get(v) if isinstance(v, int) else None
      if p is None or p in seen or p <= lo:
        continue
      seen.add(p)
      if p <= r and (best is None or p > best[0]):
        dep = _materialized_output(sched, virtual, p)
        if dep is not None:
          best = (p, dep)
      if best is not None and p < best[0]:
        continue
      stack.extend(x for x in steps[p].inputs if isinstance(x, int))
    return None if best is None else best[1]

  before: dict[int, list[Step]] = {}
  replaced: dict[int, Step] = {}
  renamed: dict[int, dict[int, int]] = {}   # step index -> {value: fenced value}

  def pin_before(q: int, token: int, limit: int, nbytes: int) -> None:
    """Orders the compute at or after step ``q`` (before ``limit``) after ``token``.

    Nothing after a done or a fetch_start reads its output until much later,
    so XLA is free to run it late (measured: it moved an offload_done past
    the next layer's matmul, keeping the source alive over a 32 MiB result).
    Fencing a small stored input of the next compute step on ``token`` makes
    that step wait for it; the fence copies at most ``nbytes // 8`` bytes
    (a value read elsewhere is copied; see ``fence_points``). Arguments are
    not fenced: XLA:CPU makes their copy at the program start
    (:meth:`Schedule.profile`), which no window budgeted for.
    """
    small = max(nbytes // 8, 1)
    for p in range(q, limit):
      st = steps[p]
      if st.kind is not StepKind.COMPUTE:
        continue
      cands = [x for x in st.inputs if isinstance(x, int) and not virtual[x]
               and x not in args and sched.value_bytes(x) <= small
               and x not in renamed.get(p, {})]
      if not cands:
        continue
      x = min(cands, key=sched.value_bytes)
      fenced = fresh(value_var[x])
      before.setdefault(p, []).append(
          Step(StepKind.FENCE, anchor_before(p), (x, token), (fenced,), var=value_var[x]))
      renamed.setdefault(p, {})[x] = fenced
      return
  pending: list[tuple[Step, Step, Step, Step, dict[str, int | bool]]] = []
  for s_o, st in enumerate(steps):
    if st.kind is not StepKind.OFFLOAD or st.outputs[0] not in fetch_at:
      continue
    handle = st.outputs[0]
    s_f = fetch_at[handle]
    fetch = steps[s_f]
    nbytes = sched.value_bytes(st.inputs[0])
    win = window_bytes(window, nbytes)
    # Offload: the source stays allocated over steps s_o+1 .. q-1.
    q, out_cover = s_o + 1, 0
    while q < s_f and out_cover < win and fits(q, nbytes):
      out_cover += int(produced[q])
      q += 1
    out_bound = q < s_f and out_cover < win and not fits(q, nbytes)
    extra[s_o + 1:q] += nbytes
    # Fetch: the destination is allocated over steps r+1 .. s_f-1 (r >= q-1).
    r, in_cover = s_f - 1, 0
    while r >= q and in_cover < win and fits(r, nbytes):
      in_cover += int(produced[r])
      r -= 1
    in_bound = r >= q and in_cover < win and not fits(r, nbytes)
    fetch_dep = fetch.inputs[1]
    if r + 1 < s_f:
      anchor_dep = ancestor_dep(fetch.inputs[1], r, q - 1)
      if anchor_dep is None:  # nothing to hold the fetch at the window's start
        r, in_cover, in_bound = s_f - 1, 0, False
      else:
        fetch_dep = anchor_dep
    extra[r + 1:s_f] += nbytes
    # A half whose window holds no computation gains nothing from being split
    # and would only give XLA's scheduler freedom: it stays one synchronous op.
    split_out = any(produced[s_o + 1:q])
    split_in = any(produced[r + 1:s_f])
    if not split_out:
      extra[s_o + 1:q] -= nbytes
      q = s_o + 1
    if not split_in:
      extra[r + 1:s_f] -= nbytes
      r = s_f - 1
    if not (split_out or split_in):
      continue
    ticket_out, ticket_in, buf = fresh(None), fresh(None), fresh(st.var)
    start = Step(StepKind.OFFLOAD_START, st.anchor, (st.inputs[0],), (ticket_out,), var=st.var)
    done_dep = dep_before(q, s_o)
    done = Step(StepKind.OFFLOAD_DONE, anchor_before(q),
                (st.inputs[0], ticket_out) + ((done_dep,) if done_dep is not None else ()),
                (handle,), var=st.var)
    fstart = Step(StepKind.FETCH_START, anchor_before(r + 1), (handle, fetch_dep),
                  (buf, ticket_in), var=st.var)
    fdone = Step(StepKind.FETCH_DONE, fetch.anchor, (buf, ticket_in, fetch.inputs[1]),
                 fetch.outputs, var=st.var)
    if split_out:
      replaced[s_o] = start
      before.setdefault(q, []).append(done)
      pin_before(q, handle, s_f, nbytes)
    else:
      start = done = st
    if split_in:
      before.setdefault(r + 1, []).append(fstart)
      replaced[s_f] = fdone
      pin_before(r + 1, ticket_in, s_f, nbytes)
    else:
      fstart = fdone = fetch
    pending.append((start, done, fstart, fdone, dict(
        var=st.var, nbytes=nbytes, window_bytes=win, offload_cover_bytes=out_cover,
        fetch_cover_bytes=in_cover, offload_budget_bound=out_bound,
        fetch_budget_bound=in_bound)))
  new_steps: list[Step] = []
  index: dict[int, int] = {}
  for i in range(n + 1):
    for extra_step in before.get(i, ()):
      index[id(extra_step)] = len(new_steps)
      new_steps.append(extra_step)
    if i < n:
      step = replaced.get(i, steps[i])
      if i in renamed:
        step = dataclasses.replace(step, inputs=tuple(
            renamed[i].get(x, x) if isinstance(x, int) else x for x in step.inputs))
      index[id(step)] = len(new_steps)
      new_steps.append(step)
  windows = tuple(CopyWindow(offload_start=index[id(a)], offload_done=index[id(b)],
                             fetch_start=index[id(c)], fetch_done=index[id(d)], **info)
                  for a, b, c, d, info in pending)
  return Schedule(sched.program, tuple(new_steps), tuple(value_var), sched.outputs, "async",
                  windows)
