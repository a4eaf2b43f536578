// Copyright 2025 The jaxmem Authors.
//
// The CPU `fence` handler (see handlers.h).

#include <cstddef>
#include <cstring>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

Status Fence(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  // With input_output_aliases={0: 0} the output *is* x and there is nothing to
  // do; copy only if XLA gave the output its own buffer.
  void* dst = out->untyped_data();
  const void* src = x.untyped_data();
  if (dst == src) return Status::Ok();
  if (out->element_type() != x.element_type() ||
      out->element_count() != x.element_count()) {
    return InvalidArgument(
        "jaxmem fence: output (" + TypeName(out->element_type()) + ", " +
        std::to_string(out->element_count()) +
        " elements) does not match input (" + TypeName(x.element_type()) +
        ", " + std::to_string(x.element_count()) + " elements)");
  }
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return Status::Ok();
  if (!IsCopyable(x.element_type())) {
    return InvalidArgument("jaxmem fence: cannot copy an unaliased " +
                           TypeName(x.element_type()) +
                           " buffer (sub-byte or token type)");
  }
  std::memmove(dst, src, bytes);
  return Status::Ok();
}

ffi::Error FenceImpl(ffi::AnyBuffer x, ffi::AnyBuffer /*dep*/,
                     ffi::Result<ffi::AnyBuffer> out) {
  return ToFfiError(Fence(x, out));
}

}  // namespace
}  // namespace jaxmem

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFence, jaxmem::FenceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()      // x
                                  .Arg<ffi::AnyBuffer>()      // dep
                                  .Ret<ffi::AnyBuffer>());    // out (aliases x)
