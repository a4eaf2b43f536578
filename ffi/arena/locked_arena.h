// Copyright 2025 The jaxmem Authors.
//
// `LockedArena`: the machinery every arena shares (see host_arena.h).

#ifndef JAXMEM_FFI_ARENA_LOCKED_ARENA_H_
#define JAXMEM_FFI_ARENA_LOCKED_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "arena/host_arena.h"
#include "mutex.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

// Handle issue/validation, the live table, counters and locking. Subclasses
// implement the `*Locked` hooks, called with `mu_` held, and mark their own
// mutable state GUARDED_BY(mu_). Public methods take `mu_` themselves.
class LockedArena : public HostArena {
 public:
  LockedArena();
  LockedArena(const LockedArena&) = delete;
  LockedArena& operator=(const LockedArena&) = delete;

  Status Allocate(size_t bytes, Allocation* out) override EXCLUDES(mu_);
  Status AllocateId(int64_t id, size_t bytes, Allocation* out) override
      EXCLUDES(mu_);
  Status Free(uint64_t handle) override EXCLUDES(mu_);
  Status Lookup(uint64_t handle, Allocation* out) const override EXCLUDES(mu_);
  Status Write(uint64_t handle, size_t offset, const void* src,
               size_t n) override EXCLUDES(mu_);
  Status Read(uint64_t handle, size_t offset, void* dst,
              size_t n) const override EXCLUDES(mu_);
  uint64_t FreeAll() override EXCLUDES(mu_);
  ArenaStats Stats() const override EXCLUDES(mu_);

 protected:
  // A block handed out by a subclass; `cookie` is the subclass's own data.
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
    size_t reserved_bytes = 0;
    int64_t id = -1;
    uint64_t cookie = 0;
    bool populate = false;  // call PopulateUnlocked once the lock is dropped
  };

  // Fill `block` for a request of `bytes` (`id` >= 0: planned slot).
  virtual Status AllocateLocked(size_t bytes, int64_t id, Block* block)
      REQUIRES(mu_) = 0;
  // Release a block previously returned by AllocateLocked.
  virtual void FreeLocked(const Block& block) REQUIRES(mu_) = 0;
  // Fill the mode-specific fields: footprint, capacity, free-block shape,
  // map/segment counters. Live/requested/op counts are filled by the base.
  virtual void FillStatsLocked(ArenaStats* stats) const REQUIRES(mu_) = 0;
  // For blocks with `populate` set: prepares the pages (outside `mu_`,
  // before the allocation is returned).
  virtual void PopulateUnlocked(void* /*ptr*/, size_t /*bytes*/) EXCLUDES(mu_) {
  }

  // Called by subclasses when the footprint grows (counted in `grows`).
  void NoteFootprintLocked(uint64_t footprint_bytes) REQUIRES(mu_);

  mutable Mutex mu_;

 private:
  Status HandleErrorLocked(uint64_t handle, const char* verb,
                           bool is_free) const REQUIRES(mu_);
  Status AllocateCommon(size_t bytes, int64_t id, Allocation* out)
      EXCLUDES(mu_);
  // Counts a refused call in `errors_` and returns `status`.
  Status Refuse(Status status) EXCLUDES(mu_);

  const uint64_t tag_;                 // arena tag (high handle bits)
  const uint64_t first_seq_;           // first sequence number issued
  uint64_t next_seq_ GUARDED_BY(mu_);  // next sequence number to issue
  std::unordered_map<uint64_t, Block> live_ GUARDED_BY(mu_);
  uint64_t live_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t peak_live_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t requested_live_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t peak_requested_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t peak_footprint_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t allocs_ GUARDED_BY(mu_) = 0;
  uint64_t frees_ GUARDED_BY(mu_) = 0;
  uint64_t grows_ GUARDED_BY(mu_) = 0;
  mutable uint64_t errors_ GUARDED_BY(mu_) = 0;
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_LOCKED_ARENA_H_
