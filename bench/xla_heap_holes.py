"""How much of XLA:CPU's compiled peak is holes in its heap layout, per corpus step.

``memory_analysis()`` reports the size of XLA's temp allocation: the top of
the heap in which buffer assignment places every temporary at a fixed
offset. When the layout leaves holes, that top is above the most temp bytes
ever live at once. jaxmem's estimate (``estimate/lifetimes.py``) is a most-
bytes-live figure: it has no layout, so holes count as under-estimation.

This compiles every corpus step (every set, unplanned, arguments donated
as the corpus says) with XLA's dump on, and reads from the dumped buffer
assignment and live ranges (``bench/xla_live_at_peak.py``'s parser):

* the heap top (the temp allocation's size) and the most temp bytes live at
  one point of XLA's schedule (values at one offset counted once);
* ``holes`` = heap top - most live;
* the same live ranges placed again by jaxmem's best-fit DSA
  (``jaxmem.dsa.solve(method="best-fit")``, SmartPool's heuristic), to say
  whether a layout without those holes exists for XLA's own buffers;
* jaxmem's estimate error against the compiled peak (from
  ``bench/results/corpus_estimates.json``, same estimator) and against the
  compiled peak less the holes.

Probe compiles (``Target.probe_options``) give the same ``memory_analysis``
as the compiles that run (``bench/results/probe_compiles.md``) and are used
here. The dump format is XLA's debug output, not an API.

Run: ``python bench/xla_heap_holes.py [--only NAME,NAME]``; writes
``bench/results/xla_heap_holes.{json,md}`` (and, for every step, the README's
excerpt; ``--render`` writes both again from the JSON). About 25 minutes on 2
CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit, write_excerpt  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20


def heap_of(directory: str, module: str) -> dict[str, int]:
  """Heap top, most bytes live, and a best-fit layout of the newest dump of ``module``."""
  from xla_live_at_peak import parse_dump

  from jaxmem import dsa

  dump = parse_dump(directory, module)
  top = sum(s for s, k in dump["allocations"].values() if k == "temp")
  # Values XLA put at one offset (aliases: a loop's carried buffer, in-place
  # updates) are one buffer: their live ranges are joined where they touch.
  by_offset: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for v in dump["values"]:
    span = dump["ranges"].get(v["name"])
    if v["kind"] == "temp" and span is not None and v["size"] > 0:
      by_offset.setdefault((v["offset"], v["size"]), []).append(span)
  lower, upper, sizes = [], [], []
  for (_, size), spans in by_offset.items():
    spans.sort()
    start, end = spans[0]
    for a, b in spans[1:]:
      if a <= end + 1:
        end = max(end, b)
        continue
      lower.append(start), upper.append(end + 1), sizes.append(size)
      start, end = a, b
    lower.append(start), upper.append(end + 1), sizes.append(size)
  if not sizes:
    return dict(heap_top=top, most_live=0, best_fit=0)
  solution = dsa.solve(lower, upper, sizes, method="best-fit")
  return dict(heap_top=top, most_live=int(solution.max_load), best_fit=int(solution.footprint))


def measure(name: str, directory: str) -> dict[str, Any]:
  """One corpus step compiled with the dump on: its memory and heap."""
  import jax

  from corpus import EVERY, all_entries

  from jaxmem._src.estimate.targets import get_target
  from jaxmem._src.verify.compiled import compiled_memory

  entry = next(e for e in all_entries(EVERY) if e.name == name)
  step, args = entry.make()
  compiled = jax.jit(step, donate_argnums=entry.donate).lower(*args).compile(
      get_target(None).probe_options or None)
  memory = compiled_memory(compiled)
  module = f"jit_{getattr(step, '__name__', 'step')}"
  return dict(peak=memory.peak_bytes, temp=memory.temp_bytes, **heap_of(directory, module))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
  parser.add_argument("--render", action="store_true",
                      help="write the tables again from the results file, compiling nothing")
  opts = parser.parse_args()
  if opts.render:
    saved = json.loads((RESULTS / "xla_heap_holes.json").read_text())
    write(saved["meta"], saved["rows"], readme=True)
    return
  if "JAXMEM_DUMP_DIR" not in os.environ:
    # The dump flag must be set before jax starts: re-run this script with it.
    directory = tempfile.mkdtemp(prefix="jaxmem-xla-dump-")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={directory} --xla_dump_hlo_as_text",
               JAXMEM_DUMP_DIR=directory, JAX_PLATFORMS="cpu")
    raise SystemExit(subprocess.call([sys.executable, *sys.argv], env=env))
  import jax
  from corpus import EVERY, all_entries

  estimates = {r["name"]: r for r in json.loads(
      (RESULTS / "corpus_estimates.json").read_text())["rows"]}
  names = [e.name for e in all_entries(EVERY)]
  if opts.only:
    unknown = sorted(set(opts.only.split(",")) - set(names))
    if unknown:
      raise SystemExit(f"`--only`: unknown steps {unknown}")
    names = [n for n in names if n in opts.only.split(",")]
  rows = []
  t0 = time.perf_counter()
  for i, name in enumerate(names):
    row = dict(name=name, set=estimates.get(name, {}).get("set", ""), **measure(
        name, os.environ["JAXMEM_DUMP_DIR"]))
    row["holes"] = row["heap_top"] - row["most_live"]
    est = estimates.get(name)
    if est is not None:
      estimate = est["estimate_mib"] * MiB
      row["estimate_mib"] = est["estimate_mib"]
      row["error"] = estimate / row["peak"] - 1
      row["error_without_holes"] = estimate / (row["peak"] - row["holes"]) - 1
    rows.append(row)
    print(f"[{i + 1}/{len(names)}] {json.dumps(row)}", flush=True)
  meta = dict(jax=jax.__version__, commit=commit(), seconds=round(time.perf_counter() - t0),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
              estimates_commit=json.loads((RESULTS / "corpus_estimates.json").read_text())
              ["meta"].get("commit", ""))
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "xla_heap_holes.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  write(meta, rows, readme=not opts.only)
  print(render(meta, rows))


def write(meta: dict[str, Any], rows: list[dict[str, Any]], readme: bool) -> None:
  """The table, and (``readme``: a run of every step) the summary the README shows."""
  text = render(meta, rows)
  (RESULTS / "xla_heap_holes.md").write_text(text)
  if readme:
    write_excerpt("xla_heap_holes", "\n".join(text.splitlines()[2:6]))


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
  with_holes = [r for r in rows if r["holes"] > 0.01 * r["peak"]]
  est = [r for r in rows if "error" in r]
  inside = sum(abs(r["error"]) <= 0.10 for r in est)
  inside_nh = sum(abs(r["error_without_holes"]) <= 0.10 for r in est)
  below = sum(r["error"] < -0.05 for r in est)
  below_nh = sum(r["error_without_holes"] < -0.05 for r in est)
  best_fit_closes = sum(r["best_fit"] <= r["most_live"] + 0.01 * r["peak"] for r in with_holes)
  lines = ["# Holes in XLA:CPU's heap layout (`bench/xla_heap_holes.py`)", "",
           f"`python bench/xla_heap_holes.py` jax {meta['jax']}, commit `{meta['commit']}`, "
           f"{meta['machine']}, {meta['seconds']} s; estimates from "
           f"`bench/results/corpus_estimates.json` (commit `{meta['estimates_commit']}`). "
           "Heap top: XLA's temp allocation; most live: the most temp bytes live at one point "
           "of XLA's schedule; holes: the difference, counted in the compiled peak and in no "
           "most-bytes-live estimate; best fit: jaxmem's best-fit DSA on the same live ranges.",
           "",
           f"* Holes over 1% of the compiled peak: **{len(with_holes)} of {len(rows)}** steps; "
           f"best fit places their buffers within 1% of the most live in "
           f"{best_fit_closes} of {len(with_holes)}.",
           f"* Estimates within ±10%: {inside} of {len(est)} against the compiled peak, "
           f"{inside_nh} of {len(est)} against the compiled peak less the holes; below -5%: "
           f"{below} against {below_nh}.", "",
           "| step | set | compiled MiB | heap top MiB | most live MiB | holes MiB | holes % of "
           "peak | best fit MiB | estimate error | error less holes |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: -r["holes"] / r["peak"]):
    err = f"{r['error']:+.1%}" if "error" in r else "-"
    errh = f"{r['error_without_holes']:+.1%}" if "error" in r else "-"
    lines.append(f"| {r['name']} | {r['set']} | {r['peak'] / MiB:.2f} | {r['heap_top'] / MiB:.2f} "
                 f"| {r['most_live'] / MiB:.2f} | {r['holes'] / MiB:.2f} | "
                 f"{r['holes'] / r['peak']:.1%} | {r['best_fit'] / MiB:.2f} | {err} | {errh} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
