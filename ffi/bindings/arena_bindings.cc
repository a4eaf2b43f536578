// Copyright 2025 The jaxmem Authors.
//
// Python bindings of the host arenas (arena/host_arena.h):
// `jaxmem._native.HostArena`, `make_arena`, `arena_stress`.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "arena/best_fit_arena.h"
#include "arena/host_arena.h"
#include "arena/planned_arena.h"
#include "arena/stress.h"
#include "arena/virtual_chunk_arena.h"
#include "bindings/bindings.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"

namespace jaxmem {

// The stats as a dict (the host store's `store_stats()["arena"]` too).
nanobind::dict ArenaStatsDict(const ArenaStats& s, const char* mode) {
  namespace nb = nanobind;
  nb::dict d;
  d["mode"] = mode;
  d["footprint_bytes"] = s.footprint_bytes;
  d["peak_footprint_bytes"] = s.peak_footprint_bytes;
  d["capacity_bytes"] = s.capacity_bytes;
  d["live_bytes"] = s.live_bytes;
  d["peak_live_bytes"] = s.peak_live_bytes;
  d["requested_live_bytes"] = s.requested_live_bytes;
  d["peak_requested_bytes"] = s.peak_requested_bytes;
  d["live_allocations"] = s.live_allocations;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block_bytes"] = s.largest_free_block_bytes;
  d["internal_fragmentation"] = s.internal_fragmentation;
  d["external_fragmentation"] = s.external_fragmentation;
  d["allocs"] = s.allocs;
  d["frees"] = s.frees;
  d["errors"] = s.errors;
  d["grows"] = s.grows;
  d["map_calls"] = s.map_calls;
  d["unmap_calls"] = s.unmap_calls;
  d["segments"] = s.segments;
  d["chunk_bytes"] = s.chunk_bytes;
  d["pool_chunks"] = s.pool_chunks;
  d["free_chunks"] = s.free_chunks;
  d["segment_bytes"] = s.segment_bytes;
  return d;
}

namespace {

namespace nb = nanobind;

// The Python object: shares the arena with in-flight calls that released the
// GIL, so `close()` never frees memory under a running copy or stress run.
class PyHostArena {
 public:
  explicit PyHostArena(std::shared_ptr<HostArena> arena)
      : arena_(std::move(arena)), mode_(arena_->mode()) {}

  std::shared_ptr<HostArena> Get() const {
    if (!arena_) {
      RaisePyError(FailedPrecondition(std::string("the ") +
                                      ArenaModeName(mode_) +
                                      " host arena is closed"));
    }
    return arena_;
  }
  void Close() { arena_.reset(); }
  bool closed() const { return !arena_; }
  ArenaMode mode() const { return mode_; }

 private:
  std::shared_ptr<HostArena> arena_;
  ArenaMode mode_;
};

nb::dict StatsDict(const ArenaStats& s, ArenaMode mode) {
  return ArenaStatsDict(s, ArenaModeName(mode));
}

// {id: value} from a dict, or {index: value} from a sequence.
std::vector<std::pair<int64_t, uint64_t>> IdTable(nb::handle obj,
                                                  const char* what) {
  std::vector<std::pair<int64_t, uint64_t>> out;
  if (obj.is_none()) return out;
  if (nb::isinstance<nb::dict>(obj)) {
    for (auto [k, v] : nb::borrow<nb::dict>(obj)) {
      out.emplace_back(nb::cast<int64_t>(k), nb::cast<uint64_t>(v));
    }
    return out;
  }
  int64_t i = 0;
  try {
    for (nb::handle v : nb::iter(obj)) {
      out.emplace_back(i++, nb::cast<uint64_t>(v));
    }
  } catch (const nb::cast_error&) {
    throw nb::value_error(
        (std::string(what) + " must be a dict {id: int} or a sequence of "
                             "non-negative ints")
            .c_str());
  }
  return out;
}

std::shared_ptr<HostArena> MakeArena(const std::string& mode,
                                     size_t chunk_bytes, size_t segment_bytes,
                                     size_t capacity_bytes, nb::handle offsets,
                                     nb::handle sizes,
                                     std::optional<uint64_t> footprint) {
  std::unique_ptr<HostArena> arena;
  Status st;
  if (mode == "virtual") {
    st = VirtualChunkArena::Create(chunk_bytes, capacity_bytes, &arena);
  } else if (mode == "best_fit") {
    st = BestFitCachingArena::Create(segment_bytes, capacity_bytes, &arena);
  } else if (mode == "planned") {
    if (offsets.is_none() || sizes.is_none()) {
      throw nb::value_error("a planned arena needs offsets= and sizes=");
    }
    auto off = IdTable(offsets, "offsets");
    auto sz = IdTable(sizes, "sizes");
    std::unordered_map<int64_t, PlannedArena::Slot> slots;
    for (const auto& [id, o] : off) slots[id].offset = o;
    std::unordered_map<int64_t, uint64_t> size_of(sz.begin(), sz.end());
    if (size_of.size() != slots.size()) {
      throw nb::value_error("offsets and sizes must name the same ids");
    }
    uint64_t end = 0;
    for (auto& [id, slot] : slots) {
      auto it = size_of.find(id);
      if (it == size_of.end()) {
        throw nb::value_error(("plan id " + std::to_string(id) +
                               " has an offset but no size")
                                  .c_str());
      }
      slot.bytes = it->second;
      end = std::max(end, slot.offset + slot.bytes);
    }
    st = PlannedArena::Create(std::move(slots), footprint.value_or(end),
                              &arena);
  } else {
    throw nb::value_error(("unknown arena mode '" + mode +
                           "': expected 'virtual', 'best_fit' or 'planned'")
                              .c_str());
  }
  if (!st.ok()) RaisePyError(st);
  return std::shared_ptr<HostArena>(std::move(arena));
}

nb::dict StressDict(const StressResult& r, const ArenaStats& s,
                    ArenaMode mode) {
  nb::dict d;
  d["ops"] = r.ops;
  d["allocs"] = r.allocs;
  d["frees"] = r.frees;
  d["corrupted"] = r.corrupted;
  d["alloc_failures"] = r.alloc_failures;
  d["free_failures"] = r.free_failures;
  d["bad_handle_probes"] = r.bad_handle_probes;
  d["bad_handle_accepted"] = r.bad_handle_accepted;
  d["bytes_written"] = r.bytes_written;
  d["seconds"] = r.seconds;
  d["first_error"] = r.first_error;
  d["peak"] = s.peak_live_bytes;
  d["peak_requested"] = s.peak_requested_bytes;
  d["footprint"] = s.footprint_bytes;
  d["live_at_end"] = s.live_bytes;
  d["live_allocations_at_end"] = s.live_allocations;
  d["stats"] = StatsDict(s, mode);
  return d;
}

nb::dict RunStressPy(const std::shared_ptr<HostArena>& arena, uint64_t n_ops,
                     uint64_t seed, size_t max_bytes, int threads,
                     size_t max_live, uint64_t bad_handle_every) {
  if (arena->mode() == ArenaMode::kPlanned) {
    throw nb::type_error("arena_stress needs a 'virtual' or 'best_fit' arena");
  }
  if (threads < 1 || threads > 64) {
    throw nb::value_error("threads must be in [1, 64]");
  }
  StressOptions opt;
  opt.n_ops = n_ops;
  opt.seed = seed;
  opt.max_bytes = max_bytes;
  opt.threads = threads;
  opt.max_live = std::max<size_t>(max_live, 1);
  opt.bad_handle_every = bad_handle_every;
  StressResult r;
  ArenaStats s;
  {
    nb::gil_scoped_release release;
    r = RunStress(arena.get(), opt);
    s = arena->Stats();
  }
  return StressDict(r, s, arena->mode());
}

using U8Array = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;
using U8In = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig,
                         nb::device::cpu>;

}  // namespace

void RegisterArenaBindings(nb::module_& m) {
  nb::class_<PyHostArena>(
      m, "HostArena",
      "A native host arena (see jaxmem._src.arena.HostArena); made by "
      "make_arena().")
      .def_prop_ro("mode",
                   [](const PyHostArena& a) { return ArenaModeName(a.mode()); })
      .def_prop_ro("closed", &PyHostArena::closed)
      .def(
          "allocate",
          [](PyHostArena& self, int64_t size_or_id,
             std::optional<uint64_t> nbytes) {
            auto arena = self.Get();
            Allocation a;
            Status st;
            if (arena->mode() == ArenaMode::kPlanned) {
              uint64_t n = 0;
              PlannedArena::Slot slot;
              if (nbytes.has_value()) {
                n = *nbytes;
              } else if (static_cast<const PlannedArena*>(arena.get())
                             ->SlotOf(size_or_id, &slot)) {
                n = slot.bytes;  // no size given: the planned one
              }
              st = arena->AllocateId(size_or_id, n, &a);
            } else {
              if (size_or_id < 0) {
                throw nb::value_error("allocation size must be >= 0");
              }
              if (nbytes.has_value() &&
                  *nbytes != static_cast<uint64_t>(size_or_id)) {
                throw nb::value_error(
                    "allocate(size, nbytes): nbytes must equal size");
              }
              st = arena->Allocate(static_cast<size_t>(size_or_id), &a);
            }
            if (!st.ok()) RaisePyError(st);
            return a.handle;
          },
          nb::arg("size_or_id"), nb::arg("nbytes") = nb::none(),
          "Allocates `size` bytes (virtual/best_fit) or plan slot `id` of "
          "`nbytes` bytes (planned); returns the 64-bit handle.")
      .def(
          "free",
          [](PyHostArena& self, uint64_t handle) {
            Status st = self.Get()->Free(handle);
            if (!st.ok()) RaisePyError(st);
          },
          nb::arg("handle"),
          "Frees a live allocation; raises ValueError for a stale, "
          "double-freed or foreign handle.")
      .def(
          "lookup",
          [](PyHostArena& self, uint64_t handle) {
            Allocation a;
            Status st = self.Get()->Lookup(handle, &a);
            if (!st.ok()) RaisePyError(st);
            nb::dict d;
            d["handle"] = a.handle;
            d["address"] = reinterpret_cast<uintptr_t>(a.ptr);
            d["nbytes"] = a.bytes;
            d["reserved_bytes"] = a.reserved_bytes;
            d["id"] = a.id;
            return d;
          },
          nb::arg("handle"), "Describes a live allocation.")
      .def(
          "write",
          [](PyHostArena& self, uint64_t handle, U8In data, size_t offset) {
            auto arena = self.Get();
            const void* src = data.data();
            const size_t n = data.shape(0);
            Status st;
            {
              nb::gil_scoped_release release;
              st = arena->Write(handle, offset, src, n);
            }
            if (!st.ok()) RaisePyError(st);
          },
          nb::arg("handle"), nb::arg("data"), nb::arg("offset") = 0,
          "Copies a 1-D contiguous uint8 array into the allocation.")
      .def(
          "read",
          [](PyHostArena& self, uint64_t handle, size_t offset,
             std::optional<size_t> nbytes) {
            auto arena = self.Get();
            Allocation a;
            Status st = arena->Lookup(handle, &a);
            if (!st.ok()) RaisePyError(st);
            const size_t n = nbytes.value_or(
                a.bytes >= offset ? a.bytes - offset : 0);
            uint8_t* buf = new uint8_t[n > 0 ? n : 1];
            nb::capsule owner(buf, [](void* p) noexcept {
              delete[] static_cast<uint8_t*>(p);
            });
            {
              nb::gil_scoped_release release;
              st = arena->Read(handle, offset, buf, n);
            }
            if (!st.ok()) RaisePyError(st);
            return U8Array(buf, {n}, owner);
          },
          nb::arg("handle"), nb::arg("offset") = 0,
          nb::arg("nbytes") = nb::none(),
          "Copies the allocation (from `offset`, `nbytes` bytes; default: "
          "to the end) into a new uint8 numpy array.")
      .def(
          "free_all", [](PyHostArena& self) { return self.Get()->FreeAll(); },
          "Frees every live allocation; returns how many were freed.")
      .def(
          "stats",
          [](PyHostArena& self) {
            auto arena = self.Get();
            return StatsDict(arena->Stats(), arena->mode());
          },
          "Counters and fragmentation, as a dict.")
      .def(
          "stress",
          [](PyHostArena& self, uint64_t n_ops, uint64_t seed, size_t max_bytes,
             int threads, size_t max_live, uint64_t bad_handle_every) {
            return RunStressPy(self.Get(), n_ops, seed, max_bytes, threads,
                               max_live, bad_handle_every);
          },
          nb::arg("n_ops") = 1000000, nb::arg("seed") = 0,
          nb::arg("max_bytes") = 65536, nb::arg("threads") = 1,
          nb::arg("max_live") = 256, nb::arg("bad_handle_every") = 997,
          "Runs the C++ stress driver on this arena (GIL released).")
      .def("close", &PyHostArena::Close,
           "Releases the arena's memory; later calls raise ValueError.");

  m.def(
      "make_arena",
      [](const std::string& mode, size_t chunk_bytes, size_t segment_bytes,
         size_t capacity_bytes, nb::handle offsets, nb::handle sizes,
         std::optional<uint64_t> footprint) {
        return PyHostArena(MakeArena(mode, chunk_bytes, segment_bytes,
                                     capacity_bytes, offsets, sizes,
                                     footprint));
      },
      nb::arg("mode"), nb::arg("chunk_bytes") = size_t{2} << 20,
      nb::arg("segment_bytes") = size_t{2} << 20,
      nb::arg("capacity_bytes") = 0, nb::arg("offsets") = nb::none(),
      nb::arg("sizes") = nb::none(), nb::arg("footprint") = nb::none(),
      "Makes a host arena: mode 'virtual' (chunk_bytes), 'best_fit' "
      "(segment_bytes) or 'planned' (offsets, sizes: dicts id -> int or "
      "sequences; footprint defaults to max(offset + size)). capacity_bytes "
      "caps the footprint of dynamic modes (0: unbounded).");

  m.def(
      "arena_stress",
      [](const std::string& mode, uint64_t n_ops, uint64_t seed,
         size_t max_bytes, int threads, size_t chunk_bytes,
         size_t segment_bytes, size_t capacity_bytes, size_t max_live,
         uint64_t bad_handle_every) {
        auto arena = MakeArena(mode, chunk_bytes, segment_bytes,
                               capacity_bytes, nb::none(), nb::none(),
                               std::nullopt);
        return RunStressPy(arena, n_ops, seed, max_bytes, threads, max_live,
                           bad_handle_every);
      },
      nb::arg("mode"), nb::arg("n_ops") = 1000000, nb::arg("seed") = 0,
      nb::arg("max_bytes") = 65536, nb::arg("threads") = 1,
      nb::arg("chunk_bytes") = size_t{64} << 10,
      nb::arg("segment_bytes") = size_t{2} << 20,
      nb::arg("capacity_bytes") = 0, nb::arg("max_live") = 256,
      nb::arg("bad_handle_every") = 997,
      "Runs n_ops random alloc/free ops in C++ (GIL released) on a fresh "
      "arena, filling each allocation with a pattern from (handle, seed) and "
      "verifying it before the free; frees everything at the end. Returns "
      "{corrupted, ops, peak, footprint, live_at_end, ...}.");

  m.attr("ARENA_ALIGNMENT") = kArenaAlignment;
}

}  // namespace jaxmem
