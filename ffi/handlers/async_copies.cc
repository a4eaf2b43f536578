// Copyright 2025 The jaxmem Authors.
//
// The CPU handlers of the window-scheduled asynchronous copies (see
// handlers.h), run by the copy engine's workers (copy_engine.h).

#include <cstdint>
#include <cstring>
#include <string>

#include "copy_engine.h"
#include "handlers/common.h"
#include "handlers/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

// Makes `out` hold `x`'s bytes when XLA did not alias them (it normally does:
// input_output_aliases={0: 0}).
ffi::Error CopyIfUnaliased(const char* op, const ffi::AnyBuffer& x,
                           ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() == x.untyped_data()) return ffi::Error::Success();
  if (out->element_type() != x.element_type() ||
      out->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument(
        std::string("jaxmem ") + op + ": output does not match the input");
  }
  if (x.size_bytes() > 0) {
    std::memmove(out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error OffloadStartImpl(ffi::AnyBuffer x,
                            ffi::ResultBufferR1<ffi::U32> ticket) {
  if (ffi::Error e = CheckWords("ticket", "offload_start",
                                ticket->element_count());
      e.failure()) {
    return e;
  }
  if (!IsCopyable(x.element_type())) {
    return ffi::Error::InvalidArgument(
        "jaxmem offload_start: dtype " + TypeName(x.element_type()) +
        " is not supported (sub-byte or token type)");
  }
  // No alias: the done reads `x` too, so XLA keeps this buffer allocated and
  // unwritten until then. (An aliased output would make XLA's copy insertion
  // copy `x` whenever another reader is not provably ordered before us.)
  uint64_t id = 0;
  std::string err = CopyEngine::Global().StartOffload(
      x.untyped_data(), x.size_bytes(),
      static_cast<uint32_t>(x.element_type()), &id);
  if (!err.empty()) return ffi::Error::Internal("jaxmem " + err);
  EncodeWords(id, ticket->typed_data());
  return ffi::Error::Success();
}

ffi::Error OffloadDoneImpl(ffi::AnyBuffer keep, ffi::BufferR1<ffi::U32> ticket,
                           ffi::AnyBuffer /*dep*/,
                           ffi::ResultBufferR1<ffi::U32> handle) {
  if (ffi::Error e = CheckWords("ticket", "offload_done",
                                ticket.element_count());
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckWords("handle", "offload_done",
                                handle->element_count());
      e.failure()) {
    return e;
  }
  uint64_t id = 0;
  std::string err = CopyEngine::Global().FinishOffload(
      DecodeWords(ticket.typed_data()), keep.untyped_data(), &id);
  if (!err.empty()) {
    return ffi::Error::InvalidArgument("jaxmem offload_done: " + err);
  }
  EncodeWords(id, handle->typed_data());
  return ffi::Error::Success();
}

ffi::Error FetchStartImpl(ffi::BufferR1<ffi::U32> handle,
                          ffi::AnyBuffer /*dep*/,
                          ffi::Result<ffi::AnyBuffer> buf,
                          ffi::ResultBufferR1<ffi::U32> ticket) {
  if (ffi::Error e = CheckWords("handle", "fetch_start",
                                handle.element_count());
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckWords("ticket", "fetch_start",
                                ticket->element_count());
      e.failure()) {
    return e;
  }
  if (!IsCopyable(buf->element_type())) {
    return ffi::Error::InvalidArgument(
        "jaxmem fetch_start: dtype " + TypeName(buf->element_type()) +
        " is not supported (sub-byte or token type)");
  }
  uint64_t id = 0;
  std::string err = CopyEngine::Global().StartFetch(
      DecodeWords(handle.typed_data()), buf->untyped_data(),
      buf->size_bytes(), static_cast<uint32_t>(buf->element_type()), &id);
  if (!err.empty()) {
    return ffi::Error::InvalidArgument("jaxmem " + err);
  }
  EncodeWords(id, ticket->typed_data());
  return ffi::Error::Success();
}

ffi::Error FetchDoneImpl(ffi::AnyBuffer buf, ffi::BufferR1<ffi::U32> ticket,
                         ffi::AnyBuffer /*dep*/,
                         ffi::Result<ffi::AnyBuffer> out) {
  if (ffi::Error e = CheckWords("ticket", "fetch_done",
                                ticket.element_count());
      e.failure()) {
    return e;
  }
  std::string err = CopyEngine::Global().FinishFetch(
      DecodeWords(ticket.typed_data()), buf.untyped_data());
  if (!err.empty()) {
    return ffi::Error::InvalidArgument("jaxmem fetch_done: " + err);
  }
  return CopyIfUnaliased("fetch_done", buf, out);
}

}  // namespace
}  // namespace jaxmem

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffloadStart, jaxmem::OffloadStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // ticket

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffloadDone, jaxmem::OffloadDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Arg<ffi::BufferR1<ffi::U32>>()    // ticket
                                  .Arg<ffi::AnyBuffer>()             // dep
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // handle

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFetchStart, jaxmem::FetchStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::U32>>()    // handle
                                  .Arg<ffi::AnyBuffer>()             // dep
                                  .Ret<ffi::AnyBuffer>()             // buf
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // ticket

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFetchDone, jaxmem::FetchDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // buf
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // ticket
                                  .Arg<ffi::AnyBuffer>()           // dep
                                  .Ret<ffi::AnyBuffer>());         // x (alias)
