"""Planner registry: ``planner(program, budget_bytes, device) -> Plan``."""

from __future__ import annotations

from typing import Any, Callable

from jaxmem._src.planners.greedy import greedy

Planner = Callable[..., Any]

PLANNERS: dict[str, Planner] = {"greedy": greedy, "auto": greedy}


def get_planner(planner: str | Planner) -> Planner:
  """Looks up a planner by name, or returns a callable unchanged."""
  if callable(planner):
    return planner
  try:
    return PLANNERS[planner]
  except KeyError:
    raise ValueError(f"`planner`={planner!r} is not a known planner; use one of "
                     f"{sorted(PLANNERS)} or pass a callable "
                     f"`planner(program, budget_bytes, device) -> jaxmem.Plan`.") from None
