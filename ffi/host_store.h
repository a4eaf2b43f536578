// Copyright 2025 The jaxmem Authors.
//
// A thread-safe native host store for jaxmem's offload/fetch custom calls.
//
// `Put` copies a buffer into host memory taken from the store's arena and
// returns a 64-bit handle; `Take` copies it back out and erases the entry,
// which frees the memory into the arena. Handles come from a per-process
// counter that starts at a random value and is never reused, so a handle
// that was already fetched, cleared, or that came from another process is
// reported as an error instead of aliasing live data. No operation crashes
// on a bad handle.
//
// The backing allocator is a `HostArena` (host_arena.h), chosen by
// `HostStore::Configure` (Python: `jaxmem.native.store_configure`) or by
// $JAXMEM_HOST_ARENA, read at the store's first use:
//
//   * "planned" (default): "best_fit" for every buffer without a planned
//     slot; the planned ones go to their plan's layout (below).
//   * "best_fit": `BestFitCachingArena`, the framework default of
//     Hayakawa & Narihira, *Out-of-core training for extremely large-scale
//     neural networks with adaptive window-based scheduling*, §4. It caches
//     freed memory itself (segments are kept, blocks split and coalesce), so
//     a step that offloads the same sizes every iteration reuses warm,
//     already faulted-in pages: as fast as the old size cache.
//   * "virtual": `VirtualChunkArena`, the same §4's fix for fragmentation:
//     physical chunks (memfd) mapped into a fresh virtual range per entry;
//     footprint is a whole number of chunks, free chunks serve any size.
//   * "heap": `HeapCachingArena`, the store's original posix_memalign + size
//     cache (the cache cap is $JAXMEM_HOST_CACHE_BYTES, default 8 GiB).
//
// The old size cache is *not* kept as a layer above the arena: best-fit
// already caches, a size cache above "virtual" would pin chunk sets to sizes
// and bring back the size-keyed fragmentation §4 removes, and above either it
// would hide freed memory from the arena's footprint/fragmentation counters
// (a cached buffer looks live to the arena). It lives on as the "heap" mode.
//
// The store keys entries by its own handles, not by arena handles: handle
// validation must survive an arena being replaced, and CUDA builds publish
// pinned buffers (cuda/handlers.cc's PinnedPool), which are not arena memory.
// The arena handle travels inside the entry's `HostBuffer`.
//
// `Clear` also drops the arena (a fresh one of the same configuration is made
// at the next use), returning its cached memory to the OS as the old cache
// trim did; arena counters (footprint, peak footprint) restart there.
// Buffers still held elsewhere keep their old arena alive through a
// `shared_ptr` and free into it, so clearing or reconfiguring never frees
// memory that a copy in flight still uses.
//
// The asynchronous copy engine (copy_engine.h, and the CUDA path in
// cuda/handlers.cc) fills and drains entries outside the store: it takes a
// `HostBuffer` from `AllocateBuffer`, copies into it on a worker thread or a
// copy stream, and only then publishes it with `Insert`; a fetch `Remove`s
// the buffer first (so a second fetch of the handle fails at once) and copies
// out of it afterwards.
//
// Planned layouts (SmartPool, Zhang et al., *Efficient Memory Management for
// GPU-based Deep Learning Systems*, §III): a plan's host buffers, their
// lifetimes known before the step runs, get static offsets from the offline
// DSA solver (dsa.h) in one buffer of the planned footprint. `RegisterPlan`
// records a layout under a plan key; the `offload_planned` and
// `offload_start_planned` custom calls carry the key and the buffer's slot
// as attributes (`PlanSlot`), and their allocation comes from that plan's
// `PlannedArena` (made at its first allocation, and again after `Clear`),
// in the store's mode "planned" (the default; in the other modes the slots
// are ignored). When the
// run's order differs from the plan's and the slot would overlap a live one,
// or the plan is not registered, the buffer comes from the store's arena
// instead: counted in `PlanStats::fallbacks`, never an error.

#ifndef JAXMEM_FFI_HOST_STORE_H_
#define JAXMEM_FFI_HOST_STORE_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "arena/host_arena.h"
#include "mutex.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

// Alignment of every buffer held by the store.
inline constexpr size_t kHostStoreAlignment = 64;
static_assert(kArenaAlignment % kHostStoreAlignment == 0,
              "arena pointers must satisfy the store's alignment");

// Which arena backs the host store. See the file comment for the modes.
struct HostArenaConfig {
  // "planned" (best-fit, and planned layouts for the buffers that have a
  // slot), "best_fit", "virtual" or "heap".
  std::string mode = "planned";
  uint64_t chunk_bytes = uint64_t{2} << 20;    // virtual: physical chunk
  uint64_t segment_bytes = uint64_t{2} << 20;  // best_fit: min segment
  uint64_t capacity_bytes = 0;                 // footprint cap (0: none)
};

// Parses a $JAXMEM_HOST_ARENA value: "MODE" or "MODE:KEY=VALUE,...", with
// KEY one of chunk_bytes, segment_bytes, capacity_bytes and VALUE an integer
// with an optional K/M/G (KiB/MiB/GiB) suffix, e.g. "virtual:chunk_bytes=4M".
// Returns InvalidArgument, or ok and the result in `*out`.
Status ParseHostArenaConfig(const std::string& text, HostArenaConfig* out);

// Makes the arena `config` describes (InvalidArgument for a bad mode or size,
// or the arena's own error).
Status MakeHostArena(const HostArenaConfig& config,
                     std::shared_ptr<HostArena>* out);

// A snapshot of the store's counters.
struct HostStoreStats {
  uint64_t live_entries = 0;  // entries currently held
  uint64_t live_bytes = 0;    // payload bytes currently held
  uint64_t peak_bytes = 0;    // maximum of live_bytes since process start
  uint64_t total_puts = 0;    // successful Put calls
  uint64_t total_takes = 0;   // successful Take calls
  uint64_t total_errors = 0;  // failed Put/Take calls
  // Memory of the current arena not handed out (best-fit free blocks, free
  // virtual chunks, cached heap buffers: `arena.free_bytes`); allocations
  // served from such memory, and allocations that grew the footprint
  // (`arena.grows`), both summed over every arena the store has had.
  uint64_t cached_bytes = 0;
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;
  std::string arena_mode;  // "best_fit", "virtual", "heap"; "invalid" when
                           // $JAXMEM_HOST_ARENA could not be parsed
  ArenaStats arena;        // the current arena (zeros before its first use)
};

// Where a planned buffer goes: plan key and slot (`plan` < 0: not planned).
struct PlanSlot {
  int64_t plan = -1;
  int64_t slot = -1;
};

// A planned layout's counters (`HostStore::PlanStatsOf`).
struct PlanStats {
  uint64_t footprint = 0;     // bytes of the planned buffer
  uint64_t slots = 0;         // planned buffers
  uint64_t planned = 0;       // allocations served from their slot
  uint64_t fallbacks = 0;     // allocations the store's arena served instead
  uint64_t peak_live_bytes = 0;  // most bytes live in the slots at once
};

// A host allocation owned by the store or by an in-flight copy. Move-only.
// Either an arena allocation (freed into its arena, which the buffer keeps
// alive) or memory with a plain deleter function (CUDA pinned blocks).
class HostBuffer {
 public:
  using Free = void (*)(void*, size_t);

  HostBuffer() = default;
  HostBuffer(void* data, size_t bytes, Free free)
      : data_(data), bytes_(bytes), free_(free) {}
  // Allocation `handle` of `arena`, at `data`, holding `bytes` bytes.
  HostBuffer(std::shared_ptr<HostArena> arena, uint64_t handle, void* data,
             size_t bytes)
      : data_(data), bytes_(bytes), arena_(std::move(arena)),
        arena_handle_(handle) {}
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  bool ok(size_t want_bytes) const { return want_bytes == 0 || data_ != nullptr; }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

  // For buffers written asynchronously (a CUDA copy stream): called before
  // the host reads the bytes (`HostStore::Take`), e.g. an event synchronize.
  void set_wait_ready(std::function<void()> f) { wait_ready_ = std::move(f); }
  void WaitReady() {
    if (wait_ready_) {
      wait_ready_();
      wait_ready_ = nullptr;
    }
  }

  void Reset();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Free free_ = nullptr;
  std::shared_ptr<HostArena> arena_;  // set for arena allocations
  uint64_t arena_handle_ = 0;
  std::function<void()> wait_ready_;
};

class HostStore {
 public:
  // The process-wide store used by the FFI handlers and the Python module.
  static HostStore& Global();

  HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // Copies `bytes` bytes from `data` into the store, tagged with `dtype_code`,
  // and writes the new handle to `*id`. Fails like `AllocateBuffer` (or
  // InvalidArgument for a null `data` of nonzero size; `data` may be null
  // when `bytes` is 0). The copy runs outside every lock.
  // With `where.plan` >= 0 the memory is the plan's slot (see the file
  // comment), else the store's arena.
  Status Put(const void* data, size_t bytes, uint32_t dtype_code, uint64_t* id,
             PlanSlot where = {}) EXCLUDES(mu_);

  // Copies the entry `id` into `dst` (which has room for `bytes` bytes) and
  // erases it. InvalidArgument, with a message saying what was wrong, for an
  // unknown / stale / already fetched handle, or a size or dtype that does
  // not match what was stored. On a size/dtype mismatch the entry is kept (a
  // corrected retry can still succeed).
  Status Take(uint64_t id, void* dst, size_t bytes, uint32_t dtype_code)
      EXCLUDES(mu_);

  // Publishes a filled buffer as a new entry of `bytes` bytes of `dtype_code`
  // (the buffer may be larger, e.g. a pooled pinned block). Never fails today;
  // returns a Status for symmetry with `Put`.
  Status Insert(HostBuffer buffer, size_t bytes, uint32_t dtype_code,
                uint64_t* id) EXCLUDES(mu_);

  // Validates entry `id` like `Take` and moves its buffer to `*out` without
  // copying. The handle is consumed at once: a second Remove/Take fails.
  Status Remove(uint64_t id, size_t bytes, uint32_t dtype_code, HostBuffer* out)
      EXCLUDES(mu_);

  // An uninitialised `bytes`-byte buffer from the store's arena (empty for
  // 0 bytes), for a copy that `Insert`s it later. ResourceExhausted when the
  // arena (its capacity, or the OS) refuses the memory; FailedPrecondition
  // when the configured arena cannot be made (bad $JAXMEM_HOST_ARENA).
  // With `where.plan` >= 0: the plan's slot when it is registered and the
  // slot is free (planned for exactly `bytes`), else the store's arena (a
  // fallback, counted).
  Status AllocateBuffer(size_t bytes, HostBuffer* out, PlanSlot where = {})
      EXCLUDES(mu_);

  // Records plan `plan`'s layout: slot id -> (offset, bytes), each offset
  // 64-byte aligned, in a buffer of `footprint` bytes, mapped at the first
  // allocation (InvalidArgument for a bad layout, ResourceExhausted when the
  // memory is refused). Replaces an earlier layout of the same key; buffers
  // of the old one stay valid until taken.
  Status RegisterPlan(int64_t plan,
                      std::unordered_map<int64_t, std::pair<uint64_t, uint64_t>> slots,
                      uint64_t footprint) EXCLUDES(mu_);

  // Forgets plan `plan` (nothing if unknown); its buffer is unmapped once no
  // entry holds a slot of it.
  void UnregisterPlan(int64_t plan) EXCLUDES(mu_);

  // Counters of a registered plan; false if `plan` is not registered.
  bool PlanStatsOf(int64_t plan, PlanStats* out) const EXCLUDES(mu_);

  // Replaces the arena with a new one made from `config`. Only while the
  // store is empty: no entries and no arena memory held by copies in flight
  // (else FailedPrecondition); a bad config fails like `MakeHostArena`. The
  // message names `store_configure`; nothing changes on failure.
  Status Configure(const HostArenaConfig& config) EXCLUDES(mu_);

  // The current configuration; `*source` (optional) is "default", "env"
  // ($JAXMEM_HOST_ARENA) or "store_configure". `*error` (optional) is the
  // reason $JAXMEM_HOST_ARENA was rejected, "" if it was not.
  HostArenaConfig Config(std::string* source, std::string* error) const
      EXCLUDES(mu_);

  // Looks up the size and dtype of a live entry without removing it.
  bool Peek(uint64_t id, size_t* bytes, uint32_t* dtype_code) const
      EXCLUDES(mu_);

  HostStoreStats Stats() const EXCLUDES(mu_);

  // Frees every entry and drops the arena (see the file comment); returns the
  // number of payload bytes freed.
  uint64_t Clear() EXCLUDES(mu_);

 private:
  struct Entry {
    HostBuffer data;  // empty when bytes == 0
    size_t bytes = 0;
    uint32_t dtype_code = 0;
  };

  std::string UnknownHandleMessage(uint64_t id) const REQUIRES(mu_);
  // Checks entry `id` against a request and erases it into `*out`.
  // InvalidArgument (and the entry is kept) on a mismatch.
  Status EraseChecked(uint64_t id, size_t bytes, uint32_t dtype_code,
                      bool need_dst, Entry* out) REQUIRES(mu_);
  // Reads $JAXMEM_HOST_ARENA on the first call.
  void EnsureConfigLocked() const REQUIRES(mu_);
  // The arena, made on first use. FailedPrecondition when the configuration
  // is unusable.
  Status EnsureArenaLocked(std::shared_ptr<HostArena>* out) REQUIRES(mu_);
  // Folds the current arena's counters into the store's and drops it;
  // returns it so the caller can release it outside mu_.
  std::shared_ptr<HostArena> RetireArenaLocked() REQUIRES(mu_);

  mutable Mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_ GUARDED_BY(mu_);
  const uint64_t first_id_;           // first handle this process ever issued
  uint64_t next_id_ GUARDED_BY(mu_);  // next handle to issue
  uint64_t issued_ GUARDED_BY(mu_) = 0;
  HostStoreStats stats_ GUARDED_BY(mu_);
  // Lazily initialised from the environment (hence mutable: `Stats` and
  // `Config` are const but may be the first use).
  mutable bool config_read_ GUARDED_BY(mu_) = false;
  mutable HostArenaConfig config_ GUARDED_BY(mu_);
  mutable std::string config_source_ GUARDED_BY(mu_) = "default";
  // Why $JAXMEM_HOST_ARENA was rejected ("" if it was not).
  mutable std::string config_error_ GUARDED_BY(mu_);
  // Null until first use / after Clear. The pointer is guarded; the arena
  // locks itself (lock order: store, then arena).
  std::shared_ptr<HostArena> arena_ GUARDED_BY(mu_);
  struct Plan {
    std::unordered_map<int64_t, std::pair<uint64_t, uint64_t>> slots;
    uint64_t footprint = 0;
    std::shared_ptr<HostArena> arena;   // null after Clear until next use
    // `peak_live`: the peak of arenas dropped by `Clear` (the current
    // arena's own peak is read in `PlanStatsOf`).
    uint64_t planned = 0, fallbacks = 0, peak_live = 0;
  };
  std::unordered_map<int64_t, Plan> plans_ GUARDED_BY(mu_);
  uint64_t retired_hits_ GUARDED_BY(mu_) = 0;    // of arenas dropped before
  uint64_t retired_misses_ GUARDED_BY(mu_) = 0;  // of arenas dropped before
};

// A human-readable name for an XLA FFI dtype code ("f32", "bf16", ...).
std::string DtypeName(uint32_t dtype_code);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_HOST_STORE_H_
