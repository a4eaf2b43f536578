"""Plan: per value a decision (keep / remat / offload) over one gap of its lifetime."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.ir import substitutions
from jaxmem._src.plan import perfetto
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.schedule import CopyMode, Schedule, Window, build_schedule

T = TypeVar("T")


# The fields `Plan.schedule` is built from.
_SCHEDULE_FIELDS = frozenset({"program", "decisions", "pinned", "copies", "window",
                              "target_bytes"})


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """A memory plan for one program.

  Attributes:
    program: the program it applies to.
    decisions: remat / offload decisions (every other variable is kept).
    target_bytes: the estimated peak the planner aimed for.
    estimated_peak_bytes: estimated peak with the plan applied.
    unplanned_estimate_bytes: estimated peak without a plan.
    planner: planner name.
    pinned: kept activations materialized by a fence right after their
      definition (see :func:`~jaxmem._src.plan.schedule.build_schedule`).
    copies: ``"sync"`` (one blocking custom call per copy) or ``"async"``
      (a start and a done per copy, placed by
      :func:`~jaxmem._src.plan.schedule.async_copies` within ``target_bytes``).
    window: the asynchronous copies' window: ``int`` bytes computed between a
      start and its done, ``float`` a multiple of the bytes copied, ``None``
      the default (:data:`~jaxmem._src.plan.schedule.DEFAULT_WINDOW`).
    diagnostics: what the planner that made it found on the way (each
      planner's own frozen record: ``auto``'s comparison of the planners,
      AutoSwap's Bayesian-optimisation trace, the MILP's solver status);
      read one with :meth:`diagnostic`.
  """
  program: AnalyzedProgram
  decisions: tuple[Decision, ...]
  target_bytes: int
  estimated_peak_bytes: int
  unplanned_estimate_bytes: int
  planner: str
  pinned: tuple[int, ...] = ()
  copies: CopyMode = "sync"
  window: Window = None
  diagnostics: tuple[Any, ...] = ()

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
    """Equations computed by a lowering substitution (:mod:`jaxmem._src.ir.substitutions`)."""
    return sum(substitutions.applies(op.eqn) for op in self.program.ops)

  @property
  def recomputed_ops(self) -> int:
    return sum(len(d.recompute) for d in self.decisions)

  def diagnostic(self, kind: type[T]) -> T | None:
    """The planner diagnostics of type ``kind`` this plan carries, if any.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> from jaxmem._src.planners.auto import AutoDiagnostics
      >>> prog = jaxmem.analyze(jax.grad(lambda x: jnp.tanh(jnp.tanh(x)).sum()), jnp.ones(1 << 16))
      >>> plan = jaxmem.get_planner("auto")(prog, prog.peak_bytes // 2, "h100-pcie")
      >>> plan.diagnostic(AutoDiagnostics).chosen == plan.planner[len("auto("):-1]
      True
    """
    return next((d for d in self.diagnostics if isinstance(d, kind)), None)

  def schedule(self) -> Schedule:
    """The program with the plan applied, as a list of steps (built once per plan)."""
    found = self.__dict__.get("_schedule_memo")
    if found is None:
      found = build_schedule(self.program, self.decisions, self.pinned, copies=self.copies,
                             window=self.window, budget=self.target_bytes)
      object.__setattr__(self, "_schedule_memo", found)
    return found

  def replace(self, **changes: Any) -> Plan:
    """``dataclasses.replace(self, **changes)``, keeping the built schedule where it still holds.

    Planners relabel and re-score plans (``estimated_peak_bytes``,
    ``planner``, ``diagnostics``) without changing what the schedule is built
    from; the new plan then shares the schedule and its profile.
    """
    unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
    if unknown:
      raise TypeError(f"`Plan.replace` got unknown fields {sorted(unknown)}.")
    out = dataclasses.replace(self, **changes)
    found = self.__dict__.get("_schedule_memo")
    if found is not None and not set(changes) & _SCHEDULE_FIELDS:
      object.__setattr__(out, "_schedule_memo", found)
    return out

  def to_perfetto(self, path: str | os.PathLike[str] | None = None, *,
                  device: DeviceLike = None) -> dict[str, Any]:
    """Chrome/Perfetto trace JSON of the schedule simulated on ``device`` (compute and copy threads).

    The trace draws :func:`jaxmem.simulate`'s timeline, so its step time,
    stalls and overlap are the simulator's.
    """
    return perfetto.schedule_trace(self, path, device=device)

  def summary(self, top: int = 10) -> str:
    """Human-readable summary: counts, bytes moved, the largest decisions."""
    lines = [
        f"Plan ({self.planner}): {len(self.decisions)} decisions — "
        f"{self.num_remat} remat ({self.recomputed_ops} ops recomputed), "
        f"{self.num_offload} offload ({format_bytes(self.offloaded_bytes)} staged to host), "
        f"{len(self.pinned)} pinned, {self.substituted_ops} lowering substitutions"
        + (", async copies" if self.copies == "async" and self.num_offload else ""),
        f"  estimated peak: {format_bytes(self.unplanned_estimate_bytes)} unplanned -> "
        f"{format_bytes(self.estimated_peak_bytes)} planned (target {format_bytes(self.target_bytes)})"
        + (f": MISSES the target by {format_bytes(self.estimated_peak_bytes - self.target_bytes)}"
           " (the closest plan this planner found)"
           if self.estimated_peak_bytes > self.target_bytes else ""),
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


__all__ = ["Plan"]
