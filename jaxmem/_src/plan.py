"""Plan: per activation a decision (keep / remat / offload) over one gap of its lifetime."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jaxmem._src.errors import format_bytes


class Action(str, enum.Enum):
  KEEP = "keep"
  REMAT = "remat"        # drop after `start`, recompute just before `end`
  OFFLOAD = "offload"    # copy to host after `start`, copy back just before `end`


@dataclasses.dataclass(frozen=True)
class Decision:
  """What to do with variable ``var`` between two consecutive uses.

  Attributes:
    var: variable id in the program.
    action: remat or offload.
    start: program position of the use (or definition) before the gap.
    end: program position of the next use; the value is restored before it.
    recompute: op indices re-executed (topological order) for a remat.
    nbytes: bytes freed during the gap.
    cost_s: estimated extra time on the planning device.
  """
  var: int
  action: Action
  start: int
  end: int
  recompute: tuple[int, ...] = ()
  nbytes: int = 0
  cost_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
  """A memory plan for one program.

  Attributes:
    program: the :class:`~jaxmem._src.trace.Program` it applies to.
    decisions: remat / offload decisions (every other variable is kept).
    target_bytes: the estimated peak the planner aimed for.
    estimated_peak_bytes: estimated peak with the plan applied.
    unplanned_estimate_bytes: estimated peak without a plan.
    planner: planner name.
    pinned: kept activations materialized by a fence right after their
      definition (see :func:`~jaxmem._src.schedule.build_schedule`).
    copies: ``"sync"`` (one blocking custom call per copy) or ``"async"``
      (a start and a done per copy, placed by
      :func:`~jaxmem._src.schedule.async_copies` within ``target_bytes``).
    window: the asynchronous copies' window: ``int`` bytes computed between a
      start and its done, ``float`` a multiple of the bytes copied, ``None``
      the default (:data:`~jaxmem._src.schedule.DEFAULT_WINDOW`).
  """
  program: Any
  decisions: tuple[Decision, ...]
  target_bytes: int
  estimated_peak_bytes: int
  unplanned_estimate_bytes: int
  planner: str
  pinned: tuple[int, ...] = ()
  copies: str = "sync"
  window: int | float | None = None

  @property
  def num_remat(self) -> int:
    return sum(d.action is Action.REMAT for d in self.decisions)

  @property
  def num_offload(self) -> int:
    return sum(d.action is Action.OFFLOAD for d in self.decisions)

  @property
  def offloaded_bytes(self) -> int:
    return sum(d.nbytes for d in self.decisions if d.action is Action.OFFLOAD)

  @property
  def substituted_ops(self) -> int:
    """Equations computed by a lowering substitution (see ``substitutions.py``)."""
    from jaxmem._src import substitutions
    return sum(substitutions.applies(op.eqn) for op in self.program.ops)

  @property
  def recomputed_ops(self) -> int:
    return sum(len(d.recompute) for d in self.decisions)

  def schedule(self) -> Any:
    """The program with the plan applied, as a list of steps."""
    from jaxmem._src import schedule
    return schedule.build_schedule(self.program, self.decisions, self.pinned,
                                   copies=self.copies, window=self.window,
                                   budget=self.target_bytes)

  def to_perfetto(self, path: str | None = None, *, device: Any = None) -> dict:
    """Chrome/Perfetto trace JSON of the schedule (compute and copy threads)."""
    from jaxmem._src.perfetto import schedule_trace
    return schedule_trace(self, path, device=device)

  def summary(self, top: int = 10) -> str:
    """Human-readable summary: counts, bytes moved, the largest decisions."""
    lines = [
        f"Plan ({self.planner}): {len(self.decisions)} decisions — "
        f"{self.num_remat} remat ({self.recomputed_ops} ops recomputed), "
        f"{self.num_offload} offload ({format_bytes(self.offloaded_bytes)} staged to host), "
        f"{len(self.pinned)} pinned, {self.substituted_ops} lowering substitutions"
        + (", async copies" if self.copies == "async" and self.num_offload else ""),
        f"  estimated peak: {format_bytes(self.unplanned_estimate_bytes)} unplanned -> "
        f"{format_bytes(self.estimated_peak_bytes)} planned (target {format_bytes(self.target_bytes)})",
    ]
    biggest = sorted(self.decisions, key=lambda d: -d.nbytes * (d.end - d.start))[:top]
    if biggest:
      lines.append(f"  {'action':8} {'bytes':>11} {'gap':>11}  {'value':24} source")
    for d in biggest:
      v = self.program.vars[d.var]
      lines.append(f"  {d.action.value:8} {format_bytes(d.nbytes):>11} {f'{d.start}->{d.end}':>11}  "
                   f"{v.type_str:24} {v.source}")
    if len(self.decisions) > top:
      lines.append(f"  ... and {len(self.decisions) - top} more")
    return "\n".join(lines)
