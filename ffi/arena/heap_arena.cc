// Copyright 2025 The jaxmem Authors.
//
// HeapCachingArena (see heap_arena.h).

#include "arena/heap_arena.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "arena/arena_util.h"

namespace jaxmem {

using arena_internal::Bytes;
using arena_internal::RoundUp;

namespace {
constexpr size_t kHeapPage = 4096;
}  // namespace

Status HeapCachingArena::Create(uint64_t cache_cap_bytes, size_t capacity_bytes,
                                std::unique_ptr<HostArena>* out) {
  out->reset(new HeapCachingArena(cache_cap_bytes, capacity_bytes));
  return Status::Ok();
}

HeapCachingArena::HeapCachingArena(uint64_t cache_cap_bytes,
                                   size_t capacity_bytes)
    : cache_cap_(cache_cap_bytes), capacity_bytes_(capacity_bytes) {}

HeapCachingArena::~HeapCachingArena() {
  ReleaseCacheLocked();
  for (const auto& [p, size] : in_use_) std::free(p);
}

void HeapCachingArena::ReleaseCacheLocked() {
  for (const auto& [size, p] : cached_) std::free(p);
  cached_.clear();
  footprint_ -= cached_bytes_;
  cached_bytes_ = 0;
}

Status HeapCachingArena::AllocateLocked(size_t bytes, int64_t /*id*/,
                                        Block* block) {
  if (bytes == 0) return Status::Ok();
  size_t rounded = 0;
  if (!RoundUp(bytes, kHeapPage, &rounded)) {
    return ResourceExhausted("heap arena: " + Bytes(bytes) + " is too large");
  }
  void* p = nullptr;
  size_t size = rounded;
  // A cached buffer of about this size: its pages are already faulted in.
  auto it = cached_.lower_bound(rounded);
  if (it != cached_.end() && it->first - rounded <= rounded / 8) {
    p = it->second;
    size = it->first;
    cached_bytes_ -= size;
    cached_.erase(it);
  } else {
    if (capacity_bytes_ != 0 && footprint_ + rounded > capacity_bytes_) {
      ReleaseCacheLocked();  // cached memory is only an optimisation
      if (footprint_ + rounded > capacity_bytes_) {
        return ResourceExhausted("heap arena out of capacity: " + Bytes(bytes) +
                                 " would take the footprint (" +
                                 Bytes(footprint_) + " live) past the " +
                                 Bytes(capacity_bytes_) + " capacity");
      }
    }
    if (::posix_memalign(&p, kArenaAlignment, rounded) != 0) p = nullptr;
    if (p == nullptr) {
      return ResourceExhausted("heap arena: posix_memalign of " +
                               Bytes(rounded) + " failed");
    }
    footprint_ += rounded;
    NoteFootprintLocked(footprint_);
  }
  in_use_[p] = size;
  live_rounded_ += size;
  high_water_ = std::max(high_water_, live_rounded_);
  block->ptr = p;
  block->reserved_bytes = size;
  block->cookie = reinterpret_cast<uintptr_t>(p);
  return Status::Ok();
}

void HeapCachingArena::FreeLocked(const Block& block) {
  if (block.ptr == nullptr) return;  // zero-byte allocation
  auto it = in_use_.find(block.ptr);
  if (it == in_use_.end()) return;
  const size_t size = it->second;
  in_use_.erase(it);
  live_rounded_ -= size;
  if (cached_bytes_ + size <= cache_cap_ &&
      cached_bytes_ + size <= high_water_) {
    cached_.emplace(size, block.ptr);
    cached_bytes_ += size;
    return;
  }
  // free() of a large buffer is an munmap under the lock: rare (only beyond
  // the high-water mark or the cap), and it keeps the footprint exact.
  std::free(block.ptr);
  footprint_ -= size;
}

void HeapCachingArena::FillStatsLocked(ArenaStats* s) const {
  s->footprint_bytes = footprint_;
  s->capacity_bytes = capacity_bytes_;
  s->largest_free_block_bytes = cached_.empty() ? 0 : cached_.rbegin()->first;
}

}  // namespace jaxmem
