// Copyright 2025 The jaxmem Authors.
//
// Python bindings of the offline DSA solver (dsa.h):
//
//   _native.dsa_solve(lower, upper, size, method, capacity, time_limit_s,
//                     node_limit, stop_at_capacity) -> dict
//   _native.dsa_pack(lower, upper, size, capacity, time_limit_s, node_limit)
//       -> dict
//   _native.dsa_check(lower, upper, size, offsets) -> dict
//   _native.dsa_max_load(lower, upper, size) -> int
//
// The arrays are 1-D C-contiguous int64 numpy arrays; the GIL is released
// while solving and checking. The solver throws std::invalid_argument on bad
// input, which nanobind raises as ValueError.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "dsa.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"

namespace jaxmem {

namespace nb = nanobind;

namespace {

using I64Array =
    nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

std::vector<int64_t> ToVector(const I64Array& a) {
  return std::vector<int64_t>(a.data(), a.data() + a.shape(0));
}

dsa::Problem ToProblem(const I64Array& lower, const I64Array& upper,
                       const I64Array& size) {
  return dsa::Problem{ToVector(lower), ToVector(upper), ToVector(size)};
}

}  // namespace

void RegisterDsaBindings(nb::module_& m) {
  m.def(
      "dsa_solve",
      [](const I64Array& lower, const I64Array& upper, const I64Array& size,
         const std::string& method, std::optional<int64_t> capacity,
         std::optional<double> time_limit_s, int64_t node_limit,
         bool stop_at_capacity) {
        const dsa::Problem p = ToProblem(lower, upper, size);
        dsa::Options options;
        options.stop_at_capacity = stop_at_capacity;
        options.time_limit_s =
            time_limit_s ? *time_limit_s
                         : std::numeric_limits<double>::infinity();
        options.node_limit = node_limit;
        options.capacity = capacity ? *capacity : -1;
        dsa::Result r;
        {
          nb::gil_scoped_release release;
          r = dsa::Solve(p, method, options);
        }
        nb::dict d;
        d["footprint"] = r.footprint;
        d["max_load"] = r.max_load;
        d["lower_bound"] = r.lower_bound;
        d["proven_optimal"] = r.proven_optimal;
        d["timed_out"] = r.timed_out;
        d["nodes"] = r.nodes;
        d["seconds"] = r.seconds;
        d["method"] = r.method;
        d["feasible"] = r.feasible;
        d["offsets"] = Int64Numpy(std::move(r.offsets));
        return d;
      },
      nb::arg("lower"), nb::arg("upper"), nb::arg("size"),
      nb::arg("method") = "auto", nb::arg("capacity") = nb::none(),
      nb::arg("time_limit_s") = 1.0, nb::arg("node_limit") = 0,
      nb::arg("stop_at_capacity") = false,
      "Offline DSA: offsets for buffers live on [lower, upper) (int64 arrays). "
      "Returns a dict (offsets, footprint, max_load, lower_bound, "
      "proven_optimal, timed_out, nodes, seconds, method, feasible). "
      "time_limit_s=None: no limit. Raises ValueError on bad input.");

  m.def(
      "dsa_pack",
      [](const I64Array& lower, const I64Array& upper, const I64Array& size,
         int64_t capacity, std::optional<double> time_limit_s,
         int64_t node_limit) {
        const dsa::Problem p = ToProblem(lower, upper, size);
        dsa::PackResult r;
        {
          nb::gil_scoped_release release;
          r = dsa::Pack(p, capacity,
                        time_limit_s ? *time_limit_s
                                     : std::numeric_limits<double>::infinity(),
                        node_limit);
        }
        nb::dict d;
        d["status"] = r.status == dsa::PackStatus::kFound        ? "found"
                      : r.status == dsa::PackStatus::kInfeasible ? "infeasible"
                                                                 : "limit";
        d["nodes"] = r.nodes;
        d["seconds"] = r.seconds;
        d["offsets"] = Int64Numpy(std::move(r.offsets));
        return d;
      },
      nb::arg("lower"), nb::arg("upper"), nb::arg("size"), nb::arg("capacity"),
      nb::arg("time_limit_s") = 1.0, nb::arg("node_limit") = 0,
      "Decision DSA: offsets within `capacity` bytes. Returns a dict (status: "
      "'found', 'infeasible' or 'limit'; offsets; nodes; seconds).");

  m.def(
      "dsa_check",
      [](const I64Array& lower, const I64Array& upper, const I64Array& size,
         const I64Array& offsets) {
        const dsa::Problem p = ToProblem(lower, upper, size);
        const std::vector<int64_t> off = ToVector(offsets);
        dsa::CheckResult c;
        {
          nb::gil_scoped_release release;
          c = dsa::Check(p, off);
        }
        nb::dict d;
        d["valid"] = c.valid;
        d["first"] = c.first;
        d["second"] = c.second;
        d["footprint"] = c.footprint;
        d["reason"] = c.reason;
        return d;
      },
      nb::arg("lower"), nb::arg("upper"), nb::arg("size"), nb::arg("offsets"),
      "Validates a DSA solution; returns a dict (valid, first, second, "
      "footprint, reason).");

  m.def(
      "dsa_max_load",
      [](const I64Array& lower, const I64Array& upper, const I64Array& size) {
        const dsa::Problem p = ToProblem(lower, upper, size);
        nb::gil_scoped_release release;
        dsa::Validate(p);
        return dsa::MaxLoad(p);
      },
      nb::arg("lower"), nb::arg("upper"), nb::arg("size"),
      "Max over time of the summed sizes of the live buffers.");
}

}  // namespace jaxmem
