// Copyright 2025 The jaxmem Authors.
//
// The C++ stress driver of the host arenas (Python: `HostArena.stress`,
// `arena_stress`).

#ifndef JAXMEM_FFI_ARENA_STRESS_H_
#define JAXMEM_FFI_ARENA_STRESS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "arena/host_arena.h"

namespace jaxmem {

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

}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_STRESS_H_
