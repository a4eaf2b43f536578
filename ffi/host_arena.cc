// Copyright 2025 The jaxmem Authors.
//
// Host arenas (see host_arena.h) and their Python bindings
// (`jaxmem._native.HostArena`, `make_arena`, `arena_stress`).

#include "host_arena.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <thread>

// JAXMEM_ARENA_NO_PYTHON builds the allocators alone (sanitizer tests).
#ifndef JAXMEM_ARENA_NO_PYTHON
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#endif

namespace jaxmem {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Declared in host_arena.h: seeds for handle and ticket counters that must not
// repeat across processes (a handle from another process is reported, not aliased).
uint64_t RandomBits() {
  uint64_t seed = 0;
  try {
    std::random_device rd;
    seed = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  } catch (...) {
    // Fall through to the time/pid mix below.
  }
  seed ^= static_cast<uint64_t>(
      std::chrono::high_resolution_clock::now().time_since_epoch().count());
  seed ^= static_cast<uint64_t>(::getpid()) << 40;
  seed ^= reinterpret_cast<uintptr_t>(&seed);
  return SplitMix64(seed);
}

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

size_t PageSize() {
  static const size_t page = [] {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return page;
}

// Rounds up to a multiple of `to` (a power of two or not); false on overflow.
bool RoundUp(size_t x, size_t to, size_t* out) {
  if (to == 0) return false;
  size_t r = x % to;
  if (r == 0) {
    *out = x;
    return true;
  }
  if (x > std::numeric_limits<size_t>::max() - (to - r)) return false;
  *out = x + (to - r);
  return true;
}

std::string Bytes(uint64_t n) { return std::to_string(n) + " bytes"; }

std::string ErrnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) +
         ")";
}

ArenaStatus Error(ArenaCode code, std::string message) {
  return ArenaStatus(code, std::move(message));
}

}  // namespace

const char* ArenaModeName(ArenaMode mode) {
  switch (mode) {
    case ArenaMode::kVirtual: return "virtual";
    case ArenaMode::kBestFit: return "best_fit";
    case ArenaMode::kPlanned: return "planned";
    case ArenaMode::kHeap: return "heap";
  }
  return "unknown";
}

std::string FormatArenaHandle(uint64_t handle) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, handle);
  return buf;
}

// LockedArena -----------------------------------------------------------------

LockedArena::LockedArena()
    : tag_(NextArenaTag()),
      first_seq_(RandomBits() & (kSeqMask >> 1)),
      next_seq_(first_seq_) {}

void LockedArena::NoteFootprintLocked(uint64_t footprint_bytes) {
  ++grows_;
  peak_footprint_bytes_ = std::max(peak_footprint_bytes_, footprint_bytes);
}

ArenaStatus LockedArena::HandleErrorLocked(uint64_t handle, const char* verb,
                                           bool is_free) const {
  ++errors_;
  const std::string h = FormatArenaHandle(handle);
  const uint64_t tag = handle >> kSeqBits;
  const uint64_t seq = handle & kSeqMask;
  const std::string arena = std::string(ArenaModeName(mode())) + " arena";
  if (tag != tag_ || seq < first_seq_ || seq >= next_seq_) {
    return Error(ArenaCode::kForeignHandle,
                 std::string("cannot ") + verb + " foreign handle " + h +
                     ": this " + arena +
                     " never issued it (a handle of another arena or "
                     "process, or garbage)");
  }
  if (is_free) {
    return Error(ArenaCode::kDoubleFree,
                 "double free of handle " + h + ": this " + arena +
                     " issued it but it was already freed");
  }
  return Error(ArenaCode::kStaleHandle,
               std::string("cannot ") + verb + " stale handle " + h +
                   ": this " + arena +
                   " issued it but it was already freed (use after free)");
}

ArenaStatus LockedArena::AllocateCommon(size_t bytes, int64_t id,
                                        Allocation* out) {
  std::unique_lock<std::mutex> lock(mu_);
  Block block;
  ArenaStatus st = AllocateLocked(bytes, id, &block);
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
  peak_requested_bytes_ = std::max(peak_requested_bytes_,
                                   requested_live_bytes_);
  ++allocs_;
  out->handle = handle;
  out->ptr = block.ptr;
  out->bytes = bytes;
  out->reserved_bytes = block.reserved_bytes;
  out->id = id;
  if (block.populate) {
    lock.unlock();
    PopulateUnlocked(block.ptr, block.reserved_bytes);
  }
  return ArenaStatus::Ok();
}

ArenaStatus LockedArena::Allocate(size_t bytes, Allocation* out) {
  if (mode() == ArenaMode::kPlanned) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    return Error(ArenaCode::kUnsupported,
                 "a planned arena allocates plan ids, not sizes: call "
                 "AllocateId(id, bytes)");
  }
  return AllocateCommon(bytes, -1, out);
}

ArenaStatus LockedArena::AllocateId(int64_t id, size_t bytes,
                                    Allocation* out) {
  if (mode() != ArenaMode::kPlanned) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    return Error(ArenaCode::kUnsupported,
                 std::string("a ") + ArenaModeName(mode()) +
                     " arena allocates sizes, not plan ids: call "
                     "Allocate(bytes)");
  }
  if (id < 0) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    return Error(ArenaCode::kPlanMismatch,
                 "plan id " + std::to_string(id) + " is negative");
  }
  return AllocateCommon(bytes, id, out);
}

ArenaStatus LockedArena::Free(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "free", true);
  const Block block = it->second;
  live_.erase(it);
  FreeLocked(block);
  live_bytes_ -= block.reserved_bytes;
  requested_live_bytes_ -= block.bytes;
  ++frees_;
  return ArenaStatus::Ok();
}

ArenaStatus LockedArena::Lookup(uint64_t handle, Allocation* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "look up", false);
  const Block& b = it->second;
  out->handle = handle;
  out->ptr = b.ptr;
  out->bytes = b.bytes;
  out->reserved_bytes = b.reserved_bytes;
  out->id = b.id;
  return ArenaStatus::Ok();
}

ArenaStatus LockedArena::Write(uint64_t handle, size_t offset, const void* src,
                               size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "write", false);
  const Block& b = it->second;
  if (offset > b.bytes || n > b.bytes - offset) {
    ++errors_;
    return Error(ArenaCode::kInvalidArgument,
                 "write of " + Bytes(n) + " at offset " +
                     std::to_string(offset) + " overruns handle " +
                     FormatArenaHandle(handle) + " of " + Bytes(b.bytes));
  }
  if (n > 0) std::memcpy(static_cast<char*>(b.ptr) + offset, src, n);
  return ArenaStatus::Ok();
}

ArenaStatus LockedArena::Read(uint64_t handle, size_t offset, void* dst,
                              size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(handle);
  if (it == live_.end()) return HandleErrorLocked(handle, "read", false);
  const Block& b = it->second;
  if (offset > b.bytes || n > b.bytes - offset) {
    ++errors_;
    return Error(ArenaCode::kInvalidArgument,
                 "read of " + Bytes(n) + " at offset " +
                     std::to_string(offset) + " overruns handle " +
                     FormatArenaHandle(handle) + " of " + Bytes(b.bytes));
  }
  if (n > 0) std::memcpy(dst, static_cast<const char*>(b.ptr) + offset, n);
  return ArenaStatus::Ok();
}

uint64_t LockedArena::FreeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t n = live_.size();
  for (const auto& [handle, block] : live_) FreeLocked(block);
  live_.clear();
  frees_ += n;
  live_bytes_ = 0;
  requested_live_bytes_ = 0;
  return n;
}

ArenaStats LockedArena::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
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

// VirtualChunkArena (paper 001 §4) --------------------------------------------

namespace {

// memfd_create through the libc wrapper when it exists, else the raw syscall;
// -1 with errno = ENOSYS where neither is available.
int MemfdCreate(const char* name) {
#if defined(__linux__)
#if defined(SYS_memfd_create)
  return static_cast<int>(::syscall(SYS_memfd_create, name, 1u /*CLOEXEC*/));
#else
  (void)name;
  errno = ENOSYS;
  return -1;
#endif
#else
  (void)name;
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace

ArenaStatus VirtualChunkArena::Create(size_t chunk_bytes,
                                      size_t capacity_bytes,
                                      std::unique_ptr<HostArena>* out,
                                      bool populate) {
  const size_t page = PageSize();
  if (chunk_bytes == 0 || chunk_bytes % page != 0) {
    return Error(ArenaCode::kInvalidArgument,
                 "chunk_bytes must be a positive multiple of the page size (" +
                     Bytes(page) + "), got " + std::to_string(chunk_bytes));
  }
  if (capacity_bytes % chunk_bytes != 0) {
    return Error(ArenaCode::kInvalidArgument,
                 "capacity_bytes (" + std::to_string(capacity_bytes) +
                     ") must be a multiple of chunk_bytes (" +
                     std::to_string(chunk_bytes) + ") or 0 for unbounded");
  }
  const int fd = MemfdCreate("jaxmem-host-arena");
  if (fd < 0) {
    const int err = errno;
    return Error(ArenaCode::kUnavailable,
                 "virtual host arena needs memfd_create (Linux >= 3.17), "
                 "which failed: " +
                     ErrnoText(err) +
                     "; use the 'best_fit' or 'planned' mode instead");
  }
  out->reset(
      new VirtualChunkArena(fd, chunk_bytes, capacity_bytes, populate));
  return ArenaStatus::Ok();
}

VirtualChunkArena::VirtualChunkArena(int fd, size_t chunk_bytes,
                                     size_t capacity_bytes, bool populate)
    : fd_(fd),
      chunk_bytes_(chunk_bytes),
      capacity_chunks_(capacity_bytes / chunk_bytes),
      populate_(populate) {}

VirtualChunkArena::~VirtualChunkArena() {
  for (const auto& [cookie, range] : ranges_) ::munmap(range.base, range.span);
  for (const auto& [seq, range] : kept_) ::munmap(range.base, range.span);
  ::close(fd_);
}

ArenaStatus VirtualChunkArena::AllocateLocked(size_t bytes, int64_t /*id*/,
                                              Block* block) {
  if (bytes == 0) return ArenaStatus::Ok();
  const uint64_t n = bytes / chunk_bytes_ + (bytes % chunk_bytes_ != 0);
  // A freed range of exactly n chunks that is still mapped: reuse it whole
  // (no mmap, no page faults), the most recently freed first (warmest).
  auto [lo, hi] = kept_by_chunks_.equal_range(n);
  if (lo != hi) {
    auto last = std::prev(hi);
    auto kept = kept_.find(last->second);
    Range range = std::move(kept->second);
    kept_.erase(kept);
    kept_by_chunks_.erase(last);
    kept_chunks_ -= n;
    const uint64_t cookie = next_cookie_++;
    block->ptr = range.base;
    block->reserved_bytes = range.span;
    block->cookie = cookie;
    ranges_.emplace(cookie, std::move(range));
    return ArenaStatus::Ok();
  }
  // Kept ranges hold free chunks: unmap the oldest ones until the free list
  // can serve the request, before the pool may grow. So the footprint is
  // what it would be without keeping (no external fragmentation, §4).
  while (free_chunks_.size() < n && !kept_.empty()) {
    UnmapKeptLocked(kept_.begin()->first);
  }
  // Grow the physical pool (the memfd) by whole chunks when the cached free
  // chunks do not suffice (§4: physical chunks are cached for later requests).
  if (free_chunks_.size() < n) {
    const uint64_t need = n - free_chunks_.size();
    if (capacity_chunks_ != 0 && pool_chunks_ + need > capacity_chunks_) {
      return Error(ArenaCode::kOutOfMemory,
                   "virtual arena out of capacity: " + Bytes(bytes) +
                       " need " + std::to_string(n) + " chunks of " +
                       Bytes(chunk_bytes_) + ", " +
                       std::to_string(free_chunks_.size()) +
                       " are free and the pool may grow by only " +
                       std::to_string(capacity_chunks_ - pool_chunks_));
    }
    const uint64_t new_size = (pool_chunks_ + need) * chunk_bytes_;
    if (::ftruncate(fd_, static_cast<off_t>(new_size)) != 0) {
      const int err = errno;
      return Error(ArenaCode::kOutOfMemory,
                   "virtual arena: growing the physical pool to " +
                       Bytes(new_size) + " failed: " + ErrnoText(err));
    }
    for (uint64_t c = pool_chunks_; c < pool_chunks_ + need; ++c) {
      free_chunks_.insert(free_chunks_.end(), c);
    }
    pool_chunks_ += need;
    NoteFootprintLocked(pool_chunks_ * chunk_bytes_);
  }
  // Reserve a contiguous virtual range, then map the chunks into it.
  const size_t span = n * chunk_bytes_;
  ++map_calls_;
  void* base = ::mmap(nullptr, span, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    return Error(ArenaCode::kOutOfMemory,
                 "virtual arena: reserving " + Bytes(span) +
                     " of address space failed: " + ErrnoText(err));
  }
  std::vector<uint64_t> chunks;
  chunks.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    chunks.push_back(*free_chunks_.begin());
    free_chunks_.erase(free_chunks_.begin());
  }
  char* va = static_cast<char*>(base);
  for (uint64_t i = 0; i < n;) {
    // One mmap per run of consecutive physical chunks.
    uint64_t j = i + 1;
    while (j < n && chunks[j] == chunks[j - 1] + 1) ++j;
    ++map_calls_;
    void* got = ::mmap(va + i * chunk_bytes_, (j - i) * chunk_bytes_,
                       PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                       static_cast<off_t>(chunks[i] * chunk_bytes_));
    if (got == MAP_FAILED) {
      const int err = errno;
      ++unmap_calls_;
      ::munmap(base, span);
      for (uint64_t c : chunks) free_chunks_.insert(c);
      return Error(ArenaCode::kOutOfMemory,
                   "virtual arena: mapping " + std::to_string(j - i) +
                       " chunk(s) into a " + Bytes(span) +
                       " range failed: " + ErrnoText(err) +
                       (err == ENOMEM
                            ? " (too many mappings? see vm.max_map_count; "
                              "use a larger chunk_bytes)"
                            : ""));
    }
    i = j;
  }
  const uint64_t cookie = next_cookie_++;
  ranges_.emplace(cookie, Range{base, span, std::move(chunks)});
  block->ptr = base;
  block->reserved_bytes = span;
  block->cookie = cookie;
  block->populate = populate_;  // fresh page tables: see PopulateUnlocked
  return ArenaStatus::Ok();
}

void VirtualChunkArena::PopulateUnlocked(void* ptr, size_t bytes) {
  // A fresh MAP_SHARED mapping has no page table entries, and write faults on
  // it are taken one 4 KiB page at a time (fault-around only serves read
  // faults): a 16 MiB copy into it measured ~6x a copy into mapped memory.
  // A read-populate maps 16 pages per fault (writable: shmem needs no dirty
  // tracking) and halves the cost. Best effort (Linux >= 5.14); no lock is
  // needed: the block is not yet handed out, and populating a range that a
  // racing FreeAll unmapped (ENOMEM) or remapped is harmless.
#if defined(__linux__)
  constexpr int kMadvPopulateRead = 22;  // MADV_POPULATE_READ
  (void)::madvise(ptr, bytes, kMadvPopulateRead);
#else
  (void)ptr;
  (void)bytes;
#endif
}

void VirtualChunkArena::UnmapKeptLocked(uint64_t seq) {
  auto it = kept_.find(seq);
  if (it == kept_.end()) return;
  const uint64_t n = it->second.chunks.size();
  auto [lo, hi] = kept_by_chunks_.equal_range(n);
  for (auto k = lo; k != hi; ++k) {
    if (k->second == seq) {
      kept_by_chunks_.erase(k);
      break;
    }
  }
  // Unmapping drops the virtual range; the memfd keeps the physical pages,
  // which go back to the free list for any later request (§4).
  ++unmap_calls_;
  ::munmap(it->second.base, it->second.span);
  for (uint64_t c : it->second.chunks) free_chunks_.insert(c);
  kept_chunks_ -= n;
  kept_.erase(it);
}

void VirtualChunkArena::FreeLocked(const Block& block) {
  if (block.cookie == 0) return;  // zero-byte allocation
  auto it = ranges_.find(block.cookie);
  if (it == ranges_.end()) return;
  // Keep the range mapped for a later request of the same chunk count (a
  // training step offloads the same sizes every iteration): on a host with
  // 4 KiB pages, mapping 16 MiB costs more than copying it (page table
  // setup, and munmap's TLB shootdown). Paper 001 §4 maps 2 MB GPU granules,
  // where this cost is small. Its chunks still count as free and are unmapped
  // on demand before the pool grows, so nothing else changes.
  const uint64_t n = it->second.chunks.size();
  const uint64_t seq = next_kept_seq_++;
  kept_by_chunks_.emplace(n, seq);
  kept_.emplace(seq, std::move(it->second));
  kept_chunks_ += n;
  ranges_.erase(it);
}

void VirtualChunkArena::FillStatsLocked(ArenaStats* s) const {
  const uint64_t free_chunks = free_chunks_.size() + kept_chunks_;
  s->footprint_bytes = pool_chunks_ * chunk_bytes_;
  s->capacity_bytes = capacity_chunks_ * chunk_bytes_;
  s->largest_free_block_bytes = free_chunks * chunk_bytes_;
  s->map_calls = map_calls_;
  s->unmap_calls = unmap_calls_;
  s->chunk_bytes = chunk_bytes_;
  s->pool_chunks = pool_chunks_;
  s->free_chunks = free_chunks;
}

// BestFitCachingArena (paper 001 §4's framework default) ----------------------

ArenaStatus BestFitCachingArena::Create(size_t segment_bytes,
                                        size_t capacity_bytes,
                                        std::unique_ptr<HostArena>* out) {
  size_t seg = 0;
  if (segment_bytes == 0 || !RoundUp(segment_bytes, PageSize(), &seg)) {
    return Error(ArenaCode::kInvalidArgument,
                 "segment_bytes must be positive, got " +
                     std::to_string(segment_bytes));
  }
  out->reset(new BestFitCachingArena(seg, capacity_bytes));
  return ArenaStatus::Ok();
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

ArenaStatus BestFitCachingArena::AllocateLocked(size_t bytes, int64_t /*id*/,
                                                Block* block) {
  if (bytes == 0) return ArenaStatus::Ok();
  size_t size = 0;
  if (!RoundUp(bytes, kArenaAlignment, &size)) {
    return Error(ArenaCode::kOutOfMemory,
                 "best-fit arena: " + Bytes(bytes) + " is too large");
  }
  // Best fit: the smallest cached free block that holds the request, lowest
  // address among equals.
  auto fit = free_.lower_bound({size, 0});
  if (fit == free_.end()) {
    // No cached block fits: grow by a new segment from the OS (never
    // returned while the arena lives — the "caching" part).
    size_t seg = 0;
    if (!RoundUp(size, PageSize(), &seg)) {
      return Error(ArenaCode::kOutOfMemory,
                   "best-fit arena: " + Bytes(bytes) + " is too large");
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
      return Error(ArenaCode::kOutOfMemory,
                   "best-fit arena out of capacity: " + Bytes(bytes) +
                       " fit no cached free block (largest " +
                       Bytes(free_.empty() ? 0 : free_.rbegin()->first) +
                       ") and a new " + Bytes(seg) +
                       " segment would exceed the " +
                       Bytes(capacity_bytes_) + " capacity (footprint " +
                       Bytes(footprint_) + ")");
    }
    void* p = ::mmap(nullptr, seg, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      return Error(ArenaCode::kOutOfMemory,
                   "best-fit arena: allocating a " + Bytes(seg) +
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
  return ArenaStatus::Ok();
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

// HeapCachingArena (the host store's "heap" mode) -----------------------------

namespace {
constexpr size_t kHeapPage = 4096;
}  // namespace

ArenaStatus HeapCachingArena::Create(uint64_t cache_cap_bytes,
                                     size_t capacity_bytes,
                                     std::unique_ptr<HostArena>* out) {
  out->reset(new HeapCachingArena(cache_cap_bytes, capacity_bytes));
  return ArenaStatus::Ok();
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

ArenaStatus HeapCachingArena::AllocateLocked(size_t bytes, int64_t /*id*/,
                                             Block* block) {
  if (bytes == 0) return ArenaStatus::Ok();
  size_t rounded = 0;
  if (!RoundUp(bytes, kHeapPage, &rounded)) {
    return Error(ArenaCode::kOutOfMemory,
                 "heap arena: " + Bytes(bytes) + " is too large");
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
        return Error(ArenaCode::kOutOfMemory,
                     "heap arena out of capacity: " + Bytes(bytes) +
                         " would take the footprint (" + Bytes(footprint_) +
                         " live) past the " + Bytes(capacity_bytes_) +
                         " capacity");
      }
    }
    if (::posix_memalign(&p, kArenaAlignment, rounded) != 0) p = nullptr;
    if (p == nullptr) {
      return Error(ArenaCode::kOutOfMemory,
                   "heap arena: posix_memalign of " + Bytes(rounded) +
                       " failed");
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
  return ArenaStatus::Ok();
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

// PlannedArena (paper 003 §III) -----------------------------------------------

ArenaStatus PlannedArena::Create(std::unordered_map<int64_t, Slot> slots,
                                 uint64_t footprint_bytes,
                                 std::unique_ptr<HostArena>* out) {
  for (const auto& [id, slot] : slots) {
    if (id < 0) {
      return Error(ArenaCode::kInvalidArgument,
                   "plan id " + std::to_string(id) + " is negative");
    }
    if (slot.offset % kArenaAlignment != 0) {
      return Error(ArenaCode::kInvalidArgument,
                   "plan id " + std::to_string(id) + " has offset " +
                       std::to_string(slot.offset) +
                       ", which is not a multiple of " +
                       std::to_string(kArenaAlignment));
    }
    if (slot.offset > footprint_bytes ||
        slot.bytes > footprint_bytes - slot.offset) {
      return Error(ArenaCode::kInvalidArgument,
                   "plan id " + std::to_string(id) + " at [" +
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
      return Error(ArenaCode::kOutOfMemory, "planned footprint too large");
    }
    base = ::mmap(nullptr, len, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      return Error(ArenaCode::kOutOfMemory,
                   "planned arena: allocating the " + Bytes(footprint_bytes) +
                       " buffer failed: " + ErrnoText(err));
    }
  }
  out->reset(new PlannedArena(std::move(slots), base, footprint_bytes));
  return ArenaStatus::Ok();
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

ArenaStatus PlannedArena::AllocateLocked(size_t bytes, int64_t id,
                                         Block* block) {
  auto it = slots_.find(id);
  const std::string ids = "plan id " + std::to_string(id);
  if (it == slots_.end()) {
    return Error(ArenaCode::kPlanMismatch, ids + " is not in the plan");
  }
  const Slot& slot = it->second;
  if (slot.bytes != bytes) {
    return Error(ArenaCode::kPlanMismatch,
                 ids + " is planned for " + Bytes(slot.bytes) + " but " +
                     Bytes(bytes) + " were requested");
  }
  if (live_ids_.count(id) != 0) {
    return Error(ArenaCode::kPlanMismatch,
                 ids + " is already live (free it before allocating it "
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
      return Error(ArenaCode::kPlanMismatch,
                   ids + " at [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + ") overlaps a live slot at [" +
                       std::to_string(clash->first) + ", " +
                       std::to_string(clash->second) +
                       "): the run's lifetimes differ from the plan's");
    }
    live_ranges_.emplace(lo, hi);
    block->ptr = static_cast<char*>(base_) + slot.offset;
  }
  live_ids_.insert(id);
  block->reserved_bytes = bytes;
  block->cookie = static_cast<uint64_t>(id);
  return ArenaStatus::Ok();
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

// Stress driver ---------------------------------------------------------------

namespace {

// The fill pattern of one allocation, word by word.
inline uint64_t PatternWord(uint64_t key, uint64_t k) {
  return SplitMix64(key ^ (k * 0xd1b54a32d192ed03ULL));
}

void Fill(void* p, size_t n, uint64_t key) {
  char* c = static_cast<char*>(p);
  const size_t words = n / 8;
  for (size_t k = 0; k < words; ++k) {
    const uint64_t w = PatternWord(key, k);
    std::memcpy(c + 8 * k, &w, 8);
  }
  const uint64_t tail = PatternWord(key, words);
  std::memcpy(c + 8 * words, &tail, n - 8 * words);
}

bool Verify(const void* p, size_t n, uint64_t key) {
  const char* c = static_cast<const char*>(p);
  const size_t words = n / 8;
  for (size_t k = 0; k < words; ++k) {
    uint64_t w;
    std::memcpy(&w, c + 8 * k, 8);
    if (w != PatternWord(key, k)) return false;
  }
  const uint64_t tail = PatternWord(key, words);
  return std::memcmp(c + 8 * words, &tail, n - 8 * words) == 0;
}

struct Live {
  Allocation a;
  uint64_t key;
};

void StressThread(HostArena* arena, const StressOptions& opt, int t,
                  uint64_t n_ops, StressResult* r) {
  std::mt19937_64 rng(SplitMix64(opt.seed * 0x9e3779b97f4a7c15ULL + t + 1));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double log_max = std::log(static_cast<double>(
      std::max<size_t>(opt.max_bytes, 1)) + 1.0);
  std::vector<Live> live;
  live.reserve(opt.max_live + 1);
  uint64_t last_freed = 0;
  auto note = [r](const std::string& msg) {
    if (r->first_error.empty()) r->first_error = msg;
  };
  auto free_one = [&](size_t i) {
    Live l = live[i];
    live[i] = live.back();
    live.pop_back();
    if (l.a.bytes > 0 && !Verify(l.a.ptr, l.a.bytes, l.key)) {
      ++r->corrupted;
      note("checksum mismatch in handle " + FormatArenaHandle(l.a.handle) +
           " (" + Bytes(l.a.bytes) + ")");
    }
    ArenaStatus st = arena->Free(l.a.handle);
    if (!st.ok()) {
      ++r->free_failures;
      note(st.message());
    } else {
      ++r->frees;
      last_freed = l.a.handle;
    }
  };
  for (uint64_t op = 0; op < n_ops; ++op) {
    ++r->ops;
    const bool can_alloc = live.size() < opt.max_live;
    if (live.empty() || (can_alloc && unit(rng) < 0.5)) {
      size_t bytes = 0;
      if (rng() % 1000 != 0) {  // 1 in 1000 allocations is zero-byte
        bytes = static_cast<size_t>(std::exp(unit(rng) * log_max));
        bytes = std::clamp<size_t>(bytes, 1,
                                   std::max<size_t>(opt.max_bytes, 1));
      }
      Live l;
      ArenaStatus st = arena->Allocate(bytes, &l.a);
      if (!st.ok()) {
        ++r->alloc_failures;
        note(st.message());
        continue;
      }
      ++r->allocs;
      l.key = l.a.handle ^ (opt.seed * 0xbf58476d1ce4e5b9ULL);
      if (bytes > 0) Fill(l.a.ptr, bytes, l.key);
      r->bytes_written += bytes;
      live.push_back(l);
    } else {
      free_one(rng() % live.size());
    }
    if (opt.bad_handle_every != 0 && op % opt.bad_handle_every == 0 &&
        last_freed != 0) {
      // A double free, a stale read and a foreign handle must all fail.
      char byte;
      r->bad_handle_probes += 3;
      if (arena->Free(last_freed).ok()) ++r->bad_handle_accepted;
      if (arena->Read(last_freed, 0, &byte, 1).ok()) ++r->bad_handle_accepted;
      if (arena->Free(last_freed | (uint64_t{1} << 63)).ok()) {
        ++r->bad_handle_accepted;
      }
    }
  }
  while (!live.empty()) free_one(live.size() - 1);
}

}  // namespace

StressResult RunStress(HostArena* arena, const StressOptions& options) {
  StressResult total;
  if (arena->mode() == ArenaMode::kPlanned) {
    total.first_error = "the stress driver needs a dynamic (virtual or "
                        "best_fit) arena";
    return total;
  }
  const int threads = std::max(1, options.threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<StressResult> parts(threads);
  if (threads == 1) {
    StressThread(arena, options, 0, options.n_ops, &parts[0]);
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      const uint64_t n = options.n_ops / threads +
                         (static_cast<uint64_t>(t) < options.n_ops % threads);
      pool.emplace_back(StressThread, arena, std::cref(options), t, n,
                        &parts[t]);
    }
    for (auto& th : pool) th.join();
  }
  for (const StressResult& p : parts) {
    total.ops += p.ops;
    total.allocs += p.allocs;
    total.frees += p.frees;
    total.corrupted += p.corrupted;
    total.alloc_failures += p.alloc_failures;
    total.free_failures += p.free_failures;
    total.bad_handle_probes += p.bad_handle_probes;
    total.bad_handle_accepted += p.bad_handle_accepted;
    total.bytes_written += p.bytes_written;
    if (total.first_error.empty()) total.first_error = p.first_error;
  }
  total.seconds = std::chrono::duration<double>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  return total;
}

#ifndef JAXMEM_ARENA_NO_PYTHON

// Python bindings -------------------------------------------------------------

// The stats as a dict (the host store's `store_stats()["arena"]` too).
nanobind::dict ArenaStatsDict(const ArenaStats& s, const char* mode) {
  namespace nb = nanobind;
  nb::dict d;
  d["mode"] = mode;
  d["footprint_bytes"] = s.footprint_bytes;
  d["peak_footprint_bytes"] = s.peak_footprint_bytes;
  d["capacity_bytes"] = s.capacity_bytes;
  d["live_bytes"] = s.live_bytes;
  d["peak_live_bytes"] = s.peak_live_bytes;
  d["requested_live_bytes"] = s.requested_live_bytes;
  d["peak_requested_bytes"] = s.peak_requested_bytes;
  d["live_allocations"] = s.live_allocations;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block_bytes"] = s.largest_free_block_bytes;
  d["internal_fragmentation"] = s.internal_fragmentation;
  d["external_fragmentation"] = s.external_fragmentation;
  d["allocs"] = s.allocs;
  d["frees"] = s.frees;
  d["errors"] = s.errors;
  d["grows"] = s.grows;
  d["map_calls"] = s.map_calls;
  d["unmap_calls"] = s.unmap_calls;
  d["segments"] = s.segments;
  d["chunk_bytes"] = s.chunk_bytes;
  d["pool_chunks"] = s.pool_chunks;
  d["free_chunks"] = s.free_chunks;
  d["segment_bytes"] = s.segment_bytes;
  return d;
}

namespace {

namespace nb = nanobind;

[[noreturn]] void Raise(const ArenaStatus& st) {
  PyObject* type = PyExc_ValueError;
  switch (st.code()) {
    case ArenaCode::kOutOfMemory: type = PyExc_MemoryError; break;
    case ArenaCode::kUnavailable: type = PyExc_OSError; break;
    case ArenaCode::kUnsupported: type = PyExc_TypeError; break;
    default: break;
  }
  PyErr_SetString(type, st.message().c_str());
  throw nb::python_error();
}

// The Python object: shares the arena with in-flight calls that released the
// GIL, so `close()` never frees memory under a running copy or stress run.
class PyHostArena {
 public:
  explicit PyHostArena(std::shared_ptr<HostArena> arena)
      : arena_(std::move(arena)), mode_(arena_->mode()) {}

  std::shared_ptr<HostArena> Get() const {
    if (!arena_) {
      PyErr_SetString(PyExc_ValueError,
                      (std::string("the ") + ArenaModeName(mode_) +
                       " host arena is closed")
                          .c_str());
      throw nb::python_error();
    }
    return arena_;
  }
  void Close() { arena_.reset(); }
  bool closed() const { return !arena_; }
  ArenaMode mode() const { return mode_; }

 private:
  std::shared_ptr<HostArena> arena_;
  ArenaMode mode_;
};

nb::dict StatsDict(const ArenaStats& s, ArenaMode mode) {
  return ArenaStatsDict(s, ArenaModeName(mode));
}

// {id: value} from a dict, or {index: value} from a sequence.
std::vector<std::pair<int64_t, uint64_t>> IdTable(nb::handle obj,
                                                  const char* what) {
  std::vector<std::pair<int64_t, uint64_t>> out;
  if (obj.is_none()) return out;
  if (nb::isinstance<nb::dict>(obj)) {
    for (auto [k, v] : nb::borrow<nb::dict>(obj)) {
      out.emplace_back(nb::cast<int64_t>(k), nb::cast<uint64_t>(v));
    }
    return out;
  }
  int64_t i = 0;
  try {
    for (nb::handle v : nb::iter(obj)) {
      out.emplace_back(i++, nb::cast<uint64_t>(v));
    }
  } catch (const nb::cast_error&) {
    throw nb::value_error(
        (std::string(what) + " must be a dict {id: int} or a sequence of "
                             "non-negative ints")
            .c_str());
  }
  return out;
}

std::shared_ptr<HostArena> MakeArena(const std::string& mode,
                                     size_t chunk_bytes, size_t segment_bytes,
                                     size_t capacity_bytes, nb::handle offsets,
                                     nb::handle sizes,
                                     std::optional<uint64_t> footprint) {
  std::unique_ptr<HostArena> arena;
  ArenaStatus st;
  if (mode == "virtual") {
    st = VirtualChunkArena::Create(chunk_bytes, capacity_bytes, &arena);
  } else if (mode == "best_fit") {
    st = BestFitCachingArena::Create(segment_bytes, capacity_bytes, &arena);
  } else if (mode == "planned") {
    if (offsets.is_none() || sizes.is_none()) {
      throw nb::value_error("a planned arena needs offsets= and sizes=");
    }
    auto off = IdTable(offsets, "offsets");
    auto sz = IdTable(sizes, "sizes");
    std::unordered_map<int64_t, PlannedArena::Slot> slots;
    for (const auto& [id, o] : off) slots[id].offset = o;
    std::unordered_map<int64_t, uint64_t> size_of(sz.begin(), sz.end());
    if (size_of.size() != slots.size()) {
      throw nb::value_error("offsets and sizes must name the same ids");
    }
    uint64_t end = 0;
    for (auto& [id, slot] : slots) {
      auto it = size_of.find(id);
      if (it == size_of.end()) {
        throw nb::value_error(("plan id " + std::to_string(id) +
                               " has an offset but no size")
                                  .c_str());
      }
      slot.bytes = it->second;
      end = std::max(end, slot.offset + slot.bytes);
    }
    st = PlannedArena::Create(std::move(slots), footprint.value_or(end),
                              &arena);
  } else {
    throw nb::value_error(("unknown arena mode '" + mode +
                           "': expected 'virtual', 'best_fit' or 'planned'")
                              .c_str());
  }
  if (!st.ok()) Raise(st);
  return std::shared_ptr<HostArena>(std::move(arena));
}

nb::dict StressDict(const StressResult& r, const ArenaStats& s,
                    ArenaMode mode) {
  nb::dict d;
  d["ops"] = r.ops;
  d["allocs"] = r.allocs;
  d["frees"] = r.frees;
  d["corrupted"] = r.corrupted;
  d["alloc_failures"] = r.alloc_failures;
  d["free_failures"] = r.free_failures;
  d["bad_handle_probes"] = r.bad_handle_probes;
  d["bad_handle_accepted"] = r.bad_handle_accepted;
  d["bytes_written"] = r.bytes_written;
  d["seconds"] = r.seconds;
  d["first_error"] = r.first_error;
  d["peak"] = s.peak_live_bytes;
  d["peak_requested"] = s.peak_requested_bytes;
  d["footprint"] = s.footprint_bytes;
  d["live_at_end"] = s.live_bytes;
  d["live_allocations_at_end"] = s.live_allocations;
  d["stats"] = StatsDict(s, mode);
  return d;
}

nb::dict RunStressPy(const std::shared_ptr<HostArena>& arena, uint64_t n_ops,
                     uint64_t seed, size_t max_bytes, int threads,
                     size_t max_live, uint64_t bad_handle_every) {
  if (arena->mode() == ArenaMode::kPlanned) {
    throw nb::type_error("arena_stress needs a 'virtual' or 'best_fit' arena");
  }
  if (threads < 1 || threads > 64) {
    throw nb::value_error("threads must be in [1, 64]");
  }
  StressOptions opt;
  opt.n_ops = n_ops;
  opt.seed = seed;
  opt.max_bytes = max_bytes;
  opt.threads = threads;
  opt.max_live = std::max<size_t>(max_live, 1);
  opt.bad_handle_every = bad_handle_every;
  StressResult r;
  ArenaStats s;
  {
    nb::gil_scoped_release release;
    r = RunStress(arena.get(), opt);
    s = arena->Stats();
  }
  return StressDict(r, s, arena->mode());
}

using U8Array = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;
using U8In = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig,
                         nb::device::cpu>;

}  // namespace

void RegisterArena(nb::module_& m) {
  nb::class_<PyHostArena>(
      m, "HostArena",
      "A native host arena (see jaxmem._src.arena.HostArena); made by "
      "make_arena().")
      .def_prop_ro("mode",
                   [](const PyHostArena& a) { return ArenaModeName(a.mode()); })
      .def_prop_ro("closed", &PyHostArena::closed)
      .def(
          "allocate",
          [](PyHostArena& self, int64_t size_or_id,
             std::optional<uint64_t> nbytes) {
            auto arena = self.Get();
            Allocation a;
            ArenaStatus st;
            if (arena->mode() == ArenaMode::kPlanned) {
              uint64_t n = 0;
              PlannedArena::Slot slot;
              if (nbytes.has_value()) {
                n = *nbytes;
              } else if (static_cast<const PlannedArena*>(arena.get())
                             ->SlotOf(size_or_id, &slot)) {
                n = slot.bytes;  // no size given: the planned one
              }
              st = arena->AllocateId(size_or_id, n, &a);
            } else {
              if (size_or_id < 0) {
                throw nb::value_error("allocation size must be >= 0");
              }
              if (nbytes.has_value() &&
                  *nbytes != static_cast<uint64_t>(size_or_id)) {
                throw nb::value_error(
                    "allocate(size, nbytes): nbytes must equal size");
              }
              st = arena->Allocate(static_cast<size_t>(size_or_id), &a);
            }
            if (!st.ok()) Raise(st);
            return a.handle;
          },
          nb::arg("size_or_id"), nb::arg("nbytes") = nb::none(),
          "Allocates `size` bytes (virtual/best_fit) or plan slot `id` of "
          "`nbytes` bytes (planned); returns the 64-bit handle.")
      .def(
          "free",
          [](PyHostArena& self, uint64_t handle) {
            ArenaStatus st = self.Get()->Free(handle);
            if (!st.ok()) Raise(st);
          },
          nb::arg("handle"),
          "Frees a live allocation; raises ValueError for a stale, "
          "double-freed or foreign handle.")
      .def(
          "lookup",
          [](PyHostArena& self, uint64_t handle) {
            Allocation a;
            ArenaStatus st = self.Get()->Lookup(handle, &a);
            if (!st.ok()) Raise(st);
            nb::dict d;
            d["handle"] = a.handle;
            d["address"] = reinterpret_cast<uintptr_t>(a.ptr);
            d["nbytes"] = a.bytes;
            d["reserved_bytes"] = a.reserved_bytes;
            d["id"] = a.id;
            return d;
          },
          nb::arg("handle"), "Describes a live allocation.")
      .def(
          "write",
          [](PyHostArena& self, uint64_t handle, U8In data, size_t offset) {
            auto arena = self.Get();
            const void* src = data.data();
            const size_t n = data.shape(0);
            ArenaStatus st;
            {
              nb::gil_scoped_release release;
              st = arena->Write(handle, offset, src, n);
            }
            if (!st.ok()) Raise(st);
          },
          nb::arg("handle"), nb::arg("data"), nb::arg("offset") = 0,
          "Copies a 1-D contiguous uint8 array into the allocation.")
      .def(
          "read",
          [](PyHostArena& self, uint64_t handle, size_t offset,
             std::optional<size_t> nbytes) {
            auto arena = self.Get();
            Allocation a;
            ArenaStatus st = arena->Lookup(handle, &a);
            if (!st.ok()) Raise(st);
            const size_t n = nbytes.value_or(
                a.bytes >= offset ? a.bytes - offset : 0);
            uint8_t* buf = new uint8_t[n > 0 ? n : 1];
            nb::capsule owner(buf, [](void* p) noexcept {
              delete[] static_cast<uint8_t*>(p);
            });
            {
              nb::gil_scoped_release release;
              st = arena->Read(handle, offset, buf, n);
            }
            if (!st.ok()) Raise(st);
            return U8Array(buf, {n}, owner);
          },
          nb::arg("handle"), nb::arg("offset") = 0,
          nb::arg("nbytes") = nb::none(),
          "Copies the allocation (from `offset`, `nbytes` bytes; default: "
          "to the end) into a new uint8 numpy array.")
      .def(
          "free_all", [](PyHostArena& self) { return self.Get()->FreeAll(); },
          "Frees every live allocation; returns how many were freed.")
      .def(
          "stats",
          [](PyHostArena& self) {
            auto arena = self.Get();
            return StatsDict(arena->Stats(), arena->mode());
          },
          "Counters and fragmentation, as a dict.")
      .def(
          "stress",
          [](PyHostArena& self, uint64_t n_ops, uint64_t seed,
             size_t max_bytes, int threads, size_t max_live,
             uint64_t bad_handle_every) {
            return RunStressPy(self.Get(), n_ops, seed, max_bytes, threads,
                               max_live, bad_handle_every);
          },
          nb::arg("n_ops") = 1000000, nb::arg("seed") = 0,
          nb::arg("max_bytes") = 65536, nb::arg("threads") = 1,
          nb::arg("max_live") = 256, nb::arg("bad_handle_every") = 997,
          "Runs the C++ stress driver on this arena (GIL released).")
      .def("close", &PyHostArena::Close,
           "Releases the arena's memory; later calls raise ValueError.");

  m.def(
      "make_arena",
      [](const std::string& mode, size_t chunk_bytes, size_t segment_bytes,
         size_t capacity_bytes, nb::handle offsets, nb::handle sizes,
         std::optional<uint64_t> footprint) {
        return PyHostArena(MakeArena(mode, chunk_bytes, segment_bytes,
                                     capacity_bytes, offsets, sizes,
                                     footprint));
      },
      nb::arg("mode"), nb::arg("chunk_bytes") = size_t{2} << 20,
      nb::arg("segment_bytes") = size_t{2} << 20,
      nb::arg("capacity_bytes") = 0, nb::arg("offsets") = nb::none(),
      nb::arg("sizes") = nb::none(), nb::arg("footprint") = nb::none(),
      "Makes a host arena: mode 'virtual' (chunk_bytes), 'best_fit' "
      "(segment_bytes) or 'planned' (offsets, sizes: dicts id -> int or "
      "sequences; footprint defaults to max(offset + size)). capacity_bytes "
      "caps the footprint of dynamic modes (0: unbounded).");

  m.def(
      "arena_stress",
      [](const std::string& mode, uint64_t n_ops, uint64_t seed,
         size_t max_bytes, int threads, size_t chunk_bytes,
         size_t segment_bytes, size_t capacity_bytes, size_t max_live,
         uint64_t bad_handle_every) {
        auto arena = MakeArena(mode, chunk_bytes, segment_bytes,
                               capacity_bytes, nb::none(), nb::none(),
                               std::nullopt);
        return RunStressPy(arena, n_ops, seed, max_bytes, threads, max_live,
                           bad_handle_every);
      },
      nb::arg("mode"), nb::arg("n_ops") = 1000000, nb::arg("seed") = 0,
      nb::arg("max_bytes") = 65536, nb::arg("threads") = 1,
      nb::arg("chunk_bytes") = size_t{64} << 10,
      nb::arg("segment_bytes") = size_t{2} << 20,
      nb::arg("capacity_bytes") = 0, nb::arg("max_live") = 256,
      nb::arg("bad_handle_every") = 997,
      "Runs n_ops random alloc/free ops in C++ (GIL released) on a fresh "
      "arena, filling each allocation with a pattern from (handle, seed) and "
      "verifying it before the free; frees everything at the end. Returns "
      "{corrupted, ops, peak, footprint, live_at_end, ...}.");

  m.attr("ARENA_ALIGNMENT") = kArenaAlignment;
}

#endif  // JAXMEM_ARENA_NO_PYTHON

}  // namespace jaxmem
