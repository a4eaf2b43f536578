// Copyright 2025 The jaxmem Authors.
//
// `jaxmem::Status`: the one error type of the native extension. Every
// fallible call below the XLA FFI handlers and the Python bindings (arenas,
// host store, copy engines) returns one; the two boundaries translate it
// once each:
//
//   * `ToFfiError` (handlers/common.h) gives the `xla::ffi::Error` with the
//     same-named `xla::ffi::ErrorCode`, so a failed custom call surfaces in
//     Python as `jax.errors.JaxRuntimeError("INVALID_ARGUMENT: ...")` etc.;
//   * `RaisePyError` (bindings/bindings.h) raises the matching Python
//     exception (see there for the table).
//
// Messages say what was wrong and are never rewritten on the way up; callers
// only prefix where it happened (`Prefixed`). This header depends on nothing
// but the standard library, so the allocators build without XLA or Python.

#ifndef JAXMEM_FFI_STATUS_H_
#define JAXMEM_FFI_STATUS_H_

#include <string>
#include <utility>

namespace jaxmem {

// A subset of the canonical codes that XLA FFI (`xla::ffi::ErrorCode`) and
// absl share, named alike.
enum class StatusCode {
  kOk = 0,
  // The caller passed something wrong: a stale, foreign, double-fetched or
  // double-freed handle or ticket, a ticket of the other kind, a shape or
  // dtype that does not match the stored entry, a bad size, offset or
  // argument, a plan id or size that the plan does not have.
  kInvalidArgument,
  // The request is well-formed but the current state refuses it: the store
  // is not empty (store_configure), its configuration is unusable, a closed
  // arena, a planned slot that is already live or overlaps a live one.
  kFailedPrecondition,
  // Out of host memory: an arena's capacity is reached, or the OS refused
  // memory (an allocation, mmap, ftruncate of the memfd, memfd_create with
  // ENOMEM, a pinned CUDA host allocation).
  kResourceExhausted,
  // The mechanism is missing on this system (memfd_create).
  kUnavailable,
  // The call does not apply to this object (sizes to a planned arena, plan
  // ids to a dynamic one, the stress driver on a planned arena).
  kUnimplemented,
  // A failure of a lower layer that fits none of the above (a CUDA error).
  kInternal,
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // The same code, with `prefix` put before the message (an ok status stays
  // ok): a caller adds where the error happened, not what it is.
  Status Prefixed(const std::string& prefix) const {
    return ok() ? *this : Status(code_, prefix + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}
inline Status FailedPrecondition(std::string message) {
  return Status(StatusCode::kFailedPrecondition, std::move(message));
}
inline Status ResourceExhausted(std::string message) {
  return Status(StatusCode::kResourceExhausted, std::move(message));
}
inline Status Unavailable(std::string message) {
  return Status(StatusCode::kUnavailable, std::move(message));
}
inline Status Unimplemented(std::string message) {
  return Status(StatusCode::kUnimplemented, std::move(message));
}
inline Status Internal(std::string message) {
  return Status(StatusCode::kInternal, std::move(message));
}

}  // namespace jaxmem

// Returns the status of `expr` from the enclosing function unless it is ok.
#define JAXMEM_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::jaxmem::Status jaxmem_status_ = (expr);        \
    if (!jaxmem_status_.ok()) return jaxmem_status_; \
  } while (0)

#endif  // JAXMEM_FFI_STATUS_H_
