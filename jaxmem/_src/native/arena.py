"""Host arenas: the allocators that hold offloaded bytes in host memory.

Python side of ``ffi/arena/`` (one file per allocator, ``host_arena.h`` the interface).
Three modes of one interface:

* ``"virtual"`` -- Hayakawa et al. §4 (*Out-of-core training for extremely
  large-scale neural networks with adaptive window-based scheduling*), "Reducing memory
  fragmentation with virtual addressing": a pool of fixed-size physical chunks
  (one ``memfd_create`` file grown by ``ftruncate``) mapped with
  ``mmap(MAP_FIXED | MAP_SHARED)`` into a fresh contiguous virtual range per
  allocation. Chunks combine in any order, so there is no external
  fragmentation; the waste is internal, under one chunk per allocation (§4
  eq. (1)). Footprint = the pool (chunks ever created).
* ``"best_fit"`` -- the "best-fit with caching" allocator §4 names as the
  framework default (TensorFlow BFC, PyTorch's caching allocator): segments of
  at least ``segment_bytes`` from the OS, never returned; best-fit block
  choice with splitting and coalescing of free neighbours in a segment.
  Footprint = the sum of segments; it fragments (Hayakawa et al. Fig. 3(a)).
* ``"planned"`` -- static offsets from an offline DSA solver (Zhang et al.,
  SmartPool §III): one buffer of the planned footprint, slot ``id`` at
  ``offset[id]``. A wrong size, an id already live or a slot overlapping a
  live one raises instead of aliasing live data.

The native host store behind jaxmem's offload/fetch custom calls allocates
from one of these arenas too (``"best_fit"``, or ``"virtual"``, or its original
``"heap"`` cache; in its default mode ``"planned"``, a plan's buffers go to a
planned arena of the plan's layout and the rest to best-fit): see
:func:`jaxmem.native.store_configure` and ``jaxmem.native.store_stats().arena``.

Handles are opaque 64-bit ints that are never reused; freeing or reading a
stale, double-freed or foreign handle raises :class:`ValueError` naming the
handle and the reason. Pointers are 64-byte aligned.

Fragmentation (the same definitions for every mode, see :class:`ArenaStats`):
internal = ``1 - requested_live / live`` (rounding waste among live blocks);
external = ``1 - largest_free_block / free`` with ``free = footprint - live``
(the share of cached free memory a single request could not use).

:func:`replay` runs an alloc/free trace on an arena; the trace of a jaxmem
plan (an offload step allocates the value's bytes, its fetch frees them) is
:func:`jaxmem._src.plan.host_trace.offload_trace`. ``bench/fragmentation.py``
uses both for the analogue of Hayakawa et al. Fig. 3.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.native.extension import native_module as _native


MODES = ("virtual", "best_fit", "planned")
ALIGNMENT = 64
DEFAULT_CHUNK_BYTES = 2 << 20    # Hayakawa et al. §4: the CUDA minimum chunk is 2 MB
DEFAULT_SEGMENT_BYTES = 2 << 20  # PyTorch's caching allocator: 2 MiB small-pool segments

# A trace event: ``(time, id, nbytes)`` allocates ``id`` (>= 1) with
# ``nbytes`` bytes (or, for a planned arena, plan slot ``id``);
# ``(time, -id)`` frees it.
TraceEvent = Union[tuple[float, int, int], tuple[float, int]]


def _require_native() -> None:
  if not hasattr(_native, "make_arena"):
    raise ImportError("this build of jaxmem._native has no host arena (ffi/arena/); "
                      "rebuild the extension")


@dataclasses.dataclass(frozen=True)
class ArenaStats:
  """A snapshot of a host arena's counters.

  Attributes:
    mode: ``"virtual"``, ``"best_fit"`` or ``"planned"`` (``"heap"``: the
      host store's original allocator, see :func:`jaxmem.native.store_configure`).
    footprint_bytes: memory obtained from the OS and held (pool, segments or
      the planned buffer).
    peak_footprint_bytes: the maximum footprint (dynamic modes never shrink).
    capacity_bytes: footprint limit (0: unbounded).
    live_bytes: reserved (rounded) bytes of live allocations.
    peak_live_bytes: maximum of ``live_bytes``.
    requested_live_bytes: requested bytes of live allocations (before rounding).
    peak_requested_bytes: maximum of ``requested_live_bytes``: the peak load,
      what an ideal allocator's footprint would be (SmartPool §II).
    live_allocations: number of live allocations.
    free_bytes: ``footprint_bytes - live_bytes``.
    largest_free_block_bytes: the largest request the cached free memory can
      serve without growing (virtual: every free chunk, as chunks combine).
    internal_fragmentation: ``1 - requested_live_bytes / live_bytes``; 0 when
      nothing is live.
    external_fragmentation: ``1 - largest_free_block_bytes / free_bytes``; 0
      when nothing is free. Always 0 for virtual chunks.
    allocs: successful allocations.
    frees: successful frees.
    errors: failed calls (bad handles, plan mismatches, out of memory).
    grows: times the footprint grew (memory obtained from the OS); the other
      ``allocs - grows`` allocations were served from cached memory.
    map_calls: virtual: ``mmap`` calls (one reservation per allocation plus one
      per run of consecutive physical chunks).
    unmap_calls: virtual: ``munmap`` calls.
    segments: best-fit: segments obtained from the OS.
    chunk_bytes: virtual: physical chunk size.
    pool_chunks: virtual: chunks in the physical pool.
    free_chunks: virtual: pool chunks not mapped now.
    segment_bytes: best-fit: minimum segment size.
  """
  mode: str
  footprint_bytes: int
  peak_footprint_bytes: int
  capacity_bytes: int
  live_bytes: int
  peak_live_bytes: int
  requested_live_bytes: int
  peak_requested_bytes: int
  live_allocations: int
  free_bytes: int
  largest_free_block_bytes: int
  internal_fragmentation: float
  external_fragmentation: float
  allocs: int
  frees: int
  errors: int
  grows: int = 0
  map_calls: int = 0
  unmap_calls: int = 0
  segments: int = 0
  chunk_bytes: int = 0
  pool_chunks: int = 0
  free_chunks: int = 0
  segment_bytes: int = 0

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ArenaStats:
    """Builds the snapshot from the native ``stats()`` dict."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})

  @property
  def overhead(self) -> float:
    """``peak_footprint_bytes / peak_requested_bytes``: SmartPool's competitive ratio (1: ideal)."""
    if not self.peak_requested_bytes:
      return 1.0
    return self.peak_footprint_bytes / self.peak_requested_bytes

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    return (f"{self.mode}: footprint {format_bytes(self.footprint_bytes)} "
            f"(peak {format_bytes(self.peak_footprint_bytes)}), live "
            f"{format_bytes(self.live_bytes)} in {self.live_allocations} "
            f"(peak {format_bytes(self.peak_live_bytes)}, requested peak "
            f"{format_bytes(self.peak_requested_bytes)}), fragmentation internal "
            f"{self.internal_fragmentation:.1%} external {self.external_fragmentation:.1%}")


def _as_u8(data: Any) -> np.ndarray:
  """A 1-D contiguous uint8 view (or copy) of bytes-like or array data."""
  if isinstance(data, (bytes, bytearray, memoryview)):
    return np.frombuffer(data, dtype=np.uint8)
  arr = np.ascontiguousarray(np.asarray(data))
  return arr.reshape(-1).view(np.uint8)


class HostArena:
  """A native host arena (see the module docstring for the modes).

  Thread-safe; usable as a context manager that closes it (releasing all of
  its memory; later calls raise :class:`ValueError`).

  Example:
    >>> with HostArena("virtual", chunk_bytes=64 << 10) as arena:
    ...   h = arena.allocate(1000)
    ...   arena.write(h, b"x" * 1000)
    ...   bytes(arena.read(h)[:3])
    b'xxx'

  Args:
    mode: ``"virtual"``, ``"best_fit"`` or ``"planned"`` (``"heap"``: the
      host store's original allocator, see :func:`jaxmem.native.store_configure`).
    chunk_bytes: virtual: physical chunk size, a multiple of the page size.
    segment_bytes: best-fit: minimum segment size (rounded up to pages).
    capacity_bytes: dynamic modes: footprint limit; 0 for unbounded. An
      allocation that would exceed it raises :class:`MemoryError`.
    offsets: planned: ``{id: offset}`` or a sequence indexed by id; offsets
      must be multiples of 64.
    sizes: planned: ``{id: nbytes}`` or a sequence, the same ids as ``offsets``.
    footprint: planned: buffer size; default ``max(offset + size)``.

  Raises:
    ValueError: bad arguments (unknown mode, misaligned or out-of-range slots).
    OSError: ``"virtual"`` where ``memfd_create`` is unavailable.
  """

  def __init__(self, mode: str = "virtual", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               segment_bytes: int = DEFAULT_SEGMENT_BYTES, capacity_bytes: int = 0,
               offsets: Mapping[int, int] | Sequence[int] | None = None,
               sizes: Mapping[int, int] | Sequence[int] | None = None,
               footprint: int | None = None) -> None:
    _require_native()
    if mode not in MODES:
      raise ValueError(f"unknown arena mode {mode!r}: expected one of {MODES}")
    self._mode = mode
    self._impl = _native.make_arena(
        mode, chunk_bytes=chunk_bytes, segment_bytes=segment_bytes,
        capacity_bytes=capacity_bytes,
        offsets=dict(offsets) if isinstance(offsets, Mapping) else
        (None if offsets is None else [int(x) for x in offsets]),
        sizes=dict(sizes) if isinstance(sizes, Mapping) else
        (None if sizes is None else [int(x) for x in sizes]),
        footprint=footprint)

  @property
  def mode(self) -> str:
    return self._mode

  @property
  def closed(self) -> bool:
    return self._impl.closed

  def allocate(self, size_or_id: int, nbytes: int | None = None) -> int:
    """Allocates memory and returns its handle.

    Args:
      size_or_id: bytes to allocate (virtual / best-fit), or the plan id
        (planned).
      nbytes: planned: the size the caller needs, checked against the plan
        (default: the planned size). Dynamic modes: must equal ``size_or_id``
        when given.

    Returns:
      The 64-bit handle.

    Raises:
      ValueError: planned: unknown id, size mismatch, id already live, or a
        slot overlapping a live one.
      MemoryError: the capacity (or the OS) refused the memory.
    """
    return self._impl.allocate(int(size_or_id), None if nbytes is None else int(nbytes))

  def free(self, handle: int) -> None:
    """Frees a live allocation.

    Raises:
      ValueError: a double free, or a handle this arena never issued.
    """
    self._impl.free(int(handle))

  def write(self, handle: int, data: Any, offset: int = 0) -> None:
    """Copies ``data`` (bytes-like or an array, as raw bytes) into the allocation at ``offset``."""
    self._impl.write(int(handle), _as_u8(data), int(offset))

  def read(self, handle: int, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
    """Copies ``nbytes`` bytes (default: to the end) from ``offset`` into a new uint8 array."""
    return self._impl.read(int(handle), int(offset), None if nbytes is None else int(nbytes))

  def lookup(self, handle: int) -> dict[str, int]:
    """``{handle, address, nbytes, reserved_bytes, id}`` of a live allocation."""
    return dict(self._impl.lookup(int(handle)))

  def free_all(self) -> int:
    """Frees every live allocation (the footprint stays cached); returns how many."""
    return self._impl.free_all()

  def stats(self) -> ArenaStats:
    """A snapshot of the counters."""
    return ArenaStats.from_dict(self._impl.stats())

  def stress(self, n_ops: int = 1_000_000, *, seed: int = 0, max_bytes: int = 65536,
             threads: int = 1, max_live: int = 256, bad_handle_every: int = 997) -> dict[str, Any]:
    """Runs the C++ stress driver on this arena (see :func:`stress`)."""
    return dict(self._impl.stress(n_ops=n_ops, seed=seed, max_bytes=max_bytes, threads=threads,
                                  max_live=max_live, bad_handle_every=bad_handle_every))

  def close(self) -> None:
    """Releases the arena's memory. Idempotent."""
    self._impl.close()

  def __enter__(self) -> HostArena:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    if self.closed:
      return f"HostArena({self._mode!r}, closed)"
    s = self.stats()
    extra = (f", chunk_bytes={s.chunk_bytes}" if self._mode == "virtual" else
             f", segment_bytes={s.segment_bytes}" if self._mode == "best_fit" else "")
    return (f"HostArena({self._mode!r}{extra}, live={s.live_allocations} "
            f"({format_bytes(s.live_bytes)}), footprint={format_bytes(s.footprint_bytes)})")


def stress(mode: str, n_ops: int = 1_000_000, *, seed: int = 0, max_bytes: int = 65536,
           threads: int = 1, chunk_bytes: int = 64 << 10,
           segment_bytes: int = DEFAULT_SEGMENT_BYTES, capacity_bytes: int = 0,
           max_live: int = 256, bad_handle_every: int = 997) -> dict[str, Any]:
  """Random alloc/free operations on a fresh arena, entirely in C++ (GIL released).

  Each allocation (log-uniform size in ``[1, max_bytes]``, 1 in 1000 of zero
  bytes) is filled with a pattern derived from ``(handle, seed)`` and verified
  before it is freed (a random live block, so frees are not LIFO); every
  ``bad_handle_every`` ops a double free, a stale read and a foreign free are
  tried and must fail. Everything is freed at the end. ``threads`` threads
  share the arena, ``n_ops`` in total.

  Returns:
    ``{corrupted, ops, allocs, frees, alloc_failures, free_failures,
    bad_handle_probes, bad_handle_accepted, peak, peak_requested, footprint,
    live_at_end, live_allocations_at_end, seconds, first_error, stats}``.
  """
  _require_native()
  return dict(_native.arena_stress(
      mode, n_ops=n_ops, seed=seed, max_bytes=max_bytes, threads=threads,
      chunk_bytes=chunk_bytes, segment_bytes=segment_bytes, capacity_bytes=capacity_bytes,
      max_live=max_live, bad_handle_every=bad_handle_every))


# Traces ------------------------------------------------------------------------

def _normalize(trace: Iterable[Sequence[Any]]) -> list[tuple[float, int, int]]:
  """``(time, id, nbytes)`` with ``nbytes = -1`` for frees, stably sorted by time."""
  out = []
  for ev in trace:
    if len(ev) == 3 and ev[1] > 0:
      out.append((float(ev[0]), int(ev[1]), int(ev[2])))
    elif len(ev) == 2 and ev[1] < 0:
      out.append((float(ev[0]), -int(ev[1]), -1))
    else:
      raise ValueError(f"bad trace event {ev!r}: expected (time, id, nbytes) with id >= 1 "
                       "or (time, -id)")
  return sorted(out, key=lambda e: e[0])


def lifetimes(trace: Iterable[Sequence[Any]]) -> list[tuple[int, int, int, int]]:
  """``(id, lower, upper, nbytes)`` per allocation: half-open event-index intervals.

  An id never freed lives to the end. An id may be allocated again after its
  free (each allocation is its own interval).
  """
  events = _normalize(trace)
  open_: dict[int, tuple[int, int]] = {}
  out = []
  for k, (_, i, n) in enumerate(events):
    if n >= 0:
      if i in open_:
        raise ValueError(f"trace allocates id {i} twice without a free")
      open_[i] = (k, n)
    else:
      if i not in open_:
        raise ValueError(f"trace frees id {i}, which is not live")
      lo, nb = open_.pop(i)
      out.append((i, lo, k, nb))
  out.extend((i, lo, len(events), nb) for i, (lo, nb) in open_.items())
  return out


def _greedy_offsets(lower: np.ndarray, upper: np.ndarray, size: np.ndarray) -> np.ndarray:
  """SmartPool §III-C best fit: largest first, smallest hole left by time-overlapping buffers."""
  order = sorted(range(len(size)), key=lambda k: (-size[k], lower[k]))
  offsets = np.zeros(len(size), dtype=np.int64)
  placed: list[int] = []
  for k in order:
    busy = sorted((offsets[j], offsets[j] + size[j]) for j in placed
                  if lower[j] < upper[k] and lower[k] < upper[j] and size[j] > 0)
    best, best_gap, at = None, None, 0
    for lo, hi in busy:
      gap = lo - at
      if gap >= size[k] and (best_gap is None or gap < best_gap):
        best, best_gap = at, gap
      at = max(at, hi)
    offsets[k] = at if best is None else best
    placed.append(k)
  return offsets


def planned_layout(trace: Iterable[Sequence[Any]]) -> tuple[dict[int, int], dict[int, int], int]:
  """Offline DSA layout of a trace for a planned arena (Zhang et al., SmartPool §III).

  Sizes are rounded up to 64 bytes (the arena's alignment). Uses the native
  solver (``ffi/dsa.cc``, best fit) when built, else the same heuristic in
  Python. An id allocated several times must keep its size; it gets one slot
  valid for all of its lifetimes.

  Returns:
    ``(offsets, sizes, footprint)``: ``{id: offset}``, ``{id: nbytes}`` (the
    requested, unrounded sizes) and the planned footprint.
  """
  lives = lifetimes(trace)
  if not lives:
    return {}, {}, 0
  sizes: dict[int, int] = {}
  span: dict[int, tuple[int, int]] = {}
  for i, lo, hi, n in lives:
    if sizes.setdefault(i, n) != n:
      raise ValueError(f"id {i} is allocated with two sizes ({sizes[i]} and {n}): a planned "
                       "arena needs one size per id")
    a, b = span.get(i, (lo, hi))
    span[i] = (min(a, lo), max(b, hi))
  ids = sorted(sizes)
  lower = np.array([span[i][0] for i in ids], dtype=np.int64)
  upper = np.array([span[i][1] for i in ids], dtype=np.int64)
  rounded = np.array([-(-sizes[i] // ALIGNMENT) * ALIGNMENT for i in ids], dtype=np.int64)
  if hasattr(_native, "dsa_solve"):
    res = _native.dsa_solve(lower, upper, rounded, method="best-fit")
    offs = np.asarray(res["offsets"], dtype=np.int64)
  else:  # pragma: no cover - depends on the build
    offs = _greedy_offsets(lower, upper, rounded)
  offsets = {i: int(o) for i, o in zip(ids, offs)}
  footprint = int(max((o + r for o, r in zip(offs, rounded)), default=0))
  return offsets, sizes, footprint


def replay(trace: Iterable[Sequence[Any]], mode: str = "virtual", *, iterations: int = 1,
           verify: bool = False, **opts: Any) -> ArenaStats:
  """Replays an alloc/free trace on a fresh arena and returns its final stats.

  Events are applied in time order (ties: in the given order). A planned arena
  gets its layout from :func:`planned_layout`. Allocations still live at the
  end of an iteration are freed then. Without ``verify`` nothing is written,
  so the memory is reserved but never touched: traces of gigabytes replay in
  milliseconds.

  Args:
    trace: events ``(time, id, nbytes)`` (allocate; id >= 1) and
      ``(time, -id)`` (free).
    mode: ``"virtual"``, ``"best_fit"`` or ``"planned"`` (``"heap"``: the
      host store's original allocator, see :func:`jaxmem.native.store_configure`).
    iterations: times to run the trace on the same arena (training steps:
      a caching allocator's footprint can keep growing after the first).
    verify: fill each allocation with a pattern and check it before its free.
    **opts: :class:`HostArena` arguments (``chunk_bytes``, ``segment_bytes``,
      ``capacity_bytes``).

  Returns:
    The arena's :class:`ArenaStats` after the last iteration (peak fields
    cover the whole replay).

  Raises:
    ValueError: a malformed trace (a free of an id that is not live, ...), or
      a checksum mismatch under ``verify``.
    MemoryError: the trace exceeds ``capacity_bytes``.
  """
  events = _normalize(trace)
  if mode == "planned":
    offsets, sizes, footprint = planned_layout([(t, i, n) if n >= 0 else (t, -i)
                                                for t, i, n in events])
    opts = {**opts, "offsets": offsets, "sizes": sizes, "footprint": footprint}
  rng = np.random.default_rng(0)
  with HostArena(mode, **opts) as arena:
    for _ in range(iterations):
      live: dict[int, tuple[int, np.ndarray | None]] = {}
      for _, i, n in events:
        if n >= 0:
          if i in live:
            raise ValueError(f"trace allocates id {i} twice without a free")
          h = arena.allocate(i, n) if mode == "planned" else arena.allocate(n)
          pattern = None
          if verify and n > 0:
            pattern = rng.integers(0, 256, size=n, dtype=np.uint8)
            arena.write(h, pattern)
          live[i] = (h, pattern)
        else:
          if i not in live:
            raise ValueError(f"trace frees id {i}, which is not live")
          h, pattern = live.pop(i)
          if pattern is not None and not np.array_equal(arena.read(h), pattern):
            raise ValueError(f"checksum mismatch for trace id {i} (handle {h:#018x})")
          arena.free(h)
      for h, _ in live.values():
        arena.free(h)
    return arena.stats()


__all__ = ["ALIGNMENT", "ArenaStats", "HostArena", "MODES", "TraceEvent", "lifetimes",
           "planned_layout", "replay", "stress"]
