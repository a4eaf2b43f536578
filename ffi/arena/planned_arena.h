// Copyright 2025 The jaxmem Authors.
//
// `PlannedArena`: static offsets from an offline DSA solver (Zhang et al.,
// *Efficient Memory Management for GPU-based Deep Learning Systems*, §III,
// SmartPool; the solver is dsa.h). See host_arena.h.

#ifndef JAXMEM_FFI_ARENA_PLANNED_ARENA_H_
#define JAXMEM_FFI_ARENA_PLANNED_ARENA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>

#include "arena/locked_arena.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

class PlannedArena : public LockedArena {
 public:
  struct Slot {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  // Every slot must be 64-byte aligned and lie inside `footprint_bytes`.
  static Status Create(std::unordered_map<int64_t, Slot> slots,
                       uint64_t footprint_bytes,
                       std::unique_ptr<HostArena>* out);
  ~PlannedArena() override;

  ArenaMode mode() const override { return ArenaMode::kPlanned; }

  // The planned slot of `id`; false if `id` is not in the plan.
  bool SlotOf(int64_t id, Slot* slot) const;

 protected:
  Status AllocateLocked(size_t bytes, int64_t id, Block* block) override
      REQUIRES(mu_);
  void FreeLocked(const Block& block) override REQUIRES(mu_);
  void FillStatsLocked(ArenaStats* stats) const override REQUIRES(mu_);

 private:
  PlannedArena(std::unordered_map<int64_t, Slot> slots, void* base,
               uint64_t footprint_bytes);

  // Immutable after construction: SlotOf reads them without the lock.
  const std::unordered_map<int64_t, Slot> slots_;
  void* const base_;
  const uint64_t footprint_;
  std::set<int64_t> live_ids_ GUARDED_BY(mu_);
  // Offset -> end of the live nonempty slots.
  std::map<uint64_t, uint64_t> live_ranges_ GUARDED_BY(mu_);
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_PLANNED_ARENA_H_
