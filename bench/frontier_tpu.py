"""The frontier's ``tpu-v5e`` points on XLA:TPU's compiled program, beside their estimates.

``bench/frontier.py`` places JAX's per-block policies and `auto` by their
*estimated* peak and *simulated* time. On the ``tpu-v5e`` profile `auto`
did not dominate 11 of those points, all on convolution nets (VGG-16, the
UNet, ResNet-50). This bench asks whether that holds on the program a TPU
would run. Per model, at the frontier's sizes, compiled ahead of time for
one v5e chip (``target="tpu:v5e"``; nothing runs on a TPU):

* plain ``jax.jit`` and each policy's step (nothing donated, as the frontier
  estimates them);
* `auto`'s plan for the policy's *estimated* peak (the frontier's question),
  planned again here on the same estimate (the planners are deterministic)
  and lowered through the ``xla`` backend.

For each program: the compiled peak (``memory_analysis()``), the compiled
FLOPs (``cost_analysis()``) and the compiled roofline time, the program's
fusions priced kernel by kernel on the ``tpu-v5e`` profile
(:func:`jaxmem._src.verify.hlo_cost.hlo_kernels`: per kernel the longer of
its compute and its memory time, plus a launch overhead). That roofline is
XLA's GPU performance model applied to XLA:TPU's fusions, not a TPU
measurement: no TPU was lent. `auto` *dominates on the compiled program*
when its plan's compiled peak is at most the policy's at no more roofline
time.

Run: ``python bench/frontier_tpu.py [--models vgg16,unet,resnet50]``; writes
bench/results/frontier_tpu.{json,md} (``--merge`` keeps other models' rows).
"""

from __future__ import annotations

import os

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")   # libtpu without a TPU

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402

import frontier as frontier_bench  # noqa: E402
import jaxmem  # noqa: E402
from _results import commit, flops_of, write_report  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402
from jaxmem._src.lower.backend import jit_plan  # noqa: E402
from jaxmem._src.plan.simulate import program_time  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET = "tpu:v5e"
PROFILE = "tpu-v5e"
# Nothing donated: the frontier estimates the steps without donation, and
# the compiled programs here are those same steps.
DONATE: tuple[int, ...] = ()
DEFAULT_MODELS = ("vgg16", "unet", "resnet50")
MIB = 2 ** 20
T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def compiled(fn: Any, shapes: Any) -> dict[str, float]:
  """Compiled peak, FLOPs, HLO roofline seconds and compile time of ``fn`` on the target."""
  t = time.perf_counter()
  c = fn.lower(*get_target(TARGET).place(shapes)).compile()
  cost = jaxmem.compiled_cost(c, from_hlo=True)
  return dict(peak=jaxmem.compiled_memory(c).peak_bytes, flops=flops_of(c),
              roofline_s=cost.seconds(jaxmem.device_profile(PROFILE)),
              compile_s=time.perf_counter() - t)


def run_model(name: str) -> list[dict[str, Any]]:
  label, mod_name, kw = frontier_bench.MODELS[name]
  module = importlib.import_module(mod_name)
  rows: list[dict[str, Any]] = []

  def build(policy: str | None) -> tuple[Any, Any, jaxmem.Program]:
    step, args = module.build(**kw, **({"remat_policy": policy} if policy else {}))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    return step, shapes, frontier_bench.analyse(module, kw, policy, "tpu")

  step, shapes, plain = build(None)
  base_s = program_time(plain, PROFILE)
  log(f"[{name}] jit ...")
  base = dict(model=name, label=label, method="jit", est_peak=plain.peak_bytes, overhead=0.0,
              **compiled(jax.jit(step, donate_argnums=DONATE), shapes))
  rows.append(base)
  log(f"[{name}] jit: compiled {base['peak'] / MIB:.0f} MiB, estimated "
      f"{base['est_peak'] / MIB:.0f} MiB, roofline {base['roofline_s'] * 1e3:.2f} ms")
  autos: dict[int, dict[str, Any]] = {}     # estimated budget -> auto's compiled row
  for pol in frontier_bench.POLICIES:
    pstep, pshapes, prog = build(pol)
    log(f"[{name}] {pol} ...")
    row = dict(model=name, label=label, method=f"policy:{pol}", est_peak=prog.peak_bytes,
               overhead=program_time(prog, PROFILE) / base_s - 1,
               **compiled(jax.jit(pstep, donate_argnums=DONATE), pshapes))
    rows.append(row)
    log(f"[{name}] {pol}: compiled {row['peak'] / base['peak']:.2f} of jit, estimated "
        f"{row['est_peak'] / base['est_peak']:.2f}")
    if prog.peak_bytes >= plain.peak_bytes:
      continue            # raises the estimated peak: the frontier asks auto nothing
    budget = prog.peak_bytes
    if budget not in autos:
      t = time.perf_counter()
      plan = jaxmem.get_planner("auto")(plain, budget, PROFILE)
      plan_s = time.perf_counter() - t
      sim = jaxmem.simulate(plan, PROFILE)
      log(f"[{name}] auto at {budget / plain.peak_bytes:.2f} ({plan.planner}) ...")
      autos[budget] = dict(model=name, label=label, method=f"auto({budget / plain.peak_bytes:.2f})",
                           planner=plan.planner, budget=budget,
                           est_peak=plan.estimated_peak_bytes, overhead=sim.overhead,
                           plan_s=plan_s, fits=plan.estimated_peak_bytes <= budget,
                           **compiled(jit_plan(plan, donate_argnums=DONATE, backend="xla"),
                                      shapes))
      rows.append(autos[budget])
    a = autos[budget]
    row["auto"] = a["method"]
    row["dominated_estimate"] = a["fits"] and a["overhead"] <= row["overhead"] + 1e-9
    row["dominated_compiled"] = (a["peak"] <= row["peak"]
                                 and a["roofline_s"] <= row["roofline_s"] * (1 + 1e-9))
  return rows


def render(res: dict[str, Any]) -> list[str]:
  m = res["meta"]
  rows = res["rows"]
  jit = {r["model"]: r for r in rows if r["method"] == "jit"}
  by = {(r["model"], r["method"]): r for r in rows}
  pols = [r for r in rows if "auto" in r]
  est = sum(r["dominated_estimate"] for r in pols)
  # As on the estimate, a policy whose compiled peak is not below jit's
  # compiled peak leaves nothing to beat there.
  lowers = [r for r in pols if r["peak"] < jit[r["model"]]["peak"]]
  comp = sum(r["dominated_compiled"] for r in lowers)
  lines = [f"`{m['command']}` at {m['commit']} (jax {m['jax']}, {m['date']}, {m['wall_s']:.0f} s): "
           "XLA:TPU's compiled program for one v5e chip, compiled ahead of time on a CPU-only "
           "machine (nothing ran on a TPU), beside the frontier's estimate. Fractions are of "
           "plain `jax.jit` (estimate to estimate, compiled to compiled). *roofline*: the "
           "compiled program's fusions priced kernel by kernel on the `tpu-v5e` profile, over "
           "jit's; *sim*: the cost model's simulated time over jit's. `auto` is asked for the "
           "policy's estimated peak, as in `bench/frontier.py`, and lowered through the `xla` "
           "backend.", "",
           f"On the estimate `auto` dominates **{est} of {len(pols)}** of these policy points "
           f"(those that lower the estimated peak). On the compiled program "
           f"{len(pols) - len(lowers)} of them raise the peak over jit's (nothing to beat "
           f"there), and `auto` dominates **{comp} of the {len(lowers)}** that lower it "
           f"(its plan's compiled peak at most the policy's, its roofline time at most the "
           f"policy's).", "",
           "| model | policy | est peak | compiled peak | sim | roofline | FLOPs | auto's plan | "
           "auto est peak | auto compiled peak | auto sim | auto roofline | auto FLOPs | "
           "dominates (est / compiled) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

  def fr(r: dict[str, Any], key: str) -> float:
    return r[key] / jit[r["model"]][key]

  for r in rows:
    if not r["method"].startswith("policy:"):
      continue
    j = jit[r["model"]]
    cells = [r["model"], r["method"][7:], f"{fr(r, 'est_peak'):.2f}", f"{fr(r, 'peak'):.2f}",
             f"{r['overhead']:+.1%}", f"{r['roofline_s'] / j['roofline_s'] - 1:+.1%}",
             f"{fr(r, 'flops'):.2f}x"]
    if "auto" not in r:
      cells += ["(raises the estimated peak)", *["-"] * 6]
    else:
      a = by[(r["model"], r["auto"])]
      cells += [a["planner"], f"{fr(a, 'est_peak'):.2f}", f"{fr(a, 'peak'):.2f}",
                f"{a['overhead']:+.1%}", f"{a['roofline_s'] / j['roofline_s'] - 1:+.1%}",
                f"{fr(a, 'flops'):.2f}x",
                f"{'yes' if r['dominated_estimate'] else '**no**'} / "
                + ("(raises the compiled peak)" if r["peak"] >= j["peak"]
                   else "yes" if r["dominated_compiled"] else "**no**")]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "| model | jit estimated peak | jit compiled peak | jit roofline |",
            "|---|---|---|---|"]
  for name, j in jit.items():
    lines.append(f"| {name} | {j['est_peak'] / MIB:.0f} MiB | {j['peak'] / MIB:.0f} MiB | "
                 f"{j['roofline_s'] * 1e3:.2f} ms |")
  sizes = "; ".join(f"{n}: {jit[n]['label']}" for n in jit)
  lines += ["", f"Models: {sizes}; nothing donated (as the frontier estimates them: "
            "parameters, optimizer state and their updates are all live at the end)."]
  return lines


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                  help="comma-separated subset of " + ",".join(frontier_bench.MODELS))
  ap.add_argument("--merge", action="store_true",
                  help="replace only these models' rows of bench/results/frontier_tpu.json")
  ap.add_argument("--out", default=str(RESULTS), help="results directory")
  ap.add_argument("--render", action="store_true", help="rewrite the report from the JSON")
  a = ap.parse_args()
  out = pathlib.Path(a.out)
  if a.render:
    res = json.loads((out / "frontier_tpu.json").read_text())
  else:
    names = [n for n in a.models.split(",") if n]
    for n in names:
      if n not in frontier_bench.MODELS:
        raise SystemExit(f"--models: unknown model {n!r}; choose from "
                         f"{', '.join(frontier_bench.MODELS)}")
    started = commit()
    rows = [r for n in names for r in run_model(n)]
    if a.merge and (out / "frontier_tpu.json").exists():
      old = json.loads((out / "frontier_tpu.json").read_text())
      rows = [r for r in old["rows"] if r["model"] not in names] + rows
    res = dict(meta=dict(command="python bench/frontier_tpu.py " + " ".join(sys.argv[1:]),
                         commit=started, jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                         wall_s=time.perf_counter() - T0), rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier_tpu.json").write_text(json.dumps(res, indent=1))
  lines = render(res)
  doc = ["# The frontier's TPU points, compiled", "", *lines]
  if out.resolve() == RESULTS.resolve():
    write_report("frontier_tpu", doc, "\n".join(lines[:3]))
  else:
    (out / "frontier_tpu.md").write_text("\n".join(doc) + "\n", encoding="utf-8")
    print("\n".join(doc))


if __name__ == "__main__":
  main()
