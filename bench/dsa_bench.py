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

A second table packs instances of the character of the public "challenging" static-allocation
suite (published with MiniMalloc, Moffitt, ASPLOS 2023: 150-450 buffers on a 2**20 time axis,
1 MiB capacity, max load at or within 6% of it) at their capacity (``solve(capacity=...,
goal="fit")``, stopped at ``--fit-time-limit``), beside best-fit: the generated families
``tiling`` (:func:`jaxmem.dsa.tiling_instance`), ``program``
(:func:`jaxmem.dsa.program_instance`) and ``grouped`` (the same, ``grouped=True``: ops
allocate and free several buffers at once), which come with a placement at capacity, and, with
``--suite DIR``, the public suite's own CSV files (``*.<capacity>.csv``, not shipped here),
and the same with every buffer above 0.1 of the capacity split into two halves with its
lifetime (``suite-split``: still feasible, only finer).
With ``--minimalloc BINARY`` MiniMalloc's own solver (a binary built from google/minimalloc,
not shipped here) packs the same instances under the same time limit, side by side; its
placements are checked like ours. A last table says what each family looks like beyond the
statistics the suite is described by (load over time, shared start/end times, crossing
lifetimes).

Writes bench/results/dsa.{json,md,png}. Run: ``python bench/dsa_bench.py [--quick]
[--time-limit S] [--fit-time-limit S] [--suite DIR] [--minimalloc BINARY]`` (about 1.5 minutes for the first table,
up to 24 x ``--fit-time-limit`` for the second (46 x with ``--suite``), on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jaxmem
from jaxmem import dsa
from jaxmem._src.native.dsa_instances import live_by_time  # noqa: E402
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


GENERATED_SEEDS = tuple(range(8))


def challenging_instances(quick: bool, suite: str | None):
  seeds = GENERATED_SEEDS[:2] if quick else GENERATED_SEEDS
  grouped = functools.partial(dsa.program_instance, grouped=True)
  for family, make in (("tiling", dsa.tiling_instance), ("program", dsa.program_instance),
                       ("grouped", grouped)):
    for seed in seeds:
      inst = make(seed)
      yield f"{family}/s{seed}", family, (inst.lower, inst.upper, inst.size), inst.capacity
  if suite:
    files = []   # (name, arrays, capacity), each file read once
    for path in sorted(pathlib.Path(suite).glob("*.csv")):
      capacity = int(path.suffixes[-2].lstrip(".")) if len(path.suffixes) >= 2 else 1 << 20
      inst = dsa.read_csv(path)
      files.append((path.name.split(".")[0], (inst.lower, inst.upper, inst.size), capacity))
    for name, arrays, capacity in files:
      yield f"suite/{name}", "suite", arrays, capacity
    for name, arrays, capacity in files:
      yield f"suite-split/{name}", "suite-split", split_large(*arrays, capacity), capacity


def split_large(lower, upper, size, capacity: int, fraction: float = 0.1):
  """Each buffer larger than ``fraction`` of the capacity as two halves with its lifetime.

  The instance stays feasible (the halves can sit where the whole did) and
  keeps the suite's times; only the large buffers get finer.
  """
  lower, upper, size = (np.asarray(a, dtype=np.int64) for a in (lower, upper, size))
  big = (size > fraction * capacity) & (size % 2048 == 0)
  keep = ~big
  return (np.concatenate([lower[keep], lower[big], lower[big]]),
          np.concatenate([upper[keep], upper[big], upper[big]]),
          np.concatenate([size[keep], size[big] // 2, size[big] // 2]))


def character(lower: np.ndarray, upper: np.ndarray, size: np.ndarray, capacity: int) -> dict:
  """What an instance looks like beyond the statistics the suite is described by.

  ``largest``: the largest buffer / capacity; ``mean_load``: time-averaged
  live bytes / capacity; ``times_per_buffer``:
  distinct start and end times per buffer (a compiled program's ops each
  allocate and free several buffers at once); ``buffers_per_lifetime``: buffers
  per distinct ``[lower, upper)``; ``crossing``: the fraction of the pairs live
  at a common time whose lifetimes cross (neither contains the other: a
  stack discipline has none).
  """
  lower, upper, size = (np.asarray(a, dtype=np.int64) for a in (lower, upper, size))
  times, _, _, live = live_by_time(lower, upper, size)
  width = np.diff(times)
  overlap = (lower[:, None] < upper[None, :]) & (lower[None, :] < upper[:, None])
  nested = (((lower[:, None] <= lower[None, :]) & (upper[None, :] <= upper[:, None]))
            | ((lower[None, :] <= lower[:, None]) & (upper[:, None] <= upper[None, :])))
  pairs = np.triu(overlap, 1)
  crossing = float((pairs & ~nested).sum() / max(1, pairs.sum()))
  return dict(largest=float(size.max() / capacity),
              mean_load=float((live[:-1] * width).sum() / width.sum() / capacity),
              times_per_buffer=len(times) / len(size),
              buffers_per_lifetime=len(size) / len(set(zip(lower.tolist(), upper.tolist()))),
              crossing=crossing)


def run_minimalloc(binary: str, lower, upper, size, capacity: int, time_limit: float) -> dict:
  """MiniMalloc's own solver (a binary built from google/minimalloc) on one instance.

  Its placement is read back and checked with :func:`jaxmem.dsa.check`; the
  time is the wall time of the process (reading the CSV included, which is
  about a millisecond).
  """
  with tempfile.TemporaryDirectory() as tmp:
    src, dst = pathlib.Path(tmp) / "in.csv", pathlib.Path(tmp) / "out.csv"
    dsa.write_csv(src, lower, upper, size)
    t = time.perf_counter()
    proc = subprocess.run([binary, f"--capacity={capacity}", f"--input={src}", f"--output={dst}",
                           f"--timeout={time_limit:g}s"], capture_output=True, text=True,
                          timeout=time_limit + 60)
    seconds = time.perf_counter() - t
    packed = False
    if proc.returncode == 0 and dst.exists():
      out = dsa.read_csv(dst)
      if out.offsets is not None:
        order = np.argsort(out.ids)
        packed = dsa.check(out.lower[order], out.upper[order], out.size[order],
                           out.offsets[order]) <= capacity
  return dict(mm_packed=packed, mm_seconds=seconds)


def run_challenging(quick: bool, time_limit: float, suite: str | None,
                    minimalloc: str | None = None) -> list[dict]:
  rows = []
  for name, family, (lower, upper, size), capacity in challenging_instances(quick, suite):
    print(f"[{name}] n={len(size)} packing at {capacity:,} ...", file=sys.stderr, flush=True)
    bf = dsa.solve(lower, upper, size, method="best-fit")
    try:
      sol = dsa.solve(lower, upper, size, capacity=capacity, goal="fit", time_limit_s=time_limit)
    except dsa.CapacityError as e:
      sol = e.solution
    footprint = dsa.check(lower, upper, size, sol.offsets)   # checked independently
    rows.append(dict(
        instance=name, family=family, n=len(size), capacity=capacity,
        max_load_ratio=sol.max_load / capacity, best_fit_ratio=bf.footprint / capacity,
        best_fit_s=bf.seconds, packed=footprint <= capacity, footprint_ratio=footprint / capacity,
        seconds=sol.seconds, nodes=sol.nodes, method=sol.method,
        **character(lower, upper, size, capacity)))
    if minimalloc:
      rows[-1].update(run_minimalloc(minimalloc, lower, upper, size, capacity, time_limit))
  return rows


def challenging_markdown(rows: list[dict], time_limit: float) -> str:
  lines = [
      "## Packing at capacity: instances of the public challenging suite's character", "",
      ("Each instance is packed at its capacity (`solve(capacity=..., goal=\"fit\")`: "
       "best-fit and first-fit, then MiniMalloc's decision search, `ffi/dsa_pack.cc`), stopped "
       f"after {time_limit:g} s. Ratios are to the capacity; every placement is checked with "
       "`dsa.check`. `tiling`: guillotine tilings of time x capacity with buffers dropped off "
       "the peak (`dsa.tiling_instance`); `program`: a program's allocations run in the "
       "capacity with random placement, its free gaps filled at a few ops "
       "(`dsa.program_instance`); `grouped`: the same with ops that allocate and free several "
       "buffers at once, as compiled programs do (`dsa.program_instance(grouped=True)`); all "
       "come with a placement at capacity, so every one is feasible. `suite`: the public "
       "files (`--suite`); `suite-split`: the same with every buffer above 0.1 of the "
       "capacity cut into two halves of its lifetime (`split_large`: still feasible)."), "",
      "| instance | n | max load / capacity | best-fit / capacity | packed at capacity | "
      "footprint / capacity | seconds | nodes | found by | MiniMalloc packed | MiniMalloc s |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    mm = (("yes" if r["mm_packed"] else "no", f"{r['mm_seconds']:.2f}") if "mm_packed" in r
          else ("-", "-"))
    lines.append(
        f"| {r['instance']} | {r['n']} | {r['max_load_ratio']:.4f} | {r['best_fit_ratio']:.4f} | "
        f"{'yes' if r['packed'] else 'no'} | {r['footprint_ratio']:.4f} | {r['seconds']:.2f} | "
        f"{r['nodes']:,} | {r['method']} | {mm[0]} | {mm[1]} |")
  lines += ["", challenging_summary(rows, time_limit), "", character_markdown(rows)]
  return "\n".join(lines) + "\n"


def character_markdown(rows: list[dict]) -> str:
  """Per family, the structure the suite is not described by (see :func:`character`)."""
  lines = [
      "What the instances look like beyond the statistics the suite is described by "
      "(`character` in this script; per family: the range over its instances):", "",
      "| family | largest buffer / capacity | mean load / capacity | distinct times per buffer | "
      "buffers per lifetime | crossing lifetimes (of pairs live together) | packed by jaxmem | "
      "packed by MiniMalloc |",
      "|---|---|---|---|---|---|---|---|"]
  for family in ("suite", "suite-split", "tiling", "program", "grouped"):
    sub = [r for r in rows if r["family"] == family]
    if not sub:
      continue

    def span(key: str, sub: list[dict] = sub) -> str:
      v = [r[key] for r in sub]
      return f"{min(v):.2f} to {max(v):.2f}"

    mm = (f"{sum(r['mm_packed'] for r in sub)} of {len(sub)}" if all("mm_packed" in r for r in sub)
          else "-")
    lines.append(f"| {family} | {span('largest')} | {span('mean_load')} | {span('times_per_buffer')} | "
                 f"{span('buffers_per_lifetime')} | {span('crossing')} | "
                 f"{sum(r['packed'] for r in sub)} of {len(sub)} | {mm} |")
  return "\n".join(lines)


def challenging_summary(rows: list[dict], time_limit: float) -> str:
  out = []
  for family in ("suite", "suite-split", "tiling", "program", "grouped"):
    sub = [r for r in rows if r["family"] == family]
    if not sub:
      continue
    packed = [r for r in sub if r["packed"]]
    times = sorted(r["seconds"] for r in packed)
    took = (f", in {times[0]:.2f} to {times[-1]:.2f} s (median "
            f"{float(np.median(times)):.2f} s)" if times else "")
    line = (f"* {family}: {len(packed)} of {len(sub)} packed at capacity within "
            f"{time_limit:g} s{took}; best-fit packs {sum(r['best_fit_ratio'] <= 1 for r in sub)}")
    if all("mm_packed" in r for r in sub):
      mm = [r for r in sub if r["mm_packed"]]
      both = [r for r in sub if r["mm_packed"] and r["packed"]]
      line += f"; MiniMalloc (its own binary, same limit) packs {len(mm)}"
      if both:
        ratio = [r["mm_seconds"] / max(r["seconds"], 1e-3) for r in both]
        line += (f", and where both pack, MiniMalloc takes {min(ratio):.1f}x to {max(ratio):.1f}x "
                 f"jaxmem's time (median {float(np.median(ratio)):.1f}x)")
    out.append(line + ".")
  return "\n".join(out)


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
  parser.add_argument("--fit-time-limit", type=float, default=20.0,
                      help="seconds for each packing at capacity (default 20)")
  parser.add_argument("--suite", default=None,
                      help="a folder of the public challenging suite's CSV files")
  parser.add_argument("--minimalloc", default=None, metavar="BINARY",
                      help="MiniMalloc's own solver (built from google/minimalloc; not shipped "
                           "here), run side by side on the packing instances")
  parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
  args = parser.parse_args()
  t0 = time.perf_counter()
  rows = run(args.quick, args.time_limit)
  packing = run_challenging(args.quick, args.fit_time_limit, args.suite, args.minimalloc)
  meta = dict(minimalloc=bool(args.minimalloc), time_limit_s=args.time_limit, fit_time_limit_s=args.fit_time_limit,
              machine=platform.machine(),
              python=platform.python_version(), numpy=np.__version__,
              date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              total_s=round(time.perf_counter() - t0, 1))
  text = markdown(rows, meta) + "\n" + challenging_markdown(packing, args.fit_time_limit)
  print(text)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "dsa.json").write_text(json.dumps(dict(meta=meta, rows=rows, packing=packing), indent=1))
  (out / "dsa.md").write_text(text)
  print(f"wrote {out / 'dsa.json'}, {out / 'dsa.md'}")
  trace_ms = max((r["exact_s"] for r in rows if r["family"] == "trace"), default=0.0) * 1e3
  excerpt = (f"`python bench/dsa_bench.py` ({meta['date']}; `bench/results/dsa.md`): footprint / "
             "max load (1 is optimal) of best-fit by decreasing size (SmartPool), first-fit and "
             f"the exact search stopped after {meta['time_limit_s']:g} s; the slowest exact "
             f"solve of a jaxmem trace took {trace_ms:.1f} ms.\n\n" + summary(rows)
             + "\n\nPacking at capacity instances of the public challenging suite's character "
             "(`suite`: its own files; `suite-split`: its buffers above 0.1 of the capacity cut in "
             "halves; `tiling`, `program`, `grouped`: generated, with a placement at capacity):\n\n" + challenging_summary(packing, args.fit_time_limit))
  print(f"wrote {write_excerpt('dsa_bench', excerpt, out)}")
  if plot(rows, out / "dsa.png"):
    print(f"wrote {out / 'dsa.png'}")


if __name__ == "__main__":
  main()
