"""A plan's schedule as a Chrome trace-event timeline (ui.perfetto.dev, chrome://tracing).

``schedule_trace(plan)`` lays out ``plan.schedule()`` on three threads of one
process: ``compute`` (every compute step, recomputations flagged, with fences
and pins as instant events), ``D2H copies`` (offloads) and ``H2D copies``
(fetches), plus a ``live bytes`` counter track from the schedule's estimated
profile and flow arrows from each offload to its fetch.

Durations come from the cost model (:mod:`jaxmem._src.cost`): a compute step
takes ``max(1 µs, flops / flops_per_s)``, a copy ``bytes / host_bytes_per_s``.
Synchronous copies (``plan.copies == "sync"``) sit at their schedule position
on their own thread and the compute clock waits for them. Asynchronous ones
(``"async"``) start at their start step, run on the copy thread while compute
goes on (one copy at a time per direction), and the compute clock waits at
the done only for what is left of the copy.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxmem._src import cost
from jaxmem._src.errors import format_bytes
from jaxmem._src.schedule import StepKind

PID = 1
TID_COMPUTE = 1
TID_D2H = 2
TID_H2D = 3
THREAD_NAMES = {TID_COMPUTE: "compute", TID_D2H: "D2H copies", TID_H2D: "H2D copies"}
MIN_COMPUTE_S = 1e-6
SYNC_NOTE = ("copies are synchronous: each copy runs at its schedule position and the "
             "compute thread waits for it (no overlap with compute)")
ASYNC_NOTE = ("copies are asynchronous: each runs on its copy thread from its start step; "
              "compute waits at the done only for what is left of it")


def schedule_trace(plan: Any, path: str | os.PathLike[str] | None = None, *,
                   device: str | cost.DeviceProfile | None = None) -> dict[str, Any]:
  """The schedule of ``plan`` as Chrome trace-event JSON.

  Args:
    plan: a :class:`jaxmem.Plan`.
    path: when given, the JSON is written there (open it in ui.perfetto.dev).
    device: device profile name or :class:`jaxmem.DeviceProfile` pricing the
      steps (default: the current JAX backend's profile).

  Returns:
    ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``;
    timestamps and durations are in microseconds, as the format wants.
  """
  profile = cost.device_profile(device)
  program = plan.program
  schedule = plan.schedule()
  live = schedule.profile().live_bytes
  note = ASYNC_NOTE if schedule.copies == "async" else SYNC_NOTE

  meta = {
      "planner": plan.planner,
      "device_profile": profile.name,
      "flops_per_s": profile.flops_per_s,
      "host_bytes_per_s": profile.host_bytes_per_s,
      "copies": note,
  }
  events: list[dict[str, Any]] = [
      {"name": "process_name", "ph": "M", "pid": PID, "tid": 0,
       "args": {"name": f"jaxmem schedule ({plan.planner}, {profile.name})"}},
      {"name": "process_labels", "ph": "M", "pid": PID, "tid": 0,
       "args": {"labels": note}},
  ]
  for tid, name in THREAD_NAMES.items():
    events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
    events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                   "args": {"sort_index": tid}})

  def counter(ts: float, value: int) -> None:
    events.append({"name": "live bytes", "ph": "C", "pid": PID, "tid": TID_COMPUTE, "ts": ts,
                   "args": {"live bytes": int(value)}})

  def var_args(var: int | None) -> dict[str, Any]:
    if var is None:
      return {}
    v = program.vars[var]
    return {"value": var, "type": v.type_str, "role": v.role.value, "value source": v.source,
            "value name": v.name}

  t = 0.0   # microseconds
  offload_flow: dict[int, int] = {}   # handle value -> flow id
  copy_free = {TID_D2H: 0.0, TID_H2D: 0.0}   # when each copy thread is idle again
  copy_end: dict[int, float] = {}            # ticket value -> end of its copy
  for i, st in enumerate(schedule.steps):
    counter(t, live[i])
    if st.kind is StepKind.COMPUTE:
      op = program.ops[st.op]
      flops = cost.eqn_flops(op.eqn)
      dur = max(MIN_COMPUTE_S, flops / profile.flops_per_s) * 1e6
      args = {"source": op.source, "module": op.module_path, "op index": st.op,
              "recompute": bool(st.recompute), "phase": op.phase.value, "flops": flops,
              "schedule step": i}
      if st.recompute:
        args["recomputes for"] = var_args(st.var)
      events.append({"name": op.primitive, "cat": "recompute" if st.recompute else "compute",
                     "ph": "X", "pid": PID, "tid": TID_COMPUTE, "ts": t, "dur": dur, "args": args})
      t += dur
    elif st.kind in (StepKind.OFFLOAD, StepKind.FETCH):
      nbytes = program.vars[st.var].nbytes
      dur = nbytes / profile.host_bytes_per_s * 1e6
      offload = st.kind is StepKind.OFFLOAD
      tid = TID_D2H if offload else TID_H2D
      args = {"bytes": nbytes, "size": format_bytes(nbytes), "schedule step": i,
              "anchor": st.anchor, "synchronous": True, "note": SYNC_NOTE, **var_args(st.var)}
      name = f"{'offload' if offload else 'fetch'} {format_bytes(nbytes)}"
      events.append({"name": name, "cat": "copy", "ph": "X", "pid": PID, "tid": tid, "ts": t,
                     "dur": dur, "args": args})
      if offload:
        fid = len(offload_flow) + 1
        offload_flow[st.outputs[0]] = fid
        events.append({"name": "host round trip", "cat": "copy", "ph": "s", "id": fid,
                       "pid": PID, "tid": tid, "ts": t})
      else:
        fid = offload_flow.get(st.inputs[0])
        if fid is not None:
          events.append({"name": "host round trip", "cat": "copy", "ph": "f", "bp": "e",
                         "id": fid, "pid": PID, "tid": tid, "ts": t})
      t += dur
    elif st.kind in (StepKind.OFFLOAD_START, StepKind.FETCH_START):
      nbytes = program.vars[st.var].nbytes
      dur = nbytes / profile.host_bytes_per_s * 1e6
      offload = st.kind is StepKind.OFFLOAD_START
      tid = TID_D2H if offload else TID_H2D
      begin = max(t, copy_free[tid])
      copy_free[tid] = copy_end[st.outputs[-1]] = begin + dur
      args = {"bytes": nbytes, "size": format_bytes(nbytes), "schedule step": i,
              "anchor": st.anchor, "synchronous": False, "note": note, **var_args(st.var)}
      name = f"{'offload' if offload else 'fetch'} {format_bytes(nbytes)}"
      events.append({"name": name, "cat": "copy", "ph": "X", "pid": PID, "tid": tid,
                     "ts": begin, "dur": dur, "args": args})
      if offload:
        fid = len(offload_flow) + 1
        offload_flow[st.var] = fid
        events.append({"name": "host round trip", "cat": "copy", "ph": "s", "id": fid,
                       "pid": PID, "tid": tid, "ts": begin})
      elif st.var in offload_flow:
        events.append({"name": "host round trip", "cat": "copy", "ph": "f", "bp": "e",
                       "id": offload_flow.pop(st.var), "pid": PID, "tid": tid, "ts": begin})
    elif st.kind in (StepKind.OFFLOAD_DONE, StepKind.FETCH_DONE):
      end = copy_end.pop(st.inputs[1], t)
      if end > t:   # compute waits for the rest of the copy
        events.append({"name": f"wait {st.kind.value}", "cat": "stall", "ph": "X", "pid": PID,
                       "tid": TID_COMPUTE, "ts": t, "dur": end - t,
                       "args": {"schedule step": i, **var_args(st.var)}})
        t = end
    else:  # fence / pin: ordering only
      events.append({"name": st.kind.value, "cat": st.kind.value, "ph": "i", "s": "t", "pid": PID,
                     "tid": TID_COMPUTE, "ts": t,
                     "args": {"schedule step": i, "anchor": st.anchor, **var_args(st.var)}})
  counter(t, live[len(schedule.steps)])
  meta["step_time_s"] = t * 1e-6
  trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}
  if path is not None:
    with open(os.fspath(path), "w", encoding="utf-8") as f:
      json.dump(trace, f)
  return trace
