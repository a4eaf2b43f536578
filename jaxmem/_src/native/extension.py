"""jaxmem's native extension (``jaxmem._native``): loading it and registering its FFI targets.

The extension is built by the package's own build (scikit-build-core + CMake +
nanobind against ``jax.ffi.include_dir()``; sources in ``ffi/``). Its XLA FFI
targets are registered with XLA for the ``cpu`` platform when this module is
imported, and for ``CUDA`` too when the extension has its CUDA handlers
(:data:`WITH_CUDA`; plain C++, built by default on Linux), jax has a CUDA
plugin and the CUDA runtime of jax's CUDA wheels loaded (:data:`CUDA_STATUS`
says which, or why not). The ops (:mod:`jaxmem._src.native.ops`), the host
store (:mod:`~jaxmem._src.native.store`), the host arenas
(:mod:`~jaxmem._src.native.arena`) and the allocation solver
(:mod:`~jaxmem._src.native.dsa`) are its Python sides.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import pathlib
import sys
from types import ModuleType

import jax
import jax.numpy as jnp

from jaxmem._src.native import cuda_runtime


def _installed_native() -> ModuleType | None:
  """The extension of an installed jaxmem, when this one is an unbuilt source tree.

  ``python -m jaxmem demo`` run from a checkout puts the checkout first on
  ``sys.path``; after ``pip install .`` the built extension lives in
  site-packages, next to the installed copy of the package. Load it from there.
  """
  here = pathlib.Path(__file__).resolve().parents[2]
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


def _load() -> ModuleType:
  try:
    import jaxmem._native as module
  except ImportError as e:  # pragma: no cover - depends on the build
    installed = _installed_native()
    if installed is None:
      raise ImportError(
          "jaxmem's native extension (jaxmem._native) is not built or failed to "
          "load; build it with `pip install .` (or `pip install "
          "--no-build-isolation -e .` for development) from the jaxmem source "
          f"tree. Original error: {e}") from e
    module = installed
  return module


#: The extension module (``jaxmem._native``).
native_module: ModuleType = _load()


#: Shape of an offload handle.
HANDLE_SHAPE: tuple[int, ...] = (2,)
#: Dtype of an offload handle (two uint32 words: low, high).
HANDLE_DTYPE = jnp.uint32
#: FFI target names are ``TARGET_PREFIX + name`` (``jaxmem_fence`` ...).
TARGET_PREFIX = "jaxmem_"
#: Whether the extension was built with the CUDA copy-stream handlers (they load
#: the CUDA runtime at run time: :data:`CUDA_STATUS`).
WITH_CUDA: bool = bool(getattr(native_module, "WITH_CUDA", False))

#: Whether the CUDA handlers can run here: ``"loaded: <libcudart path> (CUDA runtime
#: X.Y)"``, or ``"not loaded: <why>"`` (no jax CUDA plugin, no libcudart found, ...),
#: or ``"not built: ..."``. The CUDA targets are registered only when it starts with
#: ``"loaded"``.
CUDA_STATUS: str = cuda_runtime.load(native_module)


@functools.cache
def register() -> None:
  """Registers the native FFI targets with XLA once; idempotent.

  CPU always; CUDA as well when the extension has CUDA handlers
  (:data:`WITH_CUDA`) and the CUDA runtime loaded (:data:`CUDA_STATUS`; until
  then ``cuda_registrations()`` is empty) -- registering for a platform that
  this jaxlib does not have is skipped, not an error.
  """
  for name, capsule in native_module.registrations().items():
    jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform="cpu")
  for name, capsule in native_module.cuda_registrations().items():
    try:
      jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform="CUDA")
    except Exception:  # pylint: disable=broad-except  # pragma: no cover
      pass  # no CUDA plugin in this jaxlib: the CPU handlers still work


register()




__all__ = ["CUDA_STATUS", "HANDLE_DTYPE", "HANDLE_SHAPE", "TARGET_PREFIX", "WITH_CUDA",
           "native_module", "register"]
