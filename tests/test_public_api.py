"""The public names: what `import jaxmem` offers, and that each one is what it says."""

from __future__ import annotations

import inspect

import jaxmem
from jaxmem import dsa, native

# The public API as it stood before the package was layered (it must not shrink).
API = {"Action", "ArenaStats", "Block", "BudgetError", "BudgetSpec", "Comparison",
       "CompiledMemory", "Decision", "DeviceProfile", "FitResult", "Fitted", "HostArena",
       "JaxmemError", "MaxBatchResult", "Op", "PLANNERS", "Plan", "Profile", "Program", "Role",
       "Schedule", "Simulation", "VarInfo", "analyze", "compare", "compiled_memory",
       "device_profile", "dsa", "fit", "format_bytes", "get_planner", "max_batch", "native",
       "parse_budget", "plan", "simulate"}
NATIVE = {"HANDLE_DTYPE", "HANDLE_SHAPE", "TARGET_PREFIX", "WITH_CUDA", "CopyStats", "StoreStats",
          "copy_drain", "copy_stats", "fence", "fetch", "fetch_done", "fetch_start", "handle_id",
          "offload", "offload_done", "offload_start", "register", "set_copy_cpus",
          "set_copy_threads", "store_clear", "store_config", "store_configure", "store_stats"}
DSA = {"METHODS", "CapacityError", "CsvInstance", "Solution", "check", "from_program", "max_load",
       "read_csv", "solve", "write_csv"}


def test_the_public_names_are_all_there_and_resolve():
  for module, names in ((jaxmem, API), (native, NATIVE), (dsa, DSA)):
    assert names <= set(module.__all__), names - set(module.__all__)
    for name in module.__all__:
      assert getattr(module, name) is not None, name


def test_public_objects_come_from_the_layers():
  # Public classes are defined in the private package; `jaxmem.Program` is the
  # analyzed program with its reports, an instance of every layer's program type.
  from jaxmem._src.estimate.analysis import AnalyzedProgram
  from jaxmem._src.ir.program import Program as TracedProgram
  assert issubclass(jaxmem.Program, AnalyzedProgram) and issubclass(AnalyzedProgram, TracedProgram)
  for name in jaxmem.__all__:
    obj = getattr(jaxmem, name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
      assert obj.__module__.startswith("jaxmem._src."), (name, obj.__module__)


def test_the_planner_registry_and_the_protocol():
  assert {"greedy", "segments", "vdnn", "vdnn-all", "vdnn-conv", "layrub", "autoswap", "window",
          "optimal", "dqn", "auto", "best", "greedy-remat", "segments-remat", "segments-modules",
          "segments-offload", "segments-modules-offload", "selective"} == set(jaxmem.PLANNERS)
  for name, planner in jaxmem.PLANNERS.items():
    params = inspect.signature(planner).parameters
    assert {"copies", "window"} <= set(params), name        # the Planner protocol's options
    assert jaxmem.get_planner(name) is planner
