"""Decisions: what a plan does with one value over one gap of its lifetime."""

from __future__ import annotations

import dataclasses
import enum


class Action(str, enum.Enum):
  """What happens to a value over a gap: it stays, is recomputed, or is staged to host."""
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


__all__ = ["Action", "Decision"]
