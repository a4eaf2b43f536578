// Copyright 2025 The jaxmem Authors.
//
// RegisterCudaBindings (bindings.h): the CUDA runtime loader from Python.
// jaxmem/_src/native/extension.py calls cudart_load with the libcudart copies
// of jax's CUDA wheels when jax has a CUDA plugin, then registers
// cuda_registrations() (module.cc), which is empty until a runtime loaded.

#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "status.h"
#ifdef JAXMEM_WITH_CUDA
#include "cuda/cudart_loader.h"
#endif

namespace nb = nanobind;

namespace jaxmem {
namespace {

#ifndef JAXMEM_WITH_CUDA
constexpr const char* kNotBuilt =
    "not built: the extension was compiled with JAXMEM_CUDA=OFF";
#endif

}  // namespace

void RegisterCudaBindings(nb::module_& m) {
  m.def(
      "cudart_load",
      [](const std::vector<std::string>& candidates, bool defaults) {
#ifdef JAXMEM_WITH_CUDA
        nb::gil_scoped_release release;
        return cudart::Load(candidates, defaults);
#else
        (void)candidates;
        (void)defaults;
        return false;
#endif
      },
      nb::arg("candidates") = std::vector<std::string>(),
      nb::arg("defaults") = true,
      "Loads the CUDA runtime (libcudart): one already in the process, else "
      "the first of `candidates` (paths or library names) that opens and has "
      "every function the CUDA handlers call, else libcudart.so.13 / .so.12 "
      "from the dynamic linker's search (`defaults=False`: only "
      "`candidates`). Returns whether one is loaded; idempotent: a loaded "
      "runtime stays. False (and nothing tried) without the CUDA handlers.");

  m.def(
      "cudart_status",
      []() -> std::string {
#ifdef JAXMEM_WITH_CUDA
        return cudart::LoadStatus();
#else
        return kNotBuilt;
#endif
      },
      "'loaded: <path> (CUDA runtime X.Y)', or 'not loaded: ' and why each "
      "attempt failed, or 'not built: ...' without the CUDA handlers.");

  m.def(
      "cudart_probe",
      [](const std::string& path) -> std::string {
#ifdef JAXMEM_WITH_CUDA
        std::string description;
        Status st;
        {
          nb::gil_scoped_release release;
          st = cudart::Probe(path, &description);
        }
        if (!st.ok()) RaisePyError(st);  // Unavailable: OSError
        return description;
#else
        RaisePyError(Unimplemented(std::string("cudart_probe(") + path +
                                   "): " + kNotBuilt));
#endif
      },
      nb::arg("path"),
      "Opens `path` (a file path or a library name) by itself, without "
      "installing it as the runtime, and checks that it is a CUDA runtime: "
      "returns '<path> (CUDA runtime X.Y)', raises OSError saying why not.");
}

}  // namespace jaxmem
