"""Python side of jaxmem's native extension (XLA FFI custom calls).

Side-effecting custom calls implemented in ``ffi/jaxmem_ffi.cc``:

* :func:`fence` -- ``fence(x, dep) -> x``: an identity that aliases ``x``
  (``input_output_aliases={0: 0}``) and is ordered after ``dep``. XLA can
  neither CSE it nor hoist it above ``dep`` (DESIGN.md, "Why native ops" 2).
* :func:`offload` -- ``offload(x) -> handle``: copies ``x`` into the native host
  store and returns a ``uint32[2]`` handle (the 64-bit id as ``(lo, hi)``, so
  it works with ``jax_enable_x64`` off).
* :func:`fetch` -- ``fetch(handle, dep, shape=, dtype=) -> x``: copies the entry
  back (after ``dep``) and erases it. A handle can be fetched exactly once;
  a stale, foreign or double-fetched handle, or a shape/dtype that does not
  match what was offloaded, fails with an ``INVALID_ARGUMENT`` runtime error
  (``jax.errors.JaxRuntimeError``) mentioning the host store -- never a crash.

Window-scheduled asynchronous copies (DESIGN.md, "Native extension"; paper
001, Hayakawa et al., §3), run by worker threads of ``ffi/copy_engine.cc`` on
the CPU and by copy streams on CUDA builds (``JAXMEM_CUDA=1``):

* :func:`offload_start` -- ``offload_start(x) -> ticket``: queues a copy of
  ``x`` to host memory and returns at once.
* :func:`offload_done` -- ``offload_done(x, ticket, dep) -> handle``: waits
  for that copy (after ``dep``) and returns the host store handle. That the
  done reads ``x`` is what keeps the source allocated (and unwritten) while
  the copy is in flight; XLA may reuse its memory after the done. (DESIGN.md
  sketched an aliased output ``x_keep`` instead: measured, XLA's copy
  insertion then copies ``x`` whenever another reader of it is not provably
  ordered before the start, doubling its bytes for the window.)
* :func:`fetch_start` -- ``fetch_start(handle, dep) -> (buf, ticket)``: takes
  the entry out of the host store (after ``dep``) and queues its copy into
  ``buf``, a fresh buffer XLA allocates here.
* :func:`fetch_done` -- ``fetch_done(buf, ticket, dep) -> x``: waits for it;
  ``x`` aliases ``buf``.

The distance between a start and its done is the window in which the copy
overlaps computation. Tickets, like handles, are ``uint32[2]`` words of a
never-reused 64-bit id: a stale, foreign or wrong-kind ticket, like a bad
handle, fails the execution with a ``jax.errors.JaxRuntimeError`` -- never a
crash. :func:`copy_stats` reports outstanding tickets; :func:`store_clear`
also frees tickets orphaned by a failed execution (see ``copy_engine.h``).

The host store keeps offloaded bytes in a host arena (``ffi/host_arena.h``,
:mod:`jaxmem._src.arena`), chosen by :func:`store_configure` or by
``$JAXMEM_HOST_ARENA`` (read at the store's first use): ``"best_fit"`` (the
default; paper 001 §4's framework-default caching allocator), ``"virtual"``
(paper 001 §4's physical chunks mapped into contiguous virtual ranges: no
external fragmentation) or ``"heap"`` (the original ``posix_memalign`` +
size cache). :func:`store_stats` reports the arena's footprint and
fragmentation. Planned mode (static offsets from the DSA solver) is not
available to the custom calls: it would need plan slot ids as attributes.

The FFI targets are registered for the ``cpu`` platform when this module is
imported, and for ``CUDA`` too when the extension was built with the CUDA
toolkit (:data:`WITH_CUDA`). None of the ops has a JVP/transpose rule: they are inserted into an
already differentiated step by the rewrite, not differentiated through.
Under ``jax.vmap``, ``fence`` runs once on the broadcast operands (an unbatched
``dep`` is materialised at batch size) and ``offload``/``fetch`` loop over the
batch (one handle per element: handles get shape ``(batch, 2)``). The
asynchronous ops do not support ``vmap``: a copy in flight would outlive the
loop iteration that owns its buffer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from jaxmem._src.arena import ArenaStats


def _installed_native() -> Any:
  """The extension of an installed jaxmem, when this one is an unbuilt source tree.

  ``python -m jaxmem demo`` run from a checkout puts the checkout first on
  ``sys.path``; after ``pip install .`` the built extension lives in
  site-packages, next to the installed copy of the package. Load it from there.
  """
  import importlib.machinery
  import importlib.util
  import pathlib
  import sys

  here = pathlib.Path(__file__).resolve().parent.parent
  for entry in sys.path:
    pkg = pathlib.Path(entry or ".").resolve() / "jaxmem"
    if pkg == here or not pkg.is_dir():
      continue
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
      path = pkg / f"_native{suffix}"
      if path.exists():
        spec = importlib.util.spec_from_file_location("jaxmem._native", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["jaxmem._native"] = module
        return module
  return None


try:
  from jaxmem import _native
except ImportError as e:  # pragma: no cover - depends on the build
  _native = _installed_native()
  if _native is None:
    raise ImportError(
        "jaxmem's native extension (jaxmem._native) is not built or failed to "
        "load; build it with `pip install .` (or `pip install "
        "--no-build-isolation -e .` for development) from the jaxmem source "
        f"tree. Original error: {e}") from e

__all__ = [
    "HANDLE_DTYPE",
    "HANDLE_SHAPE",
    "TARGET_PREFIX",
    "WITH_CUDA",
    "CopyStats",
    "StoreStats",
    "copy_drain",
    "copy_stats",
    "fence",
    "fetch",
    "fetch_done",
    "fetch_start",
    "handle_id",
    "offload",
    "offload_done",
    "offload_start",
    "register",
    "set_copy_cpus",
    "set_copy_threads",
    "store_clear",
    "store_config",
    "store_configure",
    "store_stats",
]

#: Shape of an offload handle.
HANDLE_SHAPE: tuple[int, ...] = (2,)
#: Dtype of an offload handle (two uint32 words: low, high).
HANDLE_DTYPE = jnp.uint32
#: FFI target names are ``TARGET_PREFIX + name`` (``jaxmem_fence`` ...).
TARGET_PREFIX = "jaxmem_"
#: Whether the extension was built with the CUDA copy-stream handlers.
WITH_CUDA: bool = bool(getattr(_native, "WITH_CUDA", False))

_register_lock = threading.Lock()
_registered: bool = False


def register() -> None:
  """Registers the native FFI targets with XLA once; idempotent.

  CPU always; CUDA as well when the extension has CUDA handlers
  (:data:`WITH_CUDA`) -- registering for a platform that this jaxlib does not
  have is skipped, not an error.
  """
  global _registered
  with _register_lock:
    if _registered:
      return
    for name, capsule in _native.registrations().items():
      jax.ffi.register_ffi_target(
          TARGET_PREFIX + name, capsule, platform="cpu")
    for name, capsule in _native.cuda_registrations().items():
      try:
        jax.ffi.register_ffi_target(
            TARGET_PREFIX + name, capsule, platform="CUDA")
      except Exception:  # pylint: disable=broad-except  # pragma: no cover
        pass  # no CUDA plugin in this jaxlib: the CPU handlers still work
    _registered = True


#: Host store arena modes (see :func:`store_configure`).
STORE_MODES = ("best_fit", "virtual", "heap")
#: Default physical chunk of ``"virtual"`` (paper 001 §4: CUDA's 2 MB granule).
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
  from jaxmem._src.arena import ArenaStats  # pylint: disable=g-import-not-at-top
  d = dict(_native.store_stats())
  arena = ArenaStats.from_dict(d.pop("arena"))
  return StoreStats(**{k: int(v) for k, v in d.items()}, arena=arena)


def store_configure(mode: str = "best_fit", *, chunk_bytes: int | None = None,
                    segment_bytes: int | None = None,
                    capacity_bytes: int | None = None) -> None:
  """Chooses the host arena that holds offloaded bytes.

  Allowed only while the store is empty: no entries and no host buffers of
  asynchronous copies in flight (fetch everything, or call :func:`store_clear`
  first). Overrides ``$JAXMEM_HOST_ARENA`` (``"MODE"`` or
  ``"MODE:chunk_bytes=4M,capacity_bytes=8G"``), which the store reads at its
  first use. :func:`store_clear` keeps the configuration.

  Args:
    mode: ``"best_fit"`` (default): best-fit with caching, paper 001 §4's
      framework default; freed memory is reused, the footprint may fragment.
      ``"virtual"``: paper 001 §4's fixed-size physical chunks (a memfd)
      mapped into a contiguous virtual range per entry; the footprint is a
      whole number of chunks and never fragments externally (Linux only).
      ``"heap"``: one ``posix_memalign`` per entry plus a cache of freed
      buffers by size (the store's original allocator).
    chunk_bytes: ``"virtual"``: physical chunk size, a multiple of the page
      size (default 2 MiB).
    segment_bytes: ``"best_fit"``: minimum segment obtained from the OS
      (default 2 MiB).
    capacity_bytes: Cap on the arena's footprint; an offload beyond it fails
      with an out-of-memory error naming the arena (default 0: none).

  Raises:
    ValueError: if the store is not empty, or for a bad mode or size (the
      message names ``store_configure``).
  """
  if mode not in STORE_MODES:
    raise ValueError(
        f"store_configure: unknown mode {mode!r}; expected one of {STORE_MODES}"
        + (" (planned mode needs plan slot ids in the custom calls: not "
           "supported)" if mode == "planned" else ""))
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


def store_config() -> dict[str, Any]:
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


def set_copy_cpus(cpus: Any) -> None:
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


def _as_array(x: Any) -> Any:
  # Tracers are instances of jax.Array too.
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def fence(x: Any, dep: Any) -> jax.Array:
  """Identity on ``x`` that XLA must order after ``dep``.

  The output aliases ``x`` (no copy when ``x``'s buffer can be reused), and the
  op has a side effect, so it is neither CSE'd nor moved above ``dep``.

  Args:
    x: The array to pass through.
    dep: Any array; the fence runs after it is computed. Its value is unused.

  Returns:
    An array equal to ``x`` (same shape and dtype).
  """
  x = _as_array(x)
  dep = _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "fence",
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      has_side_effect=True,
      input_output_aliases={0: 0},
      vmap_method="broadcast_all",
  )(x, dep)


def offload(x: Any) -> jax.Array:
  """Copies ``x`` into the native host store.

  Args:
    x: The array to stage to host memory. Any shape (including scalars and
      0-size arrays) and any byte-sized dtype (bool, bfloat16, ...); sub-byte
      dtypes (int4, ...) are refused at run time.

  Returns:
    A ``uint32[2]`` handle for :func:`fetch`.
  """
  x = _as_array(x)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "offload",
      jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE),
      has_side_effect=True,
      vmap_method="sequential",
  )(x)


def fetch(handle: Any, dep: Any, *, shape: tuple[int, ...] | Any,
          dtype: Any) -> jax.Array:
  """Copies an offloaded array back (after ``dep``) and erases it from the store.

  Args:
    handle: A ``uint32[2]`` handle returned by :func:`offload`.
    dep: Any array; the fetch runs after it is computed (e.g. the incoming
      gradient of the layer that needs the fetched activation).
    shape: Shape of the offloaded array.
    dtype: Dtype of the offloaded array.

  Returns:
    The offloaded array.

  Raises:
    jax.errors.JaxRuntimeError: At run time (``INVALID_ARGUMENT: jaxmem
      fetch: ...``) if the handle is not in the host store (already fetched,
      cleared, or from another process), or ``shape``/``dtype`` do not match
      what was offloaded. Under asynchronous dispatch the error may surface
      when the result is used or blocked on.
  """
  handle = _as_array(handle)
  if tuple(handle.shape) != HANDLE_SHAPE or handle.dtype != HANDLE_DTYPE:
    raise TypeError(
        f"jaxmem fetch: a handle must be {np.dtype(HANDLE_DTYPE).name}"
        f"{list(HANDLE_SHAPE)}, got {handle.dtype}{list(handle.shape)}")
  dep = _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "fetch",
      jax.ShapeDtypeStruct(tuple(shape), dtype),
      has_side_effect=True,
      vmap_method="sequential",
  )(handle, dep)


_NO_DEP = np.zeros((), np.uint8)


def _check_words(x: Any, what: str, op: str) -> jax.Array:
  x = _as_array(x)
  if tuple(x.shape) != HANDLE_SHAPE or x.dtype != HANDLE_DTYPE:
    raise TypeError(
        f"jaxmem {op}: a {what} must be {np.dtype(HANDLE_DTYPE).name}"
        f"{list(HANDLE_SHAPE)}, got {x.dtype}{list(x.shape)}")
  return x


def offload_start(x: Any) -> jax.Array:
  """Starts copying ``x`` to host memory; returns a ``uint32[2]`` ticket at once.

  Args:
    x: The array to stage (any shape, any byte-sized dtype). Pass the same
      array to :func:`offload_done`: that read keeps it allocated meanwhile.

  Returns:
    A ``uint32[2]`` ticket for :func:`offload_done`.
  """
  x = _as_array(x)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "offload_start",
      jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE),
      has_side_effect=True,
  )(x)


def offload_done(x: Any, ticket: Any, dep: Any = None) -> jax.Array:
  """Waits (after ``dep``) for the copy of :func:`offload_start`; returns its handle.

  Args:
    x: The array passed to :func:`offload_start`.
    ticket: The ticket it returned.
    dep: Any array; the done runs after it is computed (``None``: no order).

  Returns:
    A ``uint32[2]`` host store handle for :func:`fetch` / :func:`fetch_start`.

  Raises:
    jax.errors.JaxRuntimeError: At run time for a stale, foreign or fetch
      ticket, or when ``x`` is not the buffer the copy read (the start and the
      done ran in different computations and XLA copied ``x``).
  """
  x = _as_array(x)
  ticket = _check_words(ticket, "ticket", "offload_done")
  dep = _NO_DEP if dep is None else _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "offload_done",
      jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE),
      has_side_effect=True,
  )(x, ticket, dep)


def fetch_start(handle: Any, dep: Any, *, shape: tuple[int, ...] | Any,
                dtype: Any) -> tuple[jax.Array, jax.Array]:
  """Starts copying an offloaded array back (after ``dep``); returns ``(buf, ticket)``.

  The entry leaves the host store here: a second fetch of ``handle`` fails.

  Args:
    handle: A ``uint32[2]`` handle from :func:`offload` or :func:`offload_done`.
    dep: Any array; the fetch starts after it is computed.
    shape: Shape of the offloaded array.
    dtype: Dtype of the offloaded array.

  Returns:
    ``buf``, the destination being filled (pass it to :func:`fetch_done`,
    never read it directly), and a ``uint32[2]`` ticket.

  Raises:
    jax.errors.JaxRuntimeError: At run time, as :func:`fetch`.
  """
  handle = _check_words(handle, "handle", "fetch_start")
  dep = _as_array(dep)
  return tuple(jax.ffi.ffi_call(
      TARGET_PREFIX + "fetch_start",
      (jax.ShapeDtypeStruct(tuple(shape), dtype),
       jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE)),
      has_side_effect=True,
  )(handle, dep))


def fetch_done(buf: Any, ticket: Any, dep: Any = None) -> jax.Array:
  """Waits (after ``dep``) for the copy of :func:`fetch_start`; returns the array.

  Args:
    buf: The first output of :func:`fetch_start`.
    ticket: Its second output.
    dep: Any array; the done runs after it is computed (``None``: no order).

  Returns:
    The fetched array (an alias of ``buf``).

  Raises:
    jax.errors.JaxRuntimeError: At run time for a stale, foreign or offload
      ticket, or when XLA moved ``buf`` while the copy was in flight.
  """
  buf = _as_array(buf)
  ticket = _check_words(ticket, "ticket", "fetch_done")
  dep = _NO_DEP if dep is None else _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "fetch_done",
      jax.ShapeDtypeStruct(buf.shape, buf.dtype),
      has_side_effect=True,
      input_output_aliases={0: 0},
  )(buf, ticket, dep)


def handle_id(handle: Any) -> int:
  """The 64-bit host-store id of a concrete ``uint32[2]`` handle."""
  words = np.asarray(handle, dtype=np.uint32).reshape(-1)
  if words.shape != (2,):
    raise ValueError(f"a handle has 2 words, got {words.shape[0]}")
  return int(words[0]) | (int(words[1]) << 32)


register()
