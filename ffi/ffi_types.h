// Copyright 2025 The jaxmem Authors.
//
// Which XLA element types jaxmem's copy custom calls accept (CPU and CUDA).

#ifndef JAXMEM_FFI_FFI_TYPES_H_
#define JAXMEM_FFI_FFI_TYPES_H_

#include "xla/ffi/api/ffi.h"

namespace jaxmem {

// Sub-byte types may be stored packed, so `size_bytes()` (1 byte / element)
// is not a safe copy size for them; copies of these types are refused, as are
// tokens and invalid types (no bytes to copy).
inline bool IsCopyable(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::S1:
    case xla::ffi::DataType::S2:
    case xla::ffi::DataType::S4:
    case xla::ffi::DataType::U1:
    case xla::ffi::DataType::U2:
    case xla::ffi::DataType::U4:
    case xla::ffi::DataType::F4E2M1FN:
    case xla::ffi::DataType::TOKEN:
    case xla::ffi::DataType::INVALID:
      return false;
    default:
      return true;
  }
}

}  // namespace jaxmem

#endif  // JAXMEM_FFI_FFI_TYPES_H_
