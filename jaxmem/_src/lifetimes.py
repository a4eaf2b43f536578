"""Lifetimes: live bytes at every program point, the peak and its holders.

A variable is live from the op that defines it through its last use (arguments
from the start; results and non-donated arguments through the exit point).
Opaque blocks add their inner working set at their own position. The same
routine prices a planned :class:`~jaxmem._src.schedule.Schedule`, so the
planner and the report agree on what "live" means.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Profile:
  """Estimated memory over program order.

  Attributes:
    live_bytes: live bytes at each position (the last position is the exit).
    peak_bytes: ``max(live_bytes)``.
    peak_index: first position reaching the peak.
    holders: ids of the values live at the peak, largest first.
    holder_bytes: their sizes.
  """
  live_bytes: np.ndarray
  peak_bytes: int
  peak_index: int
  holders: tuple[int, ...]
  holder_bytes: tuple[int, ...]


def profile_from_intervals(num_positions: int, starts: Sequence[int], ends: Sequence[int],
                           nbytes: Sequence[int], transient: Sequence[int] | None = None) -> Profile:
  """Live-bytes profile of values live on closed intervals ``[start, end]``."""
  starts_a = np.asarray(starts, dtype=np.int64)
  ends_a = np.asarray(ends, dtype=np.int64)
  bytes_a = np.asarray(nbytes, dtype=np.int64)
  diff = np.zeros(num_positions + 1, dtype=np.int64)
  np.add.at(diff, starts_a, bytes_a)
  np.add.at(diff, ends_a + 1, -bytes_a)
  live = np.cumsum(diff[:-1])
  if transient is not None and len(transient):
    live = live + np.asarray(transient, dtype=np.int64)
  peak_index = int(np.argmax(live)) if len(live) else 0
  peak = int(live[peak_index]) if len(live) else 0
  at_peak = np.nonzero((starts_a <= peak_index) & (ends_a >= peak_index) & (bytes_a > 0))[0]
  order = at_peak[np.argsort(-bytes_a[at_peak], kind="stable")]
  return Profile(live, peak, peak_index, tuple(int(i) for i in order),
                 tuple(int(bytes_a[i]) for i in order))


def program_profile(program) -> Profile:  # noqa: ANN001 (Program, avoids import cycle)
  """Profile of an unplanned :class:`~jaxmem._src.trace.Program`."""
  n = program.num_ops
  starts, ends, sizes = [], [], []
  for v in program.vars:
    s, e = program.interval(v.id)
    starts.append(s)
    ends.append(e)
    sizes.append(v.nbytes)
  transient = [op.transient_bytes for op in program.ops] + [0]
  return profile_from_intervals(n + 1, starts, ends, sizes, transient)
