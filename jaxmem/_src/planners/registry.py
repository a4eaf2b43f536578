"""The planners by name: ``planner(program, budget_bytes, device, *, copies, window) -> Plan``.

* ``greedy`` -- over the peak by area of absence (the first planner);
* ``vdnn`` -- vDNN (Rhu et al.) §3, dynamic policy; ``vdnn-all``, ``vdnn-conv``
  for the static ones;
* ``layrub`` -- Layrub (Jin et al.) §3-4.2;
* ``autoswap`` -- AutoSwap (Zhang et al.) §IV, Bayesian optimisation of the
  priority scores;
* ``window`` -- window-based out-of-core scheduling (Hayakawa et al.) §3;
* ``dqn`` -- the DQN paper's deep Q-network over the memory-operation graph
  (§4, Algorithm 1; needs flax and optax);
* ``optimal`` -- remat + offload as a MILP (scipy/HiGHS);
* ``segments`` -- recompute whole forward segments from checkpoints (Chen et
  al. 2016);
* ``selective`` -- selective recomputation (Korthikanti et al. §4.2): the
  values cheapest to rebuild per byte first, alone and on top of recomputed
  segments;
* ``greedy-remat``, ``segments-remat`` -- the same with recomputation only (no
  host copies): what ``jaxmem.fit`` plans for TPU targets, whose compiler
  schedules host copies by its own memory model (see ``jaxmem.fit``);
* ``segments-modules`` -- ``segments-remat`` with segments at the model's own
  module boundaries only (a GPT's decoder blocks: ``nn.remat`` on every
  block, chosen on the program); ``fit``'s second try for TPU targets;
* ``segments-offload``, ``segments-modules-offload`` -- the same, and when
  recomputing every segment is not enough, the segments' checkpoints staged
  to host until the backward pass reaches them (``nn.remat`` per block with
  the block inputs offloaded, chosen on the program);
* ``auto`` (also ``best``) -- the fastest simulated plan among the fast planners
  (and the MILP on small programs); the default of ``jaxmem.fit``.

Full titles are in the bibliography of ``docs/design.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

from jaxmem._src.planners.auto import auto
from jaxmem._src.planners.autoswap import autoswap
from jaxmem._src.planners.dqn import dqn
from jaxmem._src.planners.greedy import greedy
from jaxmem._src.planners.layrub import layrub
from jaxmem._src.planners.optimal import optimal
from jaxmem._src.planners.protocol import PlainPlanner, Planner, WithCopies
from jaxmem._src.planners.segments import segments
from jaxmem._src.planners.selective import selective
from jaxmem._src.planners.vdnn import vdnn
from jaxmem._src.planners.window import window_planner

PLANNERS: Mapping[str, Planner] = MappingProxyType({
    "greedy": greedy,
    "vdnn": vdnn,
    "vdnn-all": functools.partial(vdnn, policy="all"),
    "vdnn-conv": functools.partial(vdnn, policy="conv"),
    "layrub": layrub,
    "autoswap": autoswap,
    "window": window_planner,
    "dqn": dqn,
    "optimal": optimal,
    "segments": segments,
    "selective": selective,
    "greedy-remat": functools.partial(greedy, allow_offload=False),
    "segments-remat": functools.partial(segments, fill=False),
    "segments-modules": functools.partial(segments, fill=False, group="modules"),
    "segments-offload": functools.partial(segments, fill=False, offload_checkpoints=True),
    "segments-modules-offload": functools.partial(segments, fill=False, group="modules",
                                                  offload_checkpoints=True),
    "auto": auto,
    "best": auto,          # the name it had before it became `fit`'s default
})


def get_planner(planner: str | Planner | PlainPlanner) -> Planner | PlainPlanner:
  """Looks up a planner by name, or returns a callable unchanged.

  Raises:
    ValueError: for an unknown name, listing the known ones.
  """
  if callable(planner):
    return planner
  try:
    return PLANNERS[planner]
  except KeyError:
    raise ValueError(f"`planner`={planner!r} is not a known planner; use one of "
                     f"{sorted(PLANNERS)} or pass a callable "
                     f"`planner(program, budget_bytes, device) -> jaxmem.Plan`.") from None


def as_planner(planner: str | Planner | PlainPlanner) -> Planner:
  """``planner`` as a :class:`~jaxmem._src.planners.protocol.Planner`.

  A registered planner (by name, or the very callable of :data:`PLANNERS`)
  takes ``copies`` and ``window`` itself; any other callable is a user's
  ``planner(program, budget_bytes, device)`` and is wrapped in
  :class:`~jaxmem._src.planners.protocol.WithCopies`. No signature is inspected.
  """
  found = get_planner(planner)
  if any(found is p for p in PLANNERS.values()):
    return found  # type: ignore[return-value]
  return WithCopies(found)  # type: ignore[arg-type]


__all__ = ["PLANNERS", "as_planner", "get_planner"]
