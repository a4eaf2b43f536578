"""jaxmem's estimate against the compiled peak on every corpus step, every set, nothing fitted.

For each step of ``bench/corpus/`` (the main families, the held-out, fresh,
unseen, novel and untried sets): the peak ``jaxmem.analyze`` estimates before anything is
compiled, the peak of plain ``jax.jit`` as XLA:CPU compiles it
(``memory_analysis()``), and the relative error. The same figures as the
"estimate" columns of ``bench/corpus_bench.py``, without its fits: a few
minutes instead of hours, so an estimate change can be measured on every step
in one run before the corpus benchmarks are re-run. Writes
``bench/results/corpus_estimates.{json,md}``.

Run: ``python bench/corpus_estimates.py`` (about 10 minutes on 2 CPUs).
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

import jaxmem  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit, write_excerpt  # noqa: E402
from corpus import SETS, all_entries  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20
#: The issue's bar: within this fraction of the compiled peak.
WITHIN = 0.10
#: An estimate this far under the compiled peak misleads the budget arithmetic.
UNDER = -0.05


def measure(entry) -> dict:
  """One step's estimate, compiled peak and error."""
  step, args = entry.make()
  t0 = time.perf_counter()
  estimate = jaxmem.analyze(step, *args, donate_argnums=entry.donate).peak_bytes
  analyze_s = time.perf_counter() - t0
  compiled = jaxmem.compiled_memory(
      jax.jit(step, donate_argnums=entry.donate).lower(*args).compile()).peak_bytes
  return dict(name=entry.name, family=entry.family, compiled_mib=round(compiled / MiB, 2),
              estimate_mib=round(estimate / MiB, 2),
              error=round(estimate / compiled - 1, 4), analyze_s=round(analyze_s, 2))


def render(rows: list[dict], meta: dict) -> tuple[str, str]:
  """The full table and the summary lines."""
  by_set: dict[str, list[dict]] = {}
  for r in rows:
    by_set.setdefault(r["set"], []).append(r)
  within = sum(abs(r["error"]) <= WITHIN for r in rows)
  under = [r for r in rows if r["error"] < UNDER]
  outside = sorted((r for r in rows if abs(r["error"]) > WITHIN), key=lambda r: r["error"])
  summary = [
      f"`python bench/corpus_estimates.py` jax {meta['jax']}, commit `{meta['commit']}`, "
      f"{meta['machine']}: `jaxmem.analyze`'s peak against the compiled peak of plain "
      f"`jax.jit` (XLA:CPU) on {len(rows)} corpus steps, all {len(by_set)} sets.",
      "",
      f"* Within ±10% of the compiled peak: **{within} of {len(rows)}** ("
      + ", ".join(f"{name} {sum(abs(r['error']) <= WITHIN for r in rs)} of {len(rs)}"
                  for name, rs in by_set.items()) + f"); median |error| "
      f"{100 * statistics.median(abs(r['error']) for r in rows):.1f}%.",
      f"* Below −5% (an under-estimate the budget arithmetic trusts): {len(under)}.",
      "* Outside ±10%: " + (", ".join(f"{r['name']} {100 * r['error']:+.1f}%" for r in outside)
                            or "none") + ".",
  ]
  table = ["| set | step | compiled peak (MiB) | estimate (MiB) | error | analyze |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| {r['set']} | {r['name']} | {r['compiled_mib']:.1f} | "
                 f"{r['estimate_mib']:.1f} | {100 * r['error']:+.1f}% | {r['analyze_s']:.1f} s |")
  full = ("# jaxmem's estimate on every corpus step (`bench/corpus_estimates.py`)\n\n"
          + "\n".join(summary) + "\n\n" + "\n".join(table) + "\n")
  return full, "\n".join(summary) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="the steps whose name contains this")
  opts = parser.parse_args()
  rows = []
  entries = [(name, e) for name, families in SETS for e in all_entries(families)
             if opts.only in e.name]
  for i, (name, entry) in enumerate(entries):
    row = dict(set=name, **measure(entry))
    rows.append(row)
    print(f"[{i + 1}/{len(entries)}] {name:8} {row['name']:28} {row['compiled_mib']:8.1f} "
          f"{row['estimate_mib']:8.1f} {100 * row['error']:+6.1f}%", flush=True)
  meta = dict(jax=jax.__version__, commit=commit(),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  full, excerpt = render(rows, meta)
  if not opts.only:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "corpus_estimates.json").write_text(json.dumps(dict(meta=meta, rows=rows),
                                                              indent=1))
    (RESULTS / "corpus_estimates.md").write_text(full)
    write_excerpt("corpus_estimates", excerpt)
  print(full)


if __name__ == "__main__":
  main()
