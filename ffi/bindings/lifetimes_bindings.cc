// Copyright 2025 The jaxmem Authors.
//
// Python binding of the lifetime estimate's XLA model (lifetimes.h):
//
//   _native.estimate_lifetimes(num_steps, columns) -> tuple
//
// `columns` maps names to 1-D C-contiguous int64 numpy arrays (the flow's
// columns; jaxmem/_src/native/lifetimes.py builds them). Returns
// (pos, start, end, virtual, copy_last, stored_broadcasts), int64 arrays
// (copy_last flattened by threes, stored_broadcasts by fours). The GIL is
// released while it runs. A malformed flow raises ValueError.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "lifetimes.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"

namespace jaxmem {

namespace nb = nanobind;

namespace {

using I64Array =
    nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename T>
std::vector<T> Column(const nb::dict& columns, const char* name, bool required) {
  if (!columns.contains(name)) {
    if (required) {
      throw std::invalid_argument(std::string("estimate_lifetimes: column `") + name +
                                  "` missing");
    }
    return {};
  }
  I64Array a = nb::cast<I64Array>(columns[name]);
  return std::vector<T>(a.data(), a.data() + a.shape(0));
}

lifetimes::Rows RowsOf(const nb::dict& columns, const char* ptr, const char* idx,
                       bool required) {
  lifetimes::Rows rows;
  rows.ptr = Column<int64_t>(columns, ptr, required);
  rows.idx = Column<int64_t>(columns, idx, required || !rows.ptr.empty());
  return rows;
}

}  // namespace

void RegisterLifetimesBindings(nb::module_& m) {
  m.def(
      "estimate_lifetimes",
      [](int64_t num_steps, const nb::dict& columns) {
        lifetimes::Flow f;
        f.num_steps = num_steps;
        f.kind = Column<int8_t>(columns, "kind", true);
        f.inputs = RowsOf(columns, "in_ptr", "in_idx", true);
        f.outputs = RowsOf(columns, "out_ptr", "out_idx", true);
        f.start = Column<int64_t>(columns, "start", true);
        f.end = Column<int64_t>(columns, "end", true);
        f.nbytes = Column<int64_t>(columns, "nbytes", true);
        f.materialized = Column<uint8_t>(columns, "materialized", true);
        f.hoist_to_start = Column<int64_t>(columns, "hoist", true);
        f.merged = Column<uint8_t>(columns, "merged", true);
        f.movable = Column<uint8_t>(columns, "movable", false);
        f.fuses_operands = Column<int8_t>(columns, "fuses", false);
        f.epilogues = Column<uint8_t>(columns, "epilogues", false);
        f.indexing = Column<int8_t>(columns, "indexing", false);
        f.in_place = Column<int64_t>(columns, "in_place", false);
        f.has_forwarded = Column<uint8_t>(columns, "fwd_mask", false);
        f.forwarded = RowsOf(columns, "fwd_ptr", "fwd_idx", false);
        f.early_copies = RowsOf(columns, "ec_ptr", "ec_idx", false);
        f.shared_reads = RowsOf(columns, "sr_ptr", "sr_idx", false);
        lifetimes::Result r;
        {
          nb::gil_scoped_release release;
          r = lifetimes::Estimate(f);
        }
        std::vector<int64_t> copy_last, broadcasts;
        for (const auto& e : r.copy_last) copy_last.insert(copy_last.end(), e.begin(), e.end());
        for (const auto& e : r.stored_broadcasts)
          broadcasts.insert(broadcasts.end(), e.begin(), e.end());
        return nb::make_tuple(
            Int64Numpy(std::move(r.pos)), Int64Numpy(std::move(r.start)),
            Int64Numpy(std::move(r.end)),
            Int64Numpy(std::vector<int64_t>(r.is_virtual.begin(), r.is_virtual.end())),
            Int64Numpy(std::move(copy_last)), Int64Numpy(std::move(broadcasts)));
      },
      nb::arg("num_steps"), nb::arg("columns"),
      "The lifetime estimate's XLA model of a flow (jaxmem/_src/estimate/"
      "lifetimes.py `_lifetimes`): (pos, start, end, virtual, copy_last, "
      "stored_broadcasts) from the flow's columns (int64 arrays by name).");
}

}  // namespace jaxmem
