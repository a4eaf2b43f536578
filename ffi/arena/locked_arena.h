// Copyright 2025 The jaxmem Authors.
//
// `LockedArena`: the machinery every arena shares (see host_arena.h).

#ifndef JAXMEM_FFI_ARENA_LOCKED_ARENA_H_
#define JAXMEM_FFI_ARENA_LOCKED_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "arena/host_arena.h"

namespace jaxmem {

// Handle issue/validation, the live table, counters and locking. Subclasses
// implement the `*Locked` hooks, called with `mu_` held.
class LockedArena : public HostArena {
 public:
  LockedArena();
  LockedArena(const LockedArena&) = delete;
  LockedArena& operator=(const LockedArena&) = delete;

  Status Allocate(size_t bytes, Allocation* out) override;
  Status AllocateId(int64_t id, size_t bytes, Allocation* out) override;
  Status Free(uint64_t handle) override;
  Status Lookup(uint64_t handle, Allocation* out) const override;
  Status Write(uint64_t handle, size_t offset, const void* src,
               size_t n) override;
  Status Read(uint64_t handle, size_t offset, void* dst,
              size_t n) const override;
  uint64_t FreeAll() override;
  ArenaStats Stats() const override;

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
  virtual Status AllocateLocked(size_t bytes, int64_t id, Block* block) = 0;
  // Release a block previously returned by AllocateLocked.
  virtual void FreeLocked(const Block& block) = 0;
  // Fill the mode-specific fields: footprint, capacity, free-block shape,
  // map/segment counters. Live/requested/op counts are filled by the base.
  virtual void FillStatsLocked(ArenaStats* stats) const = 0;
  // For blocks with `populate` set: prepares the pages (outside `mu_`,
  // before the allocation is returned).
  virtual void PopulateUnlocked(void* /*ptr*/, size_t /*bytes*/) {}

  // Called by subclasses when the footprint grows (counted in `grows`).
  void NoteFootprintLocked(uint64_t footprint_bytes);

  mutable std::mutex mu_;

 private:
  Status HandleErrorLocked(uint64_t handle, const char* verb,
                           bool is_free) const;
  Status AllocateCommon(size_t bytes, int64_t id, Allocation* out);

  uint64_t tag_;        // arena tag (high handle bits)
  uint64_t first_seq_;  // first sequence number issued
  uint64_t next_seq_;   // next sequence number to issue
  std::unordered_map<uint64_t, Block> live_;
  uint64_t live_bytes_ = 0;
  uint64_t peak_live_bytes_ = 0;
  uint64_t requested_live_bytes_ = 0;
  uint64_t peak_requested_bytes_ = 0;
  uint64_t peak_footprint_bytes_ = 0;
  uint64_t allocs_ = 0;
  uint64_t frees_ = 0;
  uint64_t grows_ = 0;
  mutable uint64_t errors_ = 0;
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_LOCKED_ARENA_H_
