"""Benchmark the offline DSA solver (`jaxmem.dsa`): footprint vs max load, and solve time.

For every instance, best-fit (SmartPool's heuristic, Zhang et al. §III-C), first-fit, and the exact
branch-and-bound (seeded with both, stopped at ``--time-limit``) are run; the table gives the max
load (a lower bound on any footprint), each footprint and its ratio to the max load, whether the
exact footprint is proven optimal, nodes searched, and times. Instances:

* ``random-N``: N buffers with uniform start times over [0, N), geometric lifetimes (mean N/16)
  and log-uniform sizes (16 B .. 64 KiB);
* ``tight-N``: N buffers whose live bytes are exactly 64 KiB at every time step (hard: the
  optimum is usually above the max load);
* real jaxmem traces: the non-fused intermediate values of the example train steps
  (:func:`jaxmem.dsa.from_program`).

Writes bench/results/dsa.{json,md,png}. Run: ``python bench/dsa_bench.py [--quick]
[--time-limit S]`` (the full run takes about 1.5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jaxmem
from jaxmem import dsa
from _results import write_excerpt  # noqa: E402

RANDOM_SIZES = (50, 200, 1000, 5000)
TIGHT_SIZES = (20, 50, 200, 1000)
SEEDS = (0, 1)
TRACES = {
    "mlp-8x512-b2048": ("mlp", dict(batch_size=2048)),
    "cnn-maxpool-b64": ("cnn", dict(batch_size=64)),
    "gpt-4x128-b16": ("transformer", dict(batch_size=16)),
}


def random_instance(n: int, seed: int) -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(seed)
  lower = rng.integers(0, n, n)
  upper = lower + 1 + rng.geometric(1 / max(2, n / 16), n)
  size = (2 ** rng.uniform(4, 16, n)).astype(np.int64)
  return lower, upper, size


def tight_instance(n: int, seed: int, width: int = 1 << 16) -> tuple[np.ndarray, ...]:
  """Buffers continue to the next step with probability 0.8; new ones top the load up to width."""
  rng = np.random.default_rng(seed)
  lower: list[int] = []
  upper: list[int] = []
  size: list[int] = []
  live: list[int] = []
  t = 0
  while len(size) < n:
    live = [i for i in live if rng.random() < 0.8]
    for i in live:
      upper[i] = t + 1
    load = sum(size[i] for i in live)
    while load < width and len(size) < n:
      s = int(min(width - load, 2 ** rng.uniform(4, 16)))
      lower.append(t)
      upper.append(t + 1)
      size.append(s)
      live.append(len(size) - 1)
      load += s
    t += 1
  return np.array(lower), np.array(upper), np.array(size)


def instances(quick: bool):
  seeds = SEEDS[:1] if quick else SEEDS
  for n in RANDOM_SIZES[:3] if quick else RANDOM_SIZES:
    for seed in seeds:
      yield f"random-{n}/s{seed}", "random", random_instance(n, seed)
  for n in TIGHT_SIZES[:3] if quick else TIGHT_SIZES:
    for seed in seeds:
      yield f"tight-{n}/s{seed}", "tight", tight_instance(n, seed)
  for name, (module, kw) in (list(TRACES.items())[:1] if quick else TRACES.items()):
    print(f"[{name}] tracing ...", file=sys.stderr, flush=True)
    step, args = __import__(module).build(**kw)
    prog = jaxmem.analyze(step, *args)
    yield f"trace {name}", "trace", dsa.from_program(prog)


def run(quick: bool, time_limit: float) -> list[dict]:
  rows = []
  for name, family, (lower, upper, size) in instances(quick):
    print(f"[{name}] n={len(size)} ...", file=sys.stderr, flush=True)
    bf = dsa.solve(lower, upper, size, method="best-fit")
    ff = dsa.solve(lower, upper, size, method="first-fit")
    ex = dsa.solve(lower, upper, size, method="exact", time_limit_s=time_limit)
    for sol in (bf, ff, ex):                      # every solution is checked independently
      assert dsa.check(lower, upper, size, sol.offsets) == sol.footprint
    assert ex.footprint <= min(bf.footprint, ff.footprint)
    rows.append(dict(
        instance=name, family=family, n=len(size), max_load=ex.max_load,
        best_fit=bf.footprint, best_fit_ratio=bf.ratio, best_fit_s=bf.seconds,
        first_fit=ff.footprint, first_fit_ratio=ff.ratio, first_fit_s=ff.seconds,
        exact=ex.footprint, exact_ratio=ex.ratio, exact_s=ex.seconds, exact_nodes=ex.nodes,
        exact_method=ex.method, proven=ex.proven_optimal, timed_out=ex.timed_out))
  return rows


def _ms(s: float) -> str:
  return f"{1e3 * s:.1f}"


def markdown(rows: list[dict], meta: dict) -> str:
  lines = [
      "# Offline DSA benchmark (`jaxmem.dsa`)", "",
      f"{meta}", "",
      ("Footprint ratio = footprint / max load (the max load is a lower bound; 1.000 is "
       "optimal). The exact search starts from the better of best-fit and first-fit and stops "
       f"after {meta['time_limit_s']} s; *proven* = optimal (reached the max load, or the search "
       "finished). `found by` = which algorithm produced the exact column's offsets."), "",
      ("| instance | n | max load | best-fit footprint (ratio) | first-fit ratio | "
       "exact footprint (ratio) | proven | found by | nodes | best-fit ms | exact ms |"),
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['instance']} | {r['n']} | {r['max_load']:,} | {r['best_fit']:,} "
        f"({r['best_fit_ratio']:.4f}) | {r['first_fit_ratio']:.4f} | {r['exact']:,} "
        f"({r['exact_ratio']:.4f}) | {'yes' if r['proven'] else 'no'} | {r['exact_method']} | "
        f"{r['exact_nodes']:,} | {_ms(r['best_fit_s'])} | {_ms(r['exact_s'])} |")
  lines += ["", summary(rows)]
  return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
  out = []
  for family in ("random", "tight", "trace"):
    sub = [r for r in rows if r["family"] == family]
    if not sub:
      continue
    better = sum(r["exact"] < r["best_fit"] for r in sub)
    proven = sum(r["proven"] for r in sub)

    def gm(key: str, sub: list[dict] = sub) -> float:
      return float(np.exp(np.mean([np.log(r[key]) for r in sub])))

    out.append(f"* {family}: {len(sub)} instances; geometric-mean ratio best-fit "
               f"{gm('best_fit_ratio'):.4f}, first-fit {gm('first_fit_ratio'):.4f}, exact "
               f"{gm('exact_ratio'):.4f}; exact below best-fit on {better}, proven optimal on "
               f"{proven}.")
  return "\n".join(out)


def plot(rows: list[dict], path: pathlib.Path) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed (pip install 'jaxmem[plot]'): no PNG", file=sys.stderr)
    return False
  names = [r["instance"] for r in rows]
  x = np.arange(len(rows))
  fig, (ax, ax_t) = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(rows)), 7), sharex=True)
  for k, (key, label) in enumerate([("best_fit_ratio", "best-fit (SmartPool)"),
                                    ("first_fit_ratio", "first-fit"),
                                    ("exact_ratio", "exact (B&B, time-limited)")]):
    ax.bar(x + (k - 1) * 0.27, [r[key] - 1 for r in rows], 0.27, label=label)
  for i, r in enumerate(rows):
    if r["proven"]:
      ax.annotate("*", (x[i] + 0.27, r["exact_ratio"] - 1), ha="center", va="bottom")
  ax.set_ylabel("footprint / max load - 1")
  ax.set_title("Offline DSA: footprint above the max-load lower bound (* = proven optimal)")
  ax.legend()
  ax_t.bar(x - 0.2, [max(r["best_fit_s"], 1e-6) for r in rows], 0.4, label="best-fit")
  ax_t.bar(x + 0.2, [max(r["exact_s"], 1e-6) for r in rows], 0.4, label="exact")
  ax_t.set_yscale("log")
  ax_t.set_ylabel("seconds")
  ax_t.legend()
  ax_t.set_xticks(x)
  ax_t.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer, smaller instances")
  parser.add_argument("--time-limit", type=float, default=2.0,
                      help="seconds for each exact search (default 2)")
  parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
  args = parser.parse_args()
  t0 = time.perf_counter()
  rows = run(args.quick, args.time_limit)
  meta = dict(time_limit_s=args.time_limit, machine=platform.machine(),
              python=platform.python_version(), numpy=np.__version__,
              date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              total_s=round(time.perf_counter() - t0, 1))
  text = markdown(rows, meta)
  print(text)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "dsa.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "dsa.md").write_text(text)
  print(f"wrote {out / 'dsa.json'}, {out / 'dsa.md'}")
  trace_ms = max((r["exact_s"] for r in rows if r["family"] == "trace"), default=0.0) * 1e3
  excerpt = (f"`python bench/dsa_bench.py` ({meta['date']}; `bench/results/dsa.md`): footprint / "
             "max load (1 is optimal) of best-fit by decreasing size (SmartPool), first-fit and "
             f"the exact search stopped after {meta['time_limit_s']:g} s; the slowest exact "
             f"solve of a jaxmem trace took {trace_ms:.1f} ms.\n\n" + summary(rows))
  print(f"wrote {write_excerpt('dsa_bench', excerpt, out)}")
  if plot(rows, out / "dsa.png"):
    print(f"wrote {out / 'dsa.png'}")


if __name__ == "__main__":
  main()
