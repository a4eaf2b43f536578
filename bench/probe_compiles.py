"""Do probe compiles read the same memory as the compiles that run? (``Target.probe_options``).

``jaxmem.fit`` compiles each candidate plan only to read its compiled peak,
and on XLA:CPU it makes those compiles with ``xla_backend_optimization_level=0``
(LLVM's optimizations skipped, about half the compile time); the plan it
keeps is compiled again with the step's own options. That is sound only if
buffer assignment, which fixes every buffer before code generation, does not
depend on the option. This compiles every corpus step (main and held-out
sets), unplanned and under greedy's plan for 0.4 of its estimated peak, both
ways, and compares ``memory_analysis()`` field by field.

Run: ``python bench/probe_compiles.py [--set main|heldout|both]``; writes
``bench/results/probe_compiles.{json,md}``. About 25 minutes on 2 CPUs.
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

from jaxmem._src.api.program import analyze_step  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402
from jaxmem._src.lower.backend import jit_plan  # noqa: E402
from jaxmem._src.planners.greedy import greedy  # noqa: E402
from jaxmem._src.verify.compiled import compiled_memory  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit  # noqa: E402
from corpus import FAMILIES, HELDOUT, all_entries  # noqa: E402

RESULTS = HERE / "results"
FIELDS = ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes")


def measure(lowered: Any, probe: dict[str, Any]) -> tuple[dict[str, int], float, float]:
  """Memory of the compile as it runs and of the probe compile, and their compile times."""
  t = time.perf_counter()
  full = compiled_memory(lowered.compile())
  t_full = time.perf_counter() - t
  t = time.perf_counter()
  fast = compiled_memory(lowered.compile(probe))
  t_probe = time.perf_counter() - t
  diff = {f: getattr(fast, f) - getattr(full, f) for f in FIELDS
          if getattr(fast, f, None) != getattr(full, f, None)}
  return dict(peak=full.peak_bytes, diff=diff), t_full, t_probe


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--set", choices=("main", "heldout", "both"), default="both")
  opts = parser.parse_args()
  families = {"main": FAMILIES, "heldout": HELDOUT, "both": FAMILIES + HELDOUT}[opts.set]
  probe = get_target(None).probe_options
  rows = []
  for entry in all_entries(families):
    step, args = entry.make()
    program = analyze_step(step, args, donate_argnums=entry.donate)
    plan = greedy(program, int(0.4 * program.peak_bytes), "cpu")
    for kind, jitted in (("unplanned", jax.jit(step, donate_argnums=entry.donate)),
                         ("greedy(0.4)", jit_plan(plan, donate_argnums=entry.donate))):
      m, t_full, t_probe = measure(jitted.lower(*args), probe)
      rows.append(dict(step=entry.name, program=kind, peak_bytes=m["peak"], diff=m["diff"],
                       compile_s=round(t_full, 2), probe_s=round(t_probe, 2)))
      print(json.dumps(rows[-1]), flush=True)
  meta = dict(jax=jax.__version__, commit=commit(), probe=probe, set=opts.set,
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "probe_compiles.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  differ = [r for r in rows if r["diff"]]
  full_s = sum(r["compile_s"] for r in rows)
  probe_s = sum(r["probe_s"] for r in rows)
  lines = ["# Probe compiles against the compiles that run (`bench/probe_compiles.py`)", "",
           f"`python bench/probe_compiles.py --set {opts.set}` jax {meta['jax']}, commit "
           f"`{meta['commit']}`, {meta['machine']}: each corpus step unplanned and under "
           f"greedy's plan for 0.4 of its estimated peak, compiled with the defaults and with "
           f"`{probe}` (`Target.probe_options`). `memory_analysis()` differs in "
           f"**{len(differ)} of {len(rows)}** programs; compile time {full_s:.0f} s with the "
           f"defaults, {probe_s:.0f} s as probes ({probe_s / full_s:.2f}x).", "",
           "| step | program | compiled peak MiB | memory differs | compile s | probe s |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['step']} | {r['program']} | {r['peak_bytes'] / 2**20:.2f} | "
                 f"{r['diff'] or 'no'} | {r['compile_s']} | {r['probe_s']} |")
  (RESULTS / "probe_compiles.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines[:4]))


if __name__ == "__main__":
  main()
