// Copyright 2025 The jaxmem Authors.
//
// Host arenas: the allocators that hold offloaded bytes in host memory.
//
// Four implementations of one thread-safe interface, `HostArena`, each in its
// own file beside this one:
//
//   * `VirtualChunkArena` (virtual_chunk_arena.h) — Hayakawa & Narihira,
//     *Out-of-core training for extremely large-scale neural networks with
//     adaptive window-based scheduling*, §4, "Reducing memory fragmentation
//     with virtual addressing": physical memory is a pool of fixed-size
//     chunks (one `memfd_create` file grown by `ftruncate`); every allocation
//     reserves a fresh contiguous virtual range (`mmap(PROT_NONE)`) and maps
//     `ceil(bytes / chunk)` pool chunks into it with
//     `mmap(MAP_FIXED | MAP_SHARED, memfd, chunk_offset)`. Chunks combine in
//     any order, so there is no external fragmentation; the waste is internal
//     (rounding up to whole chunks, §4 eq. (1): < 1 chunk per allocation).
//     Freed ranges stay mapped for reuse by a request of the same chunk
//     count until their chunks are needed elsewhere (see the class).
//   * `BestFitCachingArena` (best_fit_arena.h) — the "best-fit with caching"
//     allocator that the same §4 names as the framework default (TensorFlow
//     BFC, PyTorch's caching allocator, NNL): grows by segments obtained from
//     the OS and never returns them; a request takes the smallest free block
//     that fits, splitting it, and a freed block coalesces with free
//     neighbours of the same segment. It suffers external fragmentation (the
//     same paper's Fig. 3(a)).
//   * `PlannedArena` (planned_arena.h) — static offsets from an offline DSA
//     solver (Zhang et al., *Efficient Memory Management for GPU-based Deep
//     Learning Systems*, §III, SmartPool): one buffer of the planned
//     footprint; allocation `id` lives at `base + offset[id]`.
//   * `HeapCachingArena` (heap_arena.h) — the host store's original
//     allocator, kept as the store's "heap" mode: one `posix_memalign` per
//     allocation, freed buffers cached by size (see the class). Not offered
//     by `make_arena`.
//
// `LockedArena` (locked_arena.h) is their shared base: handles, the live
// table, counters and the lock. `RunStress` (stress.h) is the C++ stress
// driver; the Python bindings are in bindings/arena_bindings.cc.
//
// Common contract:
//   * Every successful allocation gets an opaque 64-bit handle that is never
//     reused: the arena's tag (unique in the process, assigned from a counter
//     that starts at a random value) in the high bits and a per-arena
//     sequence number that starts at a random value in the low bits. A handle
//     that was freed (stale / double free) or that this arena never issued
//     (foreign: another arena, another process, garbage) is reported as an
//     error status naming the handle and the reason; no call crashes on a bad
//     handle. Such handles are InvalidArgument (status.h); a refused
//     allocation (capacity or the OS) is ResourceExhausted.
//   * Pointers are 64-byte aligned (`kArenaAlignment`). Zero-byte
//     allocations are valid, take no memory and have a null pointer.
//   * All methods are thread-safe (one mutex per arena).
//
// Plugging into the host store (host_store.h): `HostStore` holds one
// `std::shared_ptr<HostArena>`; its Put calls `arena->Allocate(bytes, &a)` and
// copies into `a.ptr` outside the arena's lock (the pointer is stable until
// `Free`); the `HostBuffer` that owns `a` calls `Free(a.handle)` when the
// entry is taken, erased or cleared. The arena never touches payload bytes.

#ifndef JAXMEM_FFI_ARENA_HOST_ARENA_H_
#define JAXMEM_FFI_ARENA_HOST_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"

namespace jaxmem {

// Alignment of every pointer handed out by an arena.
inline constexpr size_t kArenaAlignment = 64;

enum class ArenaMode { kVirtual, kBestFit, kPlanned, kHeap };

// "virtual", "best_fit", "planned", "heap".
inline const char* ArenaModeName(ArenaMode mode) {
  switch (mode) {
    case ArenaMode::kVirtual: return "virtual";
    case ArenaMode::kBestFit: return "best_fit";
    case ArenaMode::kPlanned: return "planned";
    case ArenaMode::kHeap: return "heap";
  }
  return "unknown";
}

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
//       Hayakawa & Narihira §4 eq. (1)); 0 when nothing is live.
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
  virtual Status Allocate(size_t bytes, Allocation* out) = 0;

  // Planned arenas: allocates plan slot `id`, which must be planned for
  // exactly `bytes` bytes and not be live. Other modes: Unimplemented.
  virtual Status AllocateId(int64_t id, size_t bytes, Allocation* out) = 0;

  // Frees a live allocation. Stale/double/foreign handles are errors.
  virtual Status Free(uint64_t handle) = 0;

  // Describes a live allocation. The pointer stays valid until `Free`.
  virtual Status Lookup(uint64_t handle, Allocation* out) const = 0;

  // Copies `n` bytes into / out of a live allocation at `offset`, under the
  // arena's lock (safe against a concurrent `Free` of the same handle).
  virtual Status Write(uint64_t handle, size_t offset, const void* src,
                       size_t n) = 0;
  virtual Status Read(uint64_t handle, size_t offset, void* dst,
                      size_t n) const = 0;

  // Frees every live allocation (footprint is kept cached). Returns the
  // number of allocations freed.
  virtual uint64_t FreeAll() = 0;

  virtual ArenaStats Stats() const = 0;
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_HOST_ARENA_H_
