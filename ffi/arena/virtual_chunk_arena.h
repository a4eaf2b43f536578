// Copyright 2025 The jaxmem Authors.
//
// `VirtualChunkArena`: fixed-size physical chunks mapped into contiguous
// virtual ranges (Hayakawa & Narihira, *Out-of-core training for extremely
// large-scale neural networks with adaptive window-based scheduling*, §4,
// "Reducing memory fragmentation with virtual addressing"; see host_arena.h).

#ifndef JAXMEM_FFI_ARENA_VIRTUAL_CHUNK_ARENA_H_
#define JAXMEM_FFI_ARENA_VIRTUAL_CHUNK_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "arena/locked_arena.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

// Footprint = pool size (chunks ever created; never shrinks).
//
// A freed range stays mapped ("kept") and serves the next request of the same
// chunk count without any system call; kept chunks count as free and are
// unmapped, oldest first, before the pool would grow, so footprint and
// fragmentation are those of unmapping at once. With `populate`, fresh
// mappings are read-populated outside the lock (PopulateUnlocked in the .cc).
class VirtualChunkArena : public LockedArena {
 public:
  // `chunk_bytes` must be a positive multiple of the page size;
  // `capacity_bytes` caps the physical pool (0: unbounded). Fails with
  // Unavailable when memfd_create is missing (non-Linux or old kernels),
  // ResourceExhausted when it fails for lack of memory.
  // `populate`: pre-fault every fresh mapping (outside the lock) for callers
  // that write the whole allocation at once (the host store); it commits
  // the pages, so replays that never touch their memory leave it off.
  static Status Create(size_t chunk_bytes, size_t capacity_bytes,
                       std::unique_ptr<HostArena>* out, bool populate = false);
  ~VirtualChunkArena() override;

  ArenaMode mode() const override { return ArenaMode::kVirtual; }

 protected:
  Status AllocateLocked(size_t bytes, int64_t id, Block* block) override
      REQUIRES(mu_);
  void FreeLocked(const Block& block) override REQUIRES(mu_);
  void FillStatsLocked(ArenaStats* stats) const override REQUIRES(mu_);
  void PopulateUnlocked(void* ptr, size_t bytes) override EXCLUDES(mu_);

 private:
  VirtualChunkArena(int fd, size_t chunk_bytes, size_t capacity_bytes,
                    bool populate);
  // Unmaps a kept range and frees its chunks.
  void UnmapKeptLocked(uint64_t seq) REQUIRES(mu_);

  const int fd_;
  const size_t chunk_bytes_;
  const size_t capacity_chunks_;  // 0: unbounded
  const bool populate_;
  uint64_t pool_chunks_ GUARDED_BY(mu_) = 0;
  // Lowest first: runs map in one call.
  std::set<uint64_t> free_chunks_ GUARDED_BY(mu_);
  // A live virtual range and the physical chunks mapped into it.
  struct Range {
    void* base = nullptr;
    size_t span = 0;
    std::vector<uint64_t> chunks;
  };
  std::unordered_map<uint64_t, Range> ranges_ GUARDED_BY(mu_);  // by cookie
  uint64_t next_cookie_ GUARDED_BY(mu_) = 1;
  // Freed, still mapped; by free order.
  std::map<uint64_t, Range> kept_ GUARDED_BY(mu_);
  // Chunk count -> seq of the kept ranges.
  std::multimap<uint64_t, uint64_t> kept_by_chunks_ GUARDED_BY(mu_);
  uint64_t kept_chunks_ GUARDED_BY(mu_) = 0;
  uint64_t next_kept_seq_ GUARDED_BY(mu_) = 0;
  uint64_t map_calls_ GUARDED_BY(mu_) = 0;
  uint64_t unmap_calls_ GUARDED_BY(mu_) = 0;
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_VIRTUAL_CHUNK_ARENA_H_
