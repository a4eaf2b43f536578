// Copyright 2025 The jaxmem Authors.
//
// What the XLA FFI handlers share (CPU: fence.cc, copies.cc, async_copies.cc;
// CUDA: cuda/handlers.cc): the translation of a Status into the error XLA
// sees, which element types they copy, how they name them in messages, and
// the uint32[2] encoding of handles and tickets.

#ifndef JAXMEM_FFI_HANDLERS_COMMON_H_
#define JAXMEM_FFI_HANDLERS_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmem {

// The XLA FFI error of the same code and message (status.h), the one way a
// handler reports failure: JAX raises it as
// `jax.errors.JaxRuntimeError("<CODE>: <message>")`, e.g.
// "INVALID_ARGUMENT: jaxmem fetch: handle 0x... is not in the host store".
xla::ffi::Error ToFfiError(const Status& status);

// Sub-byte types may be stored packed, so `size_bytes()` (1 byte / element)
// is not a safe copy size for them; copies of these types are refused, as are
// tokens and invalid types (no bytes to copy).
bool IsCopyable(xla::ffi::DataType t);

// InvalidArgument naming `op` unless `t` IsCopyable.
Status CheckCopyable(const char* op, xla::ffi::DataType t);

// "f32", "bf16", ... (host_store.h's DtypeName).
std::string TypeName(xla::ffi::DataType t);

// Handles and tickets are 64-bit ids split into (lo, hi) uint32 words so that
// they work with jax_enable_x64 off.
uint64_t DecodeWords(const uint32_t* words);
void EncodeWords(uint64_t id, uint32_t* words);

// InvalidArgument unless a handle or ticket operand of `op` has 2 words.
Status CheckWords(const char* what, const char* op, size_t n);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_HANDLERS_COMMON_H_
