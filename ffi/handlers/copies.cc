// Copyright 2025 The jaxmem Authors.
//
// The CPU `offload` and `fetch` handlers: synchronous copies into and out of
// the host store (see handlers.h and host_store.h).

#include <cstdint>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "host_store.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

Status Offload(ffi::AnyBuffer x, ffi::ResultBufferR1<ffi::U32> handle,
               PlanSlot where = {}) {
  if (handle->element_count() != 2) {
    return InvalidArgument(
        "jaxmem offload: the handle output must be uint32[2], got " +
        std::to_string(handle->element_count()) + " elements");
  }
  JAXMEM_RETURN_IF_ERROR(CheckCopyable("offload", x.element_type()));
  uint64_t id = 0;
  // Out of host memory (the arena's capacity or the OS) is ResourceExhausted.
  JAXMEM_RETURN_IF_ERROR(HostStore::Global()
                             .Put(x.untyped_data(), x.size_bytes(),
                                  static_cast<uint32_t>(x.element_type()), &id,
                                  where)
                             .Prefixed("jaxmem offload: "));
  EncodeWords(id, handle->typed_data());
  return Status::Ok();
}

Status Fetch(ffi::BufferR1<ffi::U32> handle, ffi::Result<ffi::AnyBuffer> out) {
  JAXMEM_RETURN_IF_ERROR(CheckWords("handle", "fetch", handle.element_count()));
  JAXMEM_RETURN_IF_ERROR(CheckCopyable("fetch", out->element_type()));
  // A stale / foreign / already fetched handle or a shape or dtype mismatch
  // is InvalidArgument.
  return HostStore::Global()
      .Take(DecodeWords(handle.typed_data()), out->untyped_data(),
            out->size_bytes(), static_cast<uint32_t>(out->element_type()))
      .Prefixed("jaxmem fetch: ");
}

ffi::Error OffloadImpl(ffi::AnyBuffer x, ffi::ResultBufferR1<ffi::U32> handle) {
  return ToFfiError(Offload(x, handle));
}

// A planned buffer (host_store.h): its memory is slot `slot` of plan `plan`;
// `dep` orders it after the frees of the slots whose bytes it reuses
// (jaxmem/_src/lower/ffi.py), as the layout was solved for.
ffi::Error OffloadPlannedImpl(ffi::AnyBuffer x, ffi::AnyBuffer /*dep*/,
                              ffi::ResultBufferR1<ffi::U32> handle, int64_t plan,
                              int64_t slot) {
  return ToFfiError(Offload(x, handle, PlanSlot{plan, slot}));
}

ffi::Error FetchImpl(ffi::BufferR1<ffi::U32> handle, ffi::AnyBuffer /*dep*/,
                     ffi::Result<ffi::AnyBuffer> out) {
  return ToFfiError(Fetch(handle, out));
}

}  // namespace
}  // namespace jaxmem

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffload, jaxmem::OffloadImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // handle

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffloadPlanned, jaxmem::OffloadPlannedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::BufferR1<ffi::U32>>()   // handle
                                  .Attr<int64_t>("plan")
                                  .Attr<int64_t>("slot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFetch, jaxmem::FetchImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // handle
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::AnyBuffer>());          // out
