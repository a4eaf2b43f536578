// Copyright 2025 The jaxmem Authors.

#include "handlers/common.h"

#include "host_store.h"

namespace jaxmem {

namespace ffi = xla::ffi;

ffi::Error ToFfiError(const Status& status) {
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (status.code()) {
    case StatusCode::kOk:
      return ffi::Error::Success();
    case StatusCode::kInvalidArgument:
      code = ffi::ErrorCode::kInvalidArgument;
      break;
    case StatusCode::kFailedPrecondition:
      code = ffi::ErrorCode::kFailedPrecondition;
      break;
    case StatusCode::kResourceExhausted:
      code = ffi::ErrorCode::kResourceExhausted;
      break;
    case StatusCode::kUnavailable:
      code = ffi::ErrorCode::kUnavailable;
      break;
    case StatusCode::kUnimplemented:
      code = ffi::ErrorCode::kUnimplemented;
      break;
    case StatusCode::kInternal:
      code = ffi::ErrorCode::kInternal;
      break;
  }
  return ffi::Error(code, status.message());
}

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

Status CheckCopyable(const char* op, ffi::DataType t) {
  if (IsCopyable(t)) return Status::Ok();
  return InvalidArgument(std::string("jaxmem ") + op + ": dtype " +
                         TypeName(t) +
                         " is not supported (sub-byte or token type)");
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

Status CheckWords(const char* what, const char* op, size_t n) {
  if (n == 2) return Status::Ok();
  return InvalidArgument(std::string("jaxmem ") + op + ": a " + what +
                         " must be uint32[2], got " + std::to_string(n) +
                         " elements");
}

}  // namespace jaxmem
