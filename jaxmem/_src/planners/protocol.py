"""What a planner is: a typed protocol with explicit keyword options.

Every planner takes the analyzed program, the target estimated peak and the
device profile to price its choices on, and the two scheduling options that
:func:`jaxmem.fit` passes through (how copies are issued and their window),
and returns a :class:`~jaxmem._src.plan.plan.Plan`. Planner-specific options
(``greedy``'s ``max_chain``, AutoSwap's ``score`` ...) are further keyword
arguments with defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window


class Planner(Protocol):
  """``planner(program, budget_bytes, device, *, copies, window) -> Plan``."""

  def __call__(self, program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
               copies: CopyMode = "sync", window: Window = None) -> Plan: ...


#: A planner a user passes: ``planner(program, budget_bytes, device) -> Plan``.
PlainPlanner = Callable[[AnalyzedProgram, int, DeviceLike], Plan]


@dataclasses.dataclass(frozen=True)
class WithCopies:
  """A user's three-argument planner, as a :class:`Planner`.

  The callable is called as ``fn(program, budget_bytes, device)``; its plan's
  copies are then scheduled as asked. A planner that knows nothing of windows
  priced synchronous copies: the asynchronous schedule stays within its target
  (windows are bounded by it, :func:`~jaxmem._src.plan.schedule.async_copies`),
  and :func:`jaxmem.fit` verifies the compiled peak as always.
  """
  fn: PlainPlanner

  def __call__(self, program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
               copies: CopyMode = "sync", window: Window = None) -> Plan:
    plan = self.fn(program, budget_bytes, device)
    return dataclasses.replace(plan, copies=copies, window=window)


__all__ = ["PlainPlanner", "Planner", "WithCopies"]
