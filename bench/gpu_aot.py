"""The `gpu:h100` target (XLA:GPU compiled ahead of time, no GPU) against an H100.

Compiles the steps of ``bench/gpu_bench.py`` for ``target="gpu:h100"`` on this
machine -- XLA:GPU's deviceless compilation through jax's CUDA plugin, from the
H100's device description (``jaxmem._src.estimate.targets.GPU_TARGET_CONFIGS``) --
and puts each compiled peak next to the one measured on an H100 of the device
machine (``bench/results/gpu_h100.json``): plain ``jax.jit``, JAX's policies by hand,
and ``jaxmem.fit(0.5, target="gpu:h100")`` (the ``xla`` backend, the only one a
GPU target compiled ahead of time can use: our CUDA handlers need a GPU to run).

Needs ``pip install "jax[cuda12]"`` (the CUDA plugin matching jax; no GPU).
Run: ``python bench/gpu_aot.py [--models mlp,gpt,resnet18] [--no-fit]``; writes
bench/results/gpu_aot.{json,md}. The H100 runs used the device image's jax 0.11.2;
this machine compiles with its own jax, so rows differ where XLA changed between
the two versions.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compile for the GPU; run nothing on one

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bench  # noqa: E402  (its models, at the same sizes)
import jaxmem  # noqa: E402
from _results import commit  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402

TARGET = "gpu:h100"
MIB = 2 ** 20
T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def run(names: list[str], fit: bool) -> list[dict[str, Any]]:
  target = get_target(TARGET)
  rows = []
  for name in names:
    model = gpu_bench.MODELS[name]
    methods = [("jit", None), *((f"policy:{p}", p) for p in gpu_bench.POLICIES)]
    if fit:
      methods.append(("fit(0.5) xla", None))
    for method, policy in methods:
      row: dict[str, Any] = dict(model=name, method=method)
      t = time.perf_counter()
      try:
        step, args = gpu_bench.build(model, policy)
        if method.startswith("fit"):
          res = jaxmem.fit(0.5, target=TARGET, backend="xla")(step).fit_result(*args)
          row.update(peak=res.peak_bytes, budget=res.budget_bytes, status="ok",
                     remat=res.plan.num_remat, offload=res.plan.num_offload)
        else:
          compiled = jax.jit(step).lower(*target.place(args)).compile()
          row.update(peak=jaxmem.compiled_memory(compiled).peak_bytes, status="ok")
      except jaxmem.BudgetError as e:
        row.update(status="BudgetError", budget=e.budget_bytes, smallest=e.smallest_bytes)
      except Exception as e:  # noqa: BLE001 (recorded; the bench goes on)
        row.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0][:200])
        log(traceback.format_exc())
      row["wall_s"] = time.perf_counter() - t
      rows.append(row)
      log(f"[{name}] {method}: {row.get('peak', row.get('smallest', 0)) / MIB:.1f} MiB "
          f"({row['status']}, {row['wall_s']:.1f} s)")
  return rows


def cuda_plugin() -> str:
  """The installed jax CUDA plugin and its version (``jax-cuda12-plugin 0.10.2``)."""
  for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
    try:
      return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
      continue
  return "no CUDA plugin"


#: The GPU run compared with by default (``--device-results``): an H100's, from
#: ``bench/gpu_bench.py``.
DEVICE_RESULTS = "bench/results/gpu_h100.json"


def device_run(path: str) -> dict[str, Any]:
  """The GPU's rows and meta in ``path`` (relative to the repository; empty when absent)."""
  file = ROOT / path
  return json.loads(file.read_text()) if file.exists() else {"meta": {}, "rows": []}


def cell(r: dict[str, Any] | None) -> str:
  if r is None:
    return "-"
  if r["status"] == "BudgetError":
    return f"`BudgetError` (smallest {r['smallest'] / MIB:.1f})"
  if r["status"] != "ok":
    return r["status"]
  return f"{r['peak'] / MIB:.1f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  results = meta.get("device_results", DEVICE_RESULTS)
  dev = {(r["model"], r["method"]): r for r in device_run(results)["rows"]}
  plugin = meta["plugin"] if " " in meta["plugin"] else f"jax-cuda12-plugin {meta['plugin']}"
  lines = [
      "# The `gpu:h100` target against an H100",
      "",
      f"`python bench/gpu_aot.py` ({meta['date']}, commit {meta['commit']}; jax {meta['jax']}, "
      f"{plugin}, {meta.get('machine') or 'on a machine without a GPU'}) against "
      f"`{results}` (an "
      f"{meta.get('device', 'H100')} of the device machine, jax {meta['device_jax']}). "
      "Peaks in MiB (argument + output + temp - alias of `memory_analysis()`); the fit "
      "rows are `jaxmem.fit(0.5, backend='xla')` (on the H100 planned and verified there, "
      "here against the target's compiled program).",
      "",
      "| model | method | `gpu:h100` here | H100 there | here / there |",
      "|---|---|---|---|---|",
  ]
  for r in rows:
    d = dev.get((r["model"], r["method"]))
    ratio = (f"{r['peak'] / d['peak']:.3f}" if d is not None and r["status"] == "ok"
             and d["status"] == "ok" and not r["method"].startswith("fit") else "-")
    lines.append(f"| {r['model']} | {r['method']} | {cell(r)} | {cell(d)} | {ratio} |")
  return "\n".join(lines + [""])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=",".join(gpu_bench.MODELS))
  p.add_argument("--no-fit", action="store_true", help="compile the baselines only")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  p.add_argument("--render", action="store_true", help="rewrite gpu_aot.md from gpu_aot.json")
  p.add_argument("--device-results", default=DEVICE_RESULTS,
                 help="the GPU's bench/gpu_bench.py results to compare with")
  a = p.parse_args()
  out = pathlib.Path(a.out)
  if a.render:
    data = json.loads((out / "gpu_aot.json").read_text())
    (out / "gpu_aot.md").write_text(markdown(data["rows"], data["meta"]))
    return
  names = [m.strip() for m in a.models.split(",") if m.strip()]
  started = commit()
  rows = run(names, not a.no_fit)
  dev = device_run(a.device_results)["meta"]
  meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), commit=started, jax=jax.__version__,
              plugin=cuda_plugin(), machine=os.environ.get("JAXMEM_MACHINE", ""),
              device_jax=dev.get("jax", "?"), device=dev.get("device", "?"),
              device_results=a.device_results,
              models=names, wall_s=time.perf_counter() - T0)
  out.mkdir(parents=True, exist_ok=True)
  (out / "gpu_aot.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "gpu_aot.md").write_text(markdown(rows, meta))
  print(markdown(rows, meta))


if __name__ == "__main__":
  main()
