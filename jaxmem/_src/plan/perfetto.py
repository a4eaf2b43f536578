"""A simulated schedule as a Chrome trace-event timeline (ui.perfetto.dev, chrome://tracing).

:func:`simulation_trace` draws a :class:`~jaxmem._src.plan.simulate.Simulation`
as it is: its timeline is the only clock (``jaxmem._src.plan.simulate`` is
jaxmem's one time model), so the trace shows exactly the step time, the stalls
and the overlap that :func:`jaxmem.simulate` reports. One process, three
threads: ``compute`` (every compute step the simulator ran, recomputations
flagged, waits for copies as stall slices, fences and pins as instant events),
``D2H copies`` (offloads) and ``H2D copies`` (fetches); a ``live bytes``
counter track from the schedule's estimated profile; and flow arrows from each
offload to the fetch that brings the value back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.plan.schedule import Schedule, StepKind
from jaxmem._src.plan.simulate import Simulation, simulate

PID = 1
TID_COMPUTE = 1
TID_D2H = 2
TID_H2D = 3
THREAD_NAMES: Mapping[int, str] = MappingProxyType({TID_COMPUTE: "compute", TID_D2H: "D2H copies",
                                                   TID_H2D: "H2D copies"})
_STREAM_TID: Mapping[str, int] = MappingProxyType({"compute": TID_COMPUTE, "d2h": TID_D2H,
                                                   "h2d": TID_H2D})
SYNC_NOTE = ("copies are synchronous: the compute thread waits for each copy at its schedule "
             "position (a stall slice), nothing overlaps")
ASYNC_NOTE = ("copies are asynchronous: each runs on its copy thread from its start step; "
              "compute waits at the done only for what is left of it")
_US = 1e6   # trace-event timestamps and durations are in microseconds


def simulation_trace(sim: Simulation, path: str | os.PathLike[str] | None = None, *,
                     title: str = "jaxmem schedule") -> dict[str, Any]:
  """The timeline of ``sim`` as Chrome trace-event JSON.

  Args:
    sim: a :class:`~jaxmem._src.plan.simulate.Simulation` (from :func:`jaxmem.simulate`).
    path: when given, the JSON is written there (open it in ui.perfetto.dev).
    title: the process name shown in the viewer.

  Returns:
    ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
  """
  schedule = sim.schedule
  program = schedule.program
  note = ASYNC_NOTE if schedule.copies == "async" else SYNC_NOTE
  events: list[dict[str, Any]] = [
      {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": title}},
      {"name": "process_labels", "ph": "M", "pid": PID, "tid": 0, "args": {"labels": note}},
  ]
  for tid, name in THREAD_NAMES.items():
    events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
    events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                   "args": {"sort_index": tid}})

  def var_args(var: int | None) -> dict[str, Any]:
    if var is None:
      return {}
    v = program.vars[var]
    return {"value": var, "type": v.type_str, "role": v.role.value, "value source": v.source,
            "value name": v.name}

  for i, t in enumerate(sim.step_start_s):
    events.append({"name": "live bytes", "ph": "C", "pid": PID, "tid": TID_COMPUTE,
                   "ts": t * _US, "args": {"live bytes": int(sim.live_bytes[i])}})
  for i, st in enumerate(schedule.steps):
    if st.kind in (StepKind.FENCE, StepKind.PIN):   # ordering only: an instant
      events.append({"name": st.kind.value, "cat": st.kind.value, "ph": "i", "s": "t",
                     "pid": PID, "tid": TID_COMPUTE, "ts": sim.step_start_s[i] * _US,
                     "args": {"schedule step": i, "anchor": st.anchor, **var_args(st.var)}})

  pending_flows: dict[int, list[int]] = {}   # variable -> flow ids of offloads not fetched yet
  flows = 0
  for ev in sim.timeline:
    st = schedule.steps[ev.step]
    tid = _STREAM_TID[ev.stream]
    slice_ = {"name": ev.name, "cat": ev.kind, "ph": "X", "pid": PID, "tid": tid,
              "ts": ev.start_s * _US, "dur": (ev.end_s - ev.start_s) * _US}
    if ev.kind in ("compute", "recompute"):
      op = program.ops[st.op]
      args = {"source": op.source, "module": op.module_path, "op index": st.op,
              "recompute": ev.kind == "recompute", "phase": op.phase.value,
              "flops": float(program.costs.flops[st.op]), "schedule step": ev.step}
      if ev.kind == "recompute":
        args["recomputes for"] = var_args(ev.var)
    elif ev.kind == "copy":
      args = {"bytes": ev.nbytes, "size": format_bytes(ev.nbytes), "schedule step": ev.step,
              "anchor": st.anchor,
              "synchronous": st.kind in (StepKind.OFFLOAD, StepKind.FETCH),
              **var_args(ev.var)}
      slice_["name"] = f"{ev.name.split()[0]} {format_bytes(ev.nbytes)}"
    else:   # a stall: compute waits for a copy
      args = {"schedule step": ev.step, **var_args(ev.var)}
    slice_["args"] = args
    events.append(slice_)
    if ev.kind == "copy" and ev.var is not None:
      if ev.stream == "d2h":
        flows += 1
        pending_flows.setdefault(ev.var, []).append(flows)
        events.append({"name": "host round trip", "cat": "copy", "ph": "s", "id": flows,
                       "pid": PID, "tid": tid, "ts": ev.start_s * _US})
      elif pending_flows.get(ev.var):
        events.append({"name": "host round trip", "cat": "copy", "ph": "f", "bp": "e",
                       "id": pending_flows[ev.var].pop(0), "pid": PID, "tid": tid,
                       "ts": ev.start_s * _US})
  meta = {"device_profile": sim.device, "copies": note, "step_time_s": sim.step_time_s,
          "unplanned_time_s": sim.unplanned_time_s, "overhead": sim.overhead,
          "stall_s": sim.stall_s, "recompute_s": sim.recompute_s,
          "copied_bytes": sim.copied_bytes, "peak_bytes": sim.peak_bytes}
  return _write({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}, path)


def _write(trace: dict[str, Any], path: str | os.PathLike[str] | None) -> dict[str, Any]:
  if path is not None:
    with open(os.fspath(path), "w", encoding="utf-8") as f:
      json.dump(trace, f)
  return trace


class _PlanLike(Protocol):
  """What :func:`schedule_trace` reads of a :class:`~jaxmem._src.plan.plan.Plan`."""
  planner: str

  def schedule(self) -> Schedule: ...


def schedule_trace(plan: _PlanLike, path: str | os.PathLike[str] | None = None, *,
                   device: DeviceLike = None) -> dict[str, Any]:
  """``plan``'s schedule, simulated on ``device``, as Chrome trace-event JSON.

  Args:
    plan: a :class:`jaxmem.Plan`.
    path: when given, the JSON is written there (open it in ui.perfetto.dev).
    device: device profile name or :class:`jaxmem.DeviceProfile` (default:
      the current JAX backend's profile).

  Returns:
    See :func:`simulation_trace`; ``otherData`` also names the planner.
  """
  profile = device_profile(device)
  sim = simulate(plan, profile)
  trace = simulation_trace(sim, title=f"jaxmem schedule ({plan.planner}, {profile.name})")
  trace["otherData"] = {"planner": plan.planner, "flops_per_s": profile.flops_per_s,
                        "host_bytes_per_s": profile.copy_bytes_per_s, **trace["otherData"]}
  return _write(trace, path)


__all__ = ["ASYNC_NOTE", "SYNC_NOTE", "THREAD_NAMES", "schedule_trace", "simulation_trace"]
