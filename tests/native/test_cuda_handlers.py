"""The CUDA handlers without nvcc: plain C++ that loads the CUDA runtime at run time.

``ffi/cuda/`` is compiled by the host compiler against its own declarations of the
CUDA runtime API (``ffi/cuda/cudart_api.h``) and calls ``libcudart`` through a table
filled with ``dlopen`` / ``dlsym`` (``ffi/cuda/cudart_loader.cc``). These tests need
no GPU and check what can be checked without one: the extension imports and its
CPU handlers work whether or not CUDA is there, ``CUDA_STATUS`` says why the CUDA
handlers are (not) registered, the loader refuses missing and non-CUDA libraries
with a message and no crash, hands out the CUDA handlers only after a runtime
loaded, and the declarations match NVIDIA's ``cuda_runtime_api.h``.

The header test runs where NVIDIA's headers are found and is skipped elsewhere
(CI has none). To run it::

    pip install nvidia-cuda-runtime-cu12      # CUDA 12 headers (small wheel)
    pip install nvidia-cuda-runtime nvidia-cuda-crt   # and/or CUDA 13's
    pytest tests/native/test_cuda_handlers.py -k header

A CUDA toolkit at ``$CUDA_HOME`` (or ``/usr/local/cuda``) is checked too. Nothing here
runs the CUDA handlers on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import native
from jaxmem._src.native import cuda_runtime
from jaxmem._src.native.extension import native_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
HANDLERS = {"fence", "offload", "fetch", "offload_start", "offload_done", "fetch_start",
            "offload_planned", "offload_start_planned",
            "fetch_done"}
STATUS_PREFIXES = ("loaded: ", "not loaded: ", "not built: ")

needs_cuda_handlers = pytest.mark.skipif(
    not native.WITH_CUDA, reason="extension built with JAXMEM_CUDA=OFF")


def _run(code: str) -> str:
  """Runs `code` in a fresh interpreter (the loaded runtime is process-wide); its stdout."""
  # JAX_PLATFORMS=cpu: importing jaxmem loads the runtime where jax has a CUDA
  # plugin (a GPU machine); these tests load it themselves.
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout


# --------------------------------------------------------- import and status


def test_extension_imports_and_cpu_handlers_work_without_cuda():
  assert isinstance(native.WITH_CUDA, bool)
  assert native.WITH_CUDA == bool(native_module.WITH_CUDA)
  x = jnp.arange(6.0, dtype=jnp.float32)
  f = jax.jit(lambda x: native.fetch(native.offload(x), x, shape=x.shape, dtype=x.dtype))
  np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))


def test_cuda_status_says_why():
  status = native.CUDA_STATUS
  assert isinstance(status, str) and status.startswith(STATUS_PREFIXES), status
  if not native.WITH_CUDA:
    assert status.startswith("not built: ") and "JAXMEM_CUDA=OFF" in status
  elif not cuda_runtime.jax_cuda_majors():
    # This machine (and CI): jax has no CUDA plugin, so no runtime is looked for.
    assert status.startswith("not loaded: ") and "no CUDA plugin" in status, status
    assert native_module.cudart_status() == "not loaded: no load was attempted"
  if not status.startswith("loaded: "):
    # Nothing to hand XLA, and nothing handed to it for the CUDA platform.
    assert native_module.cuda_registrations() == {}
    from jaxlib import xla_client
    pending = getattr(xla_client, "_custom_callback", {}).get("CUDA", [])
    assert not [entry for entry in pending if str(entry[0]).startswith(native.TARGET_PREFIX)]


def test_cuda_status_when_jax_platforms_leaves_cuda_out(monkeypatch):
  if not native.WITH_CUDA:
    pytest.skip("extension built with JAXMEM_CUDA=OFF")
  monkeypatch.setattr(cuda_runtime, "jax_cuda_majors", lambda: [12])
  monkeypatch.setattr(cuda_runtime, "jax", types.SimpleNamespace(
      config=types.SimpleNamespace(jax_platforms="cpu")))
  assert cuda_runtime.load(native_module) == "not loaded: JAX_PLATFORMS='cpu' leaves CUDA out"


def test_wheel_candidates_are_the_runtime_files_of_jax_cuda_wheels(tmp_path, monkeypatch):
  for rel in cuda_runtime.CUDART_IN_WHEELS.values():
    (tmp_path / "nvidia" / rel).parent.mkdir(parents=True)
    (tmp_path / "nvidia" / rel).write_bytes(b"")
  monkeypatch.syspath_prepend(str(tmp_path))
  importlib.invalidate_caches()
  found = [p for p in cuda_runtime.cudart_candidates([13, 12]) if p.startswith(str(tmp_path))]
  assert found == [str(tmp_path / "nvidia/cu13/lib/libcudart.so.13"),
                   str(tmp_path / "nvidia/cuda_runtime/lib/libcudart.so.12")]
  assert all("cu13" not in p for p in cuda_runtime.cudart_candidates([12]))


# ------------------------------------------------------------------- loader


@needs_cuda_handlers
def test_probe_refuses_a_missing_library():
  path = "/nonexistent/dir/libcudart.so.12"
  with pytest.raises(OSError, match=r"/nonexistent/dir/libcudart\.so\.12.*No such file"):
    native_module.cudart_probe(path)


@needs_cuda_handlers
def test_probe_refuses_a_library_that_is_not_the_cuda_runtime():
  with pytest.raises(OSError, match=r"libm\.so\.6 is not a CUDA runtime \(libcudart\): it has "
                                    r"no function cudaGetErrorString"):
    native_module.cudart_probe("libm.so.6")


@needs_cuda_handlers
def test_probe_refuses_a_file_that_is_not_a_library(tmp_path):
  fake = tmp_path / "libcudart.so.12"
  fake.write_text("not an ELF file\n")
  with pytest.raises(OSError, match=str(fake)):
    native_module.cudart_probe(str(fake))


@needs_cuda_handlers
def test_failed_load_lists_every_attempt_and_hands_out_no_handler(tmp_path):
  fake = tmp_path / "libcudart.so.12"
  fake.write_text("not an ELF file\n")
  out = _run(f"""
      import jaxmem._native as m
      assert m.cudart_load([{str(fake)!r}, "/nonexistent/libcudart.so.13", "libm.so.6"],
                           defaults=False) is False
      print(m.cudart_status())
      assert m.cuda_registrations() == {{}}
      assert m.copy_clear() == 0          # CudaClear without a runtime: nothing to free
      assert m.cudart_load([], defaults=False) is False
      print(m.cudart_status())
      """)
  first, second = out.splitlines()
  assert first.startswith("not loaded: ")
  for part in (str(fake), "/nonexistent/libcudart.so.13", "libm.so.6 is not a CUDA runtime"):
    assert part in first, (part, first)
  assert second == "not loaded: no candidate to try"


@needs_cuda_handlers
def test_a_real_runtime_loads_and_then_the_handlers_are_handed_out():
  # jax's wheels (installed), then the linker's search (a CUDA toolkit).
  candidates = cuda_runtime.cudart_candidates(list(cuda_runtime.CUDART_IN_WHEELS))
  candidates += ["libcudart.so.13", "libcudart.so.12"]
  # Loading needs no GPU and makes no driver call; the handlers are not run.
  out = _run(f"""
      import jaxmem._native as m
      assert m.cuda_registrations() == {{}}
      for path in {candidates!r}:
        try:
          print(m.cudart_probe(path))
          break
        except OSError:
          pass
      else:
        print("none")
        raise SystemExit(0)
      assert m.cudart_load([path], defaults=False) is True
      print(m.cudart_status())
      print(" ".join(sorted(m.cuda_registrations())))
      assert m.cudart_load(["/nonexistent"], defaults=False) is True   # stays loaded
      """)
  if out.strip() == "none":
    pytest.skip("no libcudart here (pip install nvidia-cuda-runtime-cu12 to run this)")
  probe, status, names = out.splitlines()
  assert "(CUDA runtime 1" in probe, probe
  assert status.startswith("loaded: ") and "(CUDA runtime 1" in status, status
  assert set(names.split()) == HANDLERS


# ------------------------------------------------------- NVIDIA's own header


def _nvidia_include_dirs() -> list[tuple[str, pathlib.Path, list[pathlib.Path]]]:
  """(label, dir with cuda_runtime_api.h, dirs that may hold crt/host_defines.h)."""
  try:
    spec = importlib.util.find_spec("nvidia")
  except (ImportError, ValueError):
    spec = None
  roots = [pathlib.Path(r) for r in (spec.submodule_search_locations or [])] if spec else []
  sets = []
  for root in roots:
    # cu12: runtime headers in cuda_runtime/, crt/ in nvidia-cuda-nvcc-cu12's cuda_nvcc/.
    sets.append(("cu12-wheel", root / "cuda_runtime/include", [root / "cuda_nvcc/include"]))
    # cu13: nvidia-cuda-runtime and nvidia-cuda-crt both install into cu13/include.
    sets.append(("cu13-wheel", root / "cu13/include", [root / "cu13/include"]))
  for home in {os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"}:
    if home:
      sets.append(("toolkit", pathlib.Path(home) / "include", [pathlib.Path(home) / "include"]))
  return [s for s in sets if (s[1] / "cuda_runtime_api.h").is_file()]


# The decoration macros of crt/host_defines.h as the host compiler sees them, for a
# runtime wheel installed without the wheel that ships crt/ (nvidia-cuda-nvcc-cu12).
# Only attribute and calling-convention macros: every declaration checked comes from
# NVIDIA's cuda_runtime_api.h and driver_types.h.
_HOST_DEFINES_STANDIN = """\
#pragma once
#define __host__
#define __device__
#define __cudart_builtin__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __annotate__(a) __attribute__((a))
#define __location__(a) __annotate__(a)
"""

_CHECK_TU = r"""
#include <cuda_runtime_api.h>

#include <type_traits>

// driver_types.h #defines the flags; keep NVIDIA's values, then free the names.
constexpr unsigned int kNvHostAllocPortable = cudaHostAllocPortable;
constexpr unsigned int kNvEventDisableTiming = cudaEventDisableTiming;
constexpr unsigned int kNvStreamNonBlocking = cudaStreamNonBlocking;
#undef cudaHostAllocPortable
#undef cudaEventDisableTiming
#undef cudaStreamNonBlocking

#include "cuda/cudart_api.h"

namespace mine = jaxmem::cudart;

// Each signature of JAXMEM_CUDART_FUNCTIONS, expanded here at global scope, names
// NVIDIA's types: it must be the type of NVIDIA's declaration.
#define CHECK_SIGNATURE(name, ret, params, args)                          \
  static_assert(std::is_same_v<decltype(&::name), ret(*) params>,         \
                #name ": cudart_api.h and cuda_runtime_api.h differ");
JAXMEM_CUDART_FUNCTIONS(CHECK_SIGNATURE)

// The types the table uses instead of NVIDIA's: same size, same values.
static_assert(sizeof(mine::cudaError_t) == sizeof(::cudaError_t));
static_assert(alignof(mine::cudaError_t) == alignof(::cudaError_t));
static_assert(mine::cudaSuccess == static_cast<int>(::cudaSuccess));
static_assert(mine::cudaErrorMemoryAllocation ==
              static_cast<int>(::cudaErrorMemoryAllocation));
static_assert(mine::cudaErrorInitializationError ==
              static_cast<int>(::cudaErrorInitializationError));
static_assert(sizeof(mine::cudaMemcpyKind) == sizeof(::cudaMemcpyKind));
static_assert(mine::cudaMemcpyHostToHost == static_cast<int>(::cudaMemcpyHostToHost));
static_assert(mine::cudaMemcpyHostToDevice == static_cast<int>(::cudaMemcpyHostToDevice));
static_assert(mine::cudaMemcpyDeviceToHost == static_cast<int>(::cudaMemcpyDeviceToHost));
static_assert(mine::cudaMemcpyDeviceToDevice ==
              static_cast<int>(::cudaMemcpyDeviceToDevice));
static_assert(mine::cudaMemcpyDefault == static_cast<int>(::cudaMemcpyDefault));
static_assert(std::is_pointer_v<::cudaStream_t> && std::is_pointer_v<mine::cudaStream_t>);
static_assert(std::is_pointer_v<::cudaEvent_t> && std::is_pointer_v<mine::cudaEvent_t>);
static_assert(std::is_same_v<mine::cudaHostFn_t, void (*)(void*)> &&
              std::is_same_v<::cudaHostFn_t, void (*)(void*)>);
static_assert(mine::cudaHostAllocPortable == kNvHostAllocPortable);
static_assert(mine::cudaEventDisableTiming == kNvEventDisableTiming);
static_assert(mine::cudaStreamNonBlocking == kNvStreamNonBlocking);

// The table holds exactly the functions listed, as pointers of those types.
#define CHECK_MEMBER(name, ret, params, args)                              \
  static_assert(std::is_pointer_v<decltype(mine::Api::name)>, #name);
JAXMEM_CUDART_FUNCTIONS(CHECK_MEMBER)

int main() { return 0; }
"""

_HEADER_SETS = _nvidia_include_dirs()


@pytest.mark.parametrize("label,include,crt_dirs", _HEADER_SETS or [
    pytest.param(None, None, None, marks=pytest.mark.skip(
        reason="no cuda_runtime_api.h here: pip install nvidia-cuda-runtime-cu12 to run"))])
def test_header_declarations_match_nvidia_cuda_runtime_api(label, include, crt_dirs, tmp_path):
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which(
      "clang++")
  if cxx is None:
    pytest.skip("no C++ compiler")
  flags = ["-I", str(include)]
  crt = next((d for d in crt_dirs if (d / "crt/host_defines.h").is_file()), None)
  if crt is None:
    standin = tmp_path / "standin"
    (standin / "crt").mkdir(parents=True)
    (standin / "crt/host_defines.h").write_text(_HOST_DEFINES_STANDIN)
    crt = standin
  if crt != include:
    flags += ["-I", str(crt)]
  source = tmp_path / "check_cudart_api.cc"
  source.write_text(_CHECK_TU)
  proc = subprocess.run(
      [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", str(ROOT / "ffi"),
       *flags, str(source)], capture_output=True, text=True, check=False, timeout=300)
  assert proc.returncode == 0, f"{label} ({include}):\n{proc.stderr[-6000:]}"
