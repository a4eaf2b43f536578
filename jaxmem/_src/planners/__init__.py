"""Planner registry: ``planner(program, budget_bytes, device) -> Plan``.

* ``greedy`` — over the peak by area of absence (the first planner);
* ``vdnn`` — paper 004 §3 (vDNN_dyn; ``vdnn-all``, ``vdnn-conv`` for the static policies);
* ``layrub`` — paper 002 §3-4.2;
* ``autoswap`` — paper 003 §IV (Bayesian optimisation of the priority scores);
* ``window`` — paper 001 §3;
* ``optimal`` — remat + offload as a MILP (scipy/HiGHS);
* ``segments`` — recompute whole forward segments from checkpoints (Chen et al. 2016);
* ``auto`` (also ``best``) — the fastest simulated plan among the fast planners (and the
  MILP on small programs); the default of ``jaxmem.fit``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from jaxmem._src.planners.auto import auto
from jaxmem._src.planners.autoswap import autoswap
from jaxmem._src.planners.greedy import greedy
from jaxmem._src.planners.layrub import layrub
from jaxmem._src.planners.optimal import optimal
from jaxmem._src.planners.segments import segments
from jaxmem._src.planners.vdnn import vdnn
from jaxmem._src.planners.window import window_planner

Planner = Callable[..., Any]

PLANNERS: dict[str, Planner] = {
    "greedy": greedy,
    "vdnn": vdnn,
    "vdnn-all": functools.partial(vdnn, policy="all"),
    "vdnn-conv": functools.partial(vdnn, policy="conv"),
    "layrub": layrub,
    "autoswap": autoswap,
    "window": window_planner,
    "optimal": optimal,
    "segments": segments,
    "auto": auto,
    "best": auto,          # the name it had before it became `fit`'s default
}


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
