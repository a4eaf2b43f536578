// Copyright 2025 The jaxmem Authors.
//
// PlannedArena (see planned_arena.h).

#include "arena/planned_arena.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

#include "arena/arena_util.h"

namespace jaxmem {

using arena_internal::Bytes;
using arena_internal::ErrnoText;
using arena_internal::PageSize;
using arena_internal::RoundUp;

Status PlannedArena::Create(std::unordered_map<int64_t, Slot> slots,
                            uint64_t footprint_bytes,
                            std::unique_ptr<HostArena>* out) {
  for (const auto& [id, slot] : slots) {
    if (id < 0) {
      return InvalidArgument("plan id " + std::to_string(id) + " is negative");
    }
    if (slot.offset % kArenaAlignment != 0) {
      return InvalidArgument("plan id " + std::to_string(id) + " has offset " +
                             std::to_string(slot.offset) +
                             ", which is not a multiple of " +
                             std::to_string(kArenaAlignment));
    }
    if (slot.offset > footprint_bytes ||
        slot.bytes > footprint_bytes - slot.offset) {
      return InvalidArgument("plan id " + std::to_string(id) + " at [" +
                             std::to_string(slot.offset) + ", " +
                             std::to_string(slot.offset + slot.bytes) +
                             ") lies outside the planned footprint of " +
                             Bytes(footprint_bytes));
    }
  }
  void* base = nullptr;
  if (footprint_bytes > 0) {
    size_t len = 0;
    if (!RoundUp(footprint_bytes, PageSize(), &len)) {
      return ResourceExhausted("planned footprint too large");
    }
    base = ::mmap(nullptr, len, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      return ResourceExhausted("planned arena: allocating the " +
                               Bytes(footprint_bytes) +
                               " buffer failed: " + ErrnoText(err));
    }
  }
  out->reset(new PlannedArena(std::move(slots), base, footprint_bytes));
  return Status::Ok();
}

PlannedArena::PlannedArena(std::unordered_map<int64_t, Slot> slots, void* base,
                           uint64_t footprint_bytes)
    : slots_(std::move(slots)), base_(base), footprint_(footprint_bytes) {
  NoteFootprintLocked(footprint_);
}

bool PlannedArena::SlotOf(int64_t id, Slot* slot) const {
  auto it = slots_.find(id);  // slots_ is immutable: no lock needed
  if (it == slots_.end()) return false;
  *slot = it->second;
  return true;
}

PlannedArena::~PlannedArena() {
  if (base_ != nullptr) {
    size_t len = 0;
    RoundUp(footprint_, PageSize(), &len);
    ::munmap(base_, len);
  }
}

Status PlannedArena::AllocateLocked(size_t bytes, int64_t id, Block* block) {
  auto it = slots_.find(id);
  const std::string ids = "plan id " + std::to_string(id);
  if (it == slots_.end()) {
    return InvalidArgument(ids + " is not in the plan");
  }
  const Slot& slot = it->second;
  if (slot.bytes != bytes) {
    return InvalidArgument(ids + " is planned for " + Bytes(slot.bytes) +
                           " but " + Bytes(bytes) + " were requested");
  }
  if (live_ids_.count(id) != 0) {
    return FailedPrecondition(ids +
                              " is already live (free it before allocating it "
                              "again)");
  }
  if (bytes > 0) {
    // The plan promises that slots live at the same time are disjoint; a run
    // whose lifetimes differ from the plan's must not alias live data.
    const uint64_t lo = slot.offset;
    const uint64_t hi = slot.offset + slot.bytes;
    auto next = live_ranges_.lower_bound(lo);
    const std::pair<uint64_t, uint64_t>* clash = nullptr;
    std::pair<uint64_t, uint64_t> other;
    if (next != live_ranges_.end() && next->first < hi) {
      other = *next;
      clash = &other;
    } else if (next != live_ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->second > lo) {
        other = *prev;
        clash = &other;
      }
    }
    if (clash != nullptr) {
      return FailedPrecondition(
          ids + " at [" + std::to_string(lo) + ", " + std::to_string(hi) +
          ") overlaps a live slot at [" + std::to_string(clash->first) + ", " +
          std::to_string(clash->second) +
          "): the run's lifetimes differ from the plan's");
    }
    live_ranges_.emplace(lo, hi);
    block->ptr = static_cast<char*>(base_) + slot.offset;
  }
  live_ids_.insert(id);
  block->reserved_bytes = bytes;
  block->cookie = static_cast<uint64_t>(id);
  return Status::Ok();
}

void PlannedArena::FreeLocked(const Block& block) {
  const int64_t id = static_cast<int64_t>(block.cookie);
  live_ids_.erase(id);
  auto it = slots_.find(id);
  if (it != slots_.end() && it->second.bytes > 0) {
    live_ranges_.erase(it->second.offset);
  }
}

void PlannedArena::FillStatsLocked(ArenaStats* s) const {
  s->footprint_bytes = footprint_;
  s->capacity_bytes = footprint_;
  uint64_t largest = 0;
  uint64_t at = 0;
  for (const auto& [lo, hi] : live_ranges_) {
    largest = std::max(largest, lo - at);
    at = hi;
  }
  largest = std::max(largest, footprint_ - std::min(at, footprint_));
  s->largest_free_block_bytes = largest;
}

}  // namespace jaxmem
