// Copyright 2025 The jaxmem Authors.
//
// Host arenas: the allocators that hold offloaded bytes in host memory.
//
// Three implementations of one thread-safe interface, `HostArena`:
//
//   * `VirtualChunkArena` — paper 001 (Hayakawa et al., "Out-of-core training
//     ... adaptive window-based scheduling") §4, "Reducing memory
//     fragmentation with virtual addressing": physical memory is a pool of
//     fixed-size chunks (one `memfd_create` file grown by `ftruncate`); every
//     allocation reserves a fresh contiguous virtual range (`mmap(PROT_NONE)`)
//     and maps `ceil(bytes / chunk)` pool chunks into it with
//     `mmap(MAP_FIXED | MAP_SHARED, memfd, chunk_offset)`. Chunks combine in
//     any order, so there is no external fragmentation; the waste is internal
//     (rounding up to whole chunks, §4 eq. (1): < 1 chunk per allocation).
//     Freed ranges stay mapped for reuse by a request of the same chunk
//     count until their chunks are needed elsewhere (see the class).
//   * `BestFitCachingArena` — the "best-fit with caching" allocator that §4
//     names as the framework default (TensorFlow BFC, PyTorch's caching
//     allocator, NNL): grows by segments obtained from the OS and never
//     returns them; a request takes the smallest free block that fits,
//     splitting it, and a freed block coalesces with free neighbours of the
//     same segment. It suffers external fragmentation (paper 001 Fig. 3(a)).
//   * `PlannedArena` — static offsets from an offline DSA solver (paper 003,
//     SmartPool §III, "Dynamic Storage Allocation"): one buffer of the planned
//     footprint; allocation `id` lives at `base + offset[id]`.
//   * `HeapCachingArena` — the host store's original allocator, kept as the
//     store's "heap" mode: one `posix_memalign` per allocation, freed buffers
//     cached by size (see the class). Not offered by `make_arena`.
//
// Common contract:
//   * Every successful allocation gets an opaque 64-bit handle that is never
//     reused: the arena's tag (unique in the process, assigned from a counter
//     that starts at a random value) in the high bits and a per-arena
//     sequence number that starts at a random value in the low bits. A handle
//     that was freed (stale / double free) or that this arena never issued
//     (foreign: another arena, another process, garbage) is reported as an
//     error status naming the handle and the reason; no call crashes on a bad
//     handle.
//   * Pointers are 64-byte aligned (`kArenaAlignment`). Zero-byte
//     allocations are valid, take no memory and have a null pointer.
//   * All methods are thread-safe (one mutex per arena).
//
// Plugging into the host store (host_store.h): `HostStore` holds one
// `std::shared_ptr<HostArena>`; its Put calls `arena->Allocate(bytes, &a)` and
// copies into `a.ptr` outside the arena's lock (the pointer is stable until
// `Free`); the `HostBuffer` that owns `a` calls `Free(a.handle)` when the
// entry is taken, erased or cleared. The arena never touches payload bytes.

#ifndef JAXMEM_FFI_HOST_ARENA_H_
#define JAXMEM_FFI_HOST_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace jaxmem {

// SplitMix64 finalizer (a bijective 64-bit mix).
uint64_t SplitMix64(uint64_t x);
// 64 random bits from std::random_device mixed with time, pid and an address.
uint64_t RandomBits();

// Alignment of every pointer handed out by an arena.
inline constexpr size_t kArenaAlignment = 64;

enum class ArenaMode { kVirtual, kBestFit, kPlanned, kHeap };

// "virtual", "best_fit", "planned", "heap".
const char* ArenaModeName(ArenaMode mode);

// Why an arena call failed.
enum class ArenaCode {
  kOk = 0,
  kInvalidArgument,  // bad constructor argument, bad offset/length, ...
  kStaleHandle,      // issued by this arena but already freed (read/write)
  kDoubleFree,       // issued by this arena but already freed (free)
  kForeignHandle,    // never issued by this arena
  kOutOfMemory,      // capacity reached, or the OS refused memory/mappings
  kPlanMismatch,     // planned mode: unknown id, wrong size, id live, overlap
  kUnavailable,      // the mechanism is missing (e.g. no memfd_create)
  kUnsupported,      // the call does not apply to this mode
};

// A status: ok, or a code plus a message that says what was wrong.
class ArenaStatus {
 public:
  ArenaStatus() = default;
  ArenaStatus(ArenaCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static ArenaStatus Ok() { return ArenaStatus(); }

  bool ok() const { return code_ == ArenaCode::kOk; }
  ArenaCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  ArenaCode code_ = ArenaCode::kOk;
  std::string message_;
};

// One live allocation.
struct Allocation {
  uint64_t handle = 0;
  void* ptr = nullptr;        // null iff bytes == 0
  size_t bytes = 0;           // requested size
  size_t reserved_bytes = 0;  // size after the arena's rounding
  int64_t id = -1;            // planned mode: the plan id; -1 otherwise
};

// A snapshot of an arena's counters. "Live" counts memory handed out now.
//
// Fragmentation definitions (the same for all modes):
//   internal_fragmentation = 1 - requested_live_bytes / live_bytes
//       (bytes lost to rounding, as a share of the live reserved bytes;
//       paper 001 §4 eq. (1)); 0 when nothing is live.
//   external_fragmentation = 1 - largest_free_block_bytes / free_bytes
//       with free_bytes = footprint_bytes - live_bytes: the share of cached
//       free memory that a single request of all the free bytes could not
//       use because it is split into pieces; 0 when nothing is free. For
//       virtual chunks every free chunk can serve any request (chunks combine
//       in any order), so largest_free_block_bytes = free_bytes and it is 0.
struct ArenaStats {
  uint64_t footprint_bytes = 0;       // memory obtained from the OS (held)
  uint64_t peak_footprint_bytes = 0;  // max footprint_bytes
  uint64_t capacity_bytes = 0;        // footprint limit (0: unbounded)
  uint64_t live_bytes = 0;            // reserved bytes of live allocations
  uint64_t peak_live_bytes = 0;       // max live_bytes
  uint64_t requested_live_bytes = 0;  // requested bytes of live allocations
  uint64_t peak_requested_bytes = 0;  // max requested_live_bytes (the load)
  uint64_t live_allocations = 0;
  uint64_t free_bytes = 0;                // footprint - live
  uint64_t largest_free_block_bytes = 0;  // see above
  double internal_fragmentation = 0.0;
  double external_fragmentation = 0.0;
  uint64_t allocs = 0;   // successful allocations
  uint64_t frees = 0;    // successful frees
  uint64_t errors = 0;   // failed calls of any kind
  uint64_t grows = 0;    // times the footprint grew (memory from the OS);
                         // allocs - grows were served from cached memory
  uint64_t map_calls = 0;     // virtual: mmap calls (reservations + chunks)
  uint64_t unmap_calls = 0;   // virtual: munmap calls
  uint64_t segments = 0;      // best-fit: segments obtained from the OS
  uint64_t chunk_bytes = 0;   // virtual: physical chunk size
  uint64_t pool_chunks = 0;   // virtual: physical chunks in the pool
  uint64_t free_chunks = 0;   // virtual: pool chunks not mapped now
  uint64_t segment_bytes = 0; // best-fit: minimum segment size
};

// The allocator interface. Thread-safe.
class HostArena {
 public:
  virtual ~HostArena() = default;

  virtual ArenaMode mode() const = 0;

  // Allocates `bytes` bytes (64-byte aligned). Not for planned arenas.
  virtual ArenaStatus Allocate(size_t bytes, Allocation* out) = 0;

  // Planned arenas: allocates plan slot `id`, which must be planned for
  // exactly `bytes` bytes and not be live. Other modes: kUnsupported.
  virtual ArenaStatus AllocateId(int64_t id, size_t bytes,
                                 Allocation* out) = 0;

  // Frees a live allocation. Stale/double/foreign handles are errors.
  virtual ArenaStatus Free(uint64_t handle) = 0;

  // Describes a live allocation. The pointer stays valid until `Free`.
  virtual ArenaStatus Lookup(uint64_t handle, Allocation* out) const = 0;

  // Copies `n` bytes into / out of a live allocation at `offset`, under the
  // arena's lock (safe against a concurrent `Free` of the same handle).
  virtual ArenaStatus Write(uint64_t handle, size_t offset, const void* src,
                            size_t n) = 0;
  virtual ArenaStatus Read(uint64_t handle, size_t offset, void* dst,
                           size_t n) const = 0;

  // Frees every live allocation (footprint is kept cached). Returns the
  // number of allocations freed.
  virtual uint64_t FreeAll() = 0;

  virtual ArenaStats Stats() const = 0;
};

// Shared machinery: handle issue/validation, the live table, counters and
// locking. Subclasses implement the `*Locked` hooks, called with `mu_` held.
class LockedArena : public HostArena {
 public:
  LockedArena();
  LockedArena(const LockedArena&) = delete;
  LockedArena& operator=(const LockedArena&) = delete;

  ArenaStatus Allocate(size_t bytes, Allocation* out) override;
  ArenaStatus AllocateId(int64_t id, size_t bytes, Allocation* out) override;
  ArenaStatus Free(uint64_t handle) override;
  ArenaStatus Lookup(uint64_t handle, Allocation* out) const override;
  ArenaStatus Write(uint64_t handle, size_t offset, const void* src,
                    size_t n) override;
  ArenaStatus Read(uint64_t handle, size_t offset, void* dst,
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
  virtual ArenaStatus AllocateLocked(size_t bytes, int64_t id,
                                     Block* block) = 0;
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
  ArenaStatus HandleErrorLocked(uint64_t handle, const char* verb,
                                bool is_free) const;
  ArenaStatus AllocateCommon(size_t bytes, int64_t id, Allocation* out);

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

// Paper 001 §4: fixed-size physical chunks mapped into contiguous virtual
// ranges. Footprint = pool size (chunks ever created; never shrinks).
//
// A freed range stays mapped ("kept") and serves the next request of the same
// chunk count without any system call; kept chunks count as free and are
// unmapped, oldest first, before the pool would grow, so footprint and
// fragmentation are those of unmapping at once. With `populate`, fresh
// mappings are read-populated outside the lock (PopulateUnlocked in the .cc).
class VirtualChunkArena : public LockedArena {
 public:
  // `chunk_bytes` must be a positive multiple of the page size;
  // `capacity_bytes` caps the physical pool (0: unbounded). Fails with
  // kUnavailable when memfd_create is missing (non-Linux or old kernels).
  // `populate`: pre-fault every fresh mapping (outside the lock) for callers
  // that write the whole allocation at once (the host store); it commits
  // the pages, so replays that never touch their memory leave it off.
  static ArenaStatus Create(size_t chunk_bytes, size_t capacity_bytes,
                            std::unique_ptr<HostArena>* out,
                            bool populate = false);
  ~VirtualChunkArena() override;

  ArenaMode mode() const override { return ArenaMode::kVirtual; }

 protected:
  ArenaStatus AllocateLocked(size_t bytes, int64_t id, Block* block) override;
  void FreeLocked(const Block& block) override;
  void FillStatsLocked(ArenaStats* stats) const override;
  void PopulateUnlocked(void* ptr, size_t bytes) override;

 private:
  VirtualChunkArena(int fd, size_t chunk_bytes, size_t capacity_bytes,
                    bool populate);
  void UnmapKeptLocked(uint64_t seq);  // unmaps a kept range, frees chunks

  int fd_;
  size_t chunk_bytes_;
  size_t capacity_chunks_;  // 0: unbounded
  bool populate_;
  uint64_t pool_chunks_ = 0;
  std::set<uint64_t> free_chunks_;  // lowest first: runs map in one call
  // A live virtual range and the physical chunks mapped into it.
  struct Range {
    void* base = nullptr;
    size_t span = 0;
    std::vector<uint64_t> chunks;
  };
  std::unordered_map<uint64_t, Range> ranges_;  // by cookie
  uint64_t next_cookie_ = 1;
  std::map<uint64_t, Range> kept_;  // freed, still mapped; by free order
  std::multimap<uint64_t, uint64_t> kept_by_chunks_;  // chunk count -> seq
  uint64_t kept_chunks_ = 0;
  uint64_t next_kept_seq_ = 0;
  uint64_t map_calls_ = 0;
  uint64_t unmap_calls_ = 0;
};

// The framework-default baseline of paper 001 §4: best-fit with caching.
class BestFitCachingArena : public LockedArena {
 public:
  // A new segment has max(segment_bytes, request rounded up to pages)
  // bytes; `capacity_bytes` caps the sum of segments (0: unbounded).
  static ArenaStatus Create(size_t segment_bytes, size_t capacity_bytes,
                            std::unique_ptr<HostArena>* out);
  ~BestFitCachingArena() override;

  ArenaMode mode() const override { return ArenaMode::kBestFit; }

 protected:
  ArenaStatus AllocateLocked(size_t bytes, int64_t id, Block* block) override;
  void FreeLocked(const Block& block) override;
  void FillStatsLocked(ArenaStats* stats) const override;

 private:
  struct Piece {
    size_t size = 0;
    uint32_t segment = 0;
    bool free = true;
  };
  BestFitCachingArena(size_t segment_bytes, size_t capacity_bytes);
  void InsertFree(uintptr_t addr, size_t size);
  void EraseFree(uintptr_t addr, size_t size);

  size_t segment_bytes_;
  size_t capacity_bytes_;
  std::vector<std::pair<void*, size_t>> segments_;
  uint64_t footprint_ = 0;
  std::map<uintptr_t, Piece> pieces_;  // every block, by address
  std::set<std::pair<size_t, uintptr_t>> free_;  // (size, addr), best fit
};

// Paper 003 (SmartPool) §III: offsets from an offline DSA solver.
class PlannedArena : public LockedArena {
 public:
  struct Slot {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  // Every slot must be 64-byte aligned and lie inside `footprint_bytes`.
  static ArenaStatus Create(std::unordered_map<int64_t, Slot> slots,
                            uint64_t footprint_bytes,
                            std::unique_ptr<HostArena>* out);
  ~PlannedArena() override;

  ArenaMode mode() const override { return ArenaMode::kPlanned; }

  // The planned slot of `id`; false if `id` is not in the plan.
  bool SlotOf(int64_t id, Slot* slot) const;

 protected:
  ArenaStatus AllocateLocked(size_t bytes, int64_t id, Block* block) override;
  void FreeLocked(const Block& block) override;
  void FillStatsLocked(ArenaStats* stats) const override;

 private:
  PlannedArena(std::unordered_map<int64_t, Slot> slots, void* base,
               uint64_t footprint_bytes);

  std::unordered_map<int64_t, Slot> slots_;
  void* base_;
  uint64_t footprint_;
  std::set<int64_t> live_ids_;
  std::map<uint64_t, uint64_t> live_ranges_;  // offset -> end, nonempty only
};

// The host store's original allocator (its "heap" mode): every allocation is
// a `posix_memalign` of the size rounded up to 4 KiB, and freed buffers are
// kept for reuse by a later request of the same rounded size (best fit
// within 1/8). On the VMs we measured, first-touch page faults of a fresh
// 16 MiB allocation cost 3-10x the memcpy itself, so a training loop that
// offloads the same sizes every step must reuse warm memory. The cache holds
// at most the high-water mark of live bytes (what the workload needed at once
// anyway) and at most `cache_cap_bytes`; a freed buffer beyond that goes back
// to the system. Footprint = live + cached buffers; it shrinks on such frees.
// Unlike best-fit, buffers are never split or merged: a cached buffer serves
// only requests of about its own size (the size-keyed reuse that paper 001 §4
// contrasts with chunk mapping).
class HeapCachingArena : public LockedArena {
 public:
  // `capacity_bytes` caps the footprint (0: unbounded; cached buffers are
  // released before a request is refused).
  static ArenaStatus Create(uint64_t cache_cap_bytes, size_t capacity_bytes,
                            std::unique_ptr<HostArena>* out);
  ~HeapCachingArena() override;

  ArenaMode mode() const override { return ArenaMode::kHeap; }

 protected:
  ArenaStatus AllocateLocked(size_t bytes, int64_t id, Block* block) override;
  void FreeLocked(const Block& block) override;
  void FillStatsLocked(ArenaStats* stats) const override;

 private:
  HeapCachingArena(uint64_t cache_cap_bytes, size_t capacity_bytes);
  void ReleaseCacheLocked();

  uint64_t cache_cap_;
  size_t capacity_bytes_;
  std::multimap<size_t, void*> cached_;     // rounded size -> buffer
  std::unordered_map<void*, size_t> in_use_;  // handed out: buffer -> size
  uint64_t cached_bytes_ = 0;
  uint64_t live_rounded_ = 0;
  uint64_t high_water_ = 0;  // max live_rounded_
  uint64_t footprint_ = 0;   // live + cached
};

// Options of the C++ stress driver.
struct StressOptions {
  uint64_t n_ops = 1000000;   // alloc + free operations, over all threads
  uint64_t seed = 0;
  size_t max_bytes = 65536;   // sizes are log-uniform in [1, max_bytes]
  size_t max_live = 256;      // per thread: at most this many live blocks
  int threads = 1;
  uint64_t bad_handle_every = 997;  // probe a stale/foreign handle this often
};

struct StressResult {
  uint64_t ops = 0;
  uint64_t allocs = 0;
  uint64_t frees = 0;
  uint64_t corrupted = 0;        // allocations whose checksum failed on free
  uint64_t alloc_failures = 0;   // Allocate errors (e.g. out of memory)
  uint64_t free_failures = 0;    // Free errors on valid handles (bugs)
  uint64_t bad_handle_probes = 0;    // stale/double/foreign frees tried
  uint64_t bad_handle_accepted = 0;  // of those, wrongly accepted (bugs)
  uint64_t bytes_written = 0;
  double seconds = 0.0;
  std::string first_error;
};

// Runs random alloc/free operations on `arena`: each allocation is filled
// with a pattern derived from (handle, seed) and verified before it is
// freed; everything is freed at the end. Dynamic modes only.
StressResult RunStress(HostArena* arena, const StressOptions& options);

// Formats a handle as 0x%016x (shared with the host store's format).
std::string FormatArenaHandle(uint64_t handle);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_HOST_ARENA_H_
