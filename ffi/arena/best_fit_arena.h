// Copyright 2025 The jaxmem Authors.
//
// `BestFitCachingArena`: the framework-default baseline that Hayakawa &
// Narihira, *Out-of-core training for extremely large-scale neural networks
// with adaptive window-based scheduling*, §4, compare virtual addressing
// against: best-fit with caching (see host_arena.h).

#ifndef JAXMEM_FFI_ARENA_BEST_FIT_ARENA_H_
#define JAXMEM_FFI_ARENA_BEST_FIT_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "arena/locked_arena.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

class BestFitCachingArena : public LockedArena {
 public:
  // A new segment has max(segment_bytes, request rounded up to pages)
  // bytes; `capacity_bytes` caps the sum of segments (0: unbounded).
  static Status Create(size_t segment_bytes, size_t capacity_bytes,
                       std::unique_ptr<HostArena>* out);
  ~BestFitCachingArena() override;

  ArenaMode mode() const override { return ArenaMode::kBestFit; }

 protected:
  Status AllocateLocked(size_t bytes, int64_t id, Block* block) override
      REQUIRES(mu_);
  void FreeLocked(const Block& block) override REQUIRES(mu_);
  void FillStatsLocked(ArenaStats* stats) const override REQUIRES(mu_);

 private:
  struct Piece {
    size_t size = 0;
    uint32_t segment = 0;
    bool free = true;
  };
  BestFitCachingArena(size_t segment_bytes, size_t capacity_bytes);
  void InsertFree(uintptr_t addr, size_t size) REQUIRES(mu_);
  void EraseFree(uintptr_t addr, size_t size) REQUIRES(mu_);

  const size_t segment_bytes_;
  const size_t capacity_bytes_;
  std::vector<std::pair<void*, size_t>> segments_ GUARDED_BY(mu_);
  uint64_t footprint_ GUARDED_BY(mu_) = 0;
  // Every block, by address.
  std::map<uintptr_t, Piece> pieces_ GUARDED_BY(mu_);
  // (size, addr) of the free blocks, for best fit.
  std::set<std::pair<size_t, uintptr_t>> free_ GUARDED_BY(mu_);
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_BEST_FIT_ARENA_H_
