"""Pieces every planner shares: candidate gaps, recompute chains, pricing, the finished plan.

A *gap* of a variable is the stretch between two consecutive events (its
definition, its uses) during which nothing reads it: the only stretch a keep /
remat / offload decision can free. The planners differ in which gaps they pick
and how; they all turn picks into :class:`~jaxmem._src.plan.Decision` objects
here, price them with the simulator's op times
(:mod:`jaxmem._src.plan.simulate`), and finish with the same schedule
estimate, so their plans compare like for like.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from jaxmem._src import _compat
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.ir import primitives
from jaxmem._src.ir.primitives import Fusion
from jaxmem._src.ir.program import Phase, Role
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Schedule, StepKind, Window, build_schedule
from jaxmem._src.planners.chains import ChainState, find_chain

CANDIDATE_ROLES = frozenset({Role.ACTIVATION, Role.TEMPORARY, Role.GRADIENT})

F = TypeVar("F", bound=Callable[..., Plan])


@dataclasses.dataclass(frozen=True)
class Gap:
  """An idle stretch ``(start, end)`` of variable ``var`` (program positions of two events).

  Attributes:
    var: variable id.
    start: the event before the gap (definition or use).
    end: the next use; a restore must happen before it.
    nbytes: bytes freed while the gap lasts.
    forward_to_backward: ``start`` is in the forward pass and ``end`` in the
      backward pass (a feature map saved for backward, what vDNN/Layrub move).
  """
  var: int
  start: int
  end: int
  nbytes: int
  forward_to_backward: bool

  @property
  def length(self) -> int:
    return self.end - self.start


def candidate_vars(program: AnalyzedProgram, min_bytes: int = 1) -> list[int]:
  """Values a plan may drop: activations, gradients and temporaries, not arguments or results."""
  return [v.id for v in program.vars
          if v.role in CANDIDATE_ROLES and not v.is_input and not v.is_output
          and v.nbytes >= min_bytes and v.uses]


def gaps_of(program: AnalyzedProgram, vid: int) -> list[Gap]:
  """Every gap of ``vid`` at least two positions long (something runs inside it)."""
  v = program.vars[vid]
  events = sorted({v.defined_by, *v.uses})
  out = []
  for a, b in zip(events, events[1:]):
    if b - a < 2:
      continue
    fb = (program.ops[a].phase is not Phase.BACKWARD
          and program.ops[b].phase is Phase.BACKWARD)
    out.append(Gap(vid, a, b, v.nbytes, fb))
  return out


def candidate_gaps(program: AnalyzedProgram, min_bytes: int = 1) -> list[Gap]:
  """All gaps of all candidate values."""
  return [g for vid in candidate_vars(program, min_bytes) for g in gaps_of(program, vid)]


def frees_over_gap(program: AnalyzedProgram, gap: Gap, pinned: Sequence[int] = ()) -> bool:
  """Does dropping ``gap.var`` over the gap free its bytes in the compiled program?

  Not when a consumer XLA fuses away (a cheap or single-use elementwise op)
  read it before the gap and is itself consumed after the gap starts: the
  fused kernel reads the original buffer there, so XLA keeps it alive whatever
  the plan does with later uses. Pinned values are materialized, not fused.
  """
  prof = program.profile
  if prof.virtual is None or prof.intervals is None:
    return True
  pinned_set = set(pinned)
  stack = [gap.var]
  seen = set()
  while stack:
    x = stack.pop()
    for u in program.vars[x].uses:
      if u > gap.start:
        continue
      for w in program.ops[u].outputs:
        if w in seen or not prof.virtual[w] or w in pinned_set:
          continue
        seen.add(w)
        if prof.intervals[w][1] > gap.start:
          return False
        stack.append(w)
  return True


def freed_bytes(program: AnalyzedProgram, gap: Gap, pinned: Sequence[int] = ()) -> int:
  """Bytes the estimate frees inside ``gap`` when ``gap.var`` is dropped over it.

  A stored value frees its own bytes. A value XLA fuses away stores nothing,
  but its stored inputs are kept alive for it (through other fused values)
  until its consumer after the gap; dropping it materializes it at the
  gap's start and lets those inputs go, if nothing else reads them later.
  """
  prof = program.profile
  if prof.virtual is None or not prof.virtual[gap.var] or gap.var in set(pinned):
    return gap.nbytes
  freed, stack, seen = 0, [gap.var], {gap.var}
  while stack:
    w = stack.pop()
    for y in program.ops[program.vars[w].defined_by].input_ids():
      if y in seen:
        continue
      seen.add(y)
      v = program.vars[y]
      if v.is_input or program.constant_like[y]:
        continue
      if prof.virtual[y]:
        stack.append(y)
        continue
      if max(v.uses) <= gap.start and prof.intervals[y][1] <= gap.end:
        freed += v.nbytes
  return freed


def recompute_chain(program: AnalyzedProgram, vid: int, pos: int,
                    max_ops: int = 8) -> tuple[int, ...] | None:
  """Ops that rebuild ``vid`` just before ``pos`` from values still live there (no other plan)."""
  return find_chain(ChainState(program), vid, pos, max_ops)


def chain_inputs(program: AnalyzedProgram, chain: Sequence[int]) -> set[int]:
  """Values a recompute chain reads that it does not make itself."""
  made = {o for k in chain for o in program.ops[k].outputs}
  return {x for k in chain for x in program.ops[k].input_ids() if x not in made}


class Pricer:
  """Extra step time of a decision on a device, from the simulator's per-op times."""

  def __init__(self, program: AnalyzedProgram, device: DeviceLike):
    self.program = program
    self.device = device_profile(device)
    # The simulator's per-op times (fused ops cost their arithmetic only):
    # planners and the simulator price alike.
    self._op_s = program.op_seconds(self.device)

  def op_seconds(self, k: int) -> float:
    return float(self._op_s[k])

  def remat_seconds(self, chain: Sequence[int]) -> float:
    return sum(self.op_seconds(k) for k in chain)

  def copy_seconds(self, nbytes: int) -> float:
    """One direction of an offload (device to host, or back)."""
    return self.device.copy_seconds(nbytes)

  def offload_seconds(self, nbytes: int) -> float:
    """Both copies of an offload, as synchronous copies cost them (an upper bound)."""
    return 2.0 * self.copy_seconds(nbytes)


def remat_decision(program: AnalyzedProgram, gap: Gap, pricer: Pricer,
                   max_ops: int = 8) -> Decision | None:
  chain = recompute_chain(program, gap.var, gap.end, max_ops)
  if not chain:
    return None
  return Decision(gap.var, Action.REMAT, gap.start, gap.end, chain, gap.nbytes,
                  pricer.remat_seconds(chain))


def offload_decision(program: AnalyzedProgram, gap: Gap, pricer: Pricer) -> Decision | None:
  if not _compat.is_plain_array_aval(program.vars[gap.var].aval):
    return None
  return Decision(gap.var, Action.OFFLOAD, gap.start, gap.end, (), gap.nbytes,
                  pricer.offload_seconds(gap.nbytes))


def pins(program: AnalyzedProgram) -> tuple[int, ...]:
  """Activations to materialize right after their definition (Layrub §4.2's memory-efficient ReLU).

  XLA would fuse a cheap producer into the backward consumer and keep the
  producer's inputs alive instead; pinning pays when the value is at most half
  the size of those inputs (a 1-byte ReLU mask of a 4-byte float). Values XLA
  stores anyway (:attr:`~jaxmem._src.ir.primitives.Fusion.MATERIALIZED`
  producers: matmuls, convolutions, custom calls, control flow) gain nothing
  from a pin.
  """
  found = _PINS.get(program)
  if found is None:
    found = _PINS[program] = _pins(program)
  return found


# Every plan of a program starts from the same pins (planners ask for them at
# each estimate): computed once per program, dying with it.
_PINS: weakref.WeakKeyDictionary[AnalyzedProgram, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _pins(program: AnalyzedProgram) -> tuple[int, ...]:
  out = []
  for v in program.vars:
    if (v.role is not Role.ACTIVATION
        or primitives.facts(program.ops[v.defined_by].primitive).fusion is Fusion.MATERIALIZED):
      continue
    ins = [program.vars[x] for x in program.ops[v.defined_by].input_ids()]
    source_bytes = sum(x.nbytes for x in ins if not x.is_input)
    if 2 * v.nbytes <= source_bytes:
      out.append(v.id)
  return tuple(out)


def position_profile(program: AnalyzedProgram, decisions: Sequence[Decision] = (),
                     pinned: Sequence[int] = ()) -> tuple[np.ndarray, int]:
  """Estimated live bytes just at each op position (compute steps only), and the peak."""
  schedule = build_schedule(program, tuple(decisions), tuple(pinned))
  return live_by_position(schedule), schedule.profile().peak_bytes


def live_by_position(schedule: Schedule) -> np.ndarray:
  """Estimated live bytes at each op position of ``schedule``'s program (its compute steps only)."""
  prof = schedule.profile()
  out = np.zeros(schedule.program.num_ops, dtype=np.int64)
  for i, st in enumerate(schedule.steps):
    if st.kind is StepKind.COMPUTE and not st.recompute:
      out[st.op] = max(out[st.op], prof.live_bytes[i])
  return out


def finish(program: AnalyzedProgram, decisions: Iterable[Decision], budget_bytes: int, name: str,
           pinned: Sequence[int] | None = None, *, copies: CopyMode = "sync",
           window: Window = None) -> Plan:
  """The plan of ``decisions`` with its estimated peak (same estimator for every planner)."""
  decisions = tuple(decisions)
  pinned = pins(program) if pinned is None else tuple(pinned)
  plan = Plan(program, decisions, int(budget_bytes), 0, program.profile.peak_bytes, name, pinned,
              copies, window)
  # What the estimated peak depends on: the decisions and pins, and for a
  # plan with copies how they are scheduled (asynchronous windows depend on
  # the budget); a remat-only plan's schedule is the same in either mode.
  offloads = any(d.action is Action.OFFLOAD for d in decisions)
  key = (decisions, pinned, *((copies, window, budget_bytes if copies == "async" else None)
                              if offloads else ()))
  memo = program.__dict__.setdefault("_estimated_peaks", {})
  peak = memo.get(key)
  if peak is None:
    peak = plan.schedule().profile().peak_bytes
    if len(memo) >= _ESTIMATED_PEAKS:
      memo.pop(next(iter(memo)))
    memo[key] = peak
  return plan.replace(estimated_peak_bytes=peak)


# Estimated peaks of the plans `finish` priced, per program, by what their
# schedule is built from (an int each, unlike the schedules
# `build_schedule` keeps, the last 16 of a few MiB each). The searches
# estimate the same plans again: every segment search (`auto`'s, then one
# per share of selective recomputation) starts from each segmentation's
# whole prefix, where no pin is left, and `fit` plans the same program for
# several targets. Oldest out first.
_ESTIMATED_PEAKS = 4096


@dataclasses.dataclass(frozen=True)
class NoBetterThanNone:
  """Diagnostics of a plan replaced by the step as written (:func:`never_worse_than_none`).

  Attributes:
    planner: the planner whose plan it was.
    estimated_peak_bytes: that plan's estimated peak.
    unplanned_peak_bytes: the estimated peak of the step as written, which it
      did not go below.
    decisions: how many decisions it had.
  """
  planner: str
  estimated_peak_bytes: int
  unplanned_peak_bytes: int
  decisions: int

  def __str__(self) -> str:
    return (f"{self.planner}'s plan ({self.decisions} decisions) was estimated at "
            f"{self.estimated_peak_bytes:,} B, not below the step as written "
            f"({self.unplanned_peak_bytes:,} B): no plan returned instead")


def never_worse_than_none(planner: F) -> F:
  """Makes ``planner`` return no decisions where its plan would not lower the estimated peak.

  A plan whose decisions (or pins) leave the estimated peak at or above the
  step as written only costs time: recomputed values XLA would have fused
  become buffers, pins store values it would not. Measured on 36 small MLP
  train steps generated by ``bench/checkmate_gap.py`` at five budgets
  (0.9-0.5 of the estimate, ``h100-sxm``): 20 of 180 ``greedy`` plans, 20
  ``segments``, 30 ``selective``, 71 ``optimal``, 40 each of ``vdnn``,
  ``layrub`` and ``autoswap`` and 18 ``window`` plans were estimated at or
  above the unplanned peak (a GELU MLP at 0.9: ``greedy-remat`` at 1.21x for +68%
  simulated time). The plan returned instead has no decisions and no pins,
  the planner's name, and its diagnostics followed by a
  :class:`NoBetterThanNone`. Whether a plan that does lower the peak but
  misses the budget is kept is the caller's choice (``fit`` tightens the
  target or raises ``BudgetError``).
  """
  @functools.wraps(planner)
  def planned(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None,
              **options: Any) -> Plan:
    plan = planner(program, budget_bytes, device, **options)
    unplanned = program.profile.peak_bytes
    if not (plan.decisions or plan.pinned) or plan.estimated_peak_bytes < unplanned:
      return plan
    none = finish(program, (), budget_bytes, plan.planner, (), copies=plan.copies,
                  window=plan.window)
    return none.replace(diagnostics=(*plan.diagnostics, NoBetterThanNone(
        plan.planner, plan.estimated_peak_bytes, unplanned, len(plan.decisions))))
  return planned  # type: ignore[return-value]


def forward_heavy_ops(program: AnalyzedProgram) -> list[int]:
  """Forward matmuls and convolutions: the "layers" of vDNN and Layrub (one heavy op each)."""
  return [op.index for op in program.ops
          if primitives.facts(op.primitive).matrix_unit and op.phase is Phase.FORWARD]


def residual_gaps(program: AnalyzedProgram, min_bytes: int = 1) -> list[Gap]:
  """The gap of every value saved for the backward pass: last forward use to first backward use."""
  out = []
  for vid in candidate_vars(program, min_bytes):
    for g in gaps_of(program, vid):
      if g.forward_to_backward and _compat.is_plain_array_aval(program.vars[vid].aval):
        out.append(g)
        break
  return out


def device_window(device: DeviceLike) -> float:
  """A window (a multiple of the bytes copied) that covers a copy's time with computation.

  ``async_copies`` counts a window in bytes computed; on a device that
  computes ``M`` bytes/s and copies ``B`` bytes/s, covering a copy of ``N``
  bytes takes about ``N * M / B`` bytes of memory-bound computation.
  """
  dev = device_profile(device)
  stream = dev.stream_bytes_per_s
  if not stream:
    return 1.0
  return max(1.0, stream / dev.copy_bytes_per_s)
