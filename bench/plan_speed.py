"""How fast does ``auto`` plan ResNet-50? Target (issue 14): under 2 s on this 2-core machine.

ResNet-50 (``examples/resnet.py``, 224x224, batch 32 and 64) with shape-only
arguments (``jax.ShapeDtypeStruct``: nothing is allocated or compiled), budget
half of the estimated peak, as in ``bench/planners.py`` part 2. Per batch:

  * ``jaxmem.analyze`` (tracing and the estimate), then
  * ``jaxmem.get_planner(name)(program, budget, device, copies="async")`` for
    ``auto`` and its two candidates that decide on ResNet-50 (``segments``,
    ``greedy``), per device profile: ``h100-pcie`` (a GPU, where ``auto``
    skips the offload-only planners by their overhead bound) and ``cpu``
    (host copies are memory copies there, so every offload-only planner,
    AutoSwap's Bayesian optimisation included, runs).

Each is timed ``--reps`` times (min / median / max), each time on a program
analyzed anew (untimed): jaxmem keeps the schedules it built per program, and
a repetition on the same program would find them. The first ``analyze`` of
each program is a warm-up for JAX's caches and is not counted.
Then one ``auto`` run is profiled with cProfile (top functions by cumulative
time). Planning is deterministic: every repetition returns the same plan.

Run: ``python bench/plan_speed.py [--reps 3] [--batches 32,64]``; writes
``bench/results/plan_speed.{json,md}``. About 2 minutes on 2 CPUs.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pathlib
import platform
import pstats
import statistics
import sys
import time
from typing import Any, Callable

import jax

import jaxmem
from _results import RESULTS, commit, write_excerpt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import resnet  # noqa: E402

TARGET_S = 2.0
PLANNERS = ("auto", "segments", "greedy")
DEVICES = ("h100-pcie", "cpu")


def timed(fn: Callable[..., Any], reps: int,
          fresh: Callable[[], Any] | None = None) -> tuple[list[float], Any]:
  """``reps`` wall times of ``fn()``, or of ``fn(fresh())`` with ``fresh()`` untimed."""
  times, out = [], None
  for _ in range(reps):
    arg = fresh() if fresh is not None else None
    t0 = time.perf_counter()
    out = fn(arg) if fresh is not None else fn()
    times.append(time.perf_counter() - t0)
  return times, out


def top_functions(prof: cProfile.Profile, n: int = 15) -> list[dict[str, Any]]:
  st = pstats.Stats(prof, stream=io.StringIO())
  rows = []
  for (file, line, func), (_, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][3]):
    if "jaxmem" not in file:
      continue
    rows.append({"function": f"{file[file.rindex('jaxmem'):]}:{line}({func})", "calls": nc,
                 "tottime_s": round(tt, 3), "cumtime_s": round(ct, 3)})
    if len(rows) >= n:
      break
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--batches", default="32,64")
  ap.add_argument("--out", default=str(RESULTS / "plan_speed"))
  a = ap.parse_args()
  batches = [int(b) for b in a.batches.split(",")]
  rows: list[dict[str, Any]] = []
  programs: list[dict[str, Any]] = []
  profile_rows: list[dict[str, Any]] = []
  for batch in batches:
    step, args = resnet.build(batch_size=batch, depth=50, image_size=224, abstract=True)
    print(f"[resnet-50 b{batch}] analyze ...", file=sys.stderr, flush=True)
    jaxmem.analyze(step, *args)                      # warm-up: JAX's tracing caches
    t_an, prog = timed(lambda: jaxmem.analyze(step, *args), a.reps)
    budget = prog.peak_bytes // 2
    programs.append(dict(batch=batch, ops=prog.num_ops, peak=prog.peak_bytes, budget=budget,
                         analyze_s=t_an))
    for device in DEVICES:
      for name in PLANNERS:
        print(f"[resnet-50 b{batch}] {name} on {device} ...", file=sys.stderr, flush=True)
        planner = jaxmem.get_planner(name)
        # Each repetition plans a program analyzed anew: jaxmem caches the
        # schedules it built per program, which a repeat would find.
        times, plan = timed(lambda p: planner(p, budget, device, copies="async"), a.reps,
                            fresh=lambda: jaxmem.analyze(step, *args))
        rows.append(dict(batch=batch, device=device, planner=name, chosen=plan.planner,
                         times_s=times, estimated=plan.estimated_peak_bytes, budget=budget,
                         fits=plan.estimated_peak_bytes <= budget, remat=plan.num_remat,
                         offload=plan.num_offload))
    if batch == batches[-1]:
      fresh_prog = jaxmem.analyze(step, *args)
      prof = cProfile.Profile()
      prof.enable()
      jaxmem.get_planner("auto")(fresh_prog, budget, "h100-pcie", copies="async")
      prof.disable()
      profile_rows = top_functions(prof)

  meta = dict(jax=jax.__version__, backend=jax.default_backend(), cpus=os.cpu_count(),
              python=platform.python_version(), commit=commit(),
              date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), reps=a.reps)
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, programs=programs, rows=rows,
                                                      profile=profile_rows), indent=1))

  def fmt(ts: list[float]) -> str:
    return f"{min(ts):.2f} | {statistics.median(ts):.2f} | {max(ts):.2f}"

  lines = ["# Planning speed: ResNet-50", "",
           f"`python bench/plan_speed.py --reps {a.reps} --batches {a.batches}` (jax "
           f"{meta['jax']}, {meta['backend']}, {meta['cpus']} CPUs, python {meta['python']}; "
           f"{meta['date']} at {meta['commit']}). ResNet-50, 224x224, shape-only arguments; "
           "budget half of the estimated peak; seconds over "
           f"{a.reps} repetitions. Target: `auto` under {TARGET_S:.0f} s.", "",
           "| batch | ops | estimated peak GiB | analyze s (min / median / max) |",
           "|---|---|---|---|"]
  for p in programs:
    lines.append(f"| {p['batch']} | {p['ops']} | {p['peak'] / 2**30:.2f} | "
                 f"{fmt(p['analyze_s'])} |")
  lines += ["", "| batch | device profile | planner | plan | estimated GiB | fits | "
            "remat / offload | min s | median s | max s | under 2 s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['batch']} | {r['device']} | {r['planner']} | {r['chosen']} | "
                 f"{r['estimated'] / 2**30:.2f} | {'yes' if r['fits'] else 'NO'} | "
                 f"{r['remat']} / {r['offload']} | {fmt(r['times_s'])} | "
                 f"{'yes' if statistics.median(r['times_s']) < TARGET_S else 'no'} |")
  auto_rows = [r for r in rows if r["planner"] == "auto"]
  met = [r for r in auto_rows if statistics.median(r["times_s"]) < TARGET_S]
  lines += ["", f"`auto` under {TARGET_S:.0f} s (median): {len(met)} of {len(auto_rows)} "
            "(batch, device profile) pairs."]
  for r in auto_rows:
    if r not in met:
      lines.append(f"- Not met: batch {r['batch']} with the `{r['device']}` profile, median "
                   f"{statistics.median(r['times_s']):.2f} s (plan `{r['chosen']}`).")
  lines += ["", f"cProfile of one `auto` run (batch {batches[-1]}, `h100-pcie`), jaxmem's "
            "functions by cumulative time (the profiler slows the run about 2x):", "",
            "| function | calls | tottime s | cumtime s |", "|---|---|---|---|"]
  for r in profile_rows:
    lines.append(f"| `{r['function']}` | {r['calls']} | {r['tottime_s']} | {r['cumtime_s']} |")
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))

  def median_of(batch: int, device: str) -> str:
    (r,) = [r for r in auto_rows if r["batch"] == batch and r["device"] == device]
    return f"{statistics.median(r['times_s']):.2f} s"

  per_device = []
  for device in DEVICES:
    ok = all(statistics.median(r["times_s"]) < TARGET_S for r in auto_rows
             if r["device"] == device)
    per_device.append(f"{' and '.join(median_of(b, device) for b in batches)} with the "
                      f"`{device}` profile ({'met' if ok else '**not met**'})")
  excerpt = (f"`python bench/plan_speed.py` ({meta['date']}; `bench/results/plan_speed.md`): "
             f"`auto` plans ResNet-50 (224x224, batch {' and '.join(map(str, batches))}, "
             f"shape-only arguments, budget half the estimated peak) in "
             f"{'; in '.join(per_device)}; median of {a.reps}, target under {TARGET_S:.0f} s. "
             "With the `cpu` profile host copies cost what device copies do, so every "
             "offload-only planner runs, AutoSwap's search included.")
  print(f"wrote {write_excerpt('plan_speed', excerpt, out.parent)}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
