// Copyright 2025 The jaxmem Authors.
//
// XLA FFI custom calls used by jaxmem's `ffi` backend (CPU), and the
// `jaxmem._native` Python module that exports them.
//
//   fence(x, dep) -> x           identity that aliases x; orders x after dep.
//   offload(x) -> u32[2] handle  copies x into the native host store.
//   fetch(handle, dep) -> x      copies the entry back (after dep) and erases it.
//
// Handles are 64-bit ids split into (lo, hi) uint32 words so they work with
// jax_enable_x64 off. See host_store.h for the store itself.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "host_store.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

// Sub-byte types may be stored packed, so `size_bytes()` (1 byte / element)
// is not a safe copy size for them; copies of these types are refused.
bool IsSubByte(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return true;
    default:
      return false;
  }
}

bool IsCopyable(ffi::DataType t) {
  return !IsSubByte(t) && t != ffi::DataType::TOKEN &&
         t != ffi::DataType::INVALID;
}

std::string TypeName(ffi::DataType t) {
  return DtypeName(static_cast<uint32_t>(t));
}

uint64_t DecodeHandle(const uint32_t* words) {
  return static_cast<uint64_t>(words[0]) |
         (static_cast<uint64_t>(words[1]) << 32);
}

// fence ----------------------------------------------------------------------

ffi::Error FenceImpl(ffi::AnyBuffer x, ffi::AnyBuffer /*dep*/,
                     ffi::Result<ffi::AnyBuffer> out) {
  // With input_output_aliases={0: 0} the output *is* x and there is nothing to
  // do; copy only if XLA gave the output its own buffer.
  void* dst = out->untyped_data();
  const void* src = x.untyped_data();
  if (dst == src) return ffi::Error::Success();
  if (out->element_type() != x.element_type() ||
      out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument(
        "jaxmem fence: output (" + TypeName(out->element_type()) + ", " +
        std::to_string(out->element_count()) +
        " elements) does not match input (" + TypeName(x.element_type()) +
        ", " + std::to_string(x.element_count()) + " elements)");
  }
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  if (!IsCopyable(x.element_type())) {
    return ffi::Error::InvalidArgument(
        "jaxmem fence: cannot copy an unaliased " + TypeName(x.element_type()) +
        " buffer (sub-byte or token type)");
  }
  std::memmove(dst, src, bytes);
  return ffi::Error::Success();
}

// offload --------------------------------------------------------------------

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
  uint32_t* words = handle->typed_data();
  words[0] = static_cast<uint32_t>(id & 0xffffffffULL);
  words[1] = static_cast<uint32_t>(id >> 32);
  return ffi::Error::Success();
}

// fetch ----------------------------------------------------------------------

ffi::Error FetchImpl(ffi::BufferR1<ffi::U32> handle, ffi::AnyBuffer /*dep*/,
                     ffi::Result<ffi::AnyBuffer> out) {
  if (handle.element_count() != 2) {
    return ffi::Error::InvalidArgument(
        "jaxmem fetch: a handle must be uint32[2], got " +
        std::to_string(handle.element_count()) + " elements");
  }
  if (!IsCopyable(out->element_type())) {
    return ffi::Error::InvalidArgument(
        "jaxmem fetch: dtype " + TypeName(out->element_type()) +
        " is not supported (sub-byte or token type)");
  }
  const uint64_t id = DecodeHandle(handle.typed_data());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFence, jaxmem::FenceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()      // x
                                  .Arg<ffi::AnyBuffer>()      // dep
                                  .Ret<ffi::AnyBuffer>());    // out (aliases x)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemOffload, jaxmem::OffloadImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // handle

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemFetch, jaxmem::FetchImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // handle
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::AnyBuffer>());          // out

// Python module ----------------------------------------------------------------

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

constexpr uint32_t kU8 = static_cast<uint32_t>(ffi::DataType::U8);

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jaxmem native extension: XLA FFI handlers and the host store.";

  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["fence"] = EncapsulateFfiHandler(JaxmemFence);
        registrations["offload"] = EncapsulateFfiHandler(JaxmemOffload);
        registrations["fetch"] = EncapsulateFfiHandler(JaxmemFetch);
        return registrations;
      },
      "Maps handler name -> PyCapsule of its XLA FFI handler (CPU).");

  m.def(
      "store_stats",
      []() {
        jaxmem::HostStoreStats s = jaxmem::HostStore::Global().Stats();
        nb::dict d;
        d["live_entries"] = s.live_entries;
        d["live_bytes"] = s.live_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["total_puts"] = s.total_puts;
        d["total_takes"] = s.total_takes;
        d["total_errors"] = s.total_errors;
        return d;
      },
      "Counters of the native host store, as a dict.");

  m.def(
      "store_clear", []() { return jaxmem::HostStore::Global().Clear(); },
      "Frees every entry of the host store; returns the bytes freed.");

  m.def(
      "store_put",
      [](nb::bytes data, uint32_t dtype_code) {
        const void* src = data.c_str();
        const size_t n = data.size();
        uint64_t id = 0;
        std::string err;
        {
          nb::gil_scoped_release release;
          err = jaxmem::HostStore::Global().Put(src, n, dtype_code, &id);
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return id;
      },
      nb::arg("data"), nb::arg("dtype_code") = kU8,
      "Copies `data` into the host store; returns the 64-bit handle.");

  m.def(
      "store_take",
      [](uint64_t id, size_t nbytes, uint32_t dtype_code) {
        std::string buf(nbytes, '\0');
        std::string err;
        {
          nb::gil_scoped_release release;
          err = jaxmem::HostStore::Global().Take(id, buf.data(), nbytes,
                                                 dtype_code);
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return nb::bytes(buf.data(), buf.size());
      },
      nb::arg("id"), nb::arg("nbytes"), nb::arg("dtype_code") = kU8,
      "Copies entry `id` out of the host store and erases it. Raises "
      "ValueError for an unknown/stale handle or a size/dtype mismatch.");

  m.attr("HANDLE_WORDS") = 2;
  m.attr("ALIGNMENT") = jaxmem::kHostStoreAlignment;
}
