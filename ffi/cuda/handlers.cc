// Copyright 2025 The jaxmem Authors.
//
// CUDA handlers for jaxmem's custom calls (built by default on Linux; CMake
// option JAXMEM_CUDA=OFF leaves them out): the same targets and semantics as
// the CPU handlers in handlers/ and copy_engine.cc, with a dedicated copy
// stream per device, CUDA events and pinned host memory (docs/design.md,
// "Native extension"; offload and prefetch on a separate stream as in vDNN:
// Rhu et al., *Virtualizing Deep Neural Networks for Memory-Efficient Neural
// Network Design*, §3; the window as in Hayakawa & Narihira, *Out-of-core
// training for extremely large-scale neural networks with adaptive
// window-based scheduling*, §3).
//
// Plain C++ with no device code: every CUDA call is a runtime API call through
// the function table of the libcudart loaded at run time (cudart_api.h,
// cudart_loader.h), so this file compiles with the host compiler and no CUDA
// headers, and module.cc hands these handlers to XLA only once a runtime has
// loaded.
//
//   offload_start(x) -> ticket
//       records `ready` on XLA's compute stream, makes the device's copy
//       stream wait for it and enqueues x -> pinned host buffer there,
//       recording `copied`. Returns at once; the compute stream goes on.
//   offload_done(x, ticket, dep) -> handle
//       makes the compute stream wait for `copied` (so XLA may reuse x's
//       memory after this op), publishes the pinned buffer in the host store
//       (host readers synchronize on `copied` first) and returns its handle.
//   fetch_start(handle, dep) -> (buf, ticket)
//       takes the entry out of the store, orders the copy stream after the
//       compute stream, enqueues pinned -> buf there and records `copied`;
//       the pinned buffer goes back to the pool from a host callback on the
//       copy stream once the copy has run.
//   fetch_done(buf, ticket, dep) -> buf (aliased)
//       makes the compute stream wait for `copied`.
//   offload / fetch / fence: the synchronous ops (copies on the compute stream).
//
// Handles and tickets live in device memory as uint32[2]; the host needs
// their value to find the entry, so offload_done, fetch_start and fetch
// read 8 bytes back, which synchronizes the compute stream at that point
// (the GPU idles for the host's launch latency; the copies themselves stay
// asynchronous). Nothing here has run on a GPU in this repository's CI: it is
// compiled everywhere, and the runtime loading is tested, not executed on a
// device.


#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "cuda/cudart_api.h"
#include "handlers/common.h"
#include "handlers/handlers.h"
#include "host_store.h"
#include "ids.h"
#include "mutex.h"
#include "status.h"
#include "thread_annotations.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxmem {
namespace {

// The runtime API under its CUDA names (cudart_api.h).
using namespace cudart;  // NOLINT(build/namespaces)

// A failed CUDA call: ResourceExhausted when CUDA ran out of memory (a
// pinned host allocation, or device memory for an event or a stream),
// Internal otherwise.
Status CudaStatus(const char* what, cudaError_t err) {
  return Status(
      err == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                                       : StatusCode::kInternal,
      std::string("jaxmem (CUDA) ") + what + ": " + cudaGetErrorString(err));
}

#define JAXMEM_CUDA_RETURN_IF_ERROR(what, expr)    \
  do {                                             \
    cudaError_t jaxmem_cuda_error_ = (expr);       \
    if (jaxmem_cuda_error_ != cudaSuccess) {       \
      return CudaStatus(what, jaxmem_cuda_error_); \
    }                                              \
  } while (0)

// Pinned host memory ---------------------------------------------------------

// cudaHostAlloc costs milliseconds (it pins pages): freed blocks are kept by
// size and reused. `CudaClear` releases them.
class PinnedPool {
 public:
  static PinnedPool& Global() {
    static PinnedPool* pool = new PinnedPool();  // leaked, like the store
    return *pool;
  }

  cudaError_t Allocate(size_t bytes, HostBuffer* out) EXCLUDES(mu_) {
    if (bytes == 0) {
      *out = HostBuffer();
      return cudaSuccess;
    }
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    void* p = nullptr;
    {
      MutexLock lock(&mu_);
      auto it = free_.lower_bound(rounded);
      if (it != free_.end() && it->first - rounded <= rounded / 8) {
        p = it->second;
        sizes_[p] = it->first;
        cached_ -= it->first;
        free_.erase(it);
      }
    }
    if (p == nullptr) {
      cudaError_t err = cudaHostAlloc(&p, rounded, cudaHostAllocPortable);
      if (err != cudaSuccess) return err;
      MutexLock lock(&mu_);
      sizes_[p] = rounded;
    }
    *out = HostBuffer(p, bytes, &PinnedPool::Release);
    return cudaSuccess;
  }

  // The HostBuffer deleter. May run in a CUDA host callback: no CUDA calls.
  static void Release(void* p, size_t /*bytes*/) {
    PinnedPool& pool = Global();
    MutexLock lock(&pool.mu_);
    auto it = pool.sizes_.find(p);
    if (it == pool.sizes_.end()) return;  // not ours: leak rather than crash
    pool.free_.emplace(it->second, p);
    pool.cached_ += it->second;
  }

  uint64_t Clear() EXCLUDES(mu_) {
    std::multimap<size_t, void*> doomed;
    uint64_t freed = 0;
    {
      MutexLock lock(&mu_);
      doomed.swap(free_);
      freed = cached_;
      cached_ = 0;
      for (auto& [size, p] : doomed) sizes_.erase(p);
    }
    for (auto& [size, p] : doomed) cudaFreeHost(p);
    return freed;
  }

 private:
  Mutex mu_;
  std::multimap<size_t, void*> free_ GUARDED_BY(mu_);
  // Every block we allocated.
  std::unordered_map<void*, size_t> sizes_ GUARDED_BY(mu_);
  uint64_t cached_ GUARDED_BY(mu_) = 0;
};

// Events and copy streams ----------------------------------------------------

struct EventDeleter {
  void operator()(CUevent_st* e) const {
    // Safe with work still pending: the driver frees it when it completes.
    if (e != nullptr) cudaEventDestroy(e);
  }
};
using Event = std::shared_ptr<CUevent_st>;

cudaError_t NewEvent(Event* out) {
  cudaEvent_t e = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  *out = Event(e, EventDeleter());
  return cudaSuccess;
}

// One non-blocking copy stream per device, created on first use.
class CopyStreams {
 public:
  static CopyStreams& Global() {
    static CopyStreams* streams = new CopyStreams();  // leaked, like the store
    return *streams;
  }

  cudaError_t Get(cudaStream_t* out) EXCLUDES(mu_) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    MutexLock lock(&mu_);
    auto it = streams_.find(device);
    if (it != streams_.end()) {
      *out = it->second;
      return cudaSuccess;
    }
    cudaStream_t s = nullptr;
    err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err != cudaSuccess) return err;
    streams_[device] = s;
    *out = s;
    return cudaSuccess;
  }

 private:
  Mutex mu_;
  std::unordered_map<int, cudaStream_t> streams_ GUARDED_BY(mu_);
};

// Makes `waiter` wait for all work enqueued on `producer` so far.
cudaError_t Order(cudaStream_t producer, cudaStream_t waiter) {
  Event e;
  cudaError_t err = NewEvent(&e);
  if (err != cudaSuccess) return err;
  err = cudaEventRecord(e.get(), producer);
  if (err != cudaSuccess) return err;
  return cudaStreamWaitEvent(waiter, e.get(), 0);
}

// Tickets --------------------------------------------------------------------

enum class Kind { kOffload, kFetch };

struct Job {
  Kind kind;
  const void* device_buffer;  // offload: source x; fetch: destination buf
  size_t bytes;
  uint32_t dtype;
  HostBuffer host;  // offload only (a fetch hands its buffer to a callback)
  Event copied;
};

class Tickets {
 public:
  static Tickets& Global() {
    static Tickets* t = new Tickets();
    return *t;
  }

  uint64_t Add(std::unique_ptr<Job> job) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    uint64_t id = next_++;
    jobs_.emplace(id, std::move(job));
    return id;
  }

  // InvalidArgument for a stale, foreign or other-kind ticket, or a moved
  // buffer.
  Status Claim(uint64_t id, Kind kind, const void* device_buffer,
               std::unique_ptr<Job>* out) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) {
      return InvalidArgument(
          "copy ticket " + FormatHandle(id) +
          (id - first_ < next_ - first_
               ? " is not outstanding (its done already ran, or the "
                 "tickets were cleared)"
               : " was never issued by this process"));
    }
    if (it->second->kind != kind) {
      return InvalidArgument("copy ticket " + FormatHandle(id) +
                             " belongs to the other kind of copy; the ticket "
                             "is kept");
    }
    if (it->second->bytes > 0 && it->second->device_buffer != device_buffer) {
      return InvalidArgument(
          "the buffer of copy ticket " + FormatHandle(id) +
          " moved between the start and the done; the result is refused");
    }
    *out = std::move(it->second);
    jobs_.erase(it);
    return Status::Ok();
  }

  uint64_t Clear() EXCLUDES(mu_) {
    std::unordered_map<uint64_t, std::unique_ptr<Job>> doomed;
    uint64_t freed = 0;
    {
      MutexLock lock(&mu_);
      doomed.swap(jobs_);
    }
    for (auto& [id, job] : doomed) freed += job->host.bytes();
    return freed;  // HostBuffer::Reset waits for each copy before freeing
  }

 private:
  Mutex mu_;
  std::unordered_map<uint64_t, std::unique_ptr<Job>> jobs_ GUARDED_BY(mu_);
  const uint64_t first_ = RandomFirstId();
  uint64_t next_ GUARDED_BY(mu_) = first_;
};

// Device <-> host ids --------------------------------------------------------

Status ReadId(cudaStream_t stream, const ffi::BufferR1<ffi::U32>& words,
              const char* what, uint64_t* id) {
  if (words.element_count() != 2) {
    return InvalidArgument(std::string("jaxmem: a ") + what +
                           " must be uint32[2]");
  }
  uint32_t host[2] = {0, 0};
  JAXMEM_CUDA_RETURN_IF_ERROR(
      "reading an id",
      cudaMemcpyAsync(host, words.typed_data(), sizeof(host),
                      cudaMemcpyDeviceToHost, stream));
  JAXMEM_CUDA_RETURN_IF_ERROR("reading an id", cudaStreamSynchronize(stream));
  *id = DecodeWords(host);
  return Status::Ok();
}

Status WriteId(cudaStream_t stream, uint64_t id,
               ffi::ResultBufferR1<ffi::U32>& words, const char* what) {
  if (words->element_count() != 2) {
    return InvalidArgument(std::string("jaxmem: a ") + what +
                           " must be uint32[2]");
  }
  // Pageable source: cudaMemcpyAsync stages it before returning.
  uint32_t host[2];
  EncodeWords(id, host);
  JAXMEM_CUDA_RETURN_IF_ERROR(
      "writing an id",
      cudaMemcpyAsync(words->typed_data(), host, sizeof(host),
                      cudaMemcpyHostToDevice, stream));
  return Status::Ok();
}

void ReleaseHostBuffer(void* data) {
  delete static_cast<HostBuffer*>(data);  // -> PinnedPool::Release
}

// Hands `host` back to the pool once `stream` has run the copies before now.
cudaError_t ReleaseAfter(cudaStream_t stream, HostBuffer host) {
  if (host.data() == nullptr) return cudaSuccess;
  host.set_wait_ready(nullptr);  // ordered by the stream; no CUDA calls later
  auto* boxed = new HostBuffer(std::move(host));
  cudaError_t err = cudaLaunchHostFunc(stream, ReleaseHostBuffer, boxed);
  if (err != cudaSuccess) {
    cudaStreamSynchronize(stream);
    delete boxed;
  }
  return err;
}

// Handlers -------------------------------------------------------------------

Status Fence(cudaStream_t stream, ffi::AnyBuffer x,
             ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() == x.untyped_data() || x.size_bytes() == 0) {
    return Status::Ok();
  }
  JAXMEM_CUDA_RETURN_IF_ERROR(
      "fence copy",
      cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(),
                      cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

// Copies `bytes` at `src` (device) into a new pinned buffer on `copy_stream`
// after the work enqueued on `stream`; `*copied` completes with the copy.
Status EnqueueOffload(cudaStream_t stream, cudaStream_t copy_stream,
                      const void* src, size_t bytes, HostBuffer* host,
                      Event* copied) {
  JAXMEM_CUDA_RETURN_IF_ERROR("pinned allocation",
                              PinnedPool::Global().Allocate(bytes, host));
  JAXMEM_CUDA_RETURN_IF_ERROR("event", NewEvent(copied));
  // Whoever frees or reads the buffer on the host waits for the DMA first.
  host->set_wait_ready([e = *copied] { cudaEventSynchronize(e.get()); });
  if (copy_stream != stream) {
    JAXMEM_CUDA_RETURN_IF_ERROR("stream order", Order(stream, copy_stream));
  }
  if (bytes > 0) {
    JAXMEM_CUDA_RETURN_IF_ERROR(
        "device-to-host copy",
        cudaMemcpyAsync(host->data(), src, bytes, cudaMemcpyDeviceToHost,
                        copy_stream));
  }
  JAXMEM_CUDA_RETURN_IF_ERROR("event record",
                              cudaEventRecord(copied->get(), copy_stream));
  return Status::Ok();
}

// Publishes an offloaded pinned buffer; host readers wait for `copied`.
Status Publish(HostBuffer host, size_t bytes, uint32_t dtype, Event copied,
               uint64_t* id) {
  host.set_wait_ready([copied] { cudaEventSynchronize(copied.get()); });
  return HostStore::Global().Insert(std::move(host), bytes, dtype, id);
}

Status Offload(cudaStream_t stream, ffi::AnyBuffer x,
               ffi::ResultBufferR1<ffi::U32> handle) {
  if (!IsCopyable(x.element_type())) {
    return InvalidArgument("jaxmem offload: unsupported dtype");
  }
  HostBuffer host;
  Event copied;
  JAXMEM_RETURN_IF_ERROR(EnqueueOffload(stream, stream, x.untyped_data(),
                                        x.size_bytes(), &host, &copied));
  uint64_t id = 0;
  JAXMEM_RETURN_IF_ERROR(Publish(std::move(host), x.size_bytes(),
                                 static_cast<uint32_t>(x.element_type()),
                                 copied, &id));
  return WriteId(stream, id, handle, "handle");
}

Status OffloadStart(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::ResultBufferR1<ffi::U32> ticket) {
  if (!IsCopyable(x.element_type())) {
    return InvalidArgument("jaxmem offload_start: unsupported dtype");
  }
  cudaStream_t copy_stream = nullptr;
  JAXMEM_CUDA_RETURN_IF_ERROR("copy stream",
                              CopyStreams::Global().Get(&copy_stream));
  auto job = std::make_unique<Job>();
  job->kind = Kind::kOffload;
  job->device_buffer = x.untyped_data();
  job->bytes = x.size_bytes();
  job->dtype = static_cast<uint32_t>(x.element_type());
  JAXMEM_RETURN_IF_ERROR(EnqueueOffload(stream, copy_stream, x.untyped_data(),
                                        x.size_bytes(), &job->host,
                                        &job->copied));
  uint64_t id = Tickets::Global().Add(std::move(job));
  return WriteId(stream, id, ticket, "ticket");
}

Status OffloadDone(cudaStream_t stream, ffi::AnyBuffer x,
                   ffi::BufferR1<ffi::U32> ticket,
                   ffi::ResultBufferR1<ffi::U32> handle) {
  uint64_t tid = 0;
  JAXMEM_RETURN_IF_ERROR(ReadId(stream, ticket, "ticket", &tid));
  std::unique_ptr<Job> job;
  JAXMEM_RETURN_IF_ERROR(Tickets::Global()
                             .Claim(tid, Kind::kOffload, x.untyped_data(), &job)
                             .Prefixed("jaxmem offload_done: "));
  // XLA may reuse x's memory for work enqueued after this op.
  JAXMEM_CUDA_RETURN_IF_ERROR(
      "stream wait", cudaStreamWaitEvent(stream, job->copied.get(), 0));
  uint64_t id = 0;
  JAXMEM_RETURN_IF_ERROR(
      Publish(std::move(job->host), job->bytes, job->dtype, job->copied, &id));
  return WriteId(stream, id, handle, "handle");
}

// Takes entry `hid` out of the store and enqueues its copy into `dst` on
// `copy_stream` (after `stream`'s work), releasing the pinned buffer after.
Status EnqueueFetch(cudaStream_t stream, cudaStream_t copy_stream, uint64_t hid,
                    void* dst, size_t bytes, uint32_t dtype, Event* copied) {
  HostBuffer host;
  // A stale / foreign / already fetched handle or a mismatch: InvalidArgument.
  JAXMEM_RETURN_IF_ERROR(HostStore::Global()
                             .Remove(hid, bytes, dtype, &host)
                             .Prefixed("jaxmem fetch: "));
  if (copy_stream != stream) {
    JAXMEM_CUDA_RETURN_IF_ERROR("stream order", Order(stream, copy_stream));
  }
  JAXMEM_CUDA_RETURN_IF_ERROR("event", NewEvent(copied));
  if (bytes > 0) {
    // The DMA into this entry (if it came from an offload) has completed:
    // the id read above synchronized the compute stream, which waited for
    // it in offload_done. So this host-side wait returns at once; it matters
    // for entries offloaded on another device.
    host.WaitReady();
    JAXMEM_CUDA_RETURN_IF_ERROR(
        "host-to-device copy",
        cudaMemcpyAsync(dst, host.data(), bytes, cudaMemcpyHostToDevice,
                        copy_stream));
  }
  JAXMEM_CUDA_RETURN_IF_ERROR("event record",
                              cudaEventRecord(copied->get(), copy_stream));
  JAXMEM_CUDA_RETURN_IF_ERROR("release",
                              ReleaseAfter(copy_stream, std::move(host)));
  return Status::Ok();
}

Status Fetch(cudaStream_t stream, ffi::BufferR1<ffi::U32> handle,
             ffi::Result<ffi::AnyBuffer> out) {
  if (!IsCopyable(out->element_type())) {
    return InvalidArgument("jaxmem fetch: unsupported dtype");
  }
  uint64_t hid = 0;
  JAXMEM_RETURN_IF_ERROR(ReadId(stream, handle, "handle", &hid));
  Event copied;
  return EnqueueFetch(stream, stream, hid, out->untyped_data(),
                      out->size_bytes(),
                      static_cast<uint32_t>(out->element_type()), &copied);
}

Status FetchStart(cudaStream_t stream, ffi::BufferR1<ffi::U32> handle,
                  ffi::Result<ffi::AnyBuffer> buf,
                  ffi::ResultBufferR1<ffi::U32> ticket) {
  if (!IsCopyable(buf->element_type())) {
    return InvalidArgument("jaxmem fetch_start: unsupported dtype");
  }
  uint64_t hid = 0;
  JAXMEM_RETURN_IF_ERROR(ReadId(stream, handle, "handle", &hid));
  cudaStream_t copy_stream = nullptr;
  JAXMEM_CUDA_RETURN_IF_ERROR("copy stream",
                              CopyStreams::Global().Get(&copy_stream));
  auto job = std::make_unique<Job>();
  job->kind = Kind::kFetch;
  job->device_buffer = buf->untyped_data();
  job->bytes = buf->size_bytes();
  job->dtype = static_cast<uint32_t>(buf->element_type());
  JAXMEM_RETURN_IF_ERROR(EnqueueFetch(stream, copy_stream, hid,
                                      buf->untyped_data(), job->bytes,
                                      job->dtype, &job->copied));
  uint64_t id = Tickets::Global().Add(std::move(job));
  return WriteId(stream, id, ticket, "ticket");
}

Status FetchDone(cudaStream_t stream, ffi::AnyBuffer buf,
                 ffi::BufferR1<ffi::U32> ticket,
                 ffi::Result<ffi::AnyBuffer> out) {
  uint64_t tid = 0;
  JAXMEM_RETURN_IF_ERROR(ReadId(stream, ticket, "ticket", &tid));
  std::unique_ptr<Job> job;
  JAXMEM_RETURN_IF_ERROR(Tickets::Global()
                             .Claim(tid, Kind::kFetch, buf.untyped_data(), &job)
                             .Prefixed("jaxmem fetch_done: "));
  JAXMEM_CUDA_RETURN_IF_ERROR(
      "stream wait", cudaStreamWaitEvent(stream, job->copied.get(), 0));
  if (out->untyped_data() != buf.untyped_data() && buf.size_bytes() > 0) {
    JAXMEM_CUDA_RETURN_IF_ERROR(
        "fetch_done copy",
        cudaMemcpyAsync(out->untyped_data(), buf.untyped_data(),
                        buf.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  }
  return Status::Ok();
}

// What XLA binds: every error leaves through ToFfiError (handlers/common.h).

ffi::Error FenceImpl(cudaStream_t stream, ffi::AnyBuffer x,
                     ffi::AnyBuffer /*dep*/, ffi::Result<ffi::AnyBuffer> out) {
  return ToFfiError(Fence(stream, x, out));
}

ffi::Error OffloadImpl(cudaStream_t stream, ffi::AnyBuffer x,
                       ffi::ResultBufferR1<ffi::U32> handle) {
  return ToFfiError(Offload(stream, x, handle));
}

ffi::Error OffloadStartImpl(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::ResultBufferR1<ffi::U32> ticket) {
  return ToFfiError(OffloadStart(stream, x, ticket));
}

// The planned forms (offload_planned, offload_start_planned: the ffi
// backend's copies into a planned host layout, jaxmem/_src/lower/ffi.py).
// Departure from the CPU handlers: on CUDA the copy goes to the pinned pool,
// not to slot `slot` of plan `plan` of the host store's planned arena. The
// arena is malloc'd memory, and a device-to-host DMA into pageable memory is
// staged through a driver buffer and does not overlap computation; the pool
// already reuses pinned blocks by size. `dep` still orders the copy after the
// frees the layout reuses, so the values and the order are the CPU's.
ffi::Error OffloadPlannedImpl(cudaStream_t stream, ffi::AnyBuffer x,
                              ffi::AnyBuffer /*dep*/,
                              ffi::ResultBufferR1<ffi::U32> handle,
                              int64_t /*plan*/, int64_t /*slot*/) {
  return ToFfiError(Offload(stream, x, handle));
}

ffi::Error OffloadStartPlannedImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                   ffi::AnyBuffer /*dep*/,
                                   ffi::ResultBufferR1<ffi::U32> ticket,
                                   int64_t /*plan*/, int64_t /*slot*/) {
  return ToFfiError(OffloadStart(stream, x, ticket));
}

ffi::Error OffloadDoneImpl(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::BufferR1<ffi::U32> ticket,
                           ffi::AnyBuffer /*dep*/,
                           ffi::ResultBufferR1<ffi::U32> handle) {
  return ToFfiError(OffloadDone(stream, x, ticket, handle));
}

ffi::Error FetchImpl(cudaStream_t stream, ffi::BufferR1<ffi::U32> handle,
                     ffi::AnyBuffer /*dep*/, ffi::Result<ffi::AnyBuffer> out) {
  return ToFfiError(Fetch(stream, handle, out));
}

ffi::Error FetchStartImpl(cudaStream_t stream, ffi::BufferR1<ffi::U32> handle,
                          ffi::AnyBuffer /*dep*/,
                          ffi::Result<ffi::AnyBuffer> buf,
                          ffi::ResultBufferR1<ffi::U32> ticket) {
  return ToFfiError(FetchStart(stream, handle, buf, ticket));
}

ffi::Error FetchDoneImpl(cudaStream_t stream, ffi::AnyBuffer buf,
                         ffi::BufferR1<ffi::U32> ticket, ffi::AnyBuffer /*dep*/,
                         ffi::Result<ffi::AnyBuffer> out) {
  return ToFfiError(FetchDone(stream, buf, ticket, out));
}

}  // namespace

// Frees pooled pinned memory and outstanding CUDA tickets; returns bytes.
// Without a loaded runtime nothing was ever allocated: 0.
uint64_t CudaClear() {
  if (cudart::Loaded() == nullptr) return 0;
  uint64_t freed = Tickets::Global().Clear();
  return freed + PinnedPool::Global().Clear();
}

}  // namespace jaxmem

// XLA passes its stream as a void*; the FFI casts it to this pointer type.
using CudaStream = ffi::PlatformStream<jaxmem::cudart::cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaFence, jaxmem::FenceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()     // x
                                  .Arg<ffi::AnyBuffer>()     // dep
                                  .Ret<ffi::AnyBuffer>());   // x (alias)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaOffload, jaxmem::OffloadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // handle

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaFetch, jaxmem::FetchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // handle
                                  .Arg<ffi::AnyBuffer>()           // dep
                                  .Ret<ffi::AnyBuffer>());         // x

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaOffloadStart, jaxmem::OffloadStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // ticket

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaOffloadPlanned, jaxmem::OffloadPlannedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::BufferR1<ffi::U32>>()   // handle
                                  .Attr<int64_t>("plan")
                                  .Attr<int64_t>("slot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaOffloadStartPlanned,
                              jaxmem::OffloadStartPlannedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // dep
                                  .Ret<ffi::BufferR1<ffi::U32>>()   // ticket
                                  .Attr<int64_t>("plan")
                                  .Attr<int64_t>("slot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaOffloadDone, jaxmem::OffloadDoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()             // x
                                  .Arg<ffi::BufferR1<ffi::U32>>()    // ticket
                                  .Arg<ffi::AnyBuffer>()             // dep
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // handle

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaFetchStart, jaxmem::FetchStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::BufferR1<ffi::U32>>()    // handle
                                  .Arg<ffi::AnyBuffer>()             // dep
                                  .Ret<ffi::AnyBuffer>()             // buf
                                  .Ret<ffi::BufferR1<ffi::U32>>());  // ticket

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemCudaFetchDone, jaxmem::FetchDoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()           // buf
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // ticket
                                  .Arg<ffi::AnyBuffer>()           // dep
                                  .Ret<ffi::AnyBuffer>());         // x (alias)
