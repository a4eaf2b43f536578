// Copyright 2025 The jaxmem Authors.
//
// `HeapCachingArena`: the host store's original allocator, its "heap" mode
// (see host_arena.h).

#ifndef JAXMEM_FFI_ARENA_HEAP_ARENA_H_
#define JAXMEM_FFI_ARENA_HEAP_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>

#include "arena/locked_arena.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

// Every allocation is a `posix_memalign` of the size rounded up to 4 KiB, and
// freed buffers are kept for reuse by a later request of the same rounded
// size (best fit within 1/8). On the VMs we measured, first-touch page faults
// of a fresh 16 MiB allocation cost 3-10x the memcpy itself, so a training
// loop that offloads the same sizes every step must reuse warm memory. The
// cache holds at most the high-water mark of live bytes (what the workload
// needed at once anyway) and at most `cache_cap_bytes`; a freed buffer beyond
// that goes back to the system. Footprint = live + cached buffers; it shrinks
// on such frees. Unlike best-fit, buffers are never split or merged: a cached
// buffer serves only requests of about its own size (the size-keyed reuse
// that Hayakawa & Narihira §4 contrast with chunk mapping).
class HeapCachingArena : public LockedArena {
 public:
  // `capacity_bytes` caps the footprint (0: unbounded; cached buffers are
  // released before a request is refused).
  static Status Create(uint64_t cache_cap_bytes, size_t capacity_bytes,
                       std::unique_ptr<HostArena>* out);
  ~HeapCachingArena() override;

  ArenaMode mode() const override { return ArenaMode::kHeap; }

 protected:
  Status AllocateLocked(size_t bytes, int64_t id, Block* block) override
      REQUIRES(mu_);
  void FreeLocked(const Block& block) override REQUIRES(mu_);
  void FillStatsLocked(ArenaStats* stats) const override REQUIRES(mu_);

 private:
  HeapCachingArena(uint64_t cache_cap_bytes, size_t capacity_bytes);
  void ReleaseCacheLocked() REQUIRES(mu_);

  const uint64_t cache_cap_;
  const size_t capacity_bytes_;
  // Rounded size -> buffer.
  std::multimap<size_t, void*> cached_ GUARDED_BY(mu_);
  // Handed out: buffer -> size.
  std::unordered_map<void*, size_t> in_use_ GUARDED_BY(mu_);
  uint64_t cached_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t live_rounded_ GUARDED_BY(mu_) = 0;
  uint64_t high_water_ GUARDED_BY(mu_) = 0;  // max live_rounded_
  uint64_t footprint_ GUARDED_BY(mu_) = 0;   // live + cached
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_HEAP_ARENA_H_
