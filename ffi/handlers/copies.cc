// Copyright 2025 The jaxmem Authors.
//
// The CPU `offload` and `fetch` handlers: synchronous copies into and out of
// the host store (see handlers.h and host_store.h).

#include <cstdint>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "host_store.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

ffi::Error OffloadImpl(ffi::AnyBuffer x,
                       ffi::ResultBufferR1<ffi::U32> handle) {
  if (handle->element_count() != 2) {
    return ffi::Error::InvalidArgument(
        "jaxmem offload: the handle output must be uint32[2], got " +
        std::to_string(handle->element_count()) + " elements");
  }
  if (!IsCopyable(x.element_type())) {
    return ffi::Error::InvalidArgument(
        "jaxmem offload: dtype " + TypeName(x.element_type()) +
        " is not supported (sub-byte or token type)");
  }
  uint64_t id = 0;
  std::string err =
      HostStore::Global().Put(x.untyped_data(), x.size_bytes(),
                              static_cast<uint32_t>(x.element_type()), &id);
  if (!err.empty()) {
    return ffi::Error::Internal("jaxmem offload: " + err);
  }
  EncodeWords(id, handle->typed_data());
  return ffi::Error::Success();
}

ffi::Error FetchImpl(ffi::BufferR1<ffi::U32> handle, ffi::AnyBuffer /*dep*/,
                     ffi::Result<ffi::AnyBuffer> out) {
  if (ffi::Error e = CheckWords("handle", "fetch", handle.element_count());
      e.failure()) {
    return e;
  }
  if (!IsCopyable(out->element_type())) {
    return ffi::Error::InvalidArgument(
        "jaxmem fetch: dtype " + TypeName(out->element_type()) +
        " is not supported (sub-byte or token type)");
  }
  const uint64_t id = DecodeWords(handle.typed_data());
  std::string err = HostStore::Global().Take(
      id, out->untyped_data(), out->size_bytes(),
      static_cast<uint32_t>(out->element_type()));
  if (!err.empty()) {
    return ffi::Error::InvalidArgument("jaxmem fetch: " + err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxmem

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffload, jaxmem::OffloadImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // handle

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFetch, jaxmem::FetchImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // handle
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::AnyBuffer>());          // out
