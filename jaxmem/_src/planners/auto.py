"""``auto``: the best of the fast planners, and the MILP when it solves in time.

Every fast planner (greedy, segments, vDNN, Layrub, AutoSwap, the window scheduler)
plans for the budget; the plans whose estimated peak fits are simulated on
the device (:func:`jaxmem.simulate`) and the fastest step wins. The MILP
(:mod:`~jaxmem._src.planners.optimal`) joins when it finishes within
``milp_time_s``. When no plan fits, the one with the lowest estimated peak is
returned (``fit`` then tightens the target or raises ``BudgetError``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxmem._src.plan import Plan

FAST = ("greedy", "segments", "vdnn", "layrub", "autoswap", "window")


@dataclasses.dataclass
class AutoTrace:
  """What the last :func:`auto` call compared (for benchmarks and reports)."""
  rows: list[tuple[str, int, float, float]] = dataclasses.field(default_factory=list)
  chosen: str = ""


LAST = AutoTrace()


def auto(program: Any, budget_bytes: int, device: Any = None, *, copies: str = "sync",
         window: int | float | None = None, planners: tuple[str, ...] = FAST,
         milp_time_s: float = 2.0) -> Plan:
  """The fastest plan (simulated on ``device``) among the planners that fit ``budget_bytes``.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak.
    device: device profile for pricing and simulation (default: current backend).
    copies, window: how every candidate plan's copies are scheduled (``window``
      ``None``: each planner's default).
    planners: the fast planners to run.
    milp_time_s: time limit of the MILP (0 skips it).

  Returns:
    A :class:`jaxmem.Plan` named ``auto(<winner>)``.
  """
  from jaxmem._src.planners import PLANNERS
  from jaxmem._src.planners.optimal import LAST as MILP, optimal
  from jaxmem._src.simulate import simulate

  candidates: list[Plan] = []
  for name in planners:
    kwargs: dict[str, Any] = {"copies": copies, "window": window}
    if name == "autoswap":
      kwargs["bo_iterations"] = 4
    candidates.append(PLANNERS[name](program, budget_bytes, device, **kwargs))
  if milp_time_s > 0:
    t = time.perf_counter()
    plan = optimal(program, budget_bytes, device, time_limit_s=milp_time_s, copies=copies,
                   window=window)
    if MILP.proven and time.perf_counter() - t <= milp_time_s * 1.5:
      candidates.append(plan)
  LAST.rows.clear()
  best: tuple[float, Plan] | None = None
  for plan in candidates:
    fits = plan.estimated_peak_bytes <= budget_bytes
    t = simulate(plan, device).step_time_s if fits else float("inf")
    LAST.rows.append((plan.planner, plan.estimated_peak_bytes, t, len(plan.decisions)))
    key = t if fits else float("inf")
    if best is None or key < best[0] or (key == best[0] == float("inf")
                                         and plan.estimated_peak_bytes < best[1].estimated_peak_bytes):
      best = (key, plan)
  assert best is not None
  LAST.chosen = best[1].planner
  return dataclasses.replace(best[1], planner=f"auto({best[1].planner})")
