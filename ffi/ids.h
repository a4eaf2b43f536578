// Copyright 2025 The jaxmem Authors.
//
// Never-reused 64-bit ids: the seeds of the host store's handles, the copy
// engines' tickets and the arenas' handles, and how messages print them.
//
// Every counter starts at a random value so that an id from another process
// (or another counter) is recognised as foreign instead of aliasing a live one.

#ifndef JAXMEM_FFI_IDS_H_
#define JAXMEM_FFI_IDS_H_

#include <cstdint>
#include <string>

namespace jaxmem {

// SplitMix64 finalizer (a bijective 64-bit mix).
uint64_t SplitMix64(uint64_t x);

// 64 random bits from std::random_device mixed with time, pid and an address.
uint64_t RandomBits();

// A random 64-bit id in [2^62, 2^63) to start a never-reused counter at (host
// store handles, copy tickets): ids from another process or counter are
// recognised as foreign, not confused with live ones.
uint64_t RandomFirstId();

// Formats a handle or ticket as 0x%016x.
std::string FormatHandle(uint64_t id);

}  // namespace jaxmem

#endif  // JAXMEM_FFI_IDS_H_
