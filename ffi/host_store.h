// Copyright 2025 The jaxmem Authors.
//
// A thread-safe native host store for jaxmem's offload/fetch custom calls.
//
// `Put` copies a buffer into a fresh 64-byte aligned heap allocation and
// returns a 64-bit handle; `Take` copies it back out and erases the entry.
// Handles come from a per-process counter that starts at a random value and
// is never reused, so a handle that was already fetched, cleared, or that
// came from another process is reported as an error instead of aliasing live
// data. No operation crashes on a bad handle.
//
// The asynchronous copy engine (copy_engine.h, and the CUDA path in
// jaxmem_cuda.cu) fills and drains entries outside the store: it allocates a
// `HostBuffer`, copies into it on a worker thread or a copy stream, and only
// then publishes it with `Insert`; a fetch `Remove`s the buffer first (so a
// second fetch of the handle fails at once) and copies out of it afterwards.

#ifndef JAXMEM_FFI_HOST_STORE_H_
#define JAXMEM_FFI_HOST_STORE_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace jaxmem {

// Alignment of every buffer held by the store.
inline constexpr size_t kHostStoreAlignment = 64;

// A snapshot of the store's counters.
struct HostStoreStats {
  uint64_t live_entries = 0;  // entries currently held
  uint64_t live_bytes = 0;    // payload bytes currently held
  uint64_t peak_bytes = 0;    // maximum of live_bytes since process start
  uint64_t total_puts = 0;    // successful Put calls
  uint64_t total_takes = 0;   // successful Take calls
  uint64_t total_errors = 0;  // failed Put/Take calls
  uint64_t cached_bytes = 0;  // freed heap buffers kept for reuse
  uint64_t cache_hits = 0;    // allocations served from the cache
  uint64_t cache_misses = 0;  // allocations that went to the system
};

// A host allocation owned by the store or by an in-flight copy. Move-only; the
// deleter is a plain function so pinned (CUDA) and heap buffers share a type.
//
// Heap buffers come from a cache of freed ones (same size rounded up to 4 KiB,
// best fit within 1/8): on the VMs we measured, first-touch page faults of a
// fresh 16 MiB allocation cost 3-10x the memcpy itself. The cache holds at
// most the store's high-water mark of bytes in use (and at most
// $JAXMEM_HOST_CACHE_BYTES, default 8 GiB), so a training loop that offloads
// the same sizes every step reuses warm memory; `HostStore::Clear` empties it.
class HostBuffer {
 public:
  using Free = void (*)(void*, size_t);

  HostBuffer() = default;
  HostBuffer(void* data, size_t bytes, Free free)
      : data_(data), bytes_(bytes), free_(free) {}
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  // A `kHostStoreAlignment`-aligned heap buffer of `bytes` bytes; an empty
  // buffer (data() == nullptr) when `bytes` is 0 or the allocation failed
  // (check `ok()`).
  static HostBuffer Allocate(size_t bytes);

  bool ok(size_t want_bytes) const { return want_bytes == 0 || data_ != nullptr; }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

  // For buffers written asynchronously (a CUDA copy stream): called before
  // the host reads the bytes (`HostStore::Take`), e.g. an event synchronize.
  void set_wait_ready(std::function<void()> f) { wait_ready_ = std::move(f); }
  void WaitReady() {
    if (wait_ready_) {
      wait_ready_();
      wait_ready_ = nullptr;
    }
  }

  void Reset();

  // Frees every cached heap buffer; returns the bytes released.
  static uint64_t TrimCache();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Free free_ = nullptr;
  std::function<void()> wait_ready_;
};

class HostStore {
 public:
  // The process-wide store used by the FFI handlers and the Python module.
  static HostStore& Global();

  HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // Copies `bytes` bytes from `data` into the store, tagged with `dtype_code`.
  // On success writes the new handle to `*id` and returns an empty string;
  // otherwise returns an error message (allocation failure). `data` may be
  // null when `bytes` is 0.
  std::string Put(const void* data, size_t bytes, uint32_t dtype_code,
                  uint64_t* id);

  // Copies the entry `id` into `dst` (which has room for `bytes` bytes) and
  // erases it. Returns an empty string on success, otherwise a message saying
  // what was wrong: unknown / stale / already fetched handle, or a size or
  // dtype that does not match what was stored. On a size/dtype mismatch the
  // entry is kept (a corrected retry can still succeed).
  std::string Take(uint64_t id, void* dst, size_t bytes, uint32_t dtype_code);

  // Publishes a filled buffer as a new entry of `bytes` bytes of `dtype_code`
  // (the buffer may be larger, e.g. a pooled pinned block). Never fails today;
  // returns an error message for symmetry with `Put`.
  std::string Insert(HostBuffer buffer, size_t bytes, uint32_t dtype_code,
                     uint64_t* id);

  // Validates entry `id` like `Take` and moves its buffer to `*out` without
  // copying. The handle is consumed at once: a second Remove/Take fails.
  std::string Remove(uint64_t id, size_t bytes, uint32_t dtype_code,
                     HostBuffer* out);

  // Looks up the size and dtype of a live entry without removing it.
  bool Peek(uint64_t id, size_t* bytes, uint32_t* dtype_code) const;

  HostStoreStats Stats() const;

  // Frees every entry; returns the number of payload bytes freed.
  uint64_t Clear();

 private:
  struct Entry {
    HostBuffer data;  // empty when bytes == 0
    size_t bytes = 0;
    uint32_t dtype_code = 0;
  };

  std::string UnknownHandleMessage(uint64_t id) const;  // requires mu_
  // Checks entry `id` against a request and erases it into `*out`; requires
  // mu_. Returns an error message (and keeps the entry) on a mismatch.
  std::string EraseChecked(uint64_t id, size_t bytes, uint32_t dtype_code,
                           bool need_dst, Entry* out);

  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_;
  uint64_t first_id_;  // first handle this process ever issued
  uint64_t next_id_;   // next handle to issue
  uint64_t issued_ = 0;
  HostStoreStats stats_;
};

// A random 64-bit id in [2^62, 2^63) to start a never-reused counter at (host
// store handles, copy tickets): ids from another process or counter are
// recognised as foreign, not confused with live ones.
uint64_t RandomFirstId();

// Formats a handle as 0x%016x.
std::string FormatHandle(uint64_t id);

// A human-readable name for an XLA FFI dtype code ("f32", "bf16", ...).
std::string DtypeName(uint32_t dtype_code);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_HOST_STORE_H_
