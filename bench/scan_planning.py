"""Scanned layers: how long planning takes and how far a plan gets, against the same model unrolled.

The baseline for planning inside scans: the examples' GPT (flax linen, adamw
train step) with its decoder blocks written as one ``nn.scan`` over stacked
parameters (``scan_layers=True``, how large models are written) and unrolled
(a Python loop), at 12, 24 and 48 layers. For each: the equations jaxmem
sees, the time to trace and analyze the step, the time for ``auto`` to plan
it at half of its estimated peak, the estimated peak before and after that
plan; for the scanned steps also ``jaxmem.fit(0.5)`` on this machine's CPU
(its compiled peak, or the ``BudgetError`` and whether it names the scan).

Today jaxmem sees a scan as one opaque block: it plans nothing inside it, so
the scanned rows show what per-iteration planning has to improve, and the
unrolled rows what planning time costs when every layer is its own
equations. Times are of one run on a shared 2-core machine, printed as they
come.

Run: ``python bench/scan_planning.py [--layers 12,24,48] [--no-unrolled]``; writes
``bench/results/scan_planning.{json,md}``. About 10 minutes on 2 CPUs, most of it planning the
unrolled 48-layer step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

import jax

import jaxmem

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
import transformer  # noqa: E402

RESULTS = HERE / "results"
SIZE = dict(batch_size=8, seq_len=64, dim=128, heads=4)
MiB = 2 ** 20


def measure(layers: int, scanned: bool, fit: bool) -> dict[str, Any]:
  step, args = transformer.build(layers=layers, scan_layers=scanned, **SIZE)
  t0 = time.perf_counter()
  prog = jaxmem.analyze(step, *args)
  analyze_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  plan = jaxmem.plan(step, *args, budget=int(0.5 * prog.peak_bytes))
  plan_s = time.perf_counter() - t0
  row = dict(layers=layers, form="scan" if scanned else "unrolled", ops=len(prog.ops),
             analyze_s=round(analyze_s, 2), plan_s=round(plan_s, 2),
             estimate_mib=round(prog.peak_bytes / MiB, 1),
             planned_estimate_mib=round(plan.estimated_peak_bytes / MiB, 1),
             decisions=len(plan.decisions))
  if fit:
    unplanned = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes
    row["compiled_mib"] = round(unplanned / MiB, 1)
    t0 = time.perf_counter()
    try:
      res = jaxmem.fit(0.5)(step).fit_result(*args)
      row["fit"] = f"{res.peak_bytes / MiB:.1f} MiB ({res.peak_bytes / unplanned:.2f})"
    except jaxmem.BudgetError as e:
      row["fit"] = (f"BudgetError: smallest {e.smallest_bytes / MiB:.1f} MiB "
                    f"({e.smallest_bytes / unplanned:.2f})"
                    + ("; names the scan" if "by the `scan` at" in str(e) else ""))
    row["fit_s"] = round(time.perf_counter() - t0, 1)
  return row


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  out = ["# Planning scanned layers: the baseline", "",
         f"`python bench/scan_planning.py` ({meta['when']} at {meta['commit']}, jax "
         f"{meta['jax']}, {meta['machine']}). GPT of the examples, batch {SIZE['batch_size']}, "
         f"sequence {SIZE['seq_len']}, width {SIZE['dim']}; `plan` is `auto` at 0.5 of the "
         "estimated peak; `fit(0.5)` is of the compiled peak, on this CPU.", "",
         "| layers | form | equations | analyze s | plan s | estimate MiB | planned estimate MiB "
         "| decisions | compiled MiB | fit(0.5) | fit s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r['layers']} | {r['form']} | {r['ops']} | {r['analyze_s']} | {r['plan_s']} "
               f"| {r['estimate_mib']} | {r['planned_estimate_mib']} | {r['decisions']} "
               f"| {r.get('compiled_mib', '-')} | {r.get('fit', '-')} | {r.get('fit_s', '-')} |")
  return "\n".join(out) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", default="12,24,48")
  p.add_argument("--no-unrolled", action="store_true", help="skip the unrolled steps")
  a = p.parse_args()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=HERE).stdout.strip()
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                         capture_output=True, text=True, cwd=HERE).stdout.strip()
  meta = dict(when=time.strftime("%Y-%m-%d %H:%M"), commit=commit + ("+dirty" if dirty else ""),
              jax=jax.__version__, machine=f"{platform.machine()}, {jax.devices()[0].platform}")
  rows = []
  for layers in map(int, a.layers.split(",")):
    for scanned in (True, False) if not a.no_unrolled else (True,):
      row = measure(layers, scanned, fit=scanned)
      print(json.dumps(row), flush=True)
      rows.append(row)
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "scan_planning.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (RESULTS / "scan_planning.md").write_text(markdown(rows, meta))
  print(markdown(rows, meta))


if __name__ == "__main__":
  main()
