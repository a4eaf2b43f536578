// Copyright 2025 The jaxmem Authors.
//
// The arena stress driver (see stress.h).

#include "arena/stress.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "arena/arena_util.h"
#include "ids.h"

namespace jaxmem {

using arena_internal::Bytes;

namespace {

// The fill pattern of one allocation, word by word.
inline uint64_t PatternWord(uint64_t key, uint64_t k) {
  return SplitMix64(key ^ (k * 0xd1b54a32d192ed03ULL));
}

void Fill(void* p, size_t n, uint64_t key) {
  char* c = static_cast<char*>(p);
  const size_t words = n / 8;
  for (size_t k = 0; k < words; ++k) {
    const uint64_t w = PatternWord(key, k);
    std::memcpy(c + 8 * k, &w, 8);
  }
  const uint64_t tail = PatternWord(key, words);
  std::memcpy(c + 8 * words, &tail, n - 8 * words);
}

bool Verify(const void* p, size_t n, uint64_t key) {
  const char* c = static_cast<const char*>(p);
  const size_t words = n / 8;
  for (size_t k = 0; k < words; ++k) {
    uint64_t w;
    std::memcpy(&w, c + 8 * k, 8);
    if (w != PatternWord(key, k)) return false;
  }
  const uint64_t tail = PatternWord(key, words);
  return std::memcmp(c + 8 * words, &tail, n - 8 * words) == 0;
}

struct Live {
  Allocation a;
  uint64_t key;
};

void StressThread(HostArena* arena, const StressOptions& opt, int t,
                  uint64_t n_ops, StressResult* r) {
  std::mt19937_64 rng(SplitMix64(opt.seed * 0x9e3779b97f4a7c15ULL + t + 1));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double log_max = std::log(static_cast<double>(
      std::max<size_t>(opt.max_bytes, 1)) + 1.0);
  std::vector<Live> live;
  live.reserve(opt.max_live + 1);
  uint64_t last_freed = 0;
  auto note = [r](const std::string& msg) {
    if (r->first_error.empty()) r->first_error = msg;
  };
  auto free_one = [&](size_t i) {
    Live l = live[i];
    live[i] = live.back();
    live.pop_back();
    if (l.a.bytes > 0 && !Verify(l.a.ptr, l.a.bytes, l.key)) {
      ++r->corrupted;
      note("checksum mismatch in handle " + FormatHandle(l.a.handle) +
           " (" + Bytes(l.a.bytes) + ")");
    }
    Status st = arena->Free(l.a.handle);
    if (!st.ok()) {
      ++r->free_failures;
      note(st.message());
    } else {
      ++r->frees;
      last_freed = l.a.handle;
    }
  };
  for (uint64_t op = 0; op < n_ops; ++op) {
    ++r->ops;
    const bool can_alloc = live.size() < opt.max_live;
    if (live.empty() || (can_alloc && unit(rng) < 0.5)) {
      size_t bytes = 0;
      if (rng() % 1000 != 0) {  // 1 in 1000 allocations is zero-byte
        bytes = static_cast<size_t>(std::exp(unit(rng) * log_max));
        bytes = std::clamp<size_t>(bytes, 1,
                                   std::max<size_t>(opt.max_bytes, 1));
      }
      Live l;
      Status st = arena->Allocate(bytes, &l.a);
      if (!st.ok()) {
        ++r->alloc_failures;
        note(st.message());
        continue;
      }
      ++r->allocs;
      l.key = l.a.handle ^ (opt.seed * 0xbf58476d1ce4e5b9ULL);
      if (bytes > 0) Fill(l.a.ptr, bytes, l.key);
      r->bytes_written += bytes;
      live.push_back(l);
    } else {
      free_one(rng() % live.size());
    }
    if (opt.bad_handle_every != 0 && op % opt.bad_handle_every == 0 &&
        last_freed != 0) {
      // A double free, a stale read and a foreign handle must all fail.
      char byte;
      r->bad_handle_probes += 3;
      if (arena->Free(last_freed).ok()) ++r->bad_handle_accepted;
      if (arena->Read(last_freed, 0, &byte, 1).ok()) ++r->bad_handle_accepted;
      if (arena->Free(last_freed | (uint64_t{1} << 63)).ok()) {
        ++r->bad_handle_accepted;
      }
    }
  }
  while (!live.empty()) free_one(live.size() - 1);
}

}  // namespace

StressResult RunStress(HostArena* arena, const StressOptions& options) {
  StressResult total;
  if (arena->mode() == ArenaMode::kPlanned) {
    total.first_error = "the stress driver needs a dynamic (virtual or "
                        "best_fit) arena";
    return total;
  }
  const int threads = std::max(1, options.threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<StressResult> parts(threads);
  if (threads == 1) {
    StressThread(arena, options, 0, options.n_ops, &parts[0]);
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      const uint64_t n = options.n_ops / threads +
                         (static_cast<uint64_t>(t) < options.n_ops % threads);
      pool.emplace_back(StressThread, arena, std::cref(options), t, n,
                        &parts[t]);
    }
    for (auto& th : pool) th.join();
  }
  for (const StressResult& p : parts) {
    total.ops += p.ops;
    total.allocs += p.allocs;
    total.frees += p.frees;
    total.corrupted += p.corrupted;
    total.alloc_failures += p.alloc_failures;
    total.free_failures += p.free_failures;
    total.bad_handle_probes += p.bad_handle_probes;
    total.bad_handle_accepted += p.bad_handle_accepted;
    total.bytes_written += p.bytes_written;
    if (total.first_error.empty()) total.first_error = p.first_error;
  }
  total.seconds = std::chrono::duration<double>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  return total;
}

}  // namespace jaxmem
