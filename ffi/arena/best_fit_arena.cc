// Copyright 2025 The jaxmem Authors.
//
// BestFitCachingArena (see best_fit_arena.h).

#include "arena/best_fit_arena.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "arena/arena_util.h"

namespace jaxmem {

using arena_internal::Bytes;
using arena_internal::ErrnoText;
using arena_internal::PageSize;
using arena_internal::RoundUp;

Status BestFitCachingArena::Create(size_t segment_bytes, size_t capacity_bytes,
                                   std::unique_ptr<HostArena>* out) {
  size_t seg = 0;
  if (segment_bytes == 0 || !RoundUp(segment_bytes, PageSize(), &seg)) {
    return InvalidArgument("segment_bytes must be positive, got " +
                           std::to_string(segment_bytes));
  }
  out->reset(new BestFitCachingArena(seg, capacity_bytes));
  return Status::Ok();
}

BestFitCachingArena::BestFitCachingArena(size_t segment_bytes,
                                         size_t capacity_bytes)
    : segment_bytes_(segment_bytes), capacity_bytes_(capacity_bytes) {}

BestFitCachingArena::~BestFitCachingArena() {
  for (const auto& [p, n] : segments_) ::munmap(p, n);
}

void BestFitCachingArena::InsertFree(uintptr_t addr, size_t size) {
  free_.emplace(size, addr);
}

void BestFitCachingArena::EraseFree(uintptr_t addr, size_t size) {
  free_.erase({size, addr});
}

Status BestFitCachingArena::AllocateLocked(size_t bytes, int64_t /*id*/,
                                           Block* block) {
  if (bytes == 0) return Status::Ok();
  size_t size = 0;
  if (!RoundUp(bytes, kArenaAlignment, &size)) {
    return ResourceExhausted("best-fit arena: " + Bytes(bytes) +
                             " is too large");
  }
  // Best fit: the smallest cached free block that holds the request, lowest
  // address among equals.
  auto fit = free_.lower_bound({size, 0});
  if (fit == free_.end()) {
    // No cached block fits: grow by a new segment from the OS (never
    // returned while the arena lives — the "caching" part).
    size_t seg = 0;
    if (!RoundUp(size, PageSize(), &seg)) {
      return ResourceExhausted("best-fit arena: " + Bytes(bytes) +
                               " is too large");
    }
    const size_t need = seg;
    seg = std::max(seg, segment_bytes_);
    if (capacity_bytes_ != 0 && footprint_ + seg > capacity_bytes_ &&
        footprint_ + need <= capacity_bytes_) {
      // A full segment would overshoot the cap but the request fits: take
      // what is left (whole pages) rather than refuse it.
      seg = (capacity_bytes_ - footprint_) / PageSize() * PageSize();
    }
    if (capacity_bytes_ != 0 && footprint_ + seg > capacity_bytes_) {
      return ResourceExhausted(
          "best-fit arena out of capacity: " + Bytes(bytes) +
          " fit no cached free block (largest " +
          Bytes(free_.empty() ? 0 : free_.rbegin()->first) + ") and a new " +
          Bytes(seg) + " segment would exceed the " + Bytes(capacity_bytes_) +
          " capacity (footprint " + Bytes(footprint_) + ")");
    }
    void* p = ::mmap(nullptr, seg, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      return ResourceExhausted("best-fit arena: allocating a " + Bytes(seg) +
                               " segment failed: " + ErrnoText(err));
    }
    const uint32_t id = static_cast<uint32_t>(segments_.size());
    segments_.emplace_back(p, seg);
    footprint_ += seg;
    NoteFootprintLocked(footprint_);
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    pieces_[a] = Piece{seg, id, true};
    InsertFree(a, seg);
    fit = free_.find({seg, a});
  }
  const size_t have = fit->first;
  const uintptr_t addr = fit->second;
  free_.erase(fit);
  Piece& piece = pieces_[addr];
  piece.free = false;
  if (have > size) {
    // Split: the tail stays cached as a free block.
    piece.size = size;
    pieces_[addr + size] = Piece{have - size, piece.segment, true};
    InsertFree(addr + size, have - size);
  }
  block->ptr = reinterpret_cast<void*>(addr);
  block->reserved_bytes = size;
  block->cookie = addr;
  return Status::Ok();
}

void BestFitCachingArena::FreeLocked(const Block& block) {
  if (block.cookie == 0) return;
  auto it = pieces_.find(block.cookie);
  if (it == pieces_.end()) return;
  it->second.free = true;
  // Coalesce with the next block of the same segment.
  auto next = std::next(it);
  if (next != pieces_.end() && next->second.free &&
      next->second.segment == it->second.segment &&
      next->first == it->first + it->second.size) {
    EraseFree(next->first, next->second.size);
    it->second.size += next->second.size;
    pieces_.erase(next);
  }
  // ... and with the previous one.
  if (it != pieces_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.segment == it->second.segment &&
        prev->first + prev->second.size == it->first) {
      EraseFree(prev->first, prev->second.size);
      prev->second.size += it->second.size;
      pieces_.erase(it);
      it = prev;
    }
  }
  InsertFree(it->first, it->second.size);
}

void BestFitCachingArena::FillStatsLocked(ArenaStats* s) const {
  s->footprint_bytes = footprint_;
  s->capacity_bytes = capacity_bytes_;
  s->largest_free_block_bytes = free_.empty() ? 0 : free_.rbegin()->first;
  s->segments = segments_.size();
  s->segment_bytes = segment_bytes_;
}

}  // namespace jaxmem
