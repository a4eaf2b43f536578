"""A planned host layout: the offline allocation of a schedule's host buffers.

Every value a plan offloads takes host memory from its offload (or
offload_start) to the end of its fetch (the fetch_done: the host buffer is
read until then), and the schedule says when each of these happens. That is
an instance of offline dynamic storage allocation, which SmartPool (Zhang et
al., *Efficient Memory Management for GPU-based Deep Learning Systems*, §III)
solves before the step runs so that one buffer of the smallest footprint holds
every host copy at a static offset: no allocator work per step, and no
fragmentation (its §III-A). :func:`host_layout` builds the instance, solves it
with :func:`jaxmem.dsa.solve` and registers the layout with the native host
store under a fresh key; the ``ffi`` backend then offloads each value into its
slot (``offload(x, slot=(key, slot))``).

Departure from SmartPool: SmartPool lays out device memory from a profiled
iteration; here it is the host memory of planned offloads, with lifetimes from
the schedule. XLA may run copies that do not depend on each other in another
order than the schedule's, or at once, so the ``ffi`` backend makes each copy
that reuses bytes of earlier slots wait for their frees (:func:`reuse_waits`;
ordering every copy after the one before raised a step's compiled peak by up
to 18%), and :func:`compiled_lifetimes` reads the order back from the compiled
program to check it. A slot that would still overlap a live one at run time is served by
the store's arena instead, counted in ``store_plan_stats(key)["fallbacks"]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import weakref

import numpy as np

from jaxmem._src.native import dsa
from jaxmem._src.native import store
from jaxmem._src.plan.schedule import Schedule, StepKind

#: Every slot starts at a multiple of this (the host store's alignment).
ALIGNMENT = 64
#: The layout's solve stops here (seconds): it runs at every lowering of a plan (`fit`
#: compiles several), and schedules' host buffers nest, so best-fit or the decision search
#: usually reach the max load at once.
SOLVE_SECONDS = 0.25

_KEYS = itertools.count(1)
# One registered layout per schedule object (a plan's schedule is built once:
# `Plan.schedule()`), so that the layout a step ran with can be looked up.
_LAYOUTS: weakref.WeakKeyDictionary[Schedule, HostLayout | None] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class HostLayout:
  """Static host offsets of a schedule's offloads, registered with the host store.

  Attributes:
    key: the plan key the layout is registered under (``offload``'s ``slot``
      attribute carries it; :func:`jaxmem.native.store_plan_stats`).
    slots: step index of each offload (or offload_start) -> its slot.
    lower, upper: each slot's lifetime, in step indices (half-open).
    nbytes: each slot's bytes.
    offsets: each slot's offset in the planned buffer.
    footprint: bytes of the planned buffer.
    max_load: most host bytes live at one step (aligned): no layout is
      smaller; ``footprint == max_load`` is an optimal layout.
    frees: step index of each fetch (or fetch_done) -> the slot it frees.
    waits: per slot, the slots whose bytes it reuses: freed earlier in the
      schedule, their bytes overlap its own. Its copy must wait for their
      frees (:func:`reuse_waits`); the ``ffi`` backend orders it after them.
  """
  key: int
  slots: dict[int, int]
  lower: np.ndarray
  upper: np.ndarray
  nbytes: np.ndarray
  offsets: np.ndarray
  footprint: int
  max_load: int
  frees: dict[int, int] = dataclasses.field(default_factory=dict)
  waits: tuple[tuple[int, ...], ...] = ()


def host_layout(schedule: Schedule) -> HostLayout | None:
  """The planned layout of ``schedule``'s host buffers, registered; None without offloads.

  Solved and registered once per schedule object: later calls return the
  same layout (the one the ``ffi`` backend's step uses).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def step(x):
    ...   h = jnp.sin(x) * 2
    ...   return (jnp.cos(h) + h).sum()
    >>> plan = jaxmem.plan(jax.grad(step), jnp.ones((512, 512)), planner="vdnn", budget=0.5)
    >>> layout = host_layout(plan.schedule())
    >>> layout is None or layout.footprint == layout.max_load
    True
  """
  if schedule in _LAYOUTS:
    return _LAYOUTS[schedule]
  layout = _solve(schedule)
  _LAYOUTS[schedule] = layout
  if layout is not None:
    # The layout (and its buffer) goes when the schedule does.
    weakref.finalize(schedule, store.store_unregister_plan, layout.key)
  return layout


def _solve(schedule: Schedule) -> HostLayout | None:
  steps = schedule.steps
  alloc_of: dict[int, int] = {}   # handle or ticket value -> index of its allocating step
  lower: list[int] = []
  upper: list[int] = []
  nbytes: list[int] = []
  slots: dict[int, int] = {}
  frees: dict[int, int] = {}
  end = len(steps) + 1
  for i, st in enumerate(steps):
    if st.kind in (StepKind.OFFLOAD, StepKind.OFFLOAD_START):
      slots[i] = len(lower)
      alloc_of[st.outputs[0]] = i
      lower.append(i)
      upper.append(end)   # until its fetch, if any
      nbytes.append(schedule.value_bytes(st.inputs[0]))
    elif st.kind is StepKind.OFFLOAD_DONE:
      alloc_of[st.outputs[0]] = alloc_of[st.inputs[1]]   # handle <- ticket
    elif st.kind is StepKind.FETCH:
      frees[i] = slots[alloc_of[st.inputs[0]]]
      upper[frees[i]] = i + 1
    elif st.kind is StepKind.FETCH_START:
      alloc_of[st.outputs[1]] = alloc_of[st.inputs[0]]   # ticket <- handle
    elif st.kind is StepKind.FETCH_DONE:
      frees[i] = slots[alloc_of[st.inputs[1]]]
      upper[frees[i]] = i + 1
  if not lower:
    return None
  size = np.asarray(nbytes, dtype=np.int64)
  aligned = -(-size // ALIGNMENT) * ALIGNMENT
  lo, up = np.asarray(lower, dtype=np.int64), np.asarray(upper, dtype=np.int64)
  sol = dsa.solve(lo, up, aligned, time_limit_s=SOLVE_SECONDS)
  key = next(_KEYS)
  store.store_register_plan(key, slots=range(len(size)), offsets=sol.offsets, sizes=size,
                            footprint=max(sol.footprint, ALIGNMENT))
  return HostLayout(key, slots, lo, up, size, sol.offsets, int(sol.footprint),
                    int(sol.max_load), frees, reuse_waits(lo, up, aligned, sol.offsets))


def reuse_waits(lower: np.ndarray, upper: np.ndarray, nbytes: np.ndarray,
                offsets: np.ndarray) -> tuple[tuple[int, ...], ...]:
  """Per slot, the slots freed before it is taken whose bytes it reuses, fewest that order it.

  A slot must not be taken before every earlier slot sharing a byte with it
  is freed. For each of its bytes, waiting for the last slot freed there is
  enough: two earlier slots sharing that byte were not live together, so the
  later one already waits for the earlier (by the same rule).

  Example:
    >>> reuse_waits(np.array([0, 2, 4]), np.array([2, 4, 6]), np.array([8, 4, 8]),
    ...             np.array([0, 0, 0]))
    ((), (0,), (1, 0))
  """
  waits = []
  for b in range(len(lower)):
    lo_b, hi_b = int(offsets[b]), int(offsets[b] + nbytes[b])
    cand = np.flatnonzero((upper <= lower[b]) & (offsets < hi_b) & (offsets + nbytes > lo_b)
                          & (nbytes > 0))
    kept: list[int] = []
    covered: list[tuple[int, int]] = []
    for a in cand[np.argsort(-upper[cand], kind="stable")]:
      lo, hi = max(lo_b, int(offsets[a])), min(hi_b, int(offsets[a] + nbytes[a]))
      if not _covers(covered, lo, hi):
        kept.append(int(a))
        covered.append((lo, hi))
    waits.append(tuple(kept))
  return tuple(waits)


def _covers(intervals: list[tuple[int, int]], lo: int, hi: int) -> bool:
  """Whether the union of ``intervals`` covers ``[lo, hi)``."""
  at = lo
  for a, b in sorted(intervals):
    if a > at:
      return False
    at = max(at, b)
    if at >= hi:
      return True
  return at >= hi


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*.*?\b(?P<op>custom-call|"
                          r"get-tuple-element|copy|bitcast)\((?P<operands>[^)]*)\)(?P<rest>.*)$")
_TARGET = re.compile(r'custom_call_target="(?:jaxmem_)?(?P<target>\w+)"')
_SLOT = re.compile(r"plan\s*=\s*(?P<plan>-?\d+)\s*:\s*i64,\s*slot\s*=\s*(?P<slot>-?\d+)")
_INDEX = re.compile(r"index=(?P<index>\d+)")


def compiled_lifetimes(layout: HostLayout, hlo_text: str) -> tuple[np.ndarray, np.ndarray] | None:
  """Each slot's lifetime in the compiled program's order, from its scheduled HLO text.

  Positions are the instructions of the entry computation, in the order XLA
  runs them: a slot lives from its ``offload_planned`` (or
  ``offload_start_planned``) to the ``fetch`` (or ``fetch_done``) that reads
  its handle, followed through ``offload_done``, ``fetch_start``,
  ``get-tuple-element`` and XLA's ``copy``. A slot whose fetch is not found lives to the
  end. None when the text has no copy of this layout (another program).
  The layout is valid for the compiled program when no two slots whose
  compiled lifetimes overlap share a byte (``jaxmem.dsa.check``).
  """
  try:
    entry = hlo_text[hlo_text.index("\nENTRY"):]
  except ValueError:
    return None
  lines = entry.splitlines()[1:]
  n = len(lines) + 1
  lower = np.full(len(layout.nbytes), -1, dtype=np.int64)
  upper = np.full(len(layout.nbytes), n, dtype=np.int64)
  slot_of: dict[str, int] = {}     # handle, ticket or tuple name -> slot
  for pos, line in enumerate(lines):
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    name = m["name"]
    operands = [x.strip().lstrip("%") for x in m["operands"].split(",") if x.strip()]
    if m["op"] in ("copy", "bitcast"):
      if operands and operands[0] in slot_of:
        slot_of[name] = slot_of[operands[0]]   # XLA's copy of a handle or ticket
      continue
    if m["op"] == "get-tuple-element":
      index = _INDEX.search(m["rest"])
      if operands and operands[0] in slot_of and index and index["index"] == "1":
        slot_of[name] = slot_of[operands[0]]   # fetch_start's ticket
      continue
    target = _TARGET.search(m["rest"])
    if target is None:
      continue
    kind = target["target"]
    if kind in ("offload_planned", "offload_start_planned"):
      where = _SLOT.search(m["rest"])
      if where and int(where["plan"]) == layout.key:
        slot = int(where["slot"])
        lower[slot] = pos
        slot_of[name] = slot
    elif kind == "offload_done" and len(operands) > 1 and operands[1] in slot_of:
      slot_of[name] = slot_of[operands[1]]
    elif kind == "fetch_start" and operands and operands[0] in slot_of:
      slot_of[name] = slot_of[operands[0]]
    elif kind == "fetch" and operands and operands[0] in slot_of:
      upper[slot_of[operands[0]]] = pos + 1
    elif kind == "fetch_done" and len(operands) > 1 and operands[1] in slot_of:
      upper[slot_of[operands[1]]] = pos + 1
  if (lower < 0).all():
    return None
  # A slot missing from the text (none should be) is live throughout.
  lower[lower < 0] = 0
  return lower, upper


__all__ = ["ALIGNMENT", "HostLayout", "compiled_lifetimes", "host_layout", "reuse_waits"]
