// Copyright 2025 The jaxmem Authors.
//
// VirtualChunkArena (see virtual_chunk_arena.h; Hayakawa & Narihira §4).

#include "arena/virtual_chunk_arena.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <iterator>
#include <string>
#include <utility>

#include "arena/arena_util.h"

namespace jaxmem {

using arena_internal::Bytes;
using arena_internal::ErrnoText;
using arena_internal::PageSize;

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

Status VirtualChunkArena::Create(size_t chunk_bytes, size_t capacity_bytes,
                                 std::unique_ptr<HostArena>* out,
                                 bool populate) {
  const size_t page = PageSize();
  if (chunk_bytes == 0 || chunk_bytes % page != 0) {
    return InvalidArgument(
        "chunk_bytes must be a positive multiple of the page size (" +
        Bytes(page) + "), got " + std::to_string(chunk_bytes));
  }
  if (capacity_bytes % chunk_bytes != 0) {
    return InvalidArgument("capacity_bytes (" + std::to_string(capacity_bytes) +
                           ") must be a multiple of chunk_bytes (" +
                           std::to_string(chunk_bytes) +
                           ") or 0 for unbounded");
  }
  const int fd = MemfdCreate("jaxmem-host-arena");
  if (fd < 0) {
    const int err = errno;
    // ENOMEM is the kernel out of memory, not the mechanism missing.
    return Status(err == ENOMEM ? StatusCode::kResourceExhausted
                                : StatusCode::kUnavailable,
                  "virtual host arena needs memfd_create (Linux >= 3.17), "
                  "which failed: " +
                      ErrnoText(err) +
                      "; use the 'best_fit' or 'planned' mode instead");
  }
  out->reset(
      new VirtualChunkArena(fd, chunk_bytes, capacity_bytes, populate));
  return Status::Ok();
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

Status VirtualChunkArena::AllocateLocked(size_t bytes, int64_t /*id*/,
                                         Block* block) {
  if (bytes == 0) return Status::Ok();
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
    return Status::Ok();
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
      return ResourceExhausted(
          "virtual arena out of capacity: " + Bytes(bytes) + " need " +
          std::to_string(n) + " chunks of " + Bytes(chunk_bytes_) + ", " +
          std::to_string(free_chunks_.size()) +
          " are free and the pool may grow by only " +
          std::to_string(capacity_chunks_ - pool_chunks_));
    }
    const uint64_t new_size = (pool_chunks_ + need) * chunk_bytes_;
    if (::ftruncate(fd_, static_cast<off_t>(new_size)) != 0) {
      const int err = errno;
      return ResourceExhausted("virtual arena: growing the physical pool to " +
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
    return ResourceExhausted("virtual arena: reserving " + Bytes(span) +
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
      return ResourceExhausted(
          "virtual arena: mapping " + std::to_string(j - i) +
          " chunk(s) into a " + Bytes(span) +
          " range failed: " + ErrnoText(err) +
          (err == ENOMEM ? " (too many mappings? see vm.max_map_count; "
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
  return Status::Ok();
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
  // setup, and munmap's TLB shootdown). Hayakawa & Narihira's §4 maps 2 MB
  // GPU granules, where this cost is small. Its chunks still count as free
  // and are unmapped on demand before the pool grows, so nothing else
  // changes.
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

}  // namespace jaxmem
