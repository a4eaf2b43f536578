// Copyright 2025 The jaxmem Authors.
//
// Loads the CUDA runtime (libcudart) at run time: dlopen, then dlsym of every
// function in JAXMEM_CUDART_FUNCTIONS (cudart_api.h) into a function table.
// The extension links against no CUDA library, so it imports, and its CPU
// handlers work, on machines without CUDA; the CUDA handlers are handed to
// XLA (module.cc, `cuda_registrations()`) only once a runtime has loaded.
//
// Where the runtime comes from, in this order (first that works):
//   1. a libcudart already in the process (dlopen with RTLD_NOLOAD of
//      libcudart.so.13, libcudart.so.12): the one jax's CUDA plugin loaded;
//   2. the candidates Python passes, normally the copies inside jax's CUDA
//      wheels: site-packages/nvidia/cu13/lib/libcudart.so.13 (the
//      nvidia-cuda-runtime wheel) and
//      site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
//      (nvidia-cuda-runtime-cu12) -- see jaxmem/_src/native/extension.py;
//   3. libcudart.so.13, libcudart.so.12 through the dynamic linker's search
//      (LD_LIBRARY_PATH, the ld.so cache: a system CUDA toolkit).
// A copy loaded by path keeps its soname, so a jax CUDA plugin loaded later
// (which needs that soname) shares it instead of loading a second runtime.
//
// A loaded runtime is never unloaded. Nothing here calls into the GPU driver:
// the only call made at load time is cudaRuntimeGetVersion.

#ifndef JAXMEM_FFI_CUDA_CUDART_LOADER_H_
#define JAXMEM_FFI_CUDA_CUDART_LOADER_H_

#include <string>
#include <vector>

#include "cuda/cudart_api.h"
#include "status.h"

namespace jaxmem {
namespace cudart {

// Loads the first runtime that works, from the places above (`candidates`
// are paths or library names, tried in order at step 2; with `defaults`
// false, only they are tried). Returns whether a runtime is loaded; once one
// is, later calls return true at once. Thread-safe.
bool Load(const std::vector<std::string>& candidates, bool defaults = true);

// One line saying what Load did: "loaded: <path> (CUDA runtime 12.9)", or
// "not loaded: " and why each attempt failed, or "not loaded: no load was
// attempted".
std::string LoadStatus();

// Opens `path` (a file path or a library name) by itself, without installing
// it as the runtime, and resolves the table: Unavailable when it cannot be
// opened or is not a CUDA runtime (a missing function), with a message naming
// `path` and the reason; on success `*description` is e.g.
// "/.../libcudart.so.12 (CUDA runtime 12.9)". For diagnostics and tests.
Status Probe(const std::string& path, std::string* description);

}  // namespace cudart
}  // namespace jaxmem

#endif  // JAXMEM_FFI_CUDA_CUDART_LOADER_H_
