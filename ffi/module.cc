// Copyright 2025 The jaxmem Authors.
//
// The `jaxmem._native` Python module: exports the XLA FFI handlers
// (handlers/handlers.h) as `registrations()` (CPU) and `cuda_registrations()`
// (CUDA builds once the CUDA runtime has loaded, cuda/cudart_loader.h; empty
// otherwise), and adds the bindings of each concept (bindings/bindings.h). Python registers the handlers as FFI targets
// `jaxmem_<name>` (jaxmem/_src/native/extension.py).

#include <type_traits>

#include "bindings/bindings.h"
#include "handlers/handlers.h"
#ifdef JAXMEM_WITH_CUDA
#include "cuda/cudart_loader.h"
#endif
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jaxmem native extension: XLA FFI handlers and the host store.";

  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["fence"] = EncapsulateFfiHandler(JaxmemFence);
        registrations["offload"] = EncapsulateFfiHandler(JaxmemOffload);
        registrations["fetch"] = EncapsulateFfiHandler(JaxmemFetch);
        registrations["offload_start"] =
            EncapsulateFfiHandler(JaxmemOffloadStart);
        registrations["offload_done"] = EncapsulateFfiHandler(JaxmemOffloadDone);
        registrations["offload_planned"] = EncapsulateFfiHandler(JaxmemOffloadPlanned);
        registrations["offload_start_planned"] =
            EncapsulateFfiHandler(JaxmemOffloadStartPlanned);
        registrations["fetch_start"] = EncapsulateFfiHandler(JaxmemFetchStart);
        registrations["fetch_done"] = EncapsulateFfiHandler(JaxmemFetchDone);
        return registrations;
      },
      "Maps handler name -> PyCapsule of its XLA FFI handler (CPU).");

  m.def(
      "cuda_registrations",
      []() {
        nb::dict registrations;
#ifdef JAXMEM_WITH_CUDA
        // Handlers that would call through an empty function table are not
        // handed out: load the runtime first (cudart_load).
        if (jaxmem::cudart::Loaded() == nullptr) return registrations;
        registrations["fence"] = EncapsulateFfiHandler(JaxmemCudaFence);
        registrations["offload"] = EncapsulateFfiHandler(JaxmemCudaOffload);
        registrations["fetch"] = EncapsulateFfiHandler(JaxmemCudaFetch);
        registrations["offload_start"] =
            EncapsulateFfiHandler(JaxmemCudaOffloadStart);
        registrations["offload_done"] =
            EncapsulateFfiHandler(JaxmemCudaOffloadDone);
        registrations["fetch_start"] =
            EncapsulateFfiHandler(JaxmemCudaFetchStart);
        registrations["fetch_done"] = EncapsulateFfiHandler(JaxmemCudaFetchDone);
        registrations["offload_planned"] =
            EncapsulateFfiHandler(JaxmemCudaOffloadPlanned);
        registrations["offload_start_planned"] =
            EncapsulateFfiHandler(JaxmemCudaOffloadStartPlanned);
#endif
        return registrations;
      },
      "Maps handler name -> PyCapsule of its CUDA XLA FFI handler; empty "
      "unless built with the CUDA handlers (WITH_CUDA) and the CUDA runtime "
      "has loaded (cudart_load; why not: cudart_status()).");

#ifdef JAXMEM_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif

  m.attr("HANDLE_WORDS") = 2;
  jaxmem::RegisterStoreBindings(m);
  jaxmem::RegisterCopyEngineBindings(m);
  jaxmem::RegisterDsaBindings(m);
  jaxmem::RegisterLifetimesBindings(m);
  jaxmem::RegisterArenaBindings(m);
  jaxmem::RegisterCudaBindings(m);
}
