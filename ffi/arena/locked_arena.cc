// Copyright 2025 The jaxmem Authors.

#include "arena/locked_arena.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "arena/arena_util.h"
#include "ids.h"

namespace jaxmem {

using arena_internal::Bytes;

namespace {

// Handle layout: [63] 0 | [62:43] arena tag (1 .. 2^20-1) | [42:0] sequence.
constexpr int kSeqBits = 43;
constexpr uint64_t kSeqMask = (uint64_t{1} << kSeqBits) - 1;
constexpr uint64_t kTagCount = (uint64_t{1} << 20) - 1;

// Arena tags: a process-wide counter that starts at a random value, so two
// arenas of one process never share a tag (until 2^20 - 1 arenas were made).
uint64_t NextArenaTag() {
  static std::atomic<uint64_t> counter{RandomBits()};
  return counter.fetch_add(1, std::memory_order_relaxed) % kTagCount + 1;
}

}  // namespace

LockedArena::LockedArena()
    : tag_(NextArenaTag()),
      first_seq_(RandomBits() & (kSeqMask >> 1)),
      next_seq_(first_seq_) {}

void LockedArena::NoteFootprintLocked(uint64_t footprint_bytes) {
  ++grows_;
  peak_footprint_bytes_ = std::max(peak_footprint_bytes_, footprint_bytes);
}

Status LockedArena::HandleErrorLocked(uint64_t handle, const char* verb,
                                      bool is_free) const {
  ++errors_;
  const std::string h = FormatHandle(handle);
  const uint64_t tag = handle >> kSeqBits;
  const uint64_t seq = handle & kSeqMask;
  const std::string arena = std::string(ArenaModeName(mode())) + " arena";
  if (tag != tag_ || seq < first_seq_ || seq >= next_seq_) {
    return InvalidArgument(std::string("cannot ") + verb + " foreign handle " +
                           h + ": this " + arena +
                           " never issued it (a handle of another arena or "
                           "process, or garbage)");
  }
  if (is_free) {
    return InvalidArgument("double free of handle " + h + ": this " + arena +
                           " issued it but it was already freed");
  }
  return InvalidArgument(
      std::string("cannot ") + verb + " stale handle " + h + ": this " + arena +
      " issued it but it was already freed (use after free)");
}

Status LockedArena::AllocateCommon(size_t bytes, int64_t id, Allocation* out) {
  Block block;
  {
    MutexLock lock(&mu_);
    Status st = AllocateLocked(bytes, id, &block);
    if (!st.ok()) {
      ++errors_;
      return st;
    }
    block.bytes = bytes;
    block.id = id;
    const uint64_t handle = (tag_ << kSeqBits) | (next_seq_++ & kSeqMask);
    live_.emplace(handle, block);
    live_bytes_ += block.reserved_bytes;
    requested_live_bytes_ += bytes;
    peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
    peak_requested_bytes_ =
        std::max(peak_requested_bytes_, requested_live_bytes_);
    ++allocs_;
    out->handle = handle;
    out->ptr = block.ptr;
    out->bytes = bytes;
    out->reserved_bytes = block.reserved_bytes;
    out->id = id;
  }
  // Outside mu_: the block is not handed out yet (see PopulateUnlocked).
  if (block.populate) PopulateUnlocked(block.ptr, block.reserved_bytes);
  return Status::Ok();
}

Status LockedArena::Refuse(Status status) {
  MutexLock lock(&mu_);
  ++errors_;
  return status;
}

Status LockedArena::Allocate(size_t bytes, Allocation* out) {
  if (mode() == ArenaMode::kPlanned) {
    return Refuse(
        Unimplemented("a planned arena allocates plan ids, not sizes: call "
                      "AllocateId(id, bytes)"));
  }
  return AllocateCommon(bytes, -1, out);
}

Status LockedArena::AllocateId(int64_t id, size_t bytes, Allocation* out) {
  if (mode() != ArenaMode::kPlanned) {
    return Refuse(Unimplemented(std::string("a ") + ArenaModeName(mode()) +
                                " arena allocates sizes, not plan ids: call "
                                "Allocate(bytes)"));
  }
  if (id < 0) {
    return Refuse(
        InvalidArgument("plan id " + std::to_string(id) + " is negative"));
  }
  return AllocateCommon(bytes, id, out);
}

Status LockedArena::Free(uint64_t handle) {
  MutexLock lock(&mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "free", true);
  const Block block = it->second;
  live_.erase(it);
  FreeLocked(block);
  live_bytes_ -= block.reserved_bytes;
  requested_live_bytes_ -= block.bytes;
  ++frees_;
  return Status::Ok();
}

Status LockedArena::Lookup(uint64_t handle, Allocation* out) const {
  MutexLock lock(&mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "look up", false);
  const Block& b = it->second;
  out->handle = handle;
  out->ptr = b.ptr;
  out->bytes = b.bytes;
  out->reserved_bytes = b.reserved_bytes;
  out->id = b.id;
  return Status::Ok();
}

Status LockedArena::Write(uint64_t handle, size_t offset, const void* src,
                          size_t n) {
  MutexLock lock(&mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "write", false);
  const Block& b = it->second;
  if (offset > b.bytes || n > b.bytes - offset) {
    ++errors_;
    return InvalidArgument("write of " + Bytes(n) + " at offset " +
                           std::to_string(offset) + " overruns handle " +
                           FormatHandle(handle) + " of " + Bytes(b.bytes));
  }
  if (n > 0) std::memcpy(static_cast<char*>(b.ptr) + offset, src, n);
  return Status::Ok();
}

Status LockedArena::Read(uint64_t handle, size_t offset, void* dst,
                         size_t n) const {
  MutexLock lock(&mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "read", false);
  const Block& b = it->second;
  if (offset > b.bytes || n > b.bytes - offset) {
    ++errors_;
    return InvalidArgument("read of " + Bytes(n) + " at offset " +
                           std::to_string(offset) + " overruns handle " +
                           FormatHandle(handle) + " of " + Bytes(b.bytes));
  }
  if (n > 0) std::memcpy(dst, static_cast<const char*>(b.ptr) + offset, n);
  return Status::Ok();
}

uint64_t LockedArena::FreeAll() {
  MutexLock lock(&mu_);
  const uint64_t n = live_.size();
  for (const auto& [handle, block] : live_) FreeLocked(block);
  live_.clear();
  frees_ += n;
  live_bytes_ = 0;
  requested_live_bytes_ = 0;
  return n;
}

ArenaStats LockedArena::Stats() const {
  MutexLock lock(&mu_);
  ArenaStats s;
  FillStatsLocked(&s);
  s.peak_footprint_bytes = std::max(peak_footprint_bytes_, s.footprint_bytes);
  s.live_bytes = live_bytes_;
  s.peak_live_bytes = peak_live_bytes_;
  s.requested_live_bytes = requested_live_bytes_;
  s.peak_requested_bytes = peak_requested_bytes_;
  s.live_allocations = live_.size();
  s.free_bytes = s.footprint_bytes >= live_bytes_
                     ? s.footprint_bytes - live_bytes_
                     : 0;
  s.internal_fragmentation =
      live_bytes_ > 0
          ? 1.0 - static_cast<double>(requested_live_bytes_) /
                      static_cast<double>(live_bytes_)
          : 0.0;
  s.external_fragmentation =
      s.free_bytes > 0
          ? 1.0 - static_cast<double>(s.largest_free_block_bytes) /
                      static_cast<double>(s.free_bytes)
          : 0.0;
  s.allocs = allocs_;
  s.frees = frees_;
  s.errors = errors_;
  s.grows = grows_;
  return s;
}

}  // namespace jaxmem
