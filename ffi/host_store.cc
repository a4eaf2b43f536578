// Copyright 2025 The jaxmem Authors.

#include "host_store.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "arena/best_fit_arena.h"
#include "arena/heap_arena.h"
#include "arena/planned_arena.h"
#include "arena/virtual_chunk_arena.h"
#include "ids.h"

namespace jaxmem {
namespace {

uint64_t CacheCapFromEnv() {
  const char* env = std::getenv("JAXMEM_HOST_CACHE_BYTES");
  if (env == nullptr || *env == '\0') return 8ULL << 30;
  char* end = nullptr;
  unsigned long long n = std::strtoull(env, &end, 10);
  return end == env ? (8ULL << 30) : static_cast<uint64_t>(n);
}

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

// "123", "4K", "4KiB", "2M", "2MiB", "1G", "1GiB" (binary units), case-blind.
bool ParseBytes(const std::string& text, uint64_t* out) {
  const std::string t = Trim(text);
  size_t i = 0;
  while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i;
  if (i == 0 || i > 19) return false;
  uint64_t n = std::strtoull(t.substr(0, i).c_str(), nullptr, 10);
  std::string unit;
  for (char c : t.substr(i)) {
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  int shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kib") {
    shift = 10;
  } else if (unit == "m" || unit == "mib") {
    shift = 20;
  } else if (unit == "g" || unit == "gib") {
    shift = 30;
  } else {
    return false;
  }
  if (shift > 0 && n > (~uint64_t{0} >> shift)) return false;
  *out = n << shift;
  return true;
}

}  // namespace

Status ParseHostArenaConfig(const std::string& text, HostArenaConfig* out) {
  HostArenaConfig c;
  const size_t colon = text.find(':');
  c.mode = Trim(text.substr(0, colon));
  if (c.mode != "planned" && c.mode != "best_fit" && c.mode != "virtual" &&
      c.mode != "heap") {
    return InvalidArgument("unknown host arena mode '" + c.mode +
                           "': expected 'planned', 'best_fit', 'virtual' or 'heap'");
  }
  if (colon != std::string::npos) {
    std::stringstream ss(text.substr(colon + 1));
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (Trim(item).empty()) continue;
      const size_t eq = item.find('=');
      const std::string key = Trim(item.substr(0, eq));
      uint64_t value = 0;
      if (eq == std::string::npos || !ParseBytes(item.substr(eq + 1), &value)) {
        return InvalidArgument("bad option '" + Trim(item) +
                               "': expected KEY=BYTES, e.g. chunk_bytes=2M");
      }
      if (key == "chunk_bytes") {
        c.chunk_bytes = value;
      } else if (key == "segment_bytes") {
        c.segment_bytes = value;
      } else if (key == "capacity_bytes") {
        c.capacity_bytes = value;
      } else {
        return InvalidArgument(
            "unknown option '" + key +
            "': expected chunk_bytes, segment_bytes or capacity_bytes");
      }
    }
  }
  *out = c;
  return Status::Ok();
}

Status MakeHostArena(const HostArenaConfig& config,
                     std::shared_ptr<HostArena>* out) {
  std::unique_ptr<HostArena> arena;
  Status st;
  if (config.mode == "best_fit" || config.mode == "planned") {
    // "planned": what has no planned slot goes to best-fit.
    st = BestFitCachingArena::Create(config.segment_bytes,
                                     config.capacity_bytes, &arena);
  } else if (config.mode == "virtual") {
    // The store writes every allocation in full right away: pre-fault it.
    st = VirtualChunkArena::Create(config.chunk_bytes, config.capacity_bytes,
                                   &arena, /*populate=*/true);
  } else if (config.mode == "heap") {
    st = HeapCachingArena::Create(CacheCapFromEnv(), config.capacity_bytes,
                                  &arena);
  } else {
    return InvalidArgument("unknown host arena mode '" + config.mode +
                           "': expected 'planned', 'best_fit', 'virtual' or 'heap'");
  }
  if (!st.ok()) return st;
  *out = std::shared_ptr<HostArena>(std::move(arena));
  return Status::Ok();
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    free_ = std::exchange(other.free_, nullptr);
    arena_ = std::move(other.arena_);
    other.arena_ = nullptr;
    arena_handle_ = std::exchange(other.arena_handle_, 0);
    wait_ready_ = std::move(other.wait_ready_);
    other.wait_ready_ = nullptr;
  }
  return *this;
}

void HostBuffer::Reset() {
  // A buffer still being written by a copy stream must not be freed under it.
  WaitReady();
  if (arena_ != nullptr) {
    // Cannot fail for a handle this buffer owns; a failure would be an arena
    // bug, and leaking is better than crashing in a destructor.
    (void)arena_->Free(arena_handle_);
    // The last buffer of a replaced arena releases it (and its memory) here.
    arena_.reset();
  } else if (data_ != nullptr && free_ != nullptr) {
    free_(data_, bytes_);
  }
  data_ = nullptr;
  bytes_ = 0;
  free_ = nullptr;
  arena_handle_ = 0;
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

void HostStore::EnsureConfigLocked() const {
  if (config_read_) return;
  config_read_ = true;
  const char* env = std::getenv("JAXMEM_HOST_ARENA");
  if (env == nullptr || Trim(env).empty()) return;
  HostArenaConfig config;
  Status st = ParseHostArenaConfig(env, &config);
  if (!st.ok()) {
    // Every allocation reports this (rather than silently using another
    // allocator than the one asked for); store_configure() overrides it.
    config_error_ = std::string("$JAXMEM_HOST_ARENA='") + env +
                    "' is invalid: " + st.message() +
                    "; fix it or call jaxmem.native.store_configure()";
    return;
  }
  config_ = config;
  config_source_ = "env";
}

Status HostStore::EnsureArenaLocked(std::shared_ptr<HostArena>* out) {
  EnsureConfigLocked();
  // The request is fine; the store's configuration is not: a precondition.
  if (!config_error_.empty()) return FailedPrecondition(config_error_);
  if (arena_ == nullptr) {
    Status st = MakeHostArena(config_, &arena_);
    if (!st.ok()) {
      const std::string where = std::string("cannot create the ") +
                                config_.mode + " host arena (from " +
                                config_source_ + "): ";
      // A bad size in the configuration is, again, not the caller's
      // argument; lack of memory or of memfd keeps its own code.
      if (st.code() == StatusCode::kInvalidArgument) {
        return FailedPrecondition(where + st.message());
      }
      return st.Prefixed(where);
    }
  }
  *out = arena_;
  return Status::Ok();
}

std::shared_ptr<HostArena> HostStore::RetireArenaLocked() {
  std::shared_ptr<HostArena> old = std::move(arena_);
  arena_ = nullptr;
  if (old != nullptr) {
    // Lock order store -> arena, as everywhere (arena locks never nest out).
    ArenaStats a = old->Stats();
    retired_hits_ += a.allocs >= a.grows ? a.allocs - a.grows : 0;
    retired_misses_ += a.grows;
  }
  return old;
}

namespace {

// A planned arena of a layout given as slot -> (offset, bytes).
Status MakePlannedArena(
    const std::unordered_map<int64_t, std::pair<uint64_t, uint64_t>>& slots,
    uint64_t footprint, std::unique_ptr<HostArena>* out) {
  std::unordered_map<int64_t, PlannedArena::Slot> arena_slots;
  for (const auto& [id, slot] : slots) arena_slots[id] = {slot.first, slot.second};
  return PlannedArena::Create(std::move(arena_slots), footprint, out);
}

}  // namespace

Status HostStore::RegisterPlan(
    int64_t plan, std::unordered_map<int64_t, std::pair<uint64_t, uint64_t>> slots,
    uint64_t footprint) {
  if (plan < 0) {
    return InvalidArgument("store_register_plan: the plan key must be >= 0, got " +
                           std::to_string(plan));
  }
  // Validated by making the arena once; its memory is mapped again at the
  // first allocation (a plan that is compiled but never run holds none).
  {
    std::unique_ptr<HostArena> made;
    JAXMEM_RETURN_IF_ERROR(MakePlannedArena(slots, footprint, &made)
                               .Prefixed("store_register_plan: "));
  }
  std::shared_ptr<HostArena> old;
  {
    MutexLock lock(&mu_);
    Plan& p = plans_[plan];
    old = std::move(p.arena);
    p = Plan{};
    p.slots = std::move(slots);
    p.footprint = footprint;
  }
  return Status::Ok();   // `old` is released here, outside the lock
}

void HostStore::UnregisterPlan(int64_t plan) {
  std::shared_ptr<HostArena> old;
  {
    MutexLock lock(&mu_);
    auto it = plans_.find(plan);
    if (it == plans_.end()) return;
    old = std::move(it->second.arena);
    plans_.erase(it);
  }
}

bool HostStore::PlanStatsOf(int64_t plan, PlanStats* out) const {
  MutexLock lock(&mu_);
  auto it = plans_.find(plan);
  if (it == plans_.end()) return false;
  const Plan& p = it->second;
  *out = PlanStats{p.footprint, p.slots.size(), p.planned, p.fallbacks, p.peak_live};
  if (p.arena) out->peak_live_bytes = std::max(out->peak_live_bytes,
                                               p.arena->Stats().peak_live_bytes);
  return true;
}

Status HostStore::AllocateBuffer(size_t bytes, HostBuffer* out, PlanSlot where) {
  *out = HostBuffer();
  if (bytes == 0) return Status::Ok();
  if (where.plan >= 0) {
    std::shared_ptr<HostArena> planned;
    bool use_plans = false;
    {
      MutexLock lock(&mu_);
      EnsureConfigLocked();
      use_plans = config_.mode == "planned";
      auto it = use_plans ? plans_.find(where.plan) : plans_.end();
      if (it != plans_.end()) {
        Plan& p = it->second;
        std::unique_ptr<HostArena> made;
        if (!p.arena && MakePlannedArena(p.slots, p.footprint, &made).ok()) {
          p.arena = std::shared_ptr<HostArena>(std::move(made));
        }
        planned = p.arena;
      }
    }
    Allocation a;
    const bool ok = planned && planned->AllocateId(where.slot, bytes, &a).ok();
    if (use_plans) {
      MutexLock lock(&mu_);
      auto it = plans_.find(where.plan);
      if (it != plans_.end()) {
        ++(ok ? it->second.planned : it->second.fallbacks);
      }
    }
    if (ok) {
      *out = HostBuffer(std::move(planned), a.handle, a.ptr, bytes);
      return Status::Ok();
    }
    // Not registered, or the slot is taken (the run's order is not the
    // plan's): the store's arena serves it.
  }
  std::shared_ptr<HostArena> arena;
  {
    MutexLock lock(&mu_);
    Status st = EnsureArenaLocked(&arena);
    if (!st.ok()) return st;
  }
  // Outside the store's lock: concurrent puts only meet in the arena's lock,
  // and only for its bookkeeping (the copies run unlocked).
  Allocation a;
  Status st = arena->Allocate(bytes, &a);
  if (!st.ok()) {
    MutexLock lock(&mu_);
    return st.Prefixed("out of host memory allocating " +
                       std::to_string(bytes) + " bytes (host store holds " +
                       std::to_string(stats_.live_bytes) + " bytes in " +
                       std::to_string(stats_.live_entries) + " entries): ");
  }
  *out = HostBuffer(std::move(arena), a.handle, a.ptr, bytes);
  return Status::Ok();
}

Status HostStore::Put(const void* data, size_t bytes, uint32_t dtype_code,
                      uint64_t* id, PlanSlot where) {
  HostBuffer buffer;
  if (bytes > 0) {
    if (data == nullptr) {
      MutexLock lock(&mu_);
      ++stats_.total_errors;
      return InvalidArgument("source buffer is null but has " +
                             std::to_string(bytes) + " bytes");
    }
    Status st = AllocateBuffer(bytes, &buffer, where);
    if (!st.ok()) {
      MutexLock lock(&mu_);
      ++stats_.total_errors;
      return st;
    }
    // The arena's pointer is stable until Free, which only this buffer's
    // owner calls: copy outside every lock so that concurrent puts overlap.
    std::memcpy(buffer.data(), data, bytes);
  }
  return Insert(std::move(buffer), bytes, dtype_code, id);
}

Status HostStore::Configure(const HostArenaConfig& config) {
  std::shared_ptr<HostArena> old;
  {
    MutexLock lock(&mu_);
    EnsureConfigLocked();  // so that the environment cannot override it later
    if (!entries_.empty()) {
      return FailedPrecondition(
          "store_configure: the host store is not empty (it holds " +
          std::to_string(stats_.live_bytes) + " bytes in " +
          std::to_string(stats_.live_entries) +
          " entries); fetch them or call jaxmem.native.store_clear() "
          "first");
    }
    if (arena_ != nullptr) {
      const uint64_t held = arena_->Stats().live_allocations;
      if (held > 0) {
        return FailedPrecondition(
            "store_configure: the host store is not empty (" +
            std::to_string(held) +
            " host buffers are held by asynchronous copies that were "
            "started but not finished); finish them or call "
            "jaxmem.native.store_clear() first");
      }
    }
    std::shared_ptr<HostArena> fresh;
    Status st = MakeHostArena(config, &fresh);
    if (!st.ok()) return st.Prefixed("store_configure: ");
    old = RetireArenaLocked();
    arena_ = std::move(fresh);
    config_ = config;
    config_source_ = "store_configure";
    config_error_.clear();
  }
  return Status::Ok();  // `old` (empty) is released outside the lock
}

HostArenaConfig HostStore::Config(std::string* source,
                                  std::string* error) const {
  MutexLock lock(&mu_);
  EnsureConfigLocked();
  if (source != nullptr) *source = config_source_;
  if (error != nullptr) *error = config_error_;
  return config_;
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

Status HostStore::EraseChecked(uint64_t id, size_t bytes, uint32_t dtype_code,
                               bool need_dst, Entry* out) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    ++stats_.total_errors;
    return InvalidArgument(UnknownHandleMessage(id));
  }
  const Entry& e = it->second;
  if (e.dtype_code != dtype_code || e.bytes != bytes) {
    ++stats_.total_errors;
    return InvalidArgument(
        "handle " + FormatHandle(id) + " holds " + std::to_string(e.bytes) +
        " bytes of " + DtypeName(e.dtype_code) + " in the host store but " +
        std::to_string(bytes) + " bytes of " + DtypeName(dtype_code) +
        " were requested (dtype or shape mismatch); the entry is kept");
  }
  if (bytes > 0 && !need_dst) {
    ++stats_.total_errors;
    return InvalidArgument("destination buffer is null but " +
                           std::to_string(bytes) +
                           " bytes were requested from the host store");
  }
  *out = std::move(it->second);
  entries_.erase(it);
  ++stats_.total_takes;
  --stats_.live_entries;
  stats_.live_bytes -= out->bytes;
  return Status::Ok();
}

Status HostStore::Take(uint64_t id, void* dst, size_t bytes,
                       uint32_t dtype_code) {
  Entry entry;
  {
    MutexLock lock(&mu_);
    Status st = EraseChecked(id, bytes, dtype_code, dst != nullptr, &entry);
    if (!st.ok()) return st;
  }
  // Copy (and free, when `entry` goes out of scope) outside the lock.
  if (bytes > 0) {
    entry.data.WaitReady();
    std::memcpy(dst, entry.data.data(), bytes);
  }
  return Status::Ok();
}

Status HostStore::Insert(HostBuffer buffer, size_t bytes, uint32_t dtype_code,
                         uint64_t* id) {
  Entry entry;
  entry.data = std::move(buffer);
  entry.bytes = bytes;
  entry.dtype_code = dtype_code;
  MutexLock lock(&mu_);
  uint64_t new_id = next_id_++;
  ++issued_;
  entries_.emplace(new_id, std::move(entry));
  ++stats_.total_puts;
  ++stats_.live_entries;
  stats_.live_bytes += bytes;
  if (stats_.live_bytes > stats_.peak_bytes) {
    stats_.peak_bytes = stats_.live_bytes;
  }
  *id = new_id;
  return Status::Ok();
}

Status HostStore::Remove(uint64_t id, size_t bytes, uint32_t dtype_code,
                         HostBuffer* out) {
  Entry entry;
  {
    MutexLock lock(&mu_);
    Status st = EraseChecked(id, bytes, dtype_code, true, &entry);
    if (!st.ok()) return st;
  }
  *out = std::move(entry.data);
  return Status::Ok();
}

bool HostStore::Peek(uint64_t id, size_t* bytes, uint32_t* dtype_code) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  if (bytes != nullptr) *bytes = it->second.bytes;
  if (dtype_code != nullptr) *dtype_code = it->second.dtype_code;
  return true;
}

HostStoreStats HostStore::Stats() const {
  HostStoreStats s;
  std::shared_ptr<HostArena> arena;
  HostArenaConfig config;
  {
    MutexLock lock(&mu_);
    EnsureConfigLocked();
    s = stats_;
    arena = arena_;
    config = config_;
    s.arena_mode = config_error_.empty() ? config_.mode : "invalid";
    s.cache_hits = retired_hits_;
    s.cache_misses = retired_misses_;
  }
  if (arena != nullptr) {
    s.arena = arena->Stats();
  } else {
    // Not made yet (first use, or dropped by Clear): nothing is held.
    if (config.mode == "virtual") s.arena.chunk_bytes = config.chunk_bytes;
    if (config.mode == "best_fit" || config.mode == "planned") {
      s.arena.segment_bytes = config.segment_bytes;
    }
    s.arena.capacity_bytes = config.capacity_bytes;
  }
  s.cached_bytes = s.arena.free_bytes;
  s.cache_hits +=
      s.arena.allocs >= s.arena.grows ? s.arena.allocs - s.arena.grows : 0;
  s.cache_misses += s.arena.grows;
  return s;
}

uint64_t HostStore::Clear() {
  std::unordered_map<uint64_t, Entry> doomed;
  std::shared_ptr<HostArena> old;
  std::vector<std::shared_ptr<HostArena>> planned;
  uint64_t freed = 0;
  {
    MutexLock lock(&mu_);
    doomed.swap(entries_);
    freed = stats_.live_bytes;
    stats_.live_bytes = 0;
    stats_.live_entries = 0;
    // Drop the arena so that its cached memory goes back to the OS; the next
    // allocation makes a fresh one of the same configuration. Planned
    // layouts stay registered; their buffers are made again at next use.
    old = RetireArenaLocked();
    for (auto& [key, plan] : plans_) {
      if (!plan.arena) continue;
      // The arena's own peak goes with it: keep it in the plan's counters.
      plan.peak_live = std::max(plan.peak_live, plan.arena->Stats().peak_live_bytes);
      planned.push_back(std::move(plan.arena));
    }
  }
  planned.clear();
  doomed.clear();  // frees the buffers into `old` outside the lock
  old.reset();     // unmaps it, unless copies in flight still hold buffers
  return freed;
}

}  // namespace jaxmem
