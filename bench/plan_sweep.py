"""Compiled peak of a planner's plans across estimate targets: is it monotone?

``jaxmem.fit`` lowers a planner's target by the compiled overshoot and stops
when a tighter target stops lowering the compiled peak; that assumes the
compiled peak falls as the planner's target does. This bench plans one step
with each planner at a sweep of targets (fractions of the unplanned *estimate*,
``jaxmem.plan(..., budget=f)``), compiles every plan for a target and prints
the compiled peak of each, so the places where a looser plan compiles lower
than a tighter one show.

Run: ``python bench/plan_sweep.py --model resnet18 --target gpu:h100`` (models of
``bench/gpu_bench.py``; a GPU target needs ``pip install "jax[cuda12]"``, a TPU
one ``jax[tpu]``); writes ``bench/results/plan_sweep_<model>_<target>.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bench  # noqa: E402
import jaxmem  # noqa: E402
from _results import commit  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402
from jaxmem._src.lower.backend import jit_plan, resolve_backend  # noqa: E402

MIB = 2 ** 20
FRACTIONS = "0.3,0.4,0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="resnet18", choices=sorted(gpu_bench.MODELS))
  p.add_argument("--target", default="gpu:h100")
  p.add_argument("--planners", default="segments,greedy,auto")
  p.add_argument("--fractions", default=FRACTIONS,
                 help="planner targets, as fractions of the unplanned estimate")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  a = p.parse_args()
  target = get_target(a.target)
  backend = resolve_backend("auto", target.platform)
  step, args = gpu_bench.build(gpu_bench.MODELS[a.model])
  placed = target.place(args)
  base = jaxmem.compiled_memory(jax.jit(step).lower(*placed).compile()).peak_bytes
  rows = []
  for planner in a.planners.split(","):
    for frac in (float(f) for f in a.fractions.split(",")):
      t = time.perf_counter()
      plan = jaxmem.plan(step, *args, budget=frac, planner=planner, target=a.target)
      peak = jaxmem.compiled_memory(
          jit_plan(plan, backend=backend).lower(*placed).compile()).peak_bytes
      rows.append(dict(planner=planner, fraction=frac, estimate=plan.estimated_peak_bytes,
                       peak=peak, remat=plan.num_remat, offload=plan.num_offload,
                       planner_used=plan.planner, seconds=time.perf_counter() - t))
      print(f"{planner} {frac}: estimate {plan.estimated_peak_bytes / MIB:.1f} MiB, compiled "
            f"{peak / MIB:.1f} MiB ({peak / base:.2f}), {plan.num_remat} remat / "
            f"{plan.num_offload} offload", flush=True)
  meta = dict(model=a.model, size=gpu_bench.MODELS[a.model].label, target=a.target,
              backend=backend, unplanned=base, jax=jax.__version__, commit=commit(),
              date=time.strftime("%Y-%m-%d %H:%M"))
  lines = [f"# Compiled peak across planner targets: {a.model} on `{a.target}`", "",
           f"`python bench/plan_sweep.py --model {a.model} --target {a.target} --planners "
           f"{a.planners} --fractions {a.fractions}` ({meta['date']}, "
           f"commit {meta['commit']}, jax {meta['jax']}; {meta['size']}; the `{backend}` "
           f"backend). Unplanned compiled peak {base / MIB:.1f} MiB. Target: a fraction of the "
           "unplanned *estimate* (`jaxmem.plan(..., budget=f)`).", "",
           "| planner | target | estimate MiB | compiled MiB | of unplanned | remat / offload |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {r['planner_used']} | {r['fraction']} | {r['estimate'] / MIB:.1f} | "
            f"{r['peak'] / MIB:.1f} | {r['peak'] / base:.2f} | {r['remat']} / {r['offload']} |"
            for r in rows]
  out = pathlib.Path(a.out)
  stem = f"plan_sweep_{a.model}_{a.target.replace(':', '_')}"
  (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
  print(f"wrote {out / stem}.md")


if __name__ == "__main__":
  main()
