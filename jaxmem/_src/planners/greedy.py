"""The first planner: greedy over the peak, ranked by area of absence.

While the estimated peak is above the target:

1. candidates (AutoSwap, Zhang et al. §IV-A): values at least ``min_bytes`` large
   whose idle gap between two consecutive uses spans the current peak;
2. ranking (AutoSwap §IV-B, AOA): bytes x length of the gap, the "area of
   absence" removed from under the memory curve, with the gap measured in
   program positions rather than seconds;
3. action: recompute the value just before its next use (remat) when a short
   chain of ops rebuilds it from values that are live there anyway and that is
   cheaper on ``device`` than a round trip to host (both priced by the
   simulator's calibrated model, :class:`~jaxmem._src.planners.common.Pricer`);
   otherwise stage it to host
   after its last use and fetch it back just before the next one (vDNN, paper
   004 §3.3: offload a feature map once its forward consumers are done,
   prefetch it for its backward consumer);
4. re-price the schedule and repeat.

Kept activations produced by cheap elementwise ops are *pinned* (Layrub §4.2,
memory-efficient ReLU: keep the 1-byte mask, not the float activation it was
computed from), see :func:`~jaxmem._src.planners.common.pins` and
:func:`~jaxmem._src.plan.schedule.build_schedule`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Literal

from jaxmem._src import _compat
from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, DeviceProfile, device_profile
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window, build_schedule
from jaxmem._src.planners.chains import ChainState, find_chain
from jaxmem._src.planners.common import Pricer, candidate_vars, never_worse_than_none, pins

#: ``rank=`` values of :func:`greedy`.
RANKS = ("area", "cost")
Rank = Literal["area", "cost"]


def _decide(state: ChainState, program: AnalyzedProgram, vid: int, a: int, b: int,
            pricer: Pricer, max_chain: int,
            allow_remat: bool, allow_offload: bool) -> Decision | None:
  """Remat or offload of ``vid`` over the gap ``(a, b)``, whichever is cheaper on the device.

  Both are priced by the simulator's model (:class:`~jaxmem._src.planners.common.Pricer`):
  a recompute at its ops' times, an offload at its two copies' times.
  """
  v = program.vars[vid]
  offload_ok = allow_offload and _compat.is_plain_array_aval(v.aval)
  offload_cost = pricer.offload_seconds(v.nbytes)
  chain = find_chain(state, vid, b, max_chain) if allow_remat else None
  remat_cost = pricer.remat_seconds(chain) if chain else float("inf")
  if chain and (not offload_ok or remat_cost <= offload_cost):
    return Decision(vid, Action.REMAT, a, b, chain, v.nbytes, remat_cost)
  if offload_ok:
    return Decision(vid, Action.OFFLOAD, a, b, (), v.nbytes, offload_cost)
  return None


@without_gc
@never_worse_than_none
def greedy(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
           copies: CopyMode = "sync", window: Window = None,
           min_bytes: int | None = None, max_chain: int = 8,
           allow_remat: bool = True, allow_offload: bool = True,
           initial: Iterable[Decision] = (), rank: Rank = "area",
           pinned: bool = True, max_cost_s: float = float("inf"),
           xla_lifetimes: bool = False) -> Plan:
  """Greedy remat/offload plan aiming at an estimated peak of ``budget_bytes``.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak in bytes.
    device: device profile name or :class:`jaxmem.DeviceProfile` used to price
      remat (FLOPs) against offload (host copies); default: current backend.
    min_bytes: ignore values smaller than this (default: 0.1% of the peak).
    max_chain: most ops one remat may re-execute.
    allow_remat, allow_offload: restrict the actions.
    copies: ``"sync"`` or ``"async"``: how offloads are scheduled. The plan is
      priced with that schedule, so asynchronous windows (which keep sources
      and destinations allocated longer) count against the target and never
      push the estimate over it (Hayakawa et al. §3).
    window: the asynchronous copies' window (see :class:`jaxmem.Plan`).
    initial: decisions to start from (another planner's), kept as they are.
    rank: how the values spanning the peak are ordered. ``"area"`` (AutoSwap's
      area of absence, bytes x gap) frees the largest, longest-idle values
      first, whatever they cost; ``"cost"`` frees first the values whose
      remat or offload costs the least time per byte freed: selective
      recomputation (Korthikanti et al., *Reducing Activation Recomputation
      in Large Transformer Models*, §4.2), which recomputes a transformer's
      attention scores, softmax and dropout masks (large, cheap to rebuild
      from the kept queries and keys) and keeps the matmul outputs (small
      for their FLOPs). Where the paper picks those values by hand for one
      architecture, this ranks every value by the simulator's price of its
      recomputation chain, so it applies to any model.
    pinned: start from Layrub's pins (:func:`~jaxmem._src.planners.common.pins`);
      ``False`` plans and estimates without them.
    max_cost_s: give up once the decisions it added (to ``initial``) cost
      more than this, priced as ranked (their ``cost_s``): the plan returned
      is the last one estimated, over the target (a caller's bound on what a
      plan may cost to be of use; selective recomputation passes it).

  Returns:
    A :class:`jaxmem.Plan`. Its ``estimated_peak_bytes`` may stay above the
    target when nothing live at the peak can be freed.
  """
  dev = device_profile(device)
  initial = tuple(initial)
  # Planners ask for the same greedy plan more than once (`auto` runs greedy,
  # then segments falls back to greedy alone for the same budget): it is
  # deterministic, so each is searched once per program. Measured on an
  # unrolled LSTM (64 steps): 8 greedy searches of about 2.4 s in one `fit`.
  try:
    key: tuple[object, ...] | None = (int(budget_bytes), dev, copies, window, min_bytes,
                                      max_chain, allow_remat, allow_offload, initial, rank, pinned,
                                      max_cost_s, xla_lifetimes)
    hash(key)
  except TypeError:        # an unhashable `window`: `build_schedule` names it below
    key = None
  found = program.__dict__.setdefault("_greedy_plans", {}).get(key) if key else None
  if found is not None:
    return found
  if rank not in RANKS:
    raise ValueError(f"`greedy`: `rank={rank!r}` is not one of {RANKS}.")
  plan = _greedy(program, budget_bytes, dev, copies, window, min_bytes, max_chain, allow_remat,
                 allow_offload, initial, rank, pinned, max_cost_s, xla_lifetimes)
  if key is not None:
    program.__dict__["_greedy_plans"][key] = plan
  return plan


def _greedy(program: AnalyzedProgram, budget_bytes: int, dev: DeviceProfile, copies: CopyMode,
            window: Window, min_bytes: int | None, max_chain: int, allow_remat: bool,
            allow_offload: bool, initial: tuple[Decision, ...], rank: Rank,
            pinned: bool, max_cost_s: float = float("inf"),
            xla_lifetimes: bool = False) -> Plan:
  """:func:`greedy`, not cached."""
  unplanned = program.profile.peak_bytes
  if min_bytes is None:
    min_bytes = max(1, unplanned // 1000)
  state = ChainState(program, xla_lifetimes)
  for d in initial:
    state.add(d)
  pricer = Pricer(program, dev)

  candidates = candidate_vars(program, min_bytes)
  rejected: set[tuple[int, int, int]] = set()
  pinned_vars = pins(program) if pinned else ()
  sched_opts = dict(copies=copies, window=window, budget=int(budget_bytes))
  schedule = build_schedule(program, tuple(state.decisions), pinned_vars, **sched_opts)
  prof = schedule.profile()
  added_s = 0.0                  # what the decisions added to `initial` cost, as priced
  estimated = tuple(state.decisions)
  while prof.peak_bytes > budget_bytes:
    peak_anchor = schedule.anchor_of(prof.peak_index)
    spanning: list[tuple[float, int, int, int]] = []
    for vid in candidates:
      ev = state.events(vid)
      j = bisect.bisect_left(ev, peak_anchor)
      if j == 0 or j >= len(ev):
        continue
      a, b = ev[j - 1], ev[j]
      if not (a + 0.5 < peak_anchor < b - 0.5) or (vid, a, b) in rejected:
        continue
      if (a, b) in state.gaps.get(vid, ()):
        continue
      spanning.append((float(program.vars[vid].nbytes) * (b - a), vid, a, b))
    if not spanning:
      break
    if rank == "cost":
      # Seconds per byte freed (ascending): the cheapest bytes first.
      priced = []
      for _, vid, a, b in spanning:
        d = _decide(state, program, vid, a, b, pricer, max_chain, allow_remat, allow_offload)
        if d is None:
          rejected.add((vid, a, b))
        else:
          priced.append((-d.cost_s / max(d.nbytes, 1), vid, a, b))
      spanning = priced
    # Take the best gaps at this peak until they cover the excess, then re-price
    # once: the schedule is rebuilt per batch, not per decision.
    spanning.sort(reverse=True)
    excess = prof.peak_bytes - budget_bytes
    freed = 0
    for _, vid, a, b in spanning:
      if freed >= excess:
        break
      ev = state.events(vid)
      j = bisect.bisect_left(ev, b)
      if j == 0 or ev[j - 1] != a or j >= len(ev) or ev[j] != b:
        continue  # an earlier remat in this batch added a use inside the gap
      d = _decide(state, program, vid, a, b, pricer, max_chain, allow_remat, allow_offload)
      if d is None:
        rejected.add((vid, a, b))
        continue
      state.add(d)
      freed += d.nbytes
      added_s += d.cost_s
    if not freed:
      continue
    if added_s > max_cost_s:
      # Over the caller's bound: the plan estimated last, not this batch.
      return Plan(program, estimated, int(budget_bytes), prof.peak_bytes, unplanned, "greedy",
                  pinned_vars, copies, window)
    schedule = build_schedule(program, state.decisions, pinned_vars, **sched_opts)
    prof = schedule.profile()
    estimated = tuple(state.decisions)
  return Plan(program, tuple(state.decisions), int(budget_bytes), prof.peak_bytes, unplanned,
              "greedy", pinned_vars, copies, window)
