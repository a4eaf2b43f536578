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
the schedule. The run follows the compiled program's order, which XLA may
choose differently for copies that do not depend on each other: a slot that
would overlap a live one is served by the store's arena instead, counted in
``store_plan_stats(key)["fallbacks"]`` (0 when the run kept the plan's order).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import numpy as np

from jaxmem._src.native import dsa
from jaxmem._src.native import store
from jaxmem._src.plan.schedule import Schedule, StepKind

#: Every slot starts at a multiple of this (the host store's alignment).
ALIGNMENT = 64
#: The layout's solve stops here (seconds); the schedules' instances are small.
SOLVE_SECONDS = 1.0

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
  """
  key: int
  slots: dict[int, int]
  lower: np.ndarray
  upper: np.ndarray
  nbytes: np.ndarray
  offsets: np.ndarray
  footprint: int
  max_load: int


def host_layout(schedule: Schedule) -> HostLayout | None:
  """The planned layout of ``schedule``'s host buffers, registered; None without offloads.

  Solved and registered once per schedule object: later calls return the
  same layout (the one the ``ffi`` backend's step uses).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def step(x):
    ...   h = jnp.sin(x) * 2
    ...   return (jnp.cos(h) + h).sum()
    >>> plan = jaxmem.plan(jax.grad(step), jnp.ones((256, 256)), planner="vdnn", budget=0.0)
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
      upper[slots[alloc_of[st.inputs[0]]]] = i + 1
    elif st.kind is StepKind.FETCH_START:
      alloc_of[st.outputs[1]] = alloc_of[st.inputs[0]]   # ticket <- handle
    elif st.kind is StepKind.FETCH_DONE:
      upper[slots[alloc_of[st.inputs[1]]]] = i + 1
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
                    int(sol.max_load))


__all__ = ["ALIGNMENT", "HostLayout", "host_layout"]
