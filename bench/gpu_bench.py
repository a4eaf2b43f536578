"""One plan through both backends on a GPU: compiled peak and step time side by side.

Runs on a machine with an NVIDIA GPU and jax's CUDA plugin, after ``pip install .``
(the package's own build: the CUDA handlers are plain C++ that load the CUDA
runtime of jax's CUDA wheels, no nvcc). For each model (examples/ at sizes whose
unplanned GPU peak is a few GiB) it compiles and runs, on the GPU:

* plain ``jax.jit`` (the reference: unplanned peak and step time);
* JAX's policies applied by hand to every block (``nn.remat`` through the
  examples' ``remat_policy=``): ``nothing_saveable``, ``dots_saveable`` and
  ``offload_dot_with_no_batch_dims`` (to ``pinned_host``);
* ``jaxmem.fit(0.5, backend="xla")`` and ``jaxmem.fit(0.5, backend="ffi")``
  (and ``copies="async"``: the copies on the CUDA handlers' own stream),
  each planned and verified on this GPU's compiled program;
* the plan of each fit lowered through the other backend
  (``jit_plan(plan, backend=...)``): the same plan through both backends.

Each row: the compiled peak (``argument + output + temp - alias`` of
``memory_analysis()``), host bytes (``host_temp_size_in_bytes``), the median
step time over ``--steps`` runs after a warm-up (arguments not donated, so every
run sees the same inputs), its ratio to ``jax.jit``, and whether the outputs
(new parameters, optimizer state, loss) are bit-identical to ``jax.jit``'s (else
the largest absolute difference). Rows are written to the JSON after each one,
and ``--deadline`` seconds after the start the remaining rows are skipped, so a
run cut short still reports what it measured.

Run (on the GPU machine): ``python bench/gpu_bench.py --out DIR [--models mlp,gpt,resnet18]``;
``--render`` rewrites ``gpu.md`` and the README excerpt from ``gpu.json`` here.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import importlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import jaxmem  # noqa: E402
from _results import flops_of, write_excerpt  # noqa: E402
from jaxmem._src.lower.backend import jit_plan  # noqa: E402

POLICIES = ("nothing_saveable", "dots_saveable", "offload_dot_with_no_batch_dims")
BUDGET = 0.5
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Model:
  module: str
  kwargs: dict[str, Any]
  label: str
  smoke: dict[str, Any]   # --smoke: tiny, to check this script on any backend


MODELS = {
    # examples/mlp.py at its defaults is the step `python -m jaxmem demo` fits.
    "demo": Model("mlp", dict(batch_size=8192, width=512, depth=8),
                  "MLP 8x512, batch 8192, adam (the demo's step)",
                  dict(batch_size=512, width=128, depth=4)),
    "mlp": Model("mlp", dict(batch_size=32768, width=1024, depth=8),
                 "MLP 8x1024, batch 32768, adam", dict(batch_size=512, width=128, depth=4)),
    "gpt": Model("transformer", dict(batch_size=128, seq_len=256, dim=128, heads=4, layers=4),
                 "GPT 4x128, seq 256, batch 128, adamw",
                 dict(batch_size=8, seq_len=32, dim=32, heads=2, layers=2)),
    "resnet18": Model("resnet", dict(batch_size=128, depth=18, image_size=112, classes=1000),
                      "ResNet-18, 112x112, batch 128, SGD momentum",
                      dict(batch_size=8, depth=18, image_size=32, width=8, classes=10,
                           stages=(1, 1, 1, 1))),
}

T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


SMOKE = False


def build(model: Model, policy: str | None = None) -> tuple[Any, Any]:
  kw = dict(model.smoke if SMOKE else model.kwargs)
  if policy is not None:
    kw["remat_policy"] = policy
  return importlib.import_module(model.module).build(**kw)


def measure(compiled: Any) -> dict[str, Any]:
  mem = jaxmem.compiled_memory(compiled)
  return dict(peak=mem.peak_bytes, temp=mem.temp_bytes, host=mem.host_temp_bytes,
              flops=flops_of(compiled))


def time_steps(compiled: Any, args: Any, steps: int) -> tuple[float, float, list[Any]]:
  """Seconds per ``compiled(*args)``: the median of ``steps`` waited-for runs after a warm-up,
  and the mean of ``steps`` runs dispatched back to back (as a training loop
  does: the host prepares the next step while the GPU runs this one); its outputs."""
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  t = time.perf_counter()
  outs = [compiled(*args) for _ in range(steps)]
  jax.block_until_ready(outs)
  pipelined = (time.perf_counter() - t) / steps
  del outs
  return statistics.median(times), pipelined, out


def _union_ns(intervals: list[tuple[int, int]]) -> int:
  """Nanoseconds covered by the union of ``(start, end)`` intervals."""
  covered, reach = 0, None
  for start, end in sorted(intervals):
    if reach is None or start > reach:
      covered += end - start
      reach = end
    elif end > reach:
      covered += end - reach
      reach = end
  return covered


def kernel_profile(compiled: Any, args: Any, runs: int = 3, top: int = 40) -> dict[str, Any]:
  """Where a step's GPU time goes: ``jax.profiler`` events of ``runs`` steps on the device.

  Per step: ``busy_ms``, the time at least one kernel or copy ran on the GPU
  (the union of every device event, so copies that overlap computation count
  once), and ``compute_ms``, the kernels of the compute stream alone. Unlike
  wall-clock step time these leave out the host's work around each call
  (dispatch, allocating the outputs, updating CUDA graphs), which varies from
  run to run by more than the plans differ. Also the events summed by the
  ``hlo_op`` they ran for (the kernel's name where they carry none), the
  ``top`` longest kept, and each timeline line's total.
  """
  device = "/device:GPU" if jax.default_backend() == "gpu" else "/host:CPU"  # (--smoke)
  with tempfile.TemporaryDirectory() as d:
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(d):
      for _ in range(runs):
        jax.block_until_ready(compiled(*args))
    files = sorted(pathlib.Path(d).rglob("*.xplane.pb"))
    if not files:
      return dict(error="jax.profiler wrote no .xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    lines: dict[str, list[float]] = {}
    ops: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    spans: list[tuple[int, int]] = []
    compute_ns = 0.0
    for plane in data.planes:
      if not plane.name.startswith(device):
        continue
      for line in plane.lines:
        total = lines.setdefault(f"{plane.name} {line.name}", [0.0, 0])
        for event in line.events:
          op = str(dict(event.stats).get("hlo_op") or event.name)
          start = int(event.start_ns)
          spans.append((start, start + int(event.duration_ns)))
          if "Compute" in line.name:
            compute_ns += event.duration_ns
          for acc in (total, ops[line.name, op]):
            acc[0] += event.duration_ns / runs
            acc[1] += 1 / runs
  ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])
  return dict(runs=runs, busy_ms=_union_ns(spans) / runs / 1e6, compute_ms=compute_ns / runs / 1e6,
              lines={k: dict(us=v[0] / 1e3, kernels=v[1]) for k, v in lines.items()},
              ops=[dict(line=k[0], op=k[1], us=v[0] / 1e3, kernels=v[1]) for k, v in ranked[:top]],
              num_ops=len(ops))


def compare(got: Any, want: Any) -> dict[str, Any]:
  identical, worst = True, 0.0
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    if not np.array_equal(g, w):
      identical = False
      worst = max(worst, float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))))
  return dict(identical=identical, max_abs_diff=worst)


def run_model(name: str, steps: int, deadline: float, budget: float, emit: Any,
              profile_dir: pathlib.Path | None = None) -> None:
  model = MODELS[name]
  step, args = build(model)
  base: dict[str, Any] = {}
  want: Any = None
  plans: dict[str, Any] = {}

  def row(method: str, compiled_fn: Any) -> None:
    nonlocal want
    r: dict[str, Any] = dict(model=name, size=model.label, method=method)
    if time.perf_counter() - T0 > deadline:
      r.update(status="skipped", error=f"--deadline {deadline:.0f} s reached")
      emit(r)
      return
    t = time.perf_counter()
    try:
      compiled, info, *own_args = compiled_fn()
      r.update(info)
      r.update(measure(compiled))
      puts = jaxmem.native.store_stats().total_puts
      call_args = own_args[0] if own_args else args
      r["step_s"], r["pipelined_s"], out = time_steps(compiled, call_args, steps)
      # Copies into jaxmem's host store per step (the ffi backend's offloads:
      # on a GPU, the CUDA handlers' copies to pinned host memory).
      r["store_puts_per_step"] = (jaxmem.native.store_stats().total_puts - puts) / (2 * steps + 1)
      if profile_dir is not None:
        # Kernel times per HLO op, and the compiled HLO they name (to read offline).
        r["profile"] = kernel_profile(compiled, call_args)
        profile_dir.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "_" for c in f"{name}_{method}")
        with gzip.open(profile_dir / f"{slug}.hlo.txt.gz", "wt") as f:
          f.write(compiled.as_text())
      if method == "jit":
        want = out
        base.update(r)
      elif jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(want):
        r.update(compare(out, want))
      del compiled, out
      if base:
        r["peak_fraction"] = r["peak"] / base["peak"]
        r["time_ratio"] = r["step_s"] / base["step_s"]
        if "pipelined_s" in base:
          r["pipelined_ratio"] = r["pipelined_s"] / base["pipelined_s"]
        if "profile" in base and "busy_ms" in r.get("profile", {}):
          r["busy_ratio"] = r["profile"]["busy_ms"] / base["profile"]["busy_ms"]
      r["status"] = "ok"
    except jaxmem.BudgetError as e:
      r.update(status="BudgetError", budget=e.budget_bytes, smallest=e.smallest_bytes,
               error=str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 (recorded as the row; the bench goes on)
      r.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0][:300],
               traceback=traceback.format_exc())
      log(r["traceback"])
    r["wall_s"] = time.perf_counter() - t
    emit(r)
    log(f"[{name}] {method}: {describe(r)} ({r['wall_s']:.1f} s)")

  row("jit", lambda: (jax.jit(step).lower(*args).compile(), {}))
  if not base:
    return

  for policy in POLICIES:
    def by_hand(policy: str = policy) -> tuple[Any, ...]:
      # Its own arguments: a model wrapped in nn.remat may name its parameters
      # differently (the same seed gives the same values where the names agree).
      s, own = build(model, policy)
      return jax.jit(s).lower(*own).compile(), {}, own
    row(f"policy:{policy}", by_hand)

  def fitted(backend: str, copies: str = "sync") -> tuple[Any, dict[str, Any]]:
    f = jaxmem.fit(budget, backend=backend, copies=copies)(step)
    t = time.perf_counter()
    res = f.fit_result(*args)
    planning = time.perf_counter() - t
    plans[backend if copies == "sync" else f"{backend} {copies}"] = res.plan
    info = dict(budget=res.budget_bytes, within=res.peak_bytes <= res.budget_bytes,
                fit_peak=res.peak_bytes, rounds=res.rounds, planning_s=planning,
                planner=res.plan.planner, remat=res.plan.num_remat,
                offload=res.plan.num_offload, backend=res.backend, platform=res.platform)
    return f.lower(*args).compile(), info

  row(f"fit({budget:g}) xla", lambda: fitted("xla"))
  row(f"fit({budget:g}) ffi", lambda: fitted("ffi"))
  # The CUDA handlers' own copy stream (start/done pairs the window scheduler
  # places), against the default's copies on XLA's compute stream.
  row(f"fit({budget:g}) ffi async", lambda: fitted("ffi", "async"))

  def same_plan(source: str, backend: str) -> tuple[Any, dict[str, Any]]:
    plan = plans.get(source)
    if plan is None:
      raise RuntimeError(f"the {source} fit made no plan")
    return (jit_plan(plan, backend=backend).lower(*args).compile(),
            dict(planner=plan.planner, remat=plan.num_remat, offload=plan.num_offload,
                 backend=backend))
  row("xla fit's plan via ffi", lambda: same_plan("xla", "ffi"))
  row("ffi fit's plan via xla", lambda: same_plan("ffi", "xla"))
  jaxmem.native.store_clear()


def describe(r: dict[str, Any]) -> str:
  if r["status"] == "BudgetError":
    return f"BudgetError: smallest {r['smallest'] / MIB:.1f} MiB"
  if r["status"] != "ok":
    return f"{r['status']}: {r.get('error', '')}"
  s = f"peak {r['peak'] / MIB:.1f} MiB, host {r['host'] / MIB:.1f} MiB, step {r['step_s'] * 1e3:.2f} ms"
  if "peak_fraction" in r:
    s += f" ({r['peak_fraction']:.2f} of jit's peak, {r['time_ratio']:.2f}x its time)"
  if "pipelined_s" in r:
    s += f", pipelined {r['pipelined_s'] * 1e3:.2f} ms"
  if "busy_ms" in r.get("profile", {}):
    s += f", GPU busy {r['profile']['busy_ms']:.2f} ms"
  if "identical" in r:
    s += ", bit-identical" if r["identical"] else f", max |diff| {r['max_abs_diff']:.2g}"
  if "budget" in r:
    s += f", budget {r['budget'] / MIB:.1f} MiB {'within' if r['within'] else 'OVER'}"
  return s


def table(rows: list[dict[str, Any]]) -> str:
  head = ("| model | method | GPU peak MiB | of jit | host MiB | step ms | vs jit "
          "| pipelined ms | vs jit | GPU busy ms | vs jit | outputs "
          "| budget MiB | within | fit: rounds, planning s, remat / offload |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    cells = [r["model"], r["method"]]
    if r["status"] == "BudgetError":
      cells += [f"`BudgetError`: smallest {r['smallest'] / MIB:.1f}"] + ["-"] * 10 + [
          f"{r['budget'] / MIB:.1f}", "no", "-"]
    elif r["status"] != "ok":
      cells += [f"{r['status']}: {r.get('error', '')}".replace("|", "\\|")] + ["-"] * 12
    else:
      outputs = ("bit-identical" if r.get("identical") else
                 f"max diff {r['max_abs_diff']:.2g}" if "identical" in r else
                 "reference" if r["method"] == "jit" else "not compared (other parameter tree)")
      cells += [f"{r['peak'] / MIB:.1f}", f"{r.get('peak_fraction', 1.0):.2f}",
                f"{r['host'] / MIB:.1f}", f"{r['step_s'] * 1e3:.2f}",
                f"{r.get('time_ratio', 1.0):.2f}x"]
      busy = r.get("profile", {}).get("busy_ms")
      cells += ([f"{r['pipelined_s'] * 1e3:.2f}", f"{r.get('pipelined_ratio', 1.0):.2f}x"]
                if "pipelined_s" in r else ["-", "-"])
      cells += ([f"{busy:.2f}", f"{r.get('busy_ratio', 1.0):.2f}x"] if busy is not None
                else ["-", "-"])
      cells.append(outputs)
      if "budget" in r:
        cells += [f"{r['budget'] / MIB:.1f}", "yes" if r["within"] else "**NO**"]
      else:
        cells += ["-", "-"]
      cells.append(f"{r['rounds']}, {r['planning_s']:.1f} s, {r['remat']} / {r['offload']}"
                   if "rounds" in r else
                   f"{r['remat']} / {r['offload']} (no planning)" if "remat" in r else "-")
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  sizes = "; ".join(f"{m}: {s}" for m, s in dict.fromkeys((r["model"], r["size"]) for r in rows))
  return "\n".join([
      "# One plan through both backends on a GPU",
      "",
      f"`{meta.get('command', 'python bench/gpu_bench.py')}` on {meta['device']} ({meta['date']}, commit "
      f"{meta['commit']}; jax {meta['jax']}, jaxlib {meta['jaxlib']}; CUDA handlers: "
      f"{meta['cuda_status']}).",
      "",
      f"Models: {sizes}. Peak = argument + output + temp - alias bytes of the GPU's "
      "compiled `memory_analysis()`; host = its `host_temp_size_in_bytes` (the `ffi` "
      "backend's copies go to jaxmem's pinned host pool, which XLA does not count). Step "
      f"ms: median of {meta['steps']} runs after a warm-up, each waited for, arguments not "
      f"donated; pipelined ms: {meta['steps']} runs dispatched back to back, per run; GPU "
      "busy ms (`--profile` rows): the time per step at least one kernel or copy ran on "
      "the GPU, from `jax.profiler`. "
      "Outputs: the new parameters, optimizer state and loss against `jax.jit`'s. "
      "`policy:` rows apply `jax.checkpoint_policies` by hand to every block; `fit(f) "
      "xla|ffi` rows are `jaxmem.fit(f, backend=...)`, planned and verified on this GPU "
      "(planning s includes every compile); the last two rows lower each fit's plan "
      "through the other backend (`jit_plan(plan, backend=...)`).",
      "",
      table(rows),
      "",
      *(["## On the same machine", "", *(f"- {n}" for n in meta["notes"]), ""]
        if meta.get("notes") else []),
  ])


def excerpt(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  return "\n".join([
      f"`python bench/gpu_bench.py` on {meta['device']} (jax {meta['jax']}, commit "
      f"{meta['commit']}; full table and notes `bench/results/gpu.md`):",
      "",
      table([r for r in rows if r["method"] == "jit" or r["method"].startswith(("fit", "xla fit", "ffi fit"))
             or r["method"] == "policy:nothing_saveable"]),
      "",
      *(f"- {n}" for n in meta.get("notes", [])[1:5]),
  ])


def write(out: pathlib.Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "gpu.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "gpu.md").write_text(markdown(rows, meta))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--budget", type=float, default=BUDGET,
                 help="the fraction of jax.jit's peak the fits aim at (default 0.5)")
  p.add_argument("--deadline", type=float, default=float("inf"),
                 help="seconds after which the remaining rows are skipped")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  p.add_argument("--commit", default=os.environ.get("JAXMEM_COMMIT", "?"))
  p.add_argument("--profile", default="",
                 help="models whose rows also get a kernel profile (jax.profiler) and "
                      "their compiled HLO under OUT/profile/")
  p.add_argument("--smoke", action="store_true",
                 help="tiny models on any backend (checks this script; not a measurement)")
  p.add_argument("--render", action="store_true",
                 help="run nothing: rewrite gpu.md and the README excerpt from gpu.json")
  a = p.parse_args()
  out = pathlib.Path(a.out)
  if a.render:
    data = json.loads((out / "gpu.json").read_text())
    write(out, data["rows"], data["meta"])
    print(table(data["rows"]))
    print(f"wrote {write_excerpt('gpu_bench', excerpt(data['rows'], data['meta']), out)}")
    return
  global SMOKE
  SMOKE = a.smoke
  if jax.default_backend() != "gpu" and not a.smoke:
    p.error(f"this bench runs on a GPU; jax.default_backend() is {jax.default_backend()!r}")
  names = [m.strip() for m in a.models.split(",") if m.strip()]
  unknown = [m for m in names if m not in MODELS]
  if unknown:
    p.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
  import jaxlib  # noqa: PLC0415
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              jaxlib=jaxlib.__version__, cuda_status=jaxmem.native.CUDA_STATUS,
              date=time.strftime("%Y-%m-%d %H:%M"), commit=a.commit, steps=a.steps,
              models=names, smoke=a.smoke, budget=a.budget)
  rows: list[dict[str, Any]] = []

  def emit(r: dict[str, Any]) -> None:
    rows.append(r)
    write(out, rows, meta)

  log(f"{meta['device']}, jax {meta['jax']}, CUDA handlers {meta['cuda_status']}")
  profiled = {m.strip() for m in a.profile.split(",")}
  for name in names:
    try:
      run_model(name, a.steps, a.deadline, a.budget, emit,
                out / "profile" if name in profiled else None)
    except Exception:  # noqa: BLE001 (a model that fails to build: logged, the bench goes on)
      log(f"[{name}] failed:\n{traceback.format_exc()}")
  meta["wall_s"] = time.perf_counter() - T0
  write(out, rows, meta)
  print(table(rows))


if __name__ == "__main__":
  main()
