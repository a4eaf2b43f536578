// Copyright 2025 The jaxmem Authors.
//
// The XLA FFI handler symbols that module.cc exports through
// `registrations()` (CPU) and `cuda_registrations()` (CUDA builds).
//
//   fence(x, dep) -> x           identity that aliases x; orders x after dep.
//   offload(x) -> u32[2] handle  copies x into the native host store.
//   fetch(handle, dep) -> x      copies the entry back (after dep) and erases it.
//
// Window-scheduled asynchronous copies (copy_engine.h):
//
//   offload_start(x) -> ticket              a worker copies x to host
//   offload_done(x, ticket, dep) -> handle  waits (after dep); x dies here
//   fetch_start(handle, dep) -> (buf, ticket)  a worker copies host -> buf
//   fetch_done(buf, ticket, dep) -> buf     aliases buf; waits (after dep)
//
// CPU handlers: fence.cc, copies.cc, async_copies.cc. With JAXMEM_CUDA (on
// by default on Linux) the same targets also exist for the CUDA platform
// (cuda/handlers.cc: copy streams, events, pinned host memory), handed out
// only once the CUDA runtime has loaded (cuda/cudart_loader.h).

#ifndef JAXMEM_FFI_HANDLERS_HANDLERS_H_
#define JAXMEM_FFI_HANDLERS_HANDLERS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemFence);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemOffload);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemFetch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemOffloadStart);
// `offload` and `offload_start` with a planned host buffer (host_store.h):
// attributes `plan` and `slot` (int64), and a `dep` operand after `x`.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemOffloadPlanned);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemOffloadStartPlanned);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemOffloadDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemFetchStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemFetchDone);

#ifdef JAXMEM_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaFence);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaOffload);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaFetch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaOffloadStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaOffloadDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaFetchStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaFetchDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaOffloadPlanned);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxmemCudaOffloadStartPlanned);

namespace jaxmem {
// Frees pooled pinned host memory and outstanding CUDA tickets; returns the
// bytes freed (cuda/handlers.cc); 0 when no CUDA runtime is loaded.
uint64_t CudaClear();
}  // namespace jaxmem
#endif  // JAXMEM_WITH_CUDA

#endif  // JAXMEM_FFI_HANDLERS_HANDLERS_H_
