"""Python side of jaxmem's native extension (XLA FFI custom calls, CPU).

Three side-effecting custom calls implemented in ``ffi/jaxmem_ffi.cc``:

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

The FFI targets are registered for the ``cpu`` platform when this module is
imported. None of the ops has a JVP/transpose rule: they are inserted into an
already differentiated step by the rewrite, not differentiated through.
Under ``jax.vmap``, ``fence`` runs once on the broadcast operands (an unbatched
``dep`` is materialised at batch size) and ``offload``/``fetch`` loop over the
batch (one handle per element: handles get shape ``(batch, 2)``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np



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
    "StoreStats",
    "fence",
    "fetch",
    "handle_id",
    "offload",
    "register",
    "store_clear",
    "store_stats",
]

#: Shape of an offload handle.
HANDLE_SHAPE: tuple[int, ...] = (2,)
#: Dtype of an offload handle (two uint32 words: low, high).
HANDLE_DTYPE = jnp.uint32
#: FFI target names are ``TARGET_PREFIX + name`` (``jaxmem_fence`` ...).
TARGET_PREFIX = "jaxmem_"

_register_lock = threading.Lock()
_registered: bool = False


def register() -> None:
  """Registers the native FFI targets with XLA (CPU) once; idempotent."""
  global _registered
  with _register_lock:
    if _registered:
      return
    for name, capsule in _native.registrations().items():
      jax.ffi.register_ffi_target(
          TARGET_PREFIX + name, capsule, platform="cpu")
    _registered = True


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
  """

  live_entries: int
  live_bytes: int
  peak_bytes: int
  total_puts: int
  total_takes: int
  total_errors: int


def store_stats() -> StoreStats:
  """Returns a snapshot of the host store's counters."""
  return StoreStats(**{k: int(v) for k, v in _native.store_stats().items()})


def store_clear() -> int:
  """Frees every entry of the host store.

  Handles of the freed entries become stale: fetching them fails.

  Returns:
    The number of payload bytes freed.
  """
  return int(_native.store_clear())


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


def handle_id(handle: Any) -> int:
  """The 64-bit host-store id of a concrete ``uint32[2]`` handle."""
  words = np.asarray(handle, dtype=np.uint32).reshape(-1)
  if words.shape != (2,):
    raise ValueError(f"a handle has 2 words, got {words.shape[0]}")
  return int(words[0]) | (int(words[1]) << 32)


register()
