// Copyright 2025 The jaxmem Authors.

#include "ids.h"

#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <random>

namespace jaxmem {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Seeds for handle and ticket counters that must not repeat across processes
// (a handle from another process is reported, not aliased).
uint64_t RandomBits() {
  uint64_t seed = 0;
  try {
    std::random_device rd;
    seed = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  } catch (...) {
    // Fall through to the time/pid mix below.
  }
  seed ^= static_cast<uint64_t>(
      std::chrono::high_resolution_clock::now().time_since_epoch().count());
  seed ^= static_cast<uint64_t>(::getpid()) << 40;
  seed ^= reinterpret_cast<uintptr_t>(&seed);
  return SplitMix64(seed);
}

// 62 random bits, never 0, and the counter cannot wrap in any realistic
// process lifetime.
uint64_t RandomFirstId() {
  uint64_t mixed = RandomBits();
  return (mixed & 0x3fffffffffffffffULL) | 0x4000000000000000ULL;
}

std::string FormatHandle(uint64_t id) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, id);
  return buf;
}

}  // namespace jaxmem
