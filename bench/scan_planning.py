"""Scanned layers: how long planning takes and how far a plan gets, against the same model unrolled.

The examples' GPT (flax linen, adamw
train step) with its decoder blocks written as one ``nn.scan`` over stacked
parameters (``scan_layers=True``, how large models are written) and unrolled
(a Python loop), at 12, 24 and 48 layers. For each: the equations jaxmem
sees, the time to trace and analyze the step, the time for ``auto`` to plan
it at half of its estimated peak, the estimated peak before and after that
plan; for the scanned steps also ``jaxmem.fit(0.5)`` on this machine's CPU
(its compiled peak, or the ``BudgetError`` and whether it names the scan).

The planners see a scan as one opaque block and plan nothing inside it: the
``plan`` columns of the scanned rows show that. ``fit`` then plans the step
rewritten to recompute stacked residuals per iteration
(``jaxmem/_src/ir/scan_remat.py``), keeping the body values a cost model
ranks most worth their bytes (``jaxmem/_src/planners/scan_policy.py``): the
``fit(0.5)`` column, with how its results compare with ``jax.jit``'s. The unrolled
rows show what planning time costs when every layer is its own equations.
Times are of one run on a shared 2-core machine, printed as they come.

Then the scanned GPT at a TPU size (batch 64, sequence 256) on a TPU v5e,
compiled ahead of time (``target="tpu:v5e"``, the ``xla`` backend): plain
``jax.jit``, JAX's policies by hand (``nn.remat`` on the scanned block) and
``fit(0.5)``, ``fit(0.3)``, ``fit(0.15)``, with compiled peaks and FLOPs.

Run: ``python bench/scan_planning.py [--layers 12,24,48] [--no-unrolled] [--tpu-layers 12]``;
writes ``bench/results/scan_planning.{json,md}``. About 15 minutes on 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
from typing import Any

import jax
import numpy as np

import jaxmem

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
import transformer  # noqa: E402
from _results import commit, flops_of, write_excerpt  # noqa: E402

RESULTS = HERE / "results"
SIZE = dict(batch_size=8, seq_len=64, dim=128, heads=4)
# A TPU size: XLA:TPU keeps small temporaries on chip, so the unplanned peak is
# made large (4.1 GiB at 12 layers) for a plan to have something to do.
TPU_SIZE = dict(batch_size=64, seq_len=256, dim=128, heads=4)
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
      fitted = jaxmem.fit(0.5)(step)
      res = fitted.fit_result(*args)
      row["fit"] = f"{res.peak_bytes / MiB:.1f} MiB ({res.peak_bytes / unplanned:.2f})"
      row["scans"] = res.scans
      row["results"] = _compare(fitted(*args), jax.jit(step)(*args))
    except jaxmem.BudgetError as e:
      row["fit"] = (f"BudgetError: smallest {e.smallest_bytes / MiB:.1f} MiB "
                    f"({e.smallest_bytes / unplanned:.2f})"
                    + ("; names the scan" if "by the `scan` at" in str(e) else ""))
    row["fit_s"] = round(time.perf_counter() - t0, 1)
  return row


def _compare(out: Any, ref: Any) -> str:
  """How the fitted step's results (updated parameters and optimizer state) compare with jit's."""
  pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(out),
                                                           jax.tree.leaves(ref))]
  differ = sum(not np.array_equal(a, b) for a, b in pairs)
  if not differ:
    return "bit-identical to jax.jit"
  worst = max(float(np.max(np.abs(a - b))) for a, b in pairs)
  return f"{differ} of {len(pairs)} leaves differ, max abs {worst:.1e}"


def measure_tpu(layers: int) -> list[dict[str, Any]]:
  """The scanned GPT at a TPU size on a v5e, compiled ahead of time: jit, JAX's policy by hand, fit."""
  target = jaxmem.get_target("tpu:v5e")
  donate = (0, 1)   # parameters and optimizer state, as a training loop does
  rows = []

  def row(method: str, compiled: Any, extra: dict[str, Any]) -> dict[str, Any]:
    mem = jaxmem.compiled_memory(compiled)
    return dict(layers=layers, method=method, peak_mib=round(mem.peak_bytes / MiB, 1),
                host_mib=round(mem.host_temp_bytes / MiB, 1), gflop=flops_of(compiled), **extra)

  step, args = transformer.build(layers=layers, scan_layers=True, **TPU_SIZE)
  placed = target.place(args)
  rows.append(row("jit", jax.jit(step, donate_argnums=donate).lower(*placed).compile(), {}))
  for policy in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
    s2, a2 = transformer.build(layers=layers, scan_layers=True, remat_policy=policy, **TPU_SIZE)
    compiled = jax.jit(s2, donate_argnums=donate).lower(*target.place(a2)).compile()
    rows.append(row(f"policy:{policy}", compiled, {}))
  for frac in (0.5, 0.3, 0.15):
    t0 = time.perf_counter()
    try:
      fitted = jaxmem.fit(frac, target="tpu:v5e", donate_argnums=donate)(step)
      res = fitted.fit_result(*args)
      rows.append(row(f"fit({frac})", fitted.lower(*args).compile(),
                      dict(budget_mib=round(res.budget_bytes / MiB, 1),
                           within=res.peak_bytes <= res.budget_bytes, scans=res.scans,
                           fit_s=round(time.perf_counter() - t0, 1))))
    except jaxmem.BudgetError as e:
      rows.append(dict(layers=layers, method=f"fit({frac})",
                       error=f"BudgetError: smallest {e.smallest_bytes / MiB:.1f} MiB",
                       budget_mib=round(e.budget_bytes / MiB, 1),
                       fit_s=round(time.perf_counter() - t0, 1)))
    print(json.dumps(rows[-1]), flush=True)
  base_peak, base_flops = rows[0]["peak_mib"], rows[0]["gflop"]
  for r in rows:
    if r.get("peak_mib") is not None:
      r["of_jit"] = round(r["peak_mib"] / base_peak, 2)
    if r.get("gflop") and base_flops:
      r["flops_vs_jit"] = round(r["gflop"] / base_flops, 2)
      r["gflop"] = round(r["gflop"] / 1e9, 1)
  return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  out = ["# Planning scanned layers", "",
         f"`python bench/scan_planning.py` ({meta['when']} at {meta['commit']}, jax "
         f"{meta['jax']}, {meta['machine']}). GPT of the examples, batch {SIZE['batch_size']}, "
         f"sequence {SIZE['seq_len']}, width {SIZE['dim']}; `plan` is `auto` at 0.5 of the "
         "estimated peak; `fit(0.5)` is of the compiled peak, on this CPU. Its results (updated "
         "parameters and adamw state after one step) are compared with `jax.jit`'s: recomputing "
         "part of each block, XLA:CPU sums some gradients in another order (the gradients "
         "equal `jax.jit`'s to float32 rounding: `tests/planners/test_scan_policy.py`), and "
         "adamw's first update is `lr * sign(g)`, which flips where a gradient is rounding noise. "
         "The choice that keeps only the carry is bit-identical to `nn.remat(nothing_saveable)`.",
         "",
         "| layers | form | equations | analyze s | plan s | estimate MiB | planned estimate MiB "
         "| decisions | compiled MiB | fit(0.5) | fit s | results of fit(0.5) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r['layers']} | {r['form']} | {r['ops']} | {r['analyze_s']} | {r['plan_s']} "
               f"| {r['estimate_mib']} | {r['planned_estimate_mib']} | {r['decisions']} "
               f"| {r.get('compiled_mib', '-')} | {r.get('fit', '-')} | {r.get('fit_s', '-')} "
               f"| {r.get('results', '-')} |")
  if meta.get("tpu"):
    out += ["", f"## TPU v5e, compiled ahead of time (libtpu; no step run on a TPU)", "",
            f"The scanned GPT at batch {TPU_SIZE['batch_size']}, sequence {TPU_SIZE['seq_len']}, "
            f"width {TPU_SIZE['dim']}, parameters and optimizer state donated; `fit` with "
            "`target=\"tpu:v5e\"` (the `xla` backend). JAX's policies are `nn.remat` on the "
            "scanned block.", "",
            "| layers | method | TPU peak MiB | of jit | host MiB | FLOPs vs jit | budget MiB | within | fit s | scans |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in meta["tpu"]:
      if "error" in r:
        out.append(f"| {r['layers']} | {r['method']} | {r['error']} | - | - | - "
                   f"| {r['budget_mib']} | no | {r['fit_s']} | - |")
      else:
        out.append(f"| {r['layers']} | {r['method']} | {r['peak_mib']} | {r.get('of_jit', '-')} "
                   f"| {r['host_mib']} | {r.get('flops_vs_jit', '-')}x | {r.get('budget_mib', '-')} "
                   f"| {r.get('within', '-')} | {r.get('fit_s', '-')} | {r.get('scans') or '-'} |")
  return "\n".join(out) + "\n"


def write(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
  """``scan_planning.md`` and its README excerpt (everything below the title)."""
  md = markdown(rows, meta)
  (RESULTS / "scan_planning.md").write_text(md)
  write_excerpt("scan_planning", md.split("\n", 2)[2])
  print(md)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", default="12,24,48")
  p.add_argument("--no-unrolled", action="store_true", help="skip the unrolled steps")
  p.add_argument("--render", action="store_true",
                 help="measure nothing: rewrite scan_planning.md from scan_planning.json")
  p.add_argument("--tpu-layers", type=int, default=12,
                 help="layers of the scanned GPT fitted for a TPU v5e (0: skip; needs jax[tpu])")
  a = p.parse_args()
  if a.render:
    data = json.loads((RESULTS / "scan_planning.json").read_text())
    write(data["rows"], data["meta"])
    return
  meta = dict(when=time.strftime("%Y-%m-%d %H:%M"), commit=commit(),
              jax=jax.__version__, machine=f"{platform.machine()}, {jax.devices()[0].platform}")
  rows = []
  for layers in map(int, a.layers.split(",")):
    for scanned in (True, False) if not a.no_unrolled else (True,):
      row = measure(layers, scanned, fit=scanned)
      print(json.dumps(row), flush=True)
      rows.append(row)
  if a.tpu_layers:
    meta["tpu"] = measure_tpu(a.tpu_layers)
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "scan_planning.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  write(rows, meta)


if __name__ == "__main__":
  main()
