// Copyright 2025 The jaxmem Authors.
//
// Small helpers shared by the arena implementations (not part of the arena
// interface).

#ifndef JAXMEM_FFI_ARENA_ARENA_UTIL_H_
#define JAXMEM_FFI_ARENA_ARENA_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "arena/host_arena.h"

namespace jaxmem {
namespace arena_internal {

// The system page size (4096 if sysconf does not say).
size_t PageSize();

// Rounds up to a multiple of `to` (a power of two or not); false on overflow.
bool RoundUp(size_t x, size_t to, size_t* out);

// "123 bytes", for messages.
std::string Bytes(uint64_t n);

// "Cannot allocate memory (errno 12)", for messages.
std::string ErrnoText(int err);

}  // namespace arena_internal
}  // namespace jaxmem

#endif  // JAXMEM_FFI_ARENA_ARENA_UTIL_H_
