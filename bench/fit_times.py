"""How long ``jaxmem.fit`` takes on chosen corpus steps (issue 14: under 60 s on any step).

``bench/corpus_bench.py`` times every step of the corpus at 0.5 and 0.3 of
its unplanned compiled peak in one long run; this re-times a few of them
(by default the slowest of the last corpus runs) after a change to the
search, without re-measuring everything. Per step and budget: ``fit``'s
wall time (tracing, planning, rewriting, compiling and checking, as a user
waits for it), its outcome and the compile rounds it took.

Run: ``python bench/fit_times.py [--steps NAME,NAME] [--fractions 0.5,0.3]``;
writes ``bench/results/fit_times.{json,md}``. A few minutes on 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jaxmem  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit  # noqa: E402
from corpus import FAMILIES, HELDOUT, all_entries  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20
#: The steps whose `fit` took longest in the corpus runs at commit d24bc48.
SLOWEST = ("rnn/lstm-unrolled-m", "rnn/lstm-unrolled-s", "mobilenet/v2-s",
           "attention/scan-decoder-m", "ssm/diag-scan-s", "ssm/diag-scan-m")
LIMIT_S = 60.0


def time_fit(entry: Any, fraction: float) -> dict[str, Any]:
  step, args = entry.make()
  t0 = time.perf_counter()
  try:
    res = jaxmem.fit(fraction, donate_argnums=entry.donate)(step).fit_result(*args)
    out = dict(outcome="fits", peak_mib=round(res.peak_bytes / MiB, 2), rounds=res.rounds,
               planner=res.plan.planner)
  except jaxmem.BudgetError as e:
    out = dict(outcome="BudgetError", peak_mib=round(e.smallest_bytes / MiB, 2))
  out["fit_s"] = round(time.perf_counter() - t0, 1)
  return dict(step=entry.name, fraction=fraction, **out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", default=",".join(SLOWEST))
  parser.add_argument("--fractions", default="0.5,0.3")
  opts = parser.parse_args()
  names = [n for n in opts.steps.split(",") if n]
  entries = {e.name: e for e in all_entries(FAMILIES) + all_entries(HELDOUT)}
  unknown = sorted(set(names) - set(entries))
  if unknown:
    raise SystemExit(f"unknown steps {unknown}; the corpus has {sorted(entries)}")
  rows = []
  for name in names:
    for fraction in (float(f) for f in opts.fractions.split(",")):
      print(f"{name} at {fraction} ...", flush=True)
      rows.append(time_fit(entries[name], fraction))
      print(json.dumps(rows[-1]), flush=True)
  meta = dict(jax=jax.__version__, commit=commit(),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "fit_times.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  over = [r for r in rows if r["fit_s"] > LIMIT_S]
  lines = ["# `fit` time on the slowest corpus steps (`bench/fit_times.py`)", "",
           f"`python bench/fit_times.py` jax {meta['jax']}, commit `{meta['commit']}`, "
           f"{meta['machine']}: wall time of `jaxmem.fit` (tracing, planning, rewriting, "
           f"compiling, checking). Over {LIMIT_S:.0f} s: {len(over)} of {len(rows)}.", "",
           "| step | budget | outcome | peak MiB | rounds | fit s |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['step']} | {r['fraction']} | {r['outcome']} | {r['peak_mib']} | "
                 f"{r.get('rounds', '—')} | {r['fit_s']} |")
  (RESULTS / "fit_times.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
