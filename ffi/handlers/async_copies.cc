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
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

// Makes `out` hold `x`'s bytes when XLA did not alias them (it normally does:
// input_output_aliases={0: 0}).
Status CopyIfUnaliased(const char* op, const ffi::AnyBuffer& x,
                       ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() == x.untyped_data()) return Status::Ok();
  if (out->element_type() != x.element_type() ||
      out->size_bytes() != x.size_bytes()) {
    return InvalidArgument(std::string("jaxmem ") + op +
                           ": output does not match the input");
  }
  if (x.size_bytes() > 0) {
    std::memmove(out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return Status::Ok();
}

Status OffloadStart(ffi::AnyBuffer x, ffi::ResultBufferR1<ffi::U32> ticket,
                    PlanSlot where = {}) {
  JAXMEM_RETURN_IF_ERROR(
      CheckWords("ticket", "offload_start", ticket->element_count()));
  JAXMEM_RETURN_IF_ERROR(CheckCopyable("offload_start", x.element_type()));
  // No alias: the done reads `x` too, so XLA keeps this buffer allocated and
  // unwritten until then. (An aliased output would make XLA's copy insertion
  // copy `x` whenever another reader is not provably ordered before us.)
  uint64_t id = 0;
  // Out of host memory is ResourceExhausted (the message starts with
  // "offload_start: ", hence only "jaxmem " here).
  JAXMEM_RETURN_IF_ERROR(
      CopyEngine::Global()
          .StartOffload(x.untyped_data(), x.size_bytes(),
                        static_cast<uint32_t>(x.element_type()), &id, where)
          .Prefixed("jaxmem "));
  EncodeWords(id, ticket->typed_data());
  return Status::Ok();
}

Status OffloadDone(ffi::AnyBuffer keep, ffi::BufferR1<ffi::U32> ticket,
                   ffi::ResultBufferR1<ffi::U32> handle) {
  JAXMEM_RETURN_IF_ERROR(
      CheckWords("ticket", "offload_done", ticket.element_count()));
  JAXMEM_RETURN_IF_ERROR(
      CheckWords("handle", "offload_done", handle->element_count()));
  uint64_t id = 0;
  // A stale, foreign or fetch ticket, or a moved buffer, is InvalidArgument.
  JAXMEM_RETURN_IF_ERROR(CopyEngine::Global()
                             .FinishOffload(DecodeWords(ticket.typed_data()),
                                            keep.untyped_data(), &id)
                             .Prefixed("jaxmem offload_done: "));
  EncodeWords(id, handle->typed_data());
  return Status::Ok();
}

Status FetchStart(ffi::BufferR1<ffi::U32> handle,
                  ffi::Result<ffi::AnyBuffer> buf,
                  ffi::ResultBufferR1<ffi::U32> ticket) {
  JAXMEM_RETURN_IF_ERROR(
      CheckWords("handle", "fetch_start", handle.element_count()));
  JAXMEM_RETURN_IF_ERROR(
      CheckWords("ticket", "fetch_start", ticket->element_count()));
  JAXMEM_RETURN_IF_ERROR(CheckCopyable("fetch_start", buf->element_type()));
  uint64_t id = 0;
  // A bad handle or a shape/dtype mismatch is InvalidArgument (the message
  // starts with "fetch_start: ").
  JAXMEM_RETURN_IF_ERROR(
      CopyEngine::Global()
          .StartFetch(DecodeWords(handle.typed_data()), buf->untyped_data(),
                      buf->size_bytes(),
                      static_cast<uint32_t>(buf->element_type()), &id)
          .Prefixed("jaxmem "));
  EncodeWords(id, ticket->typed_data());
  return Status::Ok();
}

Status FetchDone(ffi::AnyBuffer buf, ffi::BufferR1<ffi::U32> ticket,
                 ffi::Result<ffi::AnyBuffer> out) {
  JAXMEM_RETURN_IF_ERROR(
      CheckWords("ticket", "fetch_done", ticket.element_count()));
  JAXMEM_RETURN_IF_ERROR(
      CopyEngine::Global()
          .FinishFetch(DecodeWords(ticket.typed_data()), buf.untyped_data())
          .Prefixed("jaxmem fetch_done: "));
  return CopyIfUnaliased("fetch_done", buf, out);
}

ffi::Error OffloadStartImpl(ffi::AnyBuffer x,
                            ffi::ResultBufferR1<ffi::U32> ticket) {
  return ToFfiError(OffloadStart(x, ticket));
}

ffi::Error OffloadStartPlannedImpl(ffi::AnyBuffer x, ffi::AnyBuffer /*dep*/,
                                   ffi::ResultBufferR1<ffi::U32> ticket,
                                   int64_t plan, int64_t slot) {
  return ToFfiError(OffloadStart(x, ticket, PlanSlot{plan, slot}));
}

ffi::Error OffloadDoneImpl(ffi::AnyBuffer keep, ffi::BufferR1<ffi::U32> ticket,
                           ffi::AnyBuffer /*dep*/,
                           ffi::ResultBufferR1<ffi::U32> handle) {
  return ToFfiError(OffloadDone(keep, ticket, handle));
}

ffi::Error FetchStartImpl(ffi::BufferR1<ffi::U32> handle,
                          ffi::AnyBuffer /*dep*/,
                          ffi::Result<ffi::AnyBuffer> buf,
                          ffi::ResultBufferR1<ffi::U32> ticket) {
  return ToFfiError(FetchStart(handle, buf, ticket));
}

ffi::Error FetchDoneImpl(ffi::AnyBuffer buf, ffi::BufferR1<ffi::U32> ticket,
                         ffi::AnyBuffer /*dep*/,
                         ffi::Result<ffi::AnyBuffer> out) {
  return ToFfiError(FetchDone(buf, ticket, out));
}

}  // namespace
}  // namespace jaxmem

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffloadStart, jaxmem::OffloadStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // ticket

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffloadStartPlanned,
                              jaxmem::OffloadStartPlannedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::BufferR1<ffi::U32>>()   // ticket
                                  .Attr<int64_t>("plan")
                                  .Attr<int64_t>("slot"));

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
