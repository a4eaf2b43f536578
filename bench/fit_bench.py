"""Benchmark `jaxmem.fit` on the example models: compiled peak vs budget, step time, planning time.

For every model and budget, one run prints and records (bench/results/fit.{json,md,png}):
unplanned compiled peak, budget, fitted compiled peak (must be <= budget), jaxmem's estimate,
plan size, rounds, planning+compile time, and the measured CPU step-time ratio fitted/unplanned
(interleaved timing in the same process: this machine is shared and noisy).

Run: ``python bench/fit_bench.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jaxmem  # noqa: E402
from _results import write_excerpt  # noqa: E402

MODELS = {
    "mlp-8x512-b8192": ("mlp", dict(batch_size=8192)),
    "cnn-maxpool-b64": ("cnn", dict(batch_size=64)),
    "cnn-maxpool-b128": ("cnn", dict(batch_size=128)),
    "gpt-4x128-b32": ("transformer", dict(batch_size=32)),
}
BUDGETS = [0.9, 0.7, 0.5, 0.4, 0.3]


def step_time(fn, args, reps):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def run(quick: bool) -> list[dict]:
  rows = []
  models = dict(list(MODELS.items())[:2]) if quick else MODELS
  budgets = [0.7, 0.5] if quick else BUDGETS
  for name, (module, kw) in models.items():
    step, args = __import__(module).build(**kw)
    plain = jax.jit(step)
    base = jaxmem.compiled_memory(plain.lower(*args).compile())
    est = jaxmem.analyze(step, *args).peak_bytes
    for frac in budgets:
      print(f"[{name}] budget {frac} ...", file=sys.stderr, flush=True)
      row = dict(model=name, budget_fraction=frac, unplanned_peak=base.peak_bytes,
                 unplanned_estimate=est)
      t0 = time.perf_counter()
      fitted = jaxmem.fit(frac)(step)
      try:
        res = fitted.fit_result(*args)
      except jaxmem.BudgetError as e:
        row.update(status="BudgetError", budget=e.budget_bytes, smallest=e.smallest_bytes,
                   plan_s=time.perf_counter() - t0)
        rows.append(row)
        continue
      plan = res.plan
      # Interleave to share the machine's noise between the two.
      reps = 3 if quick else 5
      t_plain, t_fit = [], []
      for _ in range(2):
        t_plain.append(step_time(plain, args, reps))
        t_fit.append(step_time(fitted, args, reps))
      diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) if np.size(a) else 0.0
                 for a, b in zip(jax.tree.leaves(fitted(*args)), jax.tree.leaves(plain(*args))))
      row.update(status="ok", budget=res.budget_bytes, peak=res.peak_bytes, max_abs_diff=diff,
                 planner=plan.planner,
                 within=res.peak_bytes <= res.budget_bytes,
                 estimate=plan.estimated_peak_bytes, rounds=res.rounds,
                 remat=plan.num_remat, offload=plan.num_offload,
                 offloaded_bytes=plan.offloaded_bytes, substitutions=plan.substituted_ops,
                 plan_s=res.planning_s, step_ratio=min(t_fit) / min(t_plain),
                 step_s=min(t_fit), plain_step_s=min(t_plain))
      rows.append(row)
  return rows


def mib(x):
  return f"{x / 2**20:.1f}"


def table(rows: list[dict]) -> str:
  head = ("| model | budget | unplanned MiB | budget MiB | fitted MiB | within | estimate MiB | "
          "remat/offload/subst | rounds | plan+compile s | CPU step ratio |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    if r["status"] != "ok":
      lines.append(f"| {r['model']} | {r['budget_fraction']} | {mib(r['unplanned_peak'])} | "
                   f"{mib(r['budget'])} | BudgetError (smallest {mib(r['smallest'])}) | - | - | - | - | "
                   f"{r['plan_s']:.1f} | - |")
      continue
    lines.append(f"| {r['model']} | {r['budget_fraction']} | {mib(r['unplanned_peak'])} | "
                 f"{mib(r['budget'])} | {mib(r['peak'])} | {'yes' if r['within'] else 'NO'} | "
                 f"{mib(r['estimate'])} | {r['remat']}/{r['offload']}/{r['substitutions']} | "
                 f"{r['rounds']} | {r['plan_s']:.1f} | {r['step_ratio']:.2f} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed (pip install 'jaxmem[plot]'): no PNG", file=sys.stderr)
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for model in dict.fromkeys(r["model"] for r in rows):
    pts = [r for r in rows if r["model"] == model and r["status"] == "ok"]
    if not pts:
      continue
    ax.plot([r["peak"] / r["unplanned_peak"] for r in pts], [r["step_ratio"] for r in pts],
            "o-", label=model)
    for r in pts:
      ax.annotate(f"{r['budget_fraction']}", (r["peak"] / r["unplanned_peak"], r["step_ratio"]),
                  textcoords="offset points", xytext=(4, 4), fontsize=8)
  ax.set_xlabel("fitted compiled peak / unplanned compiled peak")
  ax.set_ylabel("CPU step time / unplanned step time")
  ax.set_title("jaxmem.fit (default planner): memory vs overhead (labels: budget fraction)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True


def readme_excerpt(rows: list[dict], meta: dict) -> str:
  """The README's view of the run: every row, and the budget violations."""
  models = list(dict.fromkeys(r["model"] for r in rows))
  budgets = list(dict.fromkeys(r["budget_fraction"] for r in rows))
  ok = [r for r in rows if r["status"] == "ok"]
  violations = sum(not r["within"] for r in ok)
  exact = sum(r["max_abs_diff"] == 0 for r in ok)
  lines = [
      f"`python bench/fit_bench.py` (jax {meta['jax']}, {meta['backend']}, {meta['date']}; "
      f"full table `bench/results/fit.md`, plot `bench/results/fit.png`): {len(models)} models x "
      f"{len(budgets)} budgets, **{violations} budget violations** (compiled peak above the "
      f"budget) in {len(ok)} fitted steps; outputs of one step equal to plain `jax.jit` bit for "
      f"bit in {exact} of {len(ok)}. Step time is measured on this CPU against plain `jax.jit` "
      "in the same run.",
      "",
      "| model | budget | unplanned | fitted (compiled) | plan: remat / offload / substitutions "
      "| max abs diff to jit | CPU step time vs jit |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    head = f"| {r['model']} | {r['budget_fraction']} | {mib(r['unplanned_peak'])} MiB "
    if r["status"] != "ok":
      lines.append(head + f"| `BudgetError`: smallest reachable {mib(r['smallest'])} MiB | | | |")
      continue
    lines.append(head + f"| {mib(r['peak'])} MiB | {r['planner']}: {r['remat']} / {r['offload']} / "
                 f"{r['substitutions']} | {r['max_abs_diff']:.2g} | {r['step_ratio']:.2f}x |")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--quick", action="store_true", help="two models, two budgets")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  a = p.parse_args()
  rows = run(a.quick)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  md = table(rows)
  print(md)
  meta = dict(jax=jax.__version__, backend=jax.default_backend(), devices=str(jax.devices()),
              date=time.strftime("%Y-%m-%d %H:%M"))
  (out / "fit.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "fit.md").write_text(f"# jaxmem.fit benchmark\n\n{meta}\n\n{md}\n")
  violations = sum(1 for r in rows if r["status"] == "ok" and not r["within"])
  print(f"budget violations: {violations}")
  print(f"wrote {write_excerpt('fit_bench', readme_excerpt(rows, meta), out)}")
  if plot(rows, out / "fit.png"):
    print(f"wrote {out / 'fit.png'}")


if __name__ == "__main__":
  main()
