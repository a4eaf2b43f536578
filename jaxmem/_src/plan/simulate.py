"""Simulator: a planned schedule on a device, with a compute stream and two copy streams.

This module is jaxmem's one time model: every clock (a plan's step time, the
planners' op times, the Perfetto timeline of :mod:`jaxmem._src.plan.perfetto`)
comes from here.

The schedule (:class:`~jaxmem._src.plan.schedule.Schedule`) is static: XLA runs
its steps in order and every buffer's place in memory is fixed when it is
compiled, so the budget is met by construction wherever the estimate says so.
What the simulator adds is *time*, after AutoSwap's scheduling model (Zhang et
al., *Efficient Memory Management for GPU-based Deep Learning Systems*, §IV-E):

* the compute stream runs the compute steps in order; each takes its roofline
  time on the device (:func:`jaxmem._src.estimate.cost.eqn_seconds`), values
  XLA fuses away cost their arithmetic only;
* a device-to-host stream and a host-to-device stream each run one copy at a
  time, in issue order ("a variable starts swap-out (-in) only after the
  previous swap-out (-in) event completes"); a device without full-duplex
  copies shares one engine between them;
* a synchronous ``offload``/``fetch`` blocks the compute stream until its copy
  is done; an ``offload_start``/``fetch_start`` only enqueues it, and the
  matching ``*_done`` waits for it. A fetch cannot start before the offload of
  the same value has finished;
* waits are *stalls*. In the paper a stall also happens when "the next Malloc
  will be delayed until sufficient variables are swapped out": in a static
  schedule that point is where the planner put the offload_done (bounded by
  the budget, see :func:`jaxmem._src.plan.schedule.async_copies`), so the same
  delay appears as the done's wait.

The result carries the step time, the overhead against the same program
without a plan on the same device, and the timeline the Perfetto export draws.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.plan.schedule import Schedule, StepKind


@dataclasses.dataclass(frozen=True)
class Event:
  """One interval on a stream of the simulated timeline.

  Attributes:
    stream: ``"compute"``, ``"d2h"`` or ``"h2d"``.
    name: the primitive, or ``offload``/``fetch`` and the value's type.
    start_s, end_s: seconds from the start of the step.
    step: index of the schedule step that issued it.
    nbytes: bytes copied (copies) or 0.
    kind: ``"compute"``, ``"recompute"``, ``"copy"`` or ``"stall"``.
    var: the program variable the step computes for, copies or waits for
      (None for a compute step of the original program).
  """
  stream: str
  name: str
  start_s: float
  end_s: float
  step: int
  nbytes: int = 0
  kind: str = "compute"
  var: int | None = None


@dataclasses.dataclass(frozen=True)
class Simulation:
  """A schedule's simulated step on a device.

  Attributes:
    device: the device profile's name.
    step_time_s: time of the planned step.
    unplanned_time_s: time of the same program without a plan.
    overhead: ``step_time_s / unplanned_time_s - 1``.
    stall_s: time the compute stream waited for copies.
    recompute_s: time spent recomputing.
    copied_bytes: bytes moved each way (device to host; the same come back).
    accessed_bytes: device-memory bytes the compute steps read and write, as
      priced (fused values move none; the model's counterpart of XLA's
      ``cost_analysis()["bytes accessed"]``).
    peak_bytes: the schedule's estimated peak.
    step_start_s: start time of every step (for memory over time).
    live_bytes: estimated live bytes at every step (``len(steps) + 1`` entries).
    timeline: the events of all streams.
    schedule: the schedule simulated.
  """
  device: str
  step_time_s: float
  unplanned_time_s: float
  overhead: float
  stall_s: float
  recompute_s: float
  copied_bytes: int
  peak_bytes: int
  step_start_s: np.ndarray
  live_bytes: np.ndarray
  timeline: tuple[Event, ...]
  schedule: Schedule = dataclasses.field(repr=False, compare=False)
  accessed_bytes: float = 0.0

  def __str__(self) -> str:
    return (f"simulated on {self.device}: step {self.step_time_s * 1e3:.3f} ms vs unplanned "
            f"{self.unplanned_time_s * 1e3:.3f} ms ({self.overhead:+.1%}); stalls "
            f"{self.stall_s * 1e3:.3f} ms, recompute {self.recompute_s * 1e3:.3f} ms, "
            f"{format_bytes(self.copied_bytes)} staged to host; peak {format_bytes(self.peak_bytes)}")


def program_time(program: AnalyzedProgram, device: DeviceLike = None) -> float:
  """Simulated time of the unplanned program on ``device`` (compute stream only)."""
  return float(program.op_seconds(device).sum())


def op_start_times(program: AnalyzedProgram, device: DeviceLike = None) -> np.ndarray:
  """Start time of every op of the unplanned program on ``device``, and its end (last entry).

  The unplanned program never waits for a copy: its clock is the running sum
  of its ops' times.
  """
  return np.concatenate([[0.0], np.cumsum(program.op_seconds(device))])


class Schedulable(Protocol):
  """Anything with a schedule to simulate (a :class:`~jaxmem._src.plan.plan.Plan`)."""

  def schedule(self) -> Schedule: ...


def simulate(plan: Schedulable | None, device: DeviceLike = None, *,
             schedule: Schedule | None = None) -> Simulation:
  """Simulates ``plan`` (or an explicit ``schedule``) on ``device``.

  Args:
    plan: a :class:`jaxmem.Plan` (its schedule is built with the plan's copy
      settings), or ``None`` when ``schedule`` is given.
    device: a profile name (``"h100-pcie"``, ``"k40"``, ...) or a
      :class:`jaxmem.DeviceProfile`; default: the current backend's.
    schedule: simulate this :class:`~jaxmem._src.plan.schedule.Schedule` instead.

  Returns:
    A :class:`Simulation`.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> prog = jaxmem.analyze(jax.grad(lambda x: jnp.tanh(jnp.tanh(x)).sum()), jnp.ones(1 << 16))
    >>> plan = jaxmem.get_planner("greedy")(prog, prog.peak_bytes)
    >>> sim = jaxmem.simulate(plan, "h100-pcie")
    >>> sim.step_time_s > 0 and sim.stall_s == 0
    True
  """
  dev = device_profile(device)
  if schedule is None:
    if plan is None:
      raise TypeError("`jaxmem.simulate` needs a plan (or `schedule=`).")
    schedule = plan.schedule()
  program = schedule.program
  prof = schedule.profile()
  virtual = prof.virtual
  # Per op, its time when fused into its consumer or not (the same roofline
  # as the unplanned program's, on this schedule's fusion).
  fused_s = program.costs.seconds(dev, fused=True)
  unfused_s = program.costs.seconds(dev, fused=False)
  fused_b = program.costs.accessed_bytes(fused=True)
  unfused_b = program.costs.accessed_bytes(fused=False)
  accessed = 0.0
  t_c = t_d2h = t_h2d = 0.0
  stall = recompute = 0.0
  copied = 0
  done_at: dict[int, float] = {}        # value id (ticket / handle / buffer) -> copy end
  offload_end: dict[int, float] = {}    # original variable -> end of its latest offload
  events: list[Event] = []
  starts = np.zeros(len(schedule.steps) + 1)
  read = {x for st in schedule.steps for x in st.inputs if isinstance(x, int)}
  read.update(x for x in schedule.outputs if isinstance(x, int))

  def copy(stream: str, ready: float, nbytes: int, step: int, name: str,
           var: int | None) -> tuple[float, float]:
    nonlocal t_d2h, t_h2d
    if dev.duplex:
      free = t_d2h if stream == "d2h" else t_h2d
    else:                                  # one copy engine for both directions
      free = max(t_d2h, t_h2d)
    begin = max(ready, free)
    end = begin + dev.copy_seconds(nbytes)
    if not dev.duplex:
      t_d2h = t_h2d = end
    elif stream == "d2h":
      t_d2h = end
    else:
      t_h2d = end
    events.append(Event(stream, name, begin, end, step, nbytes, "copy", var))
    return begin, end

  def wait(until: float, step: int, why: str, var: int | None) -> None:
    nonlocal t_c, stall
    if until > t_c:
      events.append(Event("compute", f"wait for {why}", t_c, until, step, 0, "stall", var))
      stall += until - t_c
      t_c = until

  for i, st in enumerate(schedule.steps):
    starts[i] = t_c
    kind = st.kind
    var = st.var
    if kind is StepKind.COMPUTE:
      op = program.ops[st.op]
      if st.outputs and not op.eqn.effects and not any(o in read for o in st.outputs):
        continue   # nothing reads it (a value restored later instead): XLA removes it
      fused = bool(st.outputs) and all(virtual[o] for o in st.outputs)
      dt = float(fused_s[st.op] if fused else unfused_s[st.op])
      accessed += float(fused_b[st.op] if fused else unfused_b[st.op])
      events.append(Event("compute", op.primitive, t_c, t_c + dt, i, 0,
                          "recompute" if st.recompute else "compute",
                          st.var if st.recompute else None))
      t_c += dt
      if st.recompute:
        recompute += dt
      continue
    # (Only copies are labelled: a type string per compute step costs a
    # fifth of a simulation of ResNet-50.)
    nbytes = program.vars[var].nbytes if var is not None else 0
    label = program.vars[var].type_str if var is not None else ""
    if kind is StepKind.OFFLOAD:
      _, end = copy("d2h", t_c, nbytes, i, f"offload {label}", var)
      wait(end, i, f"offload {label}", var)
      offload_end[var] = end
      copied += nbytes
    elif kind is StepKind.FETCH:
      _, end = copy("h2d", max(t_c, offload_end.get(var, 0.0)), nbytes, i, f"fetch {label}",
                    var)
      wait(end, i, f"fetch {label}", var)
    elif kind is StepKind.OFFLOAD_START:
      _, end = copy("d2h", t_c, nbytes, i, f"offload {label}", var)
      for o in st.outputs:
        done_at[o] = end
      offload_end[var] = end
      copied += nbytes
    elif kind is StepKind.FETCH_START:
      _, end = copy("h2d", max(t_c, offload_end.get(var, 0.0)), nbytes, i, f"fetch {label}",
                    var)
      for o in st.outputs:
        done_at[o] = end
    elif kind in (StepKind.OFFLOAD_DONE, StepKind.FETCH_DONE):
      ready = max([done_at.get(x, 0.0) for x in st.inputs if isinstance(x, int)], default=0.0)
      wait(ready, i, f"{kind.value.split('_')[0]} {label}", var)
    # fences and pins alias their input: no time.
  starts[-1] = t_c
  base = program_time(program, dev)
  total = t_c
  return Simulation(dev.name, total, base, total / base - 1.0 if base > 0 else 0.0, stall,
                    recompute, copied, prof.peak_bytes, starts, np.asarray(prof.live_bytes),
                    tuple(events), schedule, accessed)
