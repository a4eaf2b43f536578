// Copyright 2025 The jaxmem Authors.
//
// Python bindings of the asynchronous copy engine (copy_engine.h):
// `copy_stats`, `copy_drain`, `copy_clear`, `set_copy_threads`,
// `set_copy_cpus`.

#include <cstdint>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "copy_engine.h"
#include "handlers/handlers.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"

namespace jaxmem {

namespace nb = nanobind;

void RegisterCopyEngineBindings(nb::module_& m) {
  m.def(
      "copy_stats",
      []() {
        CopyEngineStats s = CopyEngine::Global().Stats();
        nb::dict d;
        d["threads"] = s.threads;
        nb::list cpus;
        for (int c : s.cpus) cpus.append(c);
        d["cpus"] = cpus;
        d["outstanding"] = s.outstanding;
        d["in_flight"] = s.in_flight;
        d["total_started"] = s.total_started;
        d["total_finished"] = s.total_finished;
        d["total_errors"] = s.total_errors;
        d["stolen"] = s.stolen;
        d["bytes_copied"] = s.bytes_copied;
        d["copy_seconds"] = s.copy_seconds;
        d["wait_seconds"] = s.wait_seconds;
        return d;
      },
      "Counters of the asynchronous copy engine (CPU), as a dict.");

  m.def(
      "copy_drain",
      []() {
        nb::gil_scoped_release release;
        CopyEngine::Global().Drain();
      },
      "Blocks until every asynchronous copy queued so far has finished.");

  m.def(
      "copy_clear",
      []() {
        nb::gil_scoped_release release;
        uint64_t freed = CopyEngine::Global().Clear();
#ifdef JAXMEM_WITH_CUDA
        freed += CudaClear();
#endif
        return freed;
      },
      "Drains, then drops every outstanding copy ticket; returns the host "
      "bytes freed.");

  m.def(
      "set_copy_threads",
      [](int n) { CopyEngine::Global().SetThreads(n); }, nb::arg("n"),
      "Sets the number of copy worker threads (0: copy inline in the start).");

  m.def(
      "set_copy_cpus",
      [](std::vector<int> cpus) {
        Status st = CopyEngine::Global().SetCpus(cpus);
        if (!st.ok()) RaisePyError(st);  // InvalidArgument: ValueError
      },
      nb::arg("cpus"),
      "Pins the copy workers to these CPUs (empty list: no pinning).");
}

}  // namespace jaxmem
