"""The first planner: greedy over the peak, ranked by area of absence.

While the estimated peak is above the target:

1. candidates (AutoSwap, paper 003 §IV-A): values at least ``min_bytes`` large
   whose idle gap between two consecutive uses spans the current peak;
2. ranking (AutoSwap §IV-B, AOA): bytes x length of the gap, the "area of
   absence" removed from under the memory curve, with the gap measured in
   program positions rather than seconds (the cost model comes with issue 5);
3. action: recompute the value just before its next use (remat) when a short
   chain of ops rebuilds it from values that are live there anyway and that is
   cheaper on ``device`` than a round trip to host; otherwise stage it to host
   after its last use and fetch it back just before the next one (vDNN, paper
   004 §3.3: offload a feature map once its forward consumers are done,
   prefetch it for its backward consumer);
4. re-price the schedule and repeat.

Kept activations produced by cheap elementwise ops are *pinned* (Layrub,
paper 002 §4.2, memory-efficient ReLU: keep the 1-byte mask, not the float
activation it was computed from), see ``schedule.build_schedule``.
"""

from __future__ import annotations

import bisect
from typing import Any

from jaxmem._src import _compat, cost
from jaxmem._src.plan import Action, Decision, Plan
from jaxmem._src.schedule import build_schedule
from jaxmem._src.trace import Role

# Primitives never re-executed by a remat: effects, opaque blocks, our own ops.
_NO_REMAT = {"scan", "while", "cond", "checkpoint", "remat", "remat2", "ffi_call", "custom_call",
             "pure_callback", "io_callback", "debug_callback", "shard_map", "rng_uniform",
             "random_seed", "random_bits", "random_wrap", "random_unwrap"}
# Results XLA always materializes (never duplicated into consumers by fusion).
_MATERIALIZED = {"dot_general", "conv_general_dilated", "ffi_call", "custom_call", "scan",
                 "while", "cond", "checkpoint", "remat2", "reduce_window_max",
                 "reduce_window_sum", "reduce_window"}
_CANDIDATE_ROLES = {Role.ACTIVATION, Role.TEMPORARY, Role.GRADIENT}


class _State:
  """Decisions so far plus the events (def, uses) they add to each variable."""

  def __init__(self, program: Any):
    self.program = program
    self.decisions: list[Decision] = []
    self.extra_uses: dict[int, list[int]] = {}
    self.gaps: dict[int, list[tuple[int, int]]] = {}

  def events(self, vid: int) -> list[int]:
    v = self.program.vars[vid]
    ev = sorted({v.defined_by, *v.uses, *self.extra_uses.get(vid, ())})
    return ev

  def available(self, vid: int, pos: int) -> bool:
    """Can a value of ``vid`` be read just before op ``pos`` without extending its life?"""
    v = self.program.vars[vid]
    if v.is_input:
      return True
    ev = self.events(vid)
    if not (v.defined_by < pos <= ev[-1] or v.is_output and v.defined_by < pos):
      return False
    return not any(a < pos <= b for a, b in self.gaps.get(vid, ()))

  def add(self, d: Decision) -> None:
    self.decisions.append(d)
    self.gaps.setdefault(d.var, []).append((d.start, d.end))
    # A restore before the next use (a segment's shared restore point) is an
    # event of the value: it exists again from there.
    if d.end not in self.program.vars[d.var].uses:
      lst = self.extra_uses.setdefault(d.var, [])
      if d.end not in lst:
        bisect.insort(lst, d.end)
    if d.action is Action.REMAT:
      made = {o for k in d.recompute for o in self.program.ops[k].outputs}
      for k in d.recompute:
        for x in self.program.ops[k].input_ids():
          if x not in made:
            lst = self.extra_uses.setdefault(x, [])
            if d.end not in lst:
              bisect.insort(lst, d.end)


def pins(program: Any) -> tuple[int, ...]:
  """Activations to materialize right after their definition (Layrub §4.2).

  XLA would fuse a cheap producer into the backward consumer and keep the
  producer's inputs alive instead; pinning pays when the value is at most half
  the size of those inputs (a 1-byte ReLU mask of a 4-byte float).
  """
  out = []
  for v in program.vars:
    if v.role is not Role.ACTIVATION or program.ops[v.defined_by].primitive in _MATERIALIZED:
      continue
    ins = [program.vars[x] for x in program.ops[v.defined_by].input_ids()]
    source_bytes = sum(x.nbytes for x in ins if not x.is_input)
    if 2 * v.nbytes <= source_bytes:
      out.append(v.id)
  return tuple(out)


def _rematerializable(program: Any) -> list[bool]:
  """Per op: may a remat re-execute it (no effects, no body, not one of ``_NO_REMAT``)."""
  cached = program.__dict__.get("_rematerializable")
  if cached is None:
    cached = [not (op.primitive in _NO_REMAT or op.eqn.effects or _compat.sub_jaxprs(op.eqn))
              for op in program.ops]
    program.__dict__["_rematerializable"] = cached
  return cached


def find_chain(state: _State, vid: int, pos: int, max_ops: int = 8,
               made: set[int] | None = None) -> tuple[int, ...] | None:
  """Ops that rebuild ``vid`` just before ``pos`` from values available there.

  ``made``: ops another chain restored at ``pos`` runs already (they are not
  repeated; the union runs once, see ``schedule.build_schedule``). The ops
  this chain adds are added to it.
  """
  prog = state.program
  ok = _rematerializable(prog)
  chain: list[int] = []
  seen: set[int] = set(made) if made else set()
  budget = len(seen) + max_ops

  def need(x: int, force: bool = False) -> bool:
    v = prog.vars[x]
    if not force and state.available(x, pos):
      return True
    if v.is_input:
      return True
    k = v.defined_by
    if k in seen:
      return True
    if not ok[k]:
      return False
    if len(seen) >= budget:   # bound the ops entered, so the recursion is bounded too
      return False
    seen.add(k)
    for y in prog.ops[k].input_ids():
      if not need(y):
        return False
    chain.append(k)
    return True

  if not need(vid, force=True):
    return None
  if made is not None:
    made.update(chain)
  return tuple(chain)


def _decide(state: _State, program: Any, vid: int, a: int, b: int, dev: Any, op_flops: Any,
            max_chain: int, allow_remat: bool, allow_offload: bool) -> Decision | None:
  """Remat or offload of ``vid`` over the gap ``(a, b)``, whichever is cheaper on ``dev``."""
  v = program.vars[vid]
  offload_ok = allow_offload and _compat.is_plain_array_aval(v.aval)
  offload_cost = 2.0 * v.nbytes / dev.host_bytes_per_s
  chain = find_chain(state, vid, b, max_chain) if allow_remat else None
  remat_cost = sum(op_flops(k) for k in chain) / dev.flops_per_s if chain else float("inf")
  if chain and (not offload_ok or remat_cost <= offload_cost):
    return Decision(vid, Action.REMAT, a, b, chain, v.nbytes, remat_cost)
  if offload_ok:
    return Decision(vid, Action.OFFLOAD, a, b, (), v.nbytes, offload_cost)
  return None


def greedy(program: Any, budget_bytes: int, device: Any = None, *,
           min_bytes: int | None = None, max_chain: int = 8,
           allow_remat: bool = True, allow_offload: bool = True,
           copies: str = "sync", window: int | float | None = None,
           initial: Any = ()) -> Plan:
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
      push the estimate over it (paper 001 §3).
    window: the asynchronous copies' window (see :class:`jaxmem.Plan`).
    initial: decisions to start from (another planner's), kept as they are.

  Returns:
    A :class:`jaxmem.Plan`. Its ``estimated_peak_bytes`` may stay above the
    target when nothing live at the peak can be freed.
  """
  dev = cost.device_profile(device)
  unplanned = program.profile.peak_bytes
  if min_bytes is None:
    min_bytes = max(1, unplanned // 1000)
  state = _State(program)
  for d in initial:
    state.add(d)
  flops_cache: dict[int, float] = {}

  def op_flops(k: int) -> float:
    if k not in flops_cache:
      flops_cache[k] = cost.eqn_flops(program.ops[k].eqn)
    return flops_cache[k]

  candidates = [v.id for v in program.vars
                if v.role in _CANDIDATE_ROLES and not v.is_input and not v.is_output
                and v.nbytes >= min_bytes and v.uses]
  rejected: set[tuple[int, int, int]] = set()
  pinned = pins(program)
  sched_opts = dict(copies=copies, window=window, budget=int(budget_bytes))
  schedule = build_schedule(program, tuple(state.decisions), pinned, **sched_opts)
  prof = schedule.profile()
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
      d = _decide(state, program, vid, a, b, dev, op_flops, max_chain, allow_remat, allow_offload)
      if d is None:
        rejected.add((vid, a, b))
        continue
      state.add(d)
      freed += d.nbytes
    if not freed:
      continue
    schedule = build_schedule(program, state.decisions, pinned, **sched_opts)
    prof = schedule.profile()
  return Plan(program, tuple(state.decisions), int(budget_bytes), prof.peak_bytes, unplanned,
              "greedy", pinned, copies, window)
