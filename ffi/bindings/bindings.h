// Copyright 2025 The jaxmem Authors.
//
// The nanobind bindings of `jaxmem._native`, one Register...Bindings per
// concept; module.cc calls them all.

#ifndef JAXMEM_FFI_BINDINGS_BINDINGS_H_
#define JAXMEM_FFI_BINDINGS_BINDINGS_H_

#include <cstdint>
#include <vector>

#include "arena/host_arena.h"
#include "nanobind/nanobind.h"
#include "status.h"

namespace jaxmem {

// store_stats, store_clear, store_configure, store_config, store_put,
// store_take, ALIGNMENT (store_bindings.cc).
void RegisterStoreBindings(nanobind::module_& m);

// copy_stats, copy_drain, copy_clear, set_copy_threads, set_copy_cpus
// (copy_engine_bindings.cc).
void RegisterCopyEngineBindings(nanobind::module_& m);

// HostArena, make_arena, arena_stress, ARENA_ALIGNMENT (arena_bindings.cc).
void RegisterArenaBindings(nanobind::module_& m);

// dsa_solve, dsa_check, dsa_max_load (dsa_bindings.cc).
void RegisterDsaBindings(nanobind::module_& m);

// estimate_lifetimes: the lifetime estimate's XLA model (lifetimes_bindings.cc).
void RegisterLifetimesBindings(nanobind::module_& m);

// cudart_load, cudart_status, cudart_probe: the CUDA runtime loader
// (cuda/cudart_loader.h) where the CUDA handlers are built, and stand-ins
// that say so where they are not (cuda_bindings.cc).
void RegisterCudaBindings(nanobind::module_& m);

// Raises `status` (not ok) as a Python exception:
//   InvalidArgument, FailedPrecondition -> ValueError
//   ResourceExhausted                   -> MemoryError
//   Unavailable                         -> OSError
//   Unimplemented                       -> TypeError
//   Internal                            -> RuntimeError
// `type` overrides the table for functions whose documented contract names
// one exception for every failure (store_put, store_configure: ValueError).
[[noreturn]] void RaisePyError(const Status& status, PyObject* type = nullptr);

// `values` as a 1-D int64 numpy array that owns them (numpy_arrays.cc).
nanobind::object Int64Numpy(std::vector<int64_t> values);

// An arena's stats as a dict: HostArena.stats() and store_stats()["arena"]
// (arena_bindings.cc).
nanobind::dict ArenaStatsDict(const ArenaStats& s, const char* mode);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_BINDINGS_BINDINGS_H_
