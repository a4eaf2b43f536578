"""How much of the estimate's error on the corpus is XLA's packing of buffers, not lifetimes.

``memory_analysis()``'s peak (what ``jaxmem.compiled_memory`` reads, and what
budgets are checked against) counts XLA's temporary allocation whole; XLA's
own heap simulation of the same program (its ``live-range`` dump: "Stack
trace breakdown for peak usage") gives the bytes actually live at the
busiest point of its schedule. The difference is how XLA:CPU packs buffers
of different sizes and lifetimes into that allocation. jaxmem's estimate
models what is live (``estimate/lifetimes.py``), not the packing: on a step
that packs loosely the estimate is low against the compiled peak although
its lifetimes are right.

For each corpus step (every set, or ``--only SUBSTRING``): the compiled peak,
XLA's heap-simulated peak, the packing overhead (compiled / simulated - 1)
and the estimate's error against both. Writes
``bench/results/xla_packing.{json,md}``.

Run: ``python bench/xla_packing.py [--only SUBSTRING]`` (about 10 minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jaxmem  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit  # noqa: E402
from corpus import all_entries  # noqa: E402
from corpus_estimates import SETS, UNDER, WITHIN  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20
_PEAK = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")


def heap_simulated_peak(dump: pathlib.Path) -> int:
  """The peak of XLA's heap simulation, read from the largest module's live-range dump."""
  files = sorted(dump.glob("*live-range.txt"), key=lambda f: f.stat().st_size)
  if not files:
    raise RuntimeError(f"no live-range dump under {dump}: the XLA flags were not honoured")
  found = _PEAK.search(files[-1].read_text())
  if found is None:
    raise RuntimeError(f"{files[-1]} has no peak line: XLA's dump format changed")
  return int(found.group(1).replace(" ", ""))


def measure(entry) -> dict:
  step, args = entry.make()
  estimate = jaxmem.analyze(step, *args, donate_argnums=entry.donate).peak_bytes
  with tempfile.TemporaryDirectory() as tmp:
    lowered = jax.jit(step, donate_argnums=entry.donate).lower(*args)
    compiled = lowered.compile({"xla_dump_to": tmp, "xla_dump_hlo_as_text": True})
    peak = jaxmem.compiled_memory(compiled).peak_bytes
    simulated = heap_simulated_peak(pathlib.Path(tmp))
  return dict(name=entry.name, family=entry.family, compiled_mib=round(peak / MiB, 2),
              simulated_mib=round(simulated / MiB, 2), packing=round(peak / simulated - 1, 4),
              estimate_mib=round(estimate / MiB, 2), error=round(estimate / peak - 1, 4),
              error_simulated=round(estimate / simulated - 1, 4))


def render(rows: list[dict], meta: dict) -> str:
  packing = [r["packing"] for r in rows]
  outside = [r for r in rows if abs(r["error"]) > WITHIN]
  under = [r for r in rows if r["error"] < UNDER]
  lines = [
      "# XLA's packing of buffers beside jaxmem's estimate (`bench/xla_packing.py`)", "",
      f"`python bench/xla_packing.py{' --only ' + meta['only'] if meta.get('only') else ''}` "
      f"jax {meta['jax']}, commit `{meta['commit']}`, {meta['machine']}: per corpus step, "
      f"the compiled peak (`memory_analysis()`), the peak of XLA's own heap simulation of "
      f"the same program (its live-range dump), the packing overhead between them, and "
      f"`jaxmem.analyze`'s error against each ({len(rows)} steps).", "",
      f"* Packing overhead: median {100 * statistics.median(packing):.1f}%, "
      f"largest {100 * max(packing):.1f}%; over 5% on "
      f"{sum(p > 0.05 for p in packing)} of {len(rows)} steps.",
      f"* Estimate within ±10% of the compiled peak: {len(rows) - len(outside)} of {len(rows)}; "
      f"of XLA's simulated peak: {sum(abs(r['error_simulated']) <= WITHIN for r in rows)} "
      f"of {len(rows)}.",
      "* Under −5% against the compiled peak: " + (", ".join(
          f"{r['name']} {100 * r['error']:+.1f}% ({100 * r['error_simulated']:+.1f}% of the "
          f"simulated peak, packing +{100 * r['packing']:.1f}%)" for r in under) or "none") + ".",
      "", "| set | step | compiled (MiB) | XLA simulated (MiB) | packing | estimate (MiB) "
      "| error vs compiled | vs simulated |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['set']} | {r['name']} | {r['compiled_mib']:.1f} | "
                 f"{r['simulated_mib']:.1f} | {100 * r['packing']:+.1f}% | "
                 f"{r['estimate_mib']:.1f} | {100 * r['error']:+.1f}% | "
                 f"{100 * r['error_simulated']:+.1f}% |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="the steps whose name contains this")
  opts = parser.parse_args()
  entries = [(name, e) for name, families in SETS for e in all_entries(families)
             if opts.only in e.name]
  rows = []
  for i, (name, entry) in enumerate(entries):
    row = dict(set=name, **measure(entry))
    rows.append(row)
    print(f"[{i + 1}/{len(entries)}] {name:8} {row['name']:28} compiled {row['compiled_mib']:8.1f}"
          f"  simulated {row['simulated_mib']:8.1f}  packing {100 * row['packing']:+5.1f}%"
          f"  estimate {100 * row['error']:+6.1f}% / {100 * row['error_simulated']:+6.1f}%",
          flush=True)
  meta = dict(jax=jax.__version__, commit=commit(), only=opts.only,
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  text = render(rows, meta)
  RESULTS.mkdir(parents=True, exist_ok=True)
  stem = "xla_packing" if not opts.only else "xla_packing_only"
  (RESULTS / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (RESULTS / f"{stem}.md").write_text(text)
  print(text)


if __name__ == "__main__":
  main()
