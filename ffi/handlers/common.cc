// Copyright 2025 The jaxmem Authors.

#include "handlers/common.h"

#include "host_store.h"

namespace jaxmem {

namespace ffi = xla::ffi;

bool IsCopyable(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
    case ffi::DataType::TOKEN:
    case ffi::DataType::INVALID:
      return false;
    default:
      return true;
  }
}

std::string TypeName(ffi::DataType t) {
  return DtypeName(static_cast<uint32_t>(t));
}

uint64_t DecodeWords(const uint32_t* words) {
  return static_cast<uint64_t>(words[0]) |
         (static_cast<uint64_t>(words[1]) << 32);
}

void EncodeWords(uint64_t id, uint32_t* words) {
  words[0] = static_cast<uint32_t>(id & 0xffffffffULL);
  words[1] = static_cast<uint32_t>(id >> 32);
}

ffi::Error CheckWords(const char* what, const char* op, size_t n) {
  if (n == 2) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("jaxmem ") + op + ": a " + what + " must be uint32[2], got " +
      std::to_string(n) + " elements");
}

}  // namespace jaxmem
