"""Finding the CUDA runtime for the CUDA handlers of jaxmem's native extension.

The CUDA handlers (``ffi/cuda/``) are plain C++ that call the CUDA runtime
through a table the extension fills with ``dlopen`` / ``dlsym`` at run time
(``ffi/cuda/cudart_loader.h``). This module decides whether to load it -- only
when jax has a CUDA plugin that this process may use -- and hands the extension
the ``libcudart`` copies inside jax's CUDA wheels (``nvidia-cuda-runtime`` for
CUDA 13, ``nvidia-cuda-runtime-cu12`` for CUDA 12), which it tries after a
``libcudart`` already in the process and before the dynamic linker's search.
:func:`load` returns the line that becomes
:data:`jaxmem._src.native.extension.CUDA_STATUS`.
"""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

import jax

#: libcudart inside jax's CUDA wheels (relative to site-packages/nvidia), per CUDA major.
CUDART_IN_WHEELS: dict[int, str] = {13: "cu13/lib/libcudart.so.13",
                                    12: "cuda_runtime/lib/libcudart.so.12"}


def _found(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def jax_cuda_majors() -> list[int]:
  """The CUDA majors of the installed jax CUDA plugins (looked up, not imported)."""
  return [major for major in CUDART_IN_WHEELS
          if _found(f"jax_cuda{major}_plugin") or _found(f"jax_plugins.xla_cuda{major}")]


def cudart_candidates(majors: list[int]) -> list[str]:
  """The libcudart files of the installed nvidia-cuda-runtime wheels of those majors."""
  try:
    spec = importlib.util.find_spec("nvidia")
  except (ImportError, ValueError):
    spec = None
  roots = list(spec.submodule_search_locations or []) if spec is not None else []
  paths = (pathlib.Path(root) / CUDART_IN_WHEELS[m] for m in majors for root in roots)
  return [str(p) for p in paths if p.is_file()]


def load(native: ModuleType) -> str:
  """Loads libcudart into ``native`` where jax can use CUDA; returns what happened.

  ``"loaded: <path> (CUDA runtime X.Y)"``; ``"not loaded: <why>"`` when jax has
  no CUDA plugin, ``JAX_PLATFORMS`` leaves CUDA out, or no libcudart opened (the
  extension lists each attempt); ``"not built: ..."`` when the extension has no
  CUDA handlers (``JAXMEM_CUDA=OFF``). Loading makes no call into the GPU driver.
  """
  if not getattr(native, "WITH_CUDA", False) or not hasattr(native, "cudart_load"):
    return "not built: the extension was compiled without the CUDA handlers (JAXMEM_CUDA=OFF)"
  majors = jax_cuda_majors()
  if not majors:
    return ("not loaded: jax has no CUDA plugin (no jax_cuda12_plugin or jax_cuda13_plugin; "
            "pip install 'jax[cuda12]' or 'jax[cuda13]')")
  platforms = jax.config.jax_platforms
  if platforms and not {"cuda", "gpu"} & {p.strip().lower() for p in platforms.split(",")}:
    return f"not loaded: JAX_PLATFORMS={platforms!r} leaves CUDA out"
  native.cudart_load(cudart_candidates(majors))
  return native.cudart_status()
