"""Host memory of the examples' offload plans: planned layouts against best-fit, side by side.

For each example step and each planner that offloads (the papers' vDNN, Layrub, AutoSwap and
window planners, at half the estimated peak), the planned step (``ffi`` backend) runs twice
with the host store in its default mode ``"planned"`` (each host buffer at its static offset
in the plan's layout, solved offline before the step: SmartPool, Zhang et al. §III;
``jaxmem/_src/lower/host_layout.py``) and twice in mode ``"best_fit"`` (the caching allocator
of Hayakawa et al. §4). The table gives the layout's max load (the most host bytes live at
one step of the schedule: no layout is smaller), the planned footprint, how many allocations
the run served from their slots and how many fell back to best-fit (the compiled program ran
two copies in another order than the schedule), best-fit's peak footprint, and whether both
runs' results are bit-identical to each other.

Writes bench/results/host_layout.{json,md}. Run: ``python bench/host_layout.py [--quick]``
(about 5 minutes on 2 cores; ``--render`` writes the tables again from the last run's JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import subprocess
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jaxmem  # noqa: E402
from jaxmem import native  # noqa: E402
from jaxmem._src.lower.backend import jit_plan  # noqa: E402
from jaxmem._src.lower.host_layout import host_layout  # noqa: E402
from _results import write_excerpt  # noqa: E402

EXAMPLES = {
    "mlp": ("mlp", dict(batch_size=1024)),
    "cnn": ("cnn", dict(batch_size=32)),
    "transformer": ("transformer", dict(batch_size=8)),
    "lstm": ("lstm", dict(batch_size=16, seq_len=32)),
    "resnet18": ("resnet", dict(batch_size=4, depth=18, image_size=64)),
    "unet": ("unet", dict(batch_size=2, image_size=64, depth=3, width=16)),
}
PLANNERS = ("vdnn", "layrub", "autoswap", "window")
BUDGET = 0.5


def _run_twice(step, args):
  outs = None
  for _ in range(2):
    outs = jax.block_until_ready(step(*args))
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(outs)]


def measure(quick: bool) -> list[dict]:
  rows = []
  examples = list(EXAMPLES.items())[:2] if quick else list(EXAMPLES.items())
  for name, (module, kw) in examples:
    step, args = __import__(module).build(**kw)
    for planner in PLANNERS:
      print(f"[{name}/{planner}] ...", file=sys.stderr, flush=True)
      plan = jaxmem.plan(step, *args, planner=planner, budget=BUDGET)
      layout = host_layout(plan.schedule())
      if layout is None:
        rows.append(dict(example=name, planner=planner, offloads=0))
        continue
      native.store_clear()
      native.store_configure("planned")
      planned = _run_twice(jit_plan(plan), args)
      stats = native.store_plan_stats(layout.key)
      native.store_clear()
      native.store_configure("best_fit")
      best_fit = _run_twice(jit_plan(plan), args)
      bf = native.store_stats()
      native.store_clear()
      native.store_configure("planned")
      rows.append(dict(
          example=name, planner=planner, offloads=len(layout.nbytes),
          max_load=layout.max_load, planned_footprint=stats["footprint"],
          planned_allocs=stats["planned"], fallbacks=stats["fallbacks"],
          best_fit_footprint=bf.peak_footprint_bytes,
          identical=all(a.tobytes() == b.tobytes() for a, b in zip(planned, best_fit))))
  return rows


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f}"


def markdown(rows: list[dict], meta: dict) -> str:
  lines = [
      "# Host memory of offload plans: planned layouts and best-fit", "",
      f"`python bench/host_layout.py` ({meta['date']}, jaxmem {meta['commit']}, jax "
      f"{meta['jax']}, {meta['machine']}). Plans at {BUDGET} of each step's estimated peak; "
      "each step run twice per mode (`bench/host_layout.py` says how).", "",
      "| example | planner | offloads | max load MiB | planned footprint MiB | from slots | "
      "fallbacks | best-fit footprint MiB | results identical |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if not r["offloads"]:
      lines.append(f"| {r['example']} | {r['planner']} | 0 | - | - | - | - | - | - |")
      continue
    lines.append(
        f"| {r['example']} | {r['planner']} | {r['offloads']} | {_mib(r['max_load'])} | "
        f"{_mib(r['planned_footprint'])} | {r['planned_allocs']} | {r['fallbacks']} | "
        f"{_mib(r['best_fit_footprint'])} | {'yes' if r['identical'] else 'no'} |")
  lines += ["", summary(rows)]
  return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
  done = [r for r in rows if r["offloads"]]
  at_load = sum(r["planned_footprint"] == r["max_load"] for r in done)
  clean = sum(r["fallbacks"] == 0 for r in done)
  ratio = [r["best_fit_footprint"] / r["max_load"] for r in done if r["max_load"]]
  others = ("" if clean == len(done) else " (the others ran some copies in another order "
            "than the schedule: their fallback buffers went to best-fit)")
  return (f"* {len(done)} offload plans: the planned footprint equals the max load in "
          f"{at_load}; no fallback in {clean}{others}; best-fit's footprint "
          f"is {min(ratio):.2f}x to {max(ratio):.2f}x the max load (median "
          f"{float(np.median(ratio)):.2f}x); results bit-identical between the modes in "
          f"{sum(r['identical'] for r in done)}.")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two examples only")
  parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
  parser.add_argument("--render", action="store_true",
                      help="only write the tables again from the results file of the last run")
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  if args.render:
    saved = json.loads((out / "host_layout.json").read_text())
    meta, rows = saved["meta"], saved["rows"]
  else:
    t0 = time.perf_counter()
    rows = measure(args.quick)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    meta = dict(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), commit=commit,
                jax=jax.__version__, machine=platform.machine(),
                total_s=round(time.perf_counter() - t0, 1))
  text = markdown(rows, meta)
  print(text)
  out.mkdir(parents=True, exist_ok=True)
  (out / "host_layout.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "host_layout.md").write_text(text)
  print(f"wrote {out / 'host_layout.json'}, {out / 'host_layout.md'}")
  excerpt = (f"`python bench/host_layout.py` ({meta['date']}; `bench/results/host_layout.md`): "
             "host memory of the examples' offload plans, the store's planned layouts "
             "(SmartPool's offline allocation) against best-fit.\n\n" + summary(rows))
  print(f"wrote {write_excerpt('host_layout', excerpt, out)}")


if __name__ == "__main__":
  main()
