// Copyright 2025 The jaxmem Authors.
//
// Python bindings of the host store (host_store.h): `store_stats`,
// `store_clear`, `store_configure`, `store_config`, `store_put`,
// `store_take`, `store_register_plan`, `store_unregister_plan`,
// `store_plan_stats` and `ALIGNMENT`.

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "host_store.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmem {

namespace nb = nanobind;

namespace {
constexpr uint32_t kU8 = static_cast<uint32_t>(xla::ffi::DataType::U8);
}  // namespace

void RegisterStoreBindings(nb::module_& m) {
  m.def(
      "store_stats",
      []() {
        HostStoreStats s = HostStore::Global().Stats();
        nb::dict d;
        d["live_entries"] = s.live_entries;
        d["live_bytes"] = s.live_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["total_puts"] = s.total_puts;
        d["total_takes"] = s.total_takes;
        d["total_errors"] = s.total_errors;
        d["cached_bytes"] = s.cached_bytes;
        d["cache_hits"] = s.cache_hits;
        d["cache_misses"] = s.cache_misses;
        d["arena"] = ArenaStatsDict(s.arena, s.arena_mode.c_str());
        return d;
      },
      "Counters of the native host store, as a dict; 'arena' holds the "
      "backing arena's stats (a dict like HostArena.stats()).");

  m.def(
      "store_clear", []() { return HostStore::Global().Clear(); },
      "Frees every entry of the host store and drops its arena (returning "
      "the arena's cached memory to the OS); returns the payload bytes "
      "freed.");

  m.def(
      "store_configure",
      [](const std::string& mode, uint64_t chunk_bytes, uint64_t segment_bytes,
         uint64_t capacity_bytes) {
        HostArenaConfig config;
        config.mode = mode;
        config.chunk_bytes = chunk_bytes;
        config.segment_bytes = segment_bytes;
        config.capacity_bytes = capacity_bytes;
        Status st = HostStore::Global().Configure(config);
        // Documented (jaxmem.native.store_configure): ValueError for every
        // refusal, whatever its code.
        if (!st.ok()) RaisePyError(st, PyExc_ValueError);
      },
      nb::arg("mode"), nb::arg("chunk_bytes"), nb::arg("segment_bytes"),
      nb::arg("capacity_bytes"),
      "Replaces the host store's arena ('planned', 'best_fit', 'virtual' or 'heap'); "
      "raises ValueError unless the store is empty.");

  m.def(
      "store_register_plan",
      [](int64_t plan, const std::vector<int64_t>& slots,
         const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& sizes,
         uint64_t footprint) {
        if (slots.size() != offsets.size() || slots.size() != sizes.size()) {
          throw nb::value_error("store_register_plan: slots, offsets and sizes differ in length");
        }
        std::unordered_map<int64_t, std::pair<uint64_t, uint64_t>> layout;
        for (size_t i = 0; i < slots.size(); ++i) layout[slots[i]] = {offsets[i], sizes[i]};
        Status st;
        {
          nb::gil_scoped_release release;
          st = HostStore::Global().RegisterPlan(plan, std::move(layout), footprint);
        }
        if (!st.ok()) RaisePyError(st, PyExc_ValueError);
      },
      nb::arg("plan"), nb::arg("slots"), nb::arg("offsets"), nb::arg("sizes"),
      nb::arg("footprint"),
      "Registers a planned host layout (slot -> offset, bytes) under key `plan`; "
      "raises ValueError for a bad layout.");

  m.def(
      "store_unregister_plan",
      [](int64_t plan) { HostStore::Global().UnregisterPlan(plan); },
      nb::arg("plan"), "Forgets a planned layout (nothing if unknown).");

  m.def(
      "store_plan_stats",
      [](int64_t plan) -> nb::object {
        PlanStats s;
        if (!HostStore::Global().PlanStatsOf(plan, &s)) return nb::none();
        nb::dict d;
        d["footprint"] = s.footprint;
        d["slots"] = s.slots;
        d["planned"] = s.planned;
        d["fallbacks"] = s.fallbacks;
        d["peak_live_bytes"] = s.peak_live_bytes;
        return d;
      },
      nb::arg("plan"),
      "Counters of a registered planned layout (None if `plan` is not registered).");

  m.def(
      "store_config",
      []() {
        std::string source, error;
        HostArenaConfig c =
            HostStore::Global().Config(&source, &error);
        nb::dict d;
        d["mode"] = c.mode;
        d["chunk_bytes"] = c.chunk_bytes;
        d["segment_bytes"] = c.segment_bytes;
        d["capacity_bytes"] = c.capacity_bytes;
        d["source"] = source;
        d["error"] = error;
        return d;
      },
      "The host store's arena configuration: mode, chunk_bytes, "
      "segment_bytes, capacity_bytes, source ('default', 'env', "
      "'store_configure') and error (why $JAXMEM_HOST_ARENA was rejected).");

  m.def(
      "store_put",
      [](nb::bytes data, uint32_t dtype_code) {
        const void* src = data.c_str();
        const size_t n = data.size();
        uint64_t id = 0;
        Status st;
        {
          nb::gil_scoped_release release;
          st = HostStore::Global().Put(src, n, dtype_code, &id);
        }
        // ValueError for every failure, out of memory included, as since
        // store_put exists (the FFI path reports RESOURCE_EXHAUSTED).
        if (!st.ok()) RaisePyError(st, PyExc_ValueError);
        return id;
      },
      nb::arg("data"), nb::arg("dtype_code") = kU8,
      "Copies `data` into the host store; returns the 64-bit handle.");

  m.def(
      "store_take",
      [](uint64_t id, size_t nbytes, uint32_t dtype_code) {
        // Copy straight into the result (no zero-filled staging buffer).
        if (nbytes > static_cast<size_t>(PY_SSIZE_T_MAX)) {
          throw nb::value_error("nbytes is too large");
        }
        nb::object out = nb::steal(PyBytes_FromStringAndSize(
            nullptr, static_cast<Py_ssize_t>(nbytes)));
        if (!out.is_valid()) throw nb::python_error();
        char* dst = PyBytes_AS_STRING(out.ptr());
        Status st;
        {
          nb::gil_scoped_release release;
          st = HostStore::Global().Take(id, dst, nbytes, dtype_code);
        }
        if (!st.ok()) RaisePyError(st);  // InvalidArgument: ValueError
        return nb::borrow<nb::bytes>(out);
      },
      nb::arg("id"), nb::arg("nbytes"), nb::arg("dtype_code") = kU8,
      "Copies entry `id` out of the host store and erases it. Raises "
      "ValueError for an unknown/stale handle or a size/dtype mismatch.");

  m.attr("ALIGNMENT") = kHostStoreAlignment;
}

}  // namespace jaxmem
