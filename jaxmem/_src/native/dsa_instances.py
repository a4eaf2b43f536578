"""Random static-allocation instances of the character of the public hard ones, with a witness.

The public "challenging" instances of static memory allocation (from
compiled accelerator programs, published with MiniMalloc: Moffitt,
*MiniMalloc: A Lightweight Memory Allocator for Hardware-Accelerated Machine
Learning*, ASPLOS 2023) have 150 to 450 buffers on a time axis of 2**20
units, sizes that are multiples of 1 KiB from 1 KiB to about 0.85 MiB, and a
capacity of 1 MiB that the max load meets or nearly meets: a placement at
capacity has to be *found*, a good one is not enough.

:func:`tiling_instance` makes instances of that character that are
feasible by construction: it cuts the rectangle ``[0, 2**20) x [0, capacity)``
(time x bytes) into buffers by random guillotine cuts, so the buffers tile it
exactly (every time step's live bytes equal the capacity), then
drops buffers: optionally a few live at the busiest time, so that the max
load ends up to ``slack`` below the capacity, then random ones that are not
live at the busiest time (nor at a few random times), so that the load
varies over time as in the public instances. The tiling is returned as a witness (``offsets``), so a
test can tell a solver's failure from an infeasible instance.

Example:
  >>> inst = tiling_instance(0, num_buffers=200)
  >>> len(inst.size), inst.capacity, int(inst.size.max()) <= 0.85 * 2**20
  (200, 1048576, True)
  >>> from jaxmem import dsa
  >>> dsa.check(inst.lower, inst.upper, inst.size, inst.offsets) <= inst.capacity
  True
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

__all__ = ["Instance", "tiling_instance", "program_instance"]

#: Sizes are multiples of this (bytes), as in the public instances.
UNIT = 1024
#: No buffer is larger than this fraction of the capacity.
MAX_SIZE_FRACTION = 0.85


class Instance(NamedTuple):
  """A DSA instance with a capacity and a placement that fits it.

  Attributes:
    lower, upper: int64 half-open lifetimes ``[lower, upper)``.
    size: int64 bytes.
    capacity: bytes available.
    offsets: a valid placement within ``capacity`` (the construction's).
  """
  lower: np.ndarray
  upper: np.ndarray
  size: np.ndarray
  capacity: int
  offsets: np.ndarray


def tiling_instance(seed: int, *, num_buffers: int | None = None,
                         capacity: int = 1 << 20, horizon: int = 1 << 20,
                         slack: float | None = None) -> Instance:
  """A feasible instance whose max load equals the capacity or is within ``slack`` of it.

  Args:
    seed: the random seed (the same seed gives the same instance).
    num_buffers: how many buffers (default: drawn from 150..450).
    capacity: bytes (a multiple of 1 KiB; default 1 MiB).
    horizon: length of the time axis (default 2**20).
    slack: the largest fraction of the capacity by which the max load may
      fall short of it: buffers are dropped from the tiling, at random, while
      the max load stays within it. 0: a perfect tiling (max load ==
      capacity). Default: 0 for half of the seeds, else drawn from (0, 0.06].

  Returns:
    An :class:`Instance`, buffers in random order.
  """
  rng, n, slack = _draw(seed, num_buffers, capacity, horizon, slack, fewest=150)
  units = capacity // UNIT
  max_units = max(1, int(MAX_SIZE_FRACTION * units))
  # Rectangles (time0, time1, unit0, unit1); the largest area is cut next
  # (a max-heap on -area), across time or bytes at a random point, so that
  # sizes and lifetimes both spread over orders of magnitude.
  # Tile with more buffers than asked, then drop some off the peak: the
  # public instances are full at their peak but not everywhere (their mean
  # load is 0.57 to 0.98 of the capacity).
  tiles = max(n, round(n * float(rng.uniform(1.05, 1.7))))
  heap: list[tuple[int, int, int, int, int, int]] = []
  counter = 0

  def push(t0: int, t1: int, u0: int, u1: int) -> None:
    nonlocal counter
    area = (t1 - t0) * (u1 - u0) / (horizon * units)
    # The larger rectangles are cut first, with noise so that some survive.
    key = -area * float(rng.uniform(0.25, 1.0))
    heapq.heappush(heap, (key, counter, t0, t1, u0, u1))
    counter += 1

  push(0, horizon, 0, units)
  done: list[tuple[int, int, int, int]] = []
  while heap and len(heap) + len(done) < tiles:
    _, _, t0, t1, u0, u1 = heapq.heappop(heap)
    can_time, can_bytes = t1 - t0 >= 2, u1 - u0 >= 2
    if not (can_time or can_bytes):
      done.append((t0, t1, u0, u1))
      continue
    # Cut across bytes when too tall, else either way, weighing the
    # rectangle's shape so that neither side gets long and thin.
    tall = (u1 - u0) > max_units
    p_bytes = 1.0 if tall or not can_time else (
        0.0 if not can_bytes else float(np.clip(0.5 + 0.15 * np.log2(
            ((u1 - u0) / units) / ((t1 - t0) / horizon)), 0.15, 0.85)))
    cut = float(rng.beta(2.0, 2.0))
    if rng.random() < p_bytes:
      at = u0 + min(max(1, round(cut * (u1 - u0))), u1 - u0 - 1)
      push(t0, t1, u0, at)
      push(t0, t1, at, u1)
    else:
      at = t0 + min(max(1, round(cut * (t1 - t0))), t1 - t0 - 1)
      push(t0, at, u0, u1)
      push(at, t1, u0, u1)
  rects = done + [(t0, t1, u0, u1) for _, _, t0, t1, u0, u1 in heap]
  # Still too tall (only when num_buffers is too small to cut them): halve.
  while any(u1 - u0 > max_units for _, _, u0, u1 in rects):
    t0, t1, u0, u1 = next(r for r in rects if r[3] - r[2] > max_units)
    rects.remove((t0, t1, u0, u1))
    mid = (u0 + u1) // 2
    rects += [(t0, t1, u0, mid), (t0, t1, mid, u1)]
  table = np.asarray(rects, dtype=np.int64).reshape(-1, 4)
  lower, upper = table[:, 0].copy(), table[:, 1].copy()
  size, offsets = (table[:, 3] - table[:, 2]) * UNIT, table[:, 2] * UNIT
  keep = np.arange(len(size))
  if slack > 0:
    keep = _drop_within(lower, upper, size, capacity, slack, rng)
  keep = _drop_off_peak(lower[keep], upper[keep], size[keep], n, rng, keep)
  order = keep[rng.permutation(len(keep))]
  return Instance(lower[order], upper[order], size[order], int(capacity), offsets[order])


def _draw(seed: int, num_buffers: int | None, capacity: int, horizon: int, slack: float | None,
          fewest: int) -> tuple[np.random.Generator, int, float]:
  """Checks the generators' arguments; the random generator, the buffer count and the slack."""
  if capacity <= 0 or capacity % UNIT:
    raise ValueError(f"`capacity` must be a positive multiple of {UNIT} bytes; got {capacity}")
  if horizon < 2:
    raise ValueError(f"`horizon` must be >= 2 time units; got {horizon}")
  rng = np.random.default_rng(seed)
  n = int(rng.integers(fewest, 451)) if num_buffers is None else int(num_buffers)
  if n < 1:
    raise ValueError(f"`num_buffers` must be >= 1; got {num_buffers}")
  if slack is None:
    slack = 0.0 if rng.random() < 0.5 else float(rng.uniform(0.005, 0.06))
  if not 0.0 <= slack < 1.0:
    raise ValueError(f"`slack` must be in [0, 1); got {slack}")
  return rng, n, float(slack)


def live_by_time(lower: np.ndarray, upper: np.ndarray, size: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The distinct times, each buffer's first and end index among them, and the live bytes.

  ``live[k]`` is the bytes live on ``[times[k], times[k + 1])`` (0 at the last time).
  """
  times = np.unique(np.concatenate([lower, upper]))
  lo_idx, up_idx = np.searchsorted(times, lower), np.searchsorted(times, upper)
  live = np.zeros(len(times), dtype=np.int64)
  for a, b, s in zip(lo_idx, up_idx, size):
    live[a:b] += s
  return times, lo_idx, up_idx, live


def _drop_within(lower: np.ndarray, upper: np.ndarray, size: np.ndarray, capacity: int,
                 slack: float, rng: np.random.Generator) -> np.ndarray:
  """Indexes of the buffers kept after dropping some live at the peak, the max load staying >= (1 - slack) * capacity.

  A buffer live at the busiest time is dropped while that lowers the max
  load and keeps it above the floor; so the max load ends between the floor
  and the capacity, and the tiling still fits.
  """
  _, lo_idx, up_idx, live = live_by_time(lower, upper, size)
  floor = int(np.ceil((1.0 - slack) * capacity))
  keep = np.ones(len(size), dtype=bool)
  for _ in range(len(size)):
    peak = int(np.argmax(live))
    at_peak = np.flatnonzero(keep & (lo_idx <= peak) & (up_idx > peak))
    fits = at_peak[live[peak] - size[at_peak] >= floor]
    if len(fits) == 0:
      break
    i = int(rng.choice(fits))
    live[lo_idx[i]:up_idx[i]] -= size[i]
    keep[i] = False
  return np.flatnonzero(keep)


def _drop_off_peak(lower: np.ndarray, upper: np.ndarray, size: np.ndarray, n: int,
                   rng: np.random.Generator, index: np.ndarray) -> np.ndarray:
  """``index`` less random buffers not live at the busiest time nor at a few random times, down to ``n``."""
  times, lo_idx, up_idx, live = live_by_time(lower, upper, size)
  peaks = [int(np.argmax(live))] + [int(t) for t in rng.integers(0, len(times) - 1,
                                                                  int(rng.integers(0, 5)))]
  protected = np.zeros(len(size), dtype=bool)
  for t in peaks:
    protected |= (lo_idx <= t) & (up_idx > t)
  free = rng.permutation(np.flatnonzero(~protected))
  drop = free[:max(0, len(size) - n)]
  return np.delete(index, drop)


def program_instance(seed: int, *, num_buffers: int | None = None, capacity: int = 1 << 20,
                     horizon: int = 1 << 20, slack: float | None = None,
                     grouped: bool = False) -> Instance:
  """A feasible instance made by running a program's allocations in ``capacity`` bytes.

  Ops run at even times; each allocates one buffer (sizes log-uniform over
  1 KiB .. 0.85 of the capacity, skewed small; lifetimes mostly short, some
  long-lived like saved activations) at a random 1 KiB-aligned place in a
  random free gap that fits (or shrunk to the largest gap), and buffers are
  freed when their lifetime ends. At a few ops every free gap is filled by a
  buffer of its exact size, so that the live bytes reach the capacity there.
  The run's placement is the witness; the solver has to find a placement of
  its own at the capacity. ``slack`` as in :func:`tiling_instance`.

  With ``grouped=True`` the run looks like a compiled program's: an op
  allocates one buffer or several (1 + Poisson(0.8)), half of an op's
  buffers share the lifetime of its first one, and every buffer is freed at
  an op's time (its last reader's), so buffers share start and end times
  (the public suite has 0.47 to 0.63 distinct times per buffer and 1.25 to
  1.51 buffers per distinct lifetime, ``bench/results/dsa.md``; without
  ``grouped`` every buffer has times of its own).

  Example:
    >>> inst = program_instance(0, num_buffers=200)
    >>> from jaxmem import dsa
    >>> load = dsa.max_load(inst.lower, inst.upper, inst.size)
    >>> 0.94 * inst.capacity <= load <= inst.capacity
    True
    >>> dsa.check(inst.lower, inst.upper, inst.size, inst.offsets) <= inst.capacity
    True
  """
  # A few buffers may be dropped for `slack`: draw from 165 so that 150 remain.
  rng, n, slack = _draw(seed, num_buffers, capacity, horizon, slack, fewest=165)
  units = capacity // UNIT
  max_units = max(1, int(MAX_SIZE_FRACTION * units))
  fills = int(rng.integers(1, 5))
  ops = n if not grouped else max(8, int(round(n / 1.8)))
  step = max(1, horizon // (ops + 1))
  # The fills come in the middle of the run, when memory has filled up.
  fill_at = (set(int(x) for x in rng.choice(np.arange(ops // 4, (3 * ops) // 4), size=fills,
                                           replace=False)) if ops >= 8 else {ops // 2})
  live: list[tuple[int, int, int]] = []   # (end time, unit0, unit1)
  rows: list[tuple[int, int, int, int]] = []   # (lower, upper, unit0, unit1)

  def gaps() -> list[tuple[int, int]]:
    taken = sorted((u0, u1) for _, u0, u1 in live)
    out, cursor = [], 0
    for u0, u1 in taken:
      if u0 > cursor:
        out.append((cursor, u0))
      cursor = max(cursor, u1)
    if cursor < units:
      out.append((cursor, units))
    return out

  def lifetime() -> int:
    if rng.random() < 0.7:
      return int(rng.exponential(25_000)) + 1
    return int(rng.uniform(60_000, 400_000))

  def snap(end: int) -> int:
    # A compiled program frees a buffer at an op's time (its last reader's).
    return end if not grouped else min(horizon, max(step, -(-end // step) * step))

  for k in range(ops):
    if len(rows) >= n:
      break
    t = (k + 1) * step
    live = [x for x in live if x[0] > t]
    first_end = None
    for _ in range(1 + (int(rng.poisson(0.8)) if grouped else 0)):
      free = gaps()
      if not free or len(rows) >= n:
        break
      want = min(max_units, max(1, int(round(2 ** rng.normal(np.log2(48), 1.6)))))
      fitting = [g for g in free if g[1] - g[0] >= want]
      if fitting:
        g0, g1 = fitting[int(rng.integers(len(fitting)))]
        at = g0 + int(rng.integers(0, g1 - g0 - want + 1))
      else:
        g0, g1 = max(free, key=lambda g: g[1] - g[0])
        want, at = g1 - g0, g0
      if first_end is not None and rng.random() < 0.5:
        end = first_end
      else:
        end = max(t + 1, snap(min(horizon, t + lifetime())))
      first_end = end if first_end is None else first_end
      live.append((end, at, at + want))
      rows.append((t, end, at, at + want))
    if k in fill_at:
      for g0, g1 in gaps():
        while g1 - g0 > 0:
          piece = min(g1 - g0, max_units)
          end = max(t + 1, snap(min(horizon, t + 1 + lifetime())))
          live.append((end, g0, g0 + piece))
          rows.append((t, end, g0, g0 + piece))
          g0 += piece
  table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
  lower, upper = table[:, 0].copy(), np.maximum(table[:, 1], table[:, 0] + 1)
  size, offsets = (table[:, 3] - table[:, 2]) * UNIT, table[:, 2] * UNIT
  keep = np.arange(len(size))
  if slack > 0:
    keep = _drop_within(lower, upper, size, capacity, slack, rng)
  order = keep[rng.permutation(len(keep))]
  return Instance(lower[order], upper[order], size[order], int(capacity), offsets[order])
