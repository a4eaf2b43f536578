"""The temporaries live at the compiled peak, read from XLA's schedule, on every corpus step.

``BudgetError.compiled_holders`` lists the largest temporaries live at the
peak of the compiled floor program, read from its HLO text alone
(``jaxmem/_src/verify/working_set.py``, ``live_at_peak``: each temporary live
from the instruction that writes it to the last that reads it, in the entry
computation's schedule order). ``fit`` reports that list only when the bytes
live there are within a tenth of the executable's temporaries
(``memory_analysis().temp_size_in_bytes``): the heap's holes, buffers XLA
shares, and loop bodies (not in the entry computation) make the two differ.
This measures, on plain ``jax.jit`` of every corpus step of the six sets,
how often the reading is within that tenth, and what it misses where not.
Writes ``bench/results/compiled_live.{json,md}``.

Run: ``python bench/compiled_live.py`` (about 5 minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxmem._src.verify.working_set import live_at_peak  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit  # noqa: E402
from corpus import SETS, all_entries  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20
#: What `fit` accepts (`jaxmem/_src/api/fit.py`, `compiled_holders`).
WITHIN = 0.10


def measure(entry) -> dict:
  """One step's temporaries: the executable's, and those live at its schedule's peak."""
  step, args = entry.make()
  compiled = jax.jit(step, donate_argnums=entry.donate).lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  t0 = time.perf_counter()
  peak = live_at_peak(compiled.as_text())
  read_s = time.perf_counter() - t0
  live = peak.live_bytes if peak is not None else 0
  loops = compiled.as_text().count(" while(")
  top = peak.buffers[0] if peak is not None and peak.buffers else None
  return dict(name=entry.name, temp_mib=round(temp / MiB, 2), live_mib=round(live / MiB, 2),
              ratio=round(live / temp, 4) if temp else None, loops=loops,
              largest=(f"{top.shape} {top.op_name}" if top is not None else ""),
              read_s=round(read_s, 3))


def render(rows: list[dict], meta: dict) -> str:
  within = [r for r in rows if r["ratio"] is not None and abs(r["ratio"] - 1) <= WITHIN]
  outside = sorted((r for r in rows if r not in within), key=lambda r: r["ratio"] or 0)
  lines = [
      "# Temporaries live at the compiled peak, read from XLA's schedule "
      "(`bench/compiled_live.py`)", "",
      f"`python bench/compiled_live.py` jax {meta['jax']}, commit `{meta['commit']}`, "
      f"{meta['machine']}: plain `jax.jit` of {len(rows)} corpus steps (all six sets); the "
      "temporaries live at the peak of the entry computation's schedule against "
      "`memory_analysis().temp_size_in_bytes`.", "",
      f"* Within a tenth (what `BudgetError.compiled_holders` needs to be reported): "
      f"**{len(within)} of {len(rows)}**; median ratio "
      f"{statistics.median(r['ratio'] for r in rows if r['ratio'] is not None):.3f}; reading "
      f"the text took {max(r['read_s'] for r in rows):.2f} s at most.",
      "* Outside: " + (", ".join(f"{r['name']} {r['ratio']:.2f}"
                                 + (f" ({r['loops']} loops)" if r["loops"] else "")
                                 for r in outside) or "none") + ".", "",
      "| set | step | temp (MiB) | live at the schedule's peak (MiB) | ratio | loops | largest "
      "buffer there |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['set']} | {r['name']} | {r['temp_mib']:.1f} | {r['live_mib']:.1f} | "
                 f"{r['ratio']:.3f} | {r['loops']} | {r['largest']} |")
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
    print(f"[{i + 1}/{len(entries)}] {name:8} {row['name']:28} {row['temp_mib']:8.1f} "
          f"{row['live_mib']:8.1f} {row['ratio']:.3f}", flush=True)
  meta = dict(jax=jax.__version__, commit=commit(),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  text = render(rows, meta)
  if not opts.only:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compiled_live.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (RESULTS / "compiled_live.md").write_text(text)
  print(text)


if __name__ == "__main__":
  main()
