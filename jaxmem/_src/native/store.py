"""The native host store behind the offload ops, and the asynchronous copy engine.

The host store (``ffi/host_store.h``) keeps offloaded bytes in a host arena
(``ffi/arena/host_arena.h``, :mod:`jaxmem._src.native.arena`), chosen by
:func:`store_configure` or by ``$JAXMEM_HOST_ARENA`` (read at the store's first
use): ``"planned"`` (the default: a plan's host buffers at the static offsets
of its layout, solved offline before the step runs, SmartPool §III, and
best-fit for the rest; :func:`store_register_plan`), ``"best_fit"`` (the
framework-default caching allocator of Hayakawa et al.'s window-based
out-of-core training, §4), ``"virtual"`` (their physical chunks mapped into
contiguous virtual ranges: no external fragmentation) or ``"heap"`` (the
original ``posix_memalign`` + size cache). :func:`store_stats` reports the
arena's footprint and fragmentation, :func:`store_plan_stats` a layout's.

The copy engine (``ffi/copy_engine.h``) runs the asynchronous copies of
:mod:`jaxmem._src.native.ops` on worker threads; :func:`copy_stats` reports
outstanding tickets, and :func:`store_clear` also frees tickets orphaned by a
failed execution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jaxmem._src.native.arena import ArenaStats
from jaxmem._src.native.extension import native_module as _native


#: Host store arena modes (see :func:`store_configure`).
STORE_MODES = ("planned", "best_fit", "virtual", "heap")
#: Default physical chunk of ``"virtual"`` (Hayakawa et al. §4: CUDA's 2 MB granule).
DEFAULT_CHUNK_BYTES = 2 << 20
#: Default minimum segment of ``"best_fit"`` (PyTorch's small-pool segment).
DEFAULT_SEGMENT_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class StoreStats:
  """Counters of the native host store.

  Attributes:
    live_entries: Entries currently held (offloaded, not yet fetched).
    live_bytes: Payload bytes currently held.
    peak_bytes: Maximum of ``live_bytes`` since the process started.
    total_puts: Successful offloads / ``store_put`` calls.
    total_takes: Successful fetches / ``store_take`` calls.
    total_errors: Failed puts/takes (bad handle, size or dtype mismatch).
    cached_bytes: Arena memory held but not handed out (``arena.free_bytes``:
      best-fit free blocks, free virtual chunks, cached heap buffers), kept
      because first-touch page faults of fresh memory cost more than the copy.
    cache_hits: Host allocations served from such memory (all arenas so far).
    cache_misses: Host allocations that grew the arena's footprint.
    arena: The backing arena's :class:`~jaxmem.ArenaStats` (mode, footprint,
      peak footprint, fragmentation, ...). Its counters restart when
      :func:`store_clear` drops the arena (its memory goes back to the OS).
  """

  live_entries: int
  live_bytes: int
  peak_bytes: int
  total_puts: int
  total_takes: int
  total_errors: int
  cached_bytes: int = 0
  cache_hits: int = 0
  cache_misses: int = 0
  arena: ArenaStats | None = None

  @property
  def mode(self) -> str:
    """The arena mode: ``"best_fit"``, ``"virtual"``, ``"heap"`` (``"invalid"``: bad env)."""
    return self.arena.mode if self.arena is not None else ""

  @property
  def footprint_bytes(self) -> int:
    """Host memory the arena holds now (live entries, copies in flight and cache)."""
    return self.arena.footprint_bytes if self.arena is not None else 0

  @property
  def peak_footprint_bytes(self) -> int:
    """The arena's maximum footprint since it was made."""
    return self.arena.peak_footprint_bytes if self.arena is not None else 0

  @property
  def internal_fragmentation(self) -> float:
    """``1 - requested / reserved`` over live allocations (rounding waste)."""
    return self.arena.internal_fragmentation if self.arena is not None else 0.0

  @property
  def external_fragmentation(self) -> float:
    """``1 - largest free block / free bytes`` (0 for virtual chunks)."""
    return self.arena.external_fragmentation if self.arena is not None else 0.0


def store_stats() -> StoreStats:
  """Returns a snapshot of the host store's counters (and its arena's)."""
  d = dict(_native.store_stats())
  arena = ArenaStats.from_dict(d.pop("arena"))
  return StoreStats(**{k: int(v) for k, v in d.items()}, arena=arena)


def store_configure(mode: str = "planned", *, chunk_bytes: int | None = None,
                    segment_bytes: int | None = None,
                    capacity_bytes: int | None = None) -> None:
  """Chooses the host arena that holds offloaded bytes.

  Allowed only while the store is empty: no entries and no host buffers of
  asynchronous copies in flight (fetch everything, or call :func:`store_clear`
  first). Overrides ``$JAXMEM_HOST_ARENA`` (``"MODE"`` or
  ``"MODE:chunk_bytes=4M,capacity_bytes=8G"``), which the store reads at its
  first use. :func:`store_clear` keeps the configuration.

  Args:
    mode: ``"planned"`` (default): the host buffers of a plan go to their
      slots of the plan's layout, solved offline before the step runs
      (SmartPool, Zhang et al. §III; :func:`store_register_plan`, which the
      ``ffi`` backend calls), so the plan's host footprint is the layout's;
      every other buffer goes to best-fit. ``"best_fit"``: best-fit with
      caching, the framework default of Hayakawa et al. §4; freed memory is
      reused, the footprint may fragment. ``"virtual"``: their fixed-size physical chunks (a memfd)
      mapped into a contiguous virtual range per entry; the footprint is a
      whole number of chunks and never fragments externally (Linux only).
      ``"heap"``: one ``posix_memalign`` per entry plus a cache of freed
      buffers by size (the store's original allocator).
    chunk_bytes: ``"virtual"``: physical chunk size, a multiple of the page
      size (default 2 MiB).
    segment_bytes: ``"best_fit"`` and ``"planned"``: minimum segment obtained
      from the OS (default 2 MiB).
    capacity_bytes: Cap on the arena's footprint; an offload beyond it fails
      with an out-of-memory error naming the arena (default 0: none).

  Raises:
    ValueError: if the store is not empty, or for a bad mode or size (the
      message names ``store_configure``).
  """
  if mode not in STORE_MODES:
    raise ValueError(
        f"store_configure: unknown mode {mode!r}; expected one of {STORE_MODES}")
  sizes = {"chunk_bytes": chunk_bytes, "segment_bytes": segment_bytes,
           "capacity_bytes": capacity_bytes}
  for name, value in sizes.items():
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
      raise ValueError(f"store_configure: {name} must be a non-negative int, got {value!r}")
  _native.store_configure(
      mode,
      DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes,
      DEFAULT_SEGMENT_BYTES if segment_bytes is None else segment_bytes,
      0 if capacity_bytes is None else capacity_bytes)


def store_config() -> dict[str, int | str]:
  """The host store's arena configuration.

  Returns:
    ``{"mode", "chunk_bytes", "segment_bytes", "capacity_bytes", "source",
    "error"}``; ``source`` is ``"default"``, ``"env"`` (``$JAXMEM_HOST_ARENA``)
    or ``"store_configure"``, ``error`` why ``$JAXMEM_HOST_ARENA`` was rejected
    (then every offload fails with that message until :func:`store_configure`).
  """
  return dict(_native.store_config())


def store_clear() -> int:
  """Frees every entry of the host store and every outstanding copy ticket.

  Waits for copies in flight first. Handles and tickets of the freed entries
  become stale: fetching or finishing them fails. Do not call it while a step
  that uses the store runs in another thread. The arena's cached memory goes
  back to the OS (a fresh arena of the same configuration serves the next
  offload), so its footprint counters restart.

  Returns:
    The number of payload bytes freed.
  """
  return int(_native.store_clear()) + int(_native.copy_clear())


@dataclasses.dataclass(frozen=True)
class CopyStats:
  """Counters of the asynchronous copy engine.

  Attributes:
    threads: Worker threads (0: copies run inline in their start op).
    cpus: CPUs the workers are pinned to (empty: not pinned).
    outstanding: Tickets issued by a start and not yet finished by a done
      (0 after every complete step; tickets of a failed execution stay here
      until :func:`store_clear`).
    in_flight: Copies queued or running.
    total_started: Successful start ops.
    total_finished: Successful done ops.
    total_errors: Failed start/done ops.
    stolen: Copies a done ran itself because no worker had started them
      (with every core computing, that is quicker than waiting for one).
    bytes_copied: Payload bytes moved (by workers, or by stealing dones).
    copy_seconds: Time the workers spent copying.
    wait_seconds: Time done ops spent blocked on their copy: the part of
      ``copy_seconds`` the window did not hide.
  """

  threads: int
  cpus: tuple[int, ...]
  outstanding: int
  in_flight: int
  total_started: int
  total_finished: int
  total_errors: int
  stolen: int
  bytes_copied: int
  copy_seconds: float
  wait_seconds: float


def store_register_plan(plan: int, slots: Sequence[int], offsets: Sequence[int],
                        sizes: Sequence[int], footprint: int) -> None:
  """Registers a planned host layout: slot ``slots[i]`` at ``offsets[i]``, ``sizes[i]`` bytes.

  The layout of one plan's host buffers, solved offline (SmartPool, Zhang et
  al., *Efficient Memory Management for GPU-based Deep Learning Systems*,
  §III; :func:`jaxmem.dsa.solve`), in one buffer of ``footprint`` bytes
  mapped at the first use. ``offload(x, slot=(plan, s))`` then copies into slot ``s``.
  Registering a key again replaces its layout; :func:`store_clear` frees the
  buffers, which are made again at the next use.

  Raises:
    ValueError: an offset not 64-byte aligned, a slot outside ``footprint``,
      a negative key or slot, or lengths that differ.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxmem.native import fetch, offload
    >>> store_register_plan(10, slots=[0], offsets=[0], sizes=[16], footprint=64)
    >>> h = offload(jnp.arange(4.0), slot=(10, 0))
    >>> store_plan_stats(10)["planned"], fetch(h, h, shape=(4,), dtype=jnp.float32).tolist()
    (1, [0.0, 1.0, 2.0, 3.0])
  """
  _native.store_register_plan(int(plan), [int(s) for s in slots], [int(o) for o in offsets],
                              [int(n) for n in sizes], int(footprint))


def store_unregister_plan(plan: int) -> None:
  """Forgets a planned layout (nothing if unknown); its buffer is freed once no entry holds a slot."""
  _native.store_unregister_plan(int(plan))


def store_plan_stats(plan: int) -> dict[str, int] | None:
  """Counters of a registered layout, or None: ``footprint`` and ``slots`` (the layout),
  ``planned`` (allocations its slots served), ``fallbacks`` (allocations the store's arena
  served instead: the run's order was not the plan's), ``peak_live_bytes``."""
  return _native.store_plan_stats(int(plan))


def copy_stats() -> CopyStats:
  """Returns a snapshot of the copy engine's counters."""
  d = _native.copy_stats()
  return CopyStats(**{k: (tuple(int(c) for c in v) if k == "cpus" else
                          float(v) if k.endswith("seconds") else int(v)) for k, v in d.items()})


def copy_drain() -> None:
  """Blocks until every asynchronous copy queued so far has finished."""
  _native.copy_drain()


def set_copy_threads(n: int) -> None:
  """Sets the copy engine's worker threads (default 1, or ``$JAXMEM_COPY_THREADS``).

  ``0`` runs each copy inline in its start op, which makes the asynchronous ops
  as slow as the synchronous ones (useful to measure what overlap buys).
  """
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"`n` must be a non-negative int, got {n!r}")
  _native.set_copy_threads(n)


def set_copy_cpus(cpus: Iterable[int]) -> None:
  """Pins the copy workers to ``cpus`` (Linux; default ``$JAXMEM_COPY_CPUS``, e.g. ``"1"``).

  XLA:CPU sizes its compute thread pool from the process's CPU affinity, and
  every core it has computes: a copy worker on one of them competes with the
  computation it should overlap. ``taskset -c 0 python step.py`` with
  ``JAXMEM_COPY_CPUS=1`` gives the copies a core of their own (a worker may be
  pinned outside the process's mask), as a GPU's copy engines are separate
  hardware. An empty sequence removes the pinning.

  Raises:
    ValueError: if the system refuses one of the CPUs.
  """
  _native.set_copy_cpus([int(c) for c in cpus])




__all__ = ["store_plan_stats", "store_register_plan", "store_unregister_plan", "DEFAULT_CHUNK_BYTES", "DEFAULT_SEGMENT_BYTES", "STORE_MODES", "CopyStats", "StoreStats",
           "copy_drain", "copy_stats", "set_copy_cpus", "set_copy_threads", "store_clear",
           "store_config", "store_configure", "store_stats"]
