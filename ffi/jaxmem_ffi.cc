// Copyright 2025 The jaxmem Authors.
//
// XLA FFI custom calls used by jaxmem's `ffi` backend (CPU), and the
// `jaxmem._native` Python module that exports them.
//
//   fence(x, dep) -> x           identity that aliases x; orders x after dep.
//   offload(x) -> u32[2] handle  copies x into the native host store.
//   fetch(handle, dep) -> x      copies the entry back (after dep) and erases it.
//
// Window-scheduled asynchronous copies (copy_engine.h; paper 001 §3):
//
//   offload_start(x) -> ticket              a worker copies x to host
//   offload_done(x, ticket, dep) -> handle  waits (after dep); x dies here
//   fetch_start(handle, dep) -> (buf, ticket)  a worker copies host -> buf
//   fetch_done(buf, ticket, dep) -> buf     aliases buf; waits (after dep)
//
// Handles and tickets are 64-bit ids split into (lo, hi) uint32 words so they
// work with jax_enable_x64 off. See host_store.h for the store itself. With
// JAXMEM_CUDA the same targets are also registered for the CUDA platform
// (jaxmem_cuda.cu: copy streams, events, pinned host memory).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "copy_engine.h"
#include "host_store.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"
#include "ffi_types.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

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

// async copies ---------------------------------------------------------------

ffi::Error CheckWords(const char* what, const char* op, size_t n) {
  if (n == 2) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("jaxmem ") + op + ": a " + what + " must be uint32[2], got " +
      std::to_string(n) + " elements");
}

void EncodeWords(uint64_t id, uint32_t* words) {
  words[0] = static_cast<uint32_t>(id & 0xffffffffULL);
  words[1] = static_cast<uint32_t>(id >> 32);
}

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
      DecodeHandle(ticket.typed_data()), keep.untyped_data(), &id);
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
      DecodeHandle(handle.typed_data()), buf->untyped_data(),
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
      DecodeHandle(ticket.typed_data()), buf.untyped_data());
  if (!err.empty()) {
    return ffi::Error::InvalidArgument("jaxmem fetch_done: " + err);
  }
  return CopyIfUnaliased("fetch_done", buf, out);
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

#ifdef JAXMEM_WITH_CUDA
// jaxmem_cuda.cu: the same four targets (and fence/offload/fetch) for the
// CUDA platform.
extern "C" XLA_FFI_Error* JaxmemCudaFence(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxmemCudaOffload(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxmemCudaFetch(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxmemCudaOffloadStart(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxmemCudaOffloadDone(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxmemCudaFetchStart(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxmemCudaFetchDone(XLA_FFI_CallFrame*);
namespace jaxmem {
uint64_t CudaClear();  // frees pooled pinned host memory; returns bytes
}  // namespace jaxmem
#endif

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

namespace jaxmem { void RegisterDsa(nb::module_& m); }  // dsa.cc: offline DSA solver
namespace jaxmem {
void RegisterArena(nb::module_& m);  // host_arena.cc
nb::dict ArenaStatsDict(const ArenaStats& s, const char* mode);  // ditto
}  // namespace jaxmem

NB_MODULE(_native, m) {
  m.doc() = "jaxmem native extension: XLA FFI handlers and the host store.";

  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["fence"] = EncapsulateFfiHandler(JaxmemFence);
        registrations["offload"] = EncapsulateFfiHandler(JaxmemOffload);
        registrations["fetch"] = EncapsulateFfiHandler(JaxmemFetch);
        registrations["offload_start"] =
            EncapsulateFfiHandler(JaxmemOffloadStart);
        registrations["offload_done"] = EncapsulateFfiHandler(JaxmemOffloadDone);
        registrations["fetch_start"] = EncapsulateFfiHandler(JaxmemFetchStart);
        registrations["fetch_done"] = EncapsulateFfiHandler(JaxmemFetchDone);
        return registrations;
      },
      "Maps handler name -> PyCapsule of its XLA FFI handler (CPU).");

  m.def(
      "cuda_registrations",
      []() {
        nb::dict registrations;
#ifdef JAXMEM_WITH_CUDA
        registrations["fence"] = EncapsulateFfiHandler(JaxmemCudaFence);
        registrations["offload"] = EncapsulateFfiHandler(JaxmemCudaOffload);
        registrations["fetch"] = EncapsulateFfiHandler(JaxmemCudaFetch);
        registrations["offload_start"] =
            EncapsulateFfiHandler(JaxmemCudaOffloadStart);
        registrations["offload_done"] =
            EncapsulateFfiHandler(JaxmemCudaOffloadDone);
        registrations["fetch_start"] =
            EncapsulateFfiHandler(JaxmemCudaFetchStart);
        registrations["fetch_done"] = EncapsulateFfiHandler(JaxmemCudaFetchDone);
#endif
        return registrations;
      },
      "Maps handler name -> PyCapsule of its CUDA XLA FFI handler; empty "
      "unless built with JAXMEM_CUDA=1.");

#ifdef JAXMEM_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif

  m.def(
      "copy_stats",
      []() {
        jaxmem::CopyEngineStats s = jaxmem::CopyEngine::Global().Stats();
        nb::dict d;
        d["threads"] = s.threads;
        nb::list cpus;
        for (int c : s.cpus) cpus.append(c);
        d["cpus"] = cpus;
        d["outstanding"] = s.outstanding;
        d["in_flight"] = s.in_flight;
        d["total_started"] = s.total_started;
        d["total_finished"] = s.total_finished;
        d["total_errors"] = s.total_errors;
        d["stolen"] = s.stolen;
        d["bytes_copied"] = s.bytes_copied;
        d["copy_seconds"] = s.copy_seconds;
        d["wait_seconds"] = s.wait_seconds;
        return d;
      },
      "Counters of the asynchronous copy engine (CPU), as a dict.");

  m.def(
      "copy_drain",
      []() {
        nb::gil_scoped_release release;
        jaxmem::CopyEngine::Global().Drain();
      },
      "Blocks until every asynchronous copy queued so far has finished.");

  m.def(
      "copy_clear",
      []() {
        nb::gil_scoped_release release;
        uint64_t freed = jaxmem::CopyEngine::Global().Clear();
#ifdef JAXMEM_WITH_CUDA
        freed += jaxmem::CudaClear();
#endif
        return freed;
      },
      "Drains, then drops every outstanding copy ticket; returns the host "
      "bytes freed.");

  m.def(
      "set_copy_threads",
      [](int n) { jaxmem::CopyEngine::Global().SetThreads(n); }, nb::arg("n"),
      "Sets the number of copy worker threads (0: copy inline in the start).");

  m.def(
      "set_copy_cpus",
      [](std::vector<int> cpus) {
        std::string err = jaxmem::CopyEngine::Global().SetCpus(cpus);
        if (!err.empty()) throw nb::value_error(err.c_str());
      },
      nb::arg("cpus"),
      "Pins the copy workers to these CPUs (empty list: no pinning).");

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
        d["cached_bytes"] = s.cached_bytes;
        d["cache_hits"] = s.cache_hits;
        d["cache_misses"] = s.cache_misses;
        d["arena"] = jaxmem::ArenaStatsDict(s.arena, s.arena_mode.c_str());
        return d;
      },
      "Counters of the native host store, as a dict; 'arena' holds the "
      "backing arena's stats (a dict like HostArena.stats()).");

  m.def(
      "store_clear", []() { return jaxmem::HostStore::Global().Clear(); },
      "Frees every entry of the host store and drops its arena (returning "
      "the arena's cached memory to the OS); returns the payload bytes "
      "freed.");

  m.def(
      "store_configure",
      [](const std::string& mode, uint64_t chunk_bytes, uint64_t segment_bytes,
         uint64_t capacity_bytes) {
        jaxmem::HostArenaConfig config;
        config.mode = mode;
        config.chunk_bytes = chunk_bytes;
        config.segment_bytes = segment_bytes;
        config.capacity_bytes = capacity_bytes;
        std::string err = jaxmem::HostStore::Global().Configure(config);
        if (!err.empty()) throw nb::value_error(err.c_str());
      },
      nb::arg("mode"), nb::arg("chunk_bytes"), nb::arg("segment_bytes"),
      nb::arg("capacity_bytes"),
      "Replaces the host store's arena ('best_fit', 'virtual' or 'heap'); "
      "raises ValueError unless the store is empty.");

  m.def(
      "store_config",
      []() {
        std::string source, error;
        jaxmem::HostArenaConfig c =
            jaxmem::HostStore::Global().Config(&source, &error);
        nb::dict d;
        d["mode"] = c.mode;
        d["chunk_bytes"] = c.chunk_bytes;
        d["segment_bytes"] = c.segment_bytes;
        d["capacity_bytes"] = c.capacity_bytes;
        d["source"] = source;
        d["error"] = error;
        return d;
      },
      "The host store's arena configuration: mode, chunk_bytes, "
      "segment_bytes, capacity_bytes, source ('default', 'env', "
      "'store_configure') and error (why $JAXMEM_HOST_ARENA was rejected).");

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
        // Copy straight into the result (no zero-filled staging buffer).
        if (nbytes > static_cast<size_t>(PY_SSIZE_T_MAX)) {
          throw nb::value_error("nbytes is too large");
        }
        nb::object out = nb::steal(PyBytes_FromStringAndSize(
            nullptr, static_cast<Py_ssize_t>(nbytes)));
        if (!out.is_valid()) throw nb::python_error();
        char* dst = PyBytes_AS_STRING(out.ptr());
        std::string err;
        {
          nb::gil_scoped_release release;
          err = jaxmem::HostStore::Global().Take(id, dst, nbytes, dtype_code);
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return nb::borrow<nb::bytes>(out);
      },
      nb::arg("id"), nb::arg("nbytes"), nb::arg("dtype_code") = kU8,
      "Copies entry `id` out of the host store and erases it. Raises "
      "ValueError for an unknown/stale handle or a size/dtype mismatch.");

  m.attr("HANDLE_WORDS") = 2;
  m.attr("ALIGNMENT") = jaxmem::kHostStoreAlignment;
  jaxmem::RegisterDsa(m);
  jaxmem::RegisterArena(m);
}
