// Copyright 2025 The jaxmem Authors.

#include "host_store.h"

#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <utility>

namespace jaxmem {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void* AlignedAlloc(size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, kHostStoreAlignment, bytes) != 0) return nullptr;
  return p;
}

constexpr size_t kCachePage = 4096;

size_t RoundUp(size_t bytes) {
  return (bytes + kCachePage - 1) / kCachePage * kCachePage;
}

uint64_t CacheCapFromEnv() {
  const char* env = std::getenv("JAXMEM_HOST_CACHE_BYTES");
  if (env == nullptr || *env == '\0') return 8ULL << 30;
  char* end = nullptr;
  unsigned long long n = std::strtoull(env, &end, 10);
  return end == env ? (8ULL << 30) : static_cast<uint64_t>(n);
}

// Freed heap buffers by rounded size. See HostBuffer in host_store.h.
class BufferCache {
 public:
  static BufferCache& Global() {
    static BufferCache* cache = new BufferCache();  // leaked like the store
    return *cache;
  }

  void* Take(size_t rounded) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(rounded);
      if (it != free_.end() && it->first - rounded <= rounded / 8) {
        void* p = it->second.first;
        size_t size = it->first;
        free_.erase(it);
        cached_ -= size;
        ++hits_;
        in_use_[p] = size;
        return p;
      }
      ++misses_;
    }
    void* p = AlignedAlloc(rounded);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_[p] = rounded;
    }
    return p;
  }

  void Give(void* p) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = in_use_.find(p);
    size_t size = it == in_use_.end() ? 0 : it->second;
    if (it != in_use_.end()) in_use_.erase(it);
    // Keep it if the cache stays within the high-water mark of live bytes
    // (what the workload needed at once anyway) and the configured cap.
    if (size > 0 && cached_ + size <= cap_ && cached_ + size <= high_water_) {
      free_.emplace(size, std::make_pair(p, ++seq_));
      cached_ += size;
      return;
    }
    lock.unlock();
    std::free(p);
  }

  void NoteLive(uint64_t live_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_bytes > high_water_) high_water_ = live_bytes;
  }

  uint64_t Trim() {
    std::multimap<size_t, std::pair<void*, uint64_t>> doomed;
    uint64_t freed = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      doomed.swap(free_);
      freed = cached_;
      cached_ = 0;
      high_water_ = 0;
    }
    for (auto& [size, entry] : doomed) std::free(entry.first);
    return freed;
  }

  void Stats(HostStoreStats* s) {
    std::lock_guard<std::mutex> lock(mu_);
    s->cached_bytes = cached_;
    s->cache_hits = hits_;
    s->cache_misses = misses_;
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, std::pair<void*, uint64_t>> free_;
  std::unordered_map<void*, size_t> in_use_;
  uint64_t cached_ = 0;
  uint64_t high_water_ = 0;
  uint64_t cap_ = CacheCapFromEnv();
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
  uint64_t seq_ = 0;
};

void CachedFree(void* p, size_t /*bytes*/) { BufferCache::Global().Give(p); }

}  // namespace

// 62 random bits, never 0, and the counter cannot wrap in any realistic
// process lifetime.
uint64_t RandomFirstId() {
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
  uint64_t mixed = SplitMix64(seed);
  return (mixed & 0x3fffffffffffffffULL) | 0x4000000000000000ULL;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    free_ = std::exchange(other.free_, nullptr);
    wait_ready_ = std::move(other.wait_ready_);
    other.wait_ready_ = nullptr;
  }
  return *this;
}

void HostBuffer::Reset() {
  // A buffer still being written by a copy stream must not be freed under it.
  WaitReady();
  if (data_ != nullptr && free_ != nullptr) free_(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
  free_ = nullptr;
}

HostBuffer HostBuffer::Allocate(size_t bytes) {
  if (bytes == 0) return HostBuffer();
  void* p = BufferCache::Global().Take(RoundUp(bytes));
  if (p == nullptr) return HostBuffer();
  return HostBuffer(p, bytes, &CachedFree);
}

uint64_t HostBuffer::TrimCache() { return BufferCache::Global().Trim(); }

std::string FormatHandle(uint64_t id) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, id);
  return buf;
}

std::string DtypeName(uint32_t code) {
  // Codes of XLA_FFI_DataType (xla/ffi/api/c_api.h).
  switch (code) {
    case 0: return "invalid";
    case 1: return "bool";
    case 2: return "s8";
    case 3: return "s16";
    case 4: return "s32";
    case 5: return "s64";
    case 6: return "u8";
    case 7: return "u16";
    case 8: return "u32";
    case 9: return "u64";
    case 10: return "f16";
    case 11: return "f32";
    case 12: return "f64";
    case 15: return "c64";
    case 16: return "bf16";
    case 17: return "token";
    case 18: return "c128";
    case 19: return "f8e5m2";
    case 20: return "f8e4m3fn";
    case 21: return "s4";
    case 22: return "u4";
    case 23: return "f8e4m3b11fnuz";
    case 24: return "f8e5m2fnuz";
    case 25: return "f8e4m3fnuz";
    case 26: return "s2";
    case 27: return "u2";
    case 28: return "f8e4m3";
    case 29: return "f8e3m4";
    case 30: return "s1";
    case 31: return "u1";
    case 32: return "f4e2m1fn";
    case 33: return "f8e8m0fnu";
    default: return "dtype#" + std::to_string(code);
  }
}

HostStore& HostStore::Global() {
  // Leaked on purpose: it must outlive every executable that may still run a
  // handler during interpreter shutdown.
  static HostStore* store = new HostStore();
  return *store;
}

HostStore::HostStore() : first_id_(RandomFirstId()), next_id_(first_id_) {}

std::string HostStore::Put(const void* data, size_t bytes, uint32_t dtype_code,
                           uint64_t* id) {
  // Allocate and copy outside the lock so that concurrent puts overlap.
  Entry entry;
  entry.bytes = bytes;
  entry.dtype_code = dtype_code;
  if (bytes > 0) {
    if (data == nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.total_errors;
      return "source buffer is null but has " + std::to_string(bytes) +
             " bytes";
    }
    entry.data = HostBuffer::Allocate(bytes);
    if (!entry.data.ok(bytes)) {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.total_errors;
      return "out of host memory allocating " + std::to_string(bytes) +
             " bytes (host store holds " + std::to_string(stats_.live_bytes) +
             " bytes in " + std::to_string(stats_.live_entries) + " entries)";
    }
    std::memcpy(entry.data.data(), data, bytes);
  }
  return Insert(std::move(entry.data), bytes, dtype_code, id);
}

std::string HostStore::UnknownHandleMessage(uint64_t id) const {
  std::string h = FormatHandle(id);
  if (id - first_id_ < issued_) {
    return "handle " + h +
           " is not in the host store: it was issued by this process but "
           "was already fetched or cleared (a handle can be fetched once)";
  }
  return "handle " + h +
         " is not in the host store: it was never issued by this process "
         "(a handle from another process, a stale handle, or garbage)";
}

std::string HostStore::EraseChecked(uint64_t id, size_t bytes,
                                    uint32_t dtype_code, bool need_dst,
                                    Entry* out) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    ++stats_.total_errors;
    return UnknownHandleMessage(id);
  }
  const Entry& e = it->second;
  if (e.dtype_code != dtype_code || e.bytes != bytes) {
    ++stats_.total_errors;
    return "handle " + FormatHandle(id) + " holds " + std::to_string(e.bytes) +
           " bytes of " + DtypeName(e.dtype_code) +
           " in the host store but " + std::to_string(bytes) + " bytes of " +
           DtypeName(dtype_code) +
           " were requested (dtype or shape mismatch); the entry is kept";
  }
  if (bytes > 0 && !need_dst) {
    ++stats_.total_errors;
    return "destination buffer is null but " + std::to_string(bytes) +
           " bytes were requested from the host store";
  }
  *out = std::move(it->second);
  entries_.erase(it);
  ++stats_.total_takes;
  --stats_.live_entries;
  stats_.live_bytes -= out->bytes;
  return {};
}

std::string HostStore::Take(uint64_t id, void* dst, size_t bytes,
                            uint32_t dtype_code) {
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::string err =
        EraseChecked(id, bytes, dtype_code, dst != nullptr, &entry);
    if (!err.empty()) return err;
  }
  // Copy (and free, when `entry` goes out of scope) outside the lock.
  if (bytes > 0) {
    entry.data.WaitReady();
    std::memcpy(dst, entry.data.data(), bytes);
  }
  return {};
}

std::string HostStore::Insert(HostBuffer buffer, size_t bytes,
                              uint32_t dtype_code, uint64_t* id) {
  Entry entry;
  entry.data = std::move(buffer);
  entry.bytes = bytes;
  entry.dtype_code = dtype_code;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t new_id = next_id_++;
  ++issued_;
  entries_.emplace(new_id, std::move(entry));
  ++stats_.total_puts;
  ++stats_.live_entries;
  stats_.live_bytes += bytes;
  if (stats_.live_bytes > stats_.peak_bytes) {
    stats_.peak_bytes = stats_.live_bytes;
  }
  BufferCache::Global().NoteLive(stats_.live_bytes);
  *id = new_id;
  return {};
}

std::string HostStore::Remove(uint64_t id, size_t bytes, uint32_t dtype_code,
                              HostBuffer* out) {
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::string err = EraseChecked(id, bytes, dtype_code, true, &entry);
    if (!err.empty()) return err;
  }
  *out = std::move(entry.data);
  return {};
}

bool HostStore::Peek(uint64_t id, size_t* bytes, uint32_t* dtype_code) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  if (bytes != nullptr) *bytes = it->second.bytes;
  if (dtype_code != nullptr) *dtype_code = it->second.dtype_code;
  return true;
}

HostStoreStats HostStore::Stats() const {
  HostStoreStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  BufferCache::Global().Stats(&s);
  return s;
}

uint64_t HostStore::Clear() {
  std::unordered_map<uint64_t, Entry> doomed;
  uint64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    doomed.swap(entries_);
    freed = stats_.live_bytes;
    stats_.live_bytes = 0;
    stats_.live_entries = 0;
  }
  doomed.clear();  // frees the buffers (into the cache) outside the lock
  HostBuffer::TrimCache();
  return freed;
}

}  // namespace jaxmem
