"""The host memory a plan allocates: its offloads' alloc/free sequence.

The trace is the input of the host arenas' replay
(:func:`jaxmem._src.native.arena.replay`): ``bench/fragmentation.py`` measures
how each allocator lays out what a plan stages to host memory.
"""

from __future__ import annotations

from typing import Protocol

from jaxmem._src.native.arena import TraceEvent
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import Schedule, StepKind


class _HasPlan(Protocol):
  """A result that carries a plan (:class:`jaxmem.FitResult`)."""
  plan: Plan


def offload_trace(plan_like: Plan | Schedule | _HasPlan) -> list[TraceEvent]:
  """The host alloc/free sequence of a jaxmem plan.

  Each offload allocates the offloaded value's bytes on the host and the
  matching fetch frees them (the host store erases an entry when it is
  fetched). Synchronous schedules: at the ``OFFLOAD`` / ``FETCH`` steps.
  Windowed (asynchronous) schedules: from ``OFFLOAD_START`` (the host
  destination must exist when the copy starts) to ``FETCH_DONE`` (the host
  source must live until the copy back finished), following the copy's
  ticket and handle values through ``OFFLOAD_DONE`` and ``FETCH_START``.
  Times are schedule step indices.

  Args:
    plan_like: a :class:`~jaxmem.FitResult` (its ``plan``), a
      :class:`~jaxmem.Plan` or a :class:`~jaxmem.Schedule`.

  Returns:
    Events ``(step, id, nbytes)`` and ``(step, -id)``, ids numbered from 1 in
    offload order. Empty when the plan offloads nothing.
  """
  allocs = (StepKind.OFFLOAD, StepKind.OFFLOAD_START)
  passes = (StepKind.OFFLOAD_DONE, StepKind.FETCH_START)
  frees = (StepKind.FETCH, StepKind.FETCH_DONE)
  found: object = plan_like
  if not isinstance(found, (Plan, Schedule)):
    found = getattr(found, "plan", None)
  if isinstance(found, Plan):
    found = found.schedule()
  if not isinstance(found, Schedule):
    raise TypeError("offload_trace takes a FitResult, Plan or Schedule, got "
                    f"{type(plan_like).__name__}")
  sched = found
  prog = sched.program
  trace: list[TraceEvent] = []
  owner: dict[int, int] = {}   # value id (ticket / handle) -> host allocation id
  live: set[int] = set()
  n_allocs = 0
  for k, st in enumerate(sched.steps):
    if st.kind in allocs:
      n_allocs += 1
      i = n_allocs
      trace.append((float(k), i, int(prog.vars[st.var].nbytes)))
      live.add(i)
      owner.update((o, i) for o in st.outputs)
      continue
    ids = [owner[x] for x in st.inputs if isinstance(x, int) and x in owner]
    if not ids:
      continue
    if st.kind in passes:
      owner.update((o, ids[0]) for o in st.outputs)
    elif st.kind in frees and ids[0] in live:
      live.discard(ids[0])
      trace.append((float(k), -ids[0]))
  return trace


__all__ = ["offload_trace"]
