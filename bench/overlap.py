"""Overlap benchmark: one plan compiled with synchronous and with asynchronous copies.

For each case the step is fitted once (``jaxmem.fit``, synchronous copies) and
its plan is compiled twice: ``copies="sync"`` (one blocking custom call per
offload/fetch) and ``copies="async"`` (a start and a done per copy, placed by
``schedule.async_copies`` after Hayakawa et al. §3, the copy running on the copy
engine's worker thread in between). Same decisions, same budget: only the copy
ops differ. Both must stay within the budget and be bit-identical to
``jax.jit``; then both run interleaved in one process (alternating order each
round: the machine is shared and noisy) and the ratio async/sync is printed,
as the median of per-round ratios and as the ratio of the fastest steps.

Copy-engine counters per asynchronous step say why: ``copy ms`` is the time
the copies took, ``blocked ms`` the part of it a done still waited for.

Threading. XLA:CPU computes on every core of the process's CPU affinity; the
copy worker is one more thread. ``shared`` (XLA's default) leaves no idle core
for a copy to overlap on: the worker competes with the computation it should
hide. ``copy-core`` gives XLA all cores but one (it sizes its thread pool from
the affinity mask) and pins the copy worker to the last one
(``JAXMEM_COPY_CPUS``), which is what an accelerator has: copy engines that
are separate hardware, so a copy only competes for memory bandwidth. Each
setting runs in its own subprocess (affinity and XLA's pool are per process).

Run: ``python bench/overlap.py [--quick] [--rounds N] [--threads shared,copy-core]``
Writes bench/results/overlap.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from _results import write_excerpt  # noqa: E402

SETTINGS = ("shared", "copy-core")


def apply_setting(setting: str) -> str:
  """Sets this (fresh) process up for ``setting``; returns a description."""
  cpus = sorted(os.sched_getaffinity(0))
  if setting == "shared" or len(cpus) < 2:
    return f"XLA and the copy worker share CPUs {cpus}"
  compute, copy = cpus[:-1], cpus[-1]
  os.sched_setaffinity(0, compute)            # before jax starts its thread pool
  os.environ["JAXMEM_COPY_CPUS"] = str(copy)  # read when the copy engine starts
  return f"XLA computes on CPUs {compute}, the copy worker runs on CPU {copy}"


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  model: str
  kwargs: dict[str, Any]
  budget: float
  offload_only: bool = False   # greedy with remat disabled: the plan moves bytes
  note: str = ""


CASES = [
    Case("mlp-8x512-b8192", "mlp", dict(batch_size=8192), 0.5,
         note="examples/mlp.py, budget 0.5 (the fit benchmark's plan)"),
    Case("gpt-4x128-b32", "transformer", dict(batch_size=32), 0.5,
         note="examples/transformer.py, budget 0.5"),
    Case("mlp-8x32-b262144", "mlp", dict(batch_size=262144, width=32), 0.5, offload_only=True,
         note="copy-heavy: narrow layers on a large batch (32 MiB activations, little compute "
              "per byte); offload-only greedy so the plan moves bytes"),
]


def build(case: Case):
  return __import__(case.model).build(**case.kwargs)


def planned_compiled(plan: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
  """The plan's rewritten step, compiled for ``args`` (same flat signature as the step)."""
  import jax
  from jaxmem._src.lower.ffi import schedule_function
  run = schedule_function(plan.schedule())
  out_tree = plan.program.out_tree

  def planned(*a: Any) -> Any:
    return jax.tree_util.tree_unflatten(out_tree, run(*jax.tree_util.tree_leaves(a)))

  return jax.jit(planned, compiler_options=options or None).lower(*args).compile()


def max_abs_diff(a: Any, b: Any) -> float:
  """Largest absolute difference over all leaves (0.0: bit-identical up to NaN payloads)."""
  import jax
  import numpy as np
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  worst = 0.0
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    if x.size and not np.array_equal(x, y):
      worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) or 1e-300)
  return worst


def run_case(case: Case, rounds: int, window: float | None) -> dict[str, Any]:
  import jax
  import jaxmem
  from jaxmem import native
  from jaxmem._src.planners.greedy import greedy

  step, args = build(case)
  planner = functools.partial(greedy, allow_remat=False) if case.offload_only else "auto"
  t0 = time.perf_counter()
  fitted = jaxmem.fit(case.budget, planner=planner)(step)
  res = fitted.fit_result(*args)
  plan_sync = res.plan
  plan_async = dataclasses.replace(plan_sync, copies="async", window=window)
  sched = plan_async.schedule()
  split = [w for w in sched.windows
           if w.offload_done > w.offload_start or w.fetch_done > w.fetch_start]
  compiled = {
      "sync": planned_compiled(plan_sync, args, res.compiler_options),
      "async": planned_compiled(plan_async, args, res.compiler_options),
  }
  mem = {k: jaxmem.compiled_memory(c).peak_bytes for k, c in compiled.items()}
  want = jax.jit(step)(*args)
  got = {k: c(*args) for k, c in compiled.items()}
  diff = {k: max_abs_diff(g, want) for k, g in got.items()}
  diff["async_vs_sync"] = max_abs_diff(got["async"], got["sync"])
  # What a user of `jaxmem.fit(..., copies="async")` gets (the planner prices
  # the windows itself; it may pick other decisions).
  fit_async = jaxmem.fit(case.budget, planner=planner, copies="async", window=window)(step)
  res_async = fit_async.fit_result(*args)
  setup_s = time.perf_counter() - t0

  for c in compiled.values():   # warm up: first runs fault in memory
    for _ in range(2):
      jax.block_until_ready(c(*args))
  times: dict[str, list[float]] = {"sync": [], "async": []}
  copy_s, wait_s, stolen = [], [], 0
  for r in range(rounds):
    order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
    for k in order:
      s0 = native.copy_stats()
      t = time.perf_counter()
      jax.block_until_ready(compiled[k](*args))
      times[k].append(time.perf_counter() - t)
      s1 = native.copy_stats()
      if k == "async":
        copy_s.append(s1.copy_seconds - s0.copy_seconds)
        wait_s.append(s1.wait_seconds - s0.wait_seconds)
        stolen += s1.stolen - s0.stolen
  ratios = [a / s for a, s in zip(times["async"], times["sync"])]
  stats = native.copy_stats()
  return dict(
      case=case.name, note=case.note, budget_fraction=case.budget, budget=res.budget_bytes,
      unplanned_peak=res.unplanned_peak_bytes, offloads=plan_sync.num_offload,
      remat=plan_sync.num_remat, offloaded_bytes=plan_sync.offloaded_bytes,
      windows=len(split), window=window,
      peak_sync=mem["sync"], peak_async=mem["async"],
      within_sync=mem["sync"] <= res.budget_bytes, within_async=mem["async"] <= res.budget_bytes,
      identical_sync=diff["sync"] == 0.0, identical_async=diff["async"] == 0.0,
      max_abs_diff_sync=diff["sync"], max_abs_diff_async=diff["async"],
      max_abs_diff_async_vs_sync=diff["async_vs_sync"],
      fit_async_peak=res_async.peak_bytes, fit_async_rounds=res_async.rounds,
      fit_async_offloads=res_async.plan.num_offload, fit_async_remat=res_async.plan.num_remat,
      rounds=rounds, sync_ms=[1e3 * t for t in times["sync"]],
      async_ms=[1e3 * t for t in times["async"]],
      sync_min_ms=1e3 * min(times["sync"]), async_min_ms=1e3 * min(times["async"]),
      sync_median_ms=1e3 * statistics.median(times["sync"]),
      async_median_ms=1e3 * statistics.median(times["async"]),
      ratio_median=statistics.median(ratios),
      ratio_min=min(times["async"]) / min(times["sync"]),
      async_faster_rounds=sum(x < 1.0 for x in ratios),
      copy_ms_per_step=1e3 * statistics.median(copy_s),
      blocked_ms_per_step=1e3 * statistics.median(wait_s),
      stolen_per_step=stolen / rounds,
      outstanding_after=stats.outstanding,
      store_entries_after=native.store_stats().live_entries,
      setup_s=setup_s)


def worker(a: argparse.Namespace) -> None:
  setting = apply_setting(a.threads)
  import jax
  from jaxmem import native
  cases = [c for c in CASES if not a.cases or c.name in a.cases.split(",")]
  rows = []
  for case in cases:
    print(f"[{a.threads}] {case.name} ...", file=sys.stderr, flush=True)
    row = run_case(case, a.rounds, a.window)
    row.update(threads=a.threads, copy_threads=native.copy_stats().threads)
    rows.append(row)
    print(f"[{a.threads}] {case.name}: async/sync {row['ratio_median']:.3f} (median of rounds), "
          f"{row['ratio_min']:.3f} (fastest); copies {row['copy_ms_per_step']:.1f} ms/step, "
          f"blocked {row['blocked_ms_per_step']:.1f}", file=sys.stderr, flush=True)
  meta = dict(jax=jax.__version__, backend=jax.default_backend(), cpus=os.cpu_count(),
              setting=setting, copy_cpus=list(native.copy_stats().cpus))
  pathlib.Path(a.worker_out).write_text(json.dumps(dict(meta=meta, rows=rows)))


def mib(x: float) -> str:
  return f"{x / 2**20:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
  head = ("| setting | case | budget MiB | offloads | split windows | peak sync / async MiB | "
          "max abs diff to jax.jit: sync / async | sync ms (median) | async ms (median) | "
          "**async/sync** (median of rounds) | async/sync (fastest) | async faster in | "
          "copy ms/step | blocked ms/step |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    ok = " / ".join("0 (bit-identical)" if d == 0 else f"{d:.1e}"
                    for d in (r["max_abs_diff_sync"], r["max_abs_diff_async"]))
    within = "" if r["within_sync"] and r["within_async"] else " (OVER)"
    lines.append(
        f"| {r['threads']} | {r['case']} | {mib(r['budget'])} | {r['offloads']} | {r['windows']} | "
        f"{mib(r['peak_sync'])} / {mib(r['peak_async'])}{within} | {ok} | "
        f"{r['sync_median_ms']:.0f} | {r['async_median_ms']:.0f} | **{r['ratio_median']:.3f}** | "
        f"{r['ratio_min']:.3f} | {r['async_faster_rounds']}/{r['rounds']} | "
        f"{r['copy_ms_per_step']:.1f} | {r['blocked_ms_per_step']:.1f} |")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="fewer rounds")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
  p.add_argument("--threads", default=",".join(SETTINGS),
                 help=f"comma-separated settings from {SETTINGS}")
  p.add_argument("--window", type=float, default=None, help="async window (default: jaxmem's)")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.rounds is None:
    a.rounds = 6 if a.quick else 20
  if a.worker_out:
    worker(a)
    return
  rows, metas = [], {}
  for threads in a.threads.split(","):
    if threads not in SETTINGS:
      p.error(f"unknown setting {threads!r}; use {SETTINGS}")
    env = dict(os.environ)
    tmp = pathlib.Path(a.out) / f".overlap-{threads}.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--worker-out", str(tmp), "--rounds", str(a.rounds),
           "--cases", a.cases]
    cmd += ["--threads", threads] + (["--window", str(a.window)] if a.window is not None else [])
    subprocess.run(cmd, env=env, check=True)
    got = json.loads(tmp.read_text())
    tmp.unlink()
    rows += got["rows"]
    metas[threads] = got["meta"]
  md = table(rows)
  print(md)
  for r in rows:
    print(f"overlap ratio async/sync [{r['threads']}] {r['case']}: {r['ratio_median']:.3f}")
  out = pathlib.Path(a.out)
  meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), settings=metas)
  (out / "overlap.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "overlap.md").write_text(
      "# Overlap: the same plan with synchronous vs asynchronous copies\n\n"
      "Produced by `python bench/overlap.py` (one run; see its docstring). Each row: one "
      "plan from `jaxmem.fit` (greedy; offload-only for the copy-heavy case), compiled with "
      "`copies=\"sync\"` and with `copies=\"async\"` (default window), both within the "
      "budget, timed interleaved in one process. async/sync < 1: asynchronous copies are "
      "faster. *copy ms/step*: time the copies took on the copy engine; *blocked*: the part "
      "of it a done still waited for (the rest was hidden behind computation).\n\n"
      "Settings: *shared* = XLA computes on every core and the copy worker competes with it "
      "(XLA's default); *copy-core* = XLA on all cores but one, the copy worker pinned to "
      "that one (`JAXMEM_COPY_CPUS`), as a GPU's copy engines are separate hardware.\n\n"
      f"{meta}\n\n{md}\n")
  print(f"wrote {write_excerpt('overlap', readme_excerpt(rows, meta), out)}")


def readme_excerpt(rows: list[dict], meta: dict) -> str:
  """The README's view: async/sync per setting and case."""
  lines = [f"`python bench/overlap.py` ({meta['date']}; `bench/results/overlap.md`): the same plan "
           "with synchronous and asynchronous copies, timed interleaved; async/sync < 1 is "
           "faster. *shared*: the copy worker competes with XLA for every core; *copy-core*: "
           "it has a core of its own (`JAXMEM_COPY_CPUS`), as a GPU's copy engine is its own "
           "hardware.", "",
           "| setting | case | offloads | async/sync (median of rounds) | copy ms per step, "
           "still blocked |", "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['threads']} | {r['case']} | {r['offloads']} | {r['ratio_median']:.3f} | "
                 f"{r['copy_ms_per_step']:.1f}, {r['blocked_ms_per_step']:.1f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
