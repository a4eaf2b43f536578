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

#ifndef JAXMEM_FFI_HOST_STORE_H_
#define JAXMEM_FFI_HOST_STORE_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
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

  // Looks up the size and dtype of a live entry without removing it.
  bool Peek(uint64_t id, size_t* bytes, uint32_t* dtype_code) const;

  HostStoreStats Stats() const;

  // Frees every entry; returns the number of payload bytes freed.
  uint64_t Clear();

 private:
  struct AlignedFree {
    void operator()(void* p) const { std::free(p); }
  };
  struct Entry {
    std::unique_ptr<void, AlignedFree> data;  // null when bytes == 0
    size_t bytes = 0;
    uint32_t dtype_code = 0;
  };

  std::string UnknownHandleMessage(uint64_t id) const;  // requires mu_

  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_;
  uint64_t first_id_;  // first handle this process ever issued
  uint64_t next_id_;   // next handle to issue
  uint64_t issued_ = 0;
  HostStoreStats stats_;
};

// Formats a handle as 0x%016x.
std::string FormatHandle(uint64_t id);

// A human-readable name for an XLA FFI dtype code ("f32", "bf16", ...).
std::string DtypeName(uint32_t dtype_code);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_HOST_STORE_H_
