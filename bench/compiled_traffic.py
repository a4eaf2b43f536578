"""The cost model against XLA:TPU's compiled program: peak, FLOPs and bytes accessed.

The simulator prices a step by its FLOPs and the bytes its unfused ops move
(``estimate/cost.py``); the planners and the frontier (``bench/frontier.py``)
compare plans with JAX's policies by that price. This bench checks the price
against a compiler's own figures: each step is compiled ahead of time for a
TPU v5e (``target="tpu:v5e"``, libtpu, no TPU needed) and
``cost_analysis()`` gives its FLOPs and ``"bytes accessed"`` (every fusion's
operands read and results written, after XLA's fusion), ``memory_analysis()``
its peak. Per model, one row each for

* plain ``jax.jit``;
* JAX's policies applied by hand to every block (``nn.remat``);
* ``auto``'s plans at 0.85, 0.7 and 0.5 of the estimated peak, planned on
  the ``tpu-v5e`` profile and lowered through the ``xla`` backend (what
  ``fit`` compiles on a TPU);
* selective recomputation's plans (``planners/selective.py``) at 0.75, 0.7
  and 0.5 of the estimated peak priced on the ``flops`` profile (memory
  traffic free: the extra FLOPs are the cost), lowered the same way;
* with ``--fits``, ``jaxmem.fit`` itself (planned, compiled and verified on
  the target, the budget a fraction of the compiled peak) with the device
  profile and planner given;

with the estimate beside the compiled figure: the estimated peak and the
compiled one (argument + output + temp - alias), the estimated FLOPs of the
ops the schedule runs and the compiled ones, the bytes the simulator prices
(``Simulation.accessed_bytes``) and the compiled bytes accessed, and the
simulated overhead on ``tpu-v5e``. Each ratio is to plain ``jax.jit``'s own
(estimated to estimated, compiled to compiled). Nothing runs on a TPU: there
is no step time here, only what it is made of.

Run: ``python bench/compiled_traffic.py [--models resnet18,gpt,mlp]``
(each compile takes 10 s to 3 min on 2 cores; ``--estimates-only`` estimates
again beside the compiled figures already recorded and compiles only the
plans that changed since and the rows not recorded); writes
bench/results/compiled_traffic.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxmem  # noqa: E402
from _results import RESULTS, bytes_accessed_of, commit, flops_of, write_report  # noqa: E402
from jaxmem._src.estimate.analysis import analyze_program  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402
from jaxmem._src.ir.trace import trace  # noqa: E402
from jaxmem._src.lower.backend import jit_plan  # noqa: E402
from jaxmem._src.planners import common  # noqa: E402

TARGET, PROFILE = "tpu:v5e", "tpu-v5e"
POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
FRACTIONS = (0.85, 0.7, 0.5)
# Selective recomputation priced by FLOPs alone, at these fractions of the estimated peak.
FLOPS_FRACTIONS = (0.75, 0.7, 0.5)
# (label, example module, build kwargs): the GPT is the 4-layer step
# (batch 64 x 256 tokens, width 128); the ResNet-18 and the MLP are
# bench/gpu_bench.py's, measured on an H200 there.
MODELS = {
    "resnet18": ("ResNet-18, 112x112, batch 128", "resnet",
                 dict(batch_size=128, depth=18, image_size=112, classes=1000)),
    "gpt": ("GPT 4x128, seq 256, batch 64", "transformer",
            dict(batch_size=64, seq_len=256, dim=128, heads=4, layers=4)),
    "mlp": ("MLP 8x1024, batch 32768", "mlp", dict(batch_size=32768, width=1024, depth=8)),
}
T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def estimated(plan: jaxmem.Plan) -> dict[str, float]:
  """The estimate of ``plan``: peak, FLOPs of the ops its schedule runs, priced bytes, overhead."""
  sim = jaxmem.simulate(plan, PROFILE)
  # The compute steps the simulator ran (it skips those whose results nobody reads).
  ran = {e.step for e in sim.timeline if e.kind in ("compute", "recompute")}
  costs = plan.program.costs
  flops = float(sum(costs.flops[sim.schedule.steps[i].op] for i in ran))
  return dict(est_peak=plan.estimated_peak_bytes, est_flops=flops,
              est_accessed=sim.accessed_bytes, overhead=sim.overhead,
              sim_s=sim.step_time_s)


def compiled(fn: Any, args: Any, target: Any, earlier: dict | None = None) -> dict[str, float]:
  """The compiled figures of ``fn`` (``earlier``'s instead, when given: ``--estimates-only``)."""
  if earlier is not None:
    return {k: earlier[k] for k in ("peak", "flops", "accessed", "compile_s")}
  t = time.perf_counter()
  c = fn.lower(*target.place(args)).compile()
  mem = jaxmem.compiled_memory(c)
  return dict(peak=mem.peak_bytes, flops=flops_of(c), accessed=bytes_accessed_of(c),
              compile_s=time.perf_counter() - t)


def analyse(step: Any, args: Any) -> jaxmem.Program:
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  return jaxmem.Program.of(analyze_program(trace(step, shapes, backend="tpu")))


def fit_method(spec: str) -> str:
  """The method name of the ``jaxmem.fit`` row for ``spec`` ``"f:device:planner"``
  (``default``: the argument left out)."""
  frac, device, planner = spec.split(":")
  kw = [f"{k}={v!r}" for k, v in (("device", device), ("planner", planner)) if v != "default"]
  return f"fit({', '.join([frac, *kw])})"


def run_fit(name: str, step: Any, args: Any, spec: str) -> dict[str, Any]:
  """``jaxmem.fit(f, target=TARGET, device=D, planner=P)`` for ``spec`` ``"f:D:P"``, compiled
  (``default`` for D or P: the argument left out)."""
  frac, device, planner = spec.split(":")
  kw = {k: v for k, v in (("device", device), ("planner", planner)) if v != "default"}
  t = time.perf_counter()
  fitted = jaxmem.fit(float(frac), target=TARGET, **kw)(step)
  res = fitted.fit_result(*args)
  plan_s = time.perf_counter() - t
  row = dict(model=name, label=MODELS[name][0], method=fit_method(spec),
             planner=res.plan.planner, plan_s=plan_s,
             decisions=len(res.plan.decisions), rounds=res.rounds,
             host=res.memory.host_temp_bytes, **estimated(res.plan))
  c = fitted.lower(*args).compile()
  row.update(peak=jaxmem.compiled_memory(c).peak_bytes, flops=flops_of(c),
             accessed=bytes_accessed_of(c), compile_s=plan_s)
  return row


def run_model(name: str, target: Any, earlier: dict[str, dict] | None = None,
              fits: tuple[str, ...] = (), plans: tuple[str, ...] = (),
              refit: bool = False) -> list[dict[str, Any]]:
  """The rows of one model; ``earlier``: compiled rows by method, reused instead of compiling;
  ``fits``: ``"f:device:planner"`` of the ``jaxmem.fit`` rows to add (:func:`run_fit`;
  an earlier row of the same fit is reused unless ``refit``); ``plans``: ``"f:device:planner"`` of plans for
  ``f`` of the estimated peak to add (after the selective ones at ``FLOPS_FRACTIONS``),
  lowered through the ``xla`` backend."""
  label, mod_name, kw = MODELS[name]

  def before(method: str) -> dict | None:
    return None if earlier is None else earlier.get(method)

  def planned(method: str, plan: jaxmem.Plan, plan_s: float) -> dict[str, Any]:
    old = before(method)
    now = (plan.planner, len(plan.decisions))
    if old is not None and (old["planner"], old["decisions"]) != now:
      log(f"[{name}] {method} now plans {plan.planner} ({len(plan.decisions)} decisions), "
          f"not the compiled {old['planner']} ({old['decisions']}): compiling it")
      old = None
    return dict(model=name, label=label, method=method, planner=plan.planner, plan_s=plan_s,
                decisions=len(plan.decisions), **estimated(plan),
                **compiled(jit_plan(plan, backend="xla"), args, target, old))

  module = importlib.import_module(mod_name)
  rows = []
  step, args = module.build(**kw)
  plain = analyse(step, args)
  none = common.finish(plain, (), plain.peak_bytes, "none", ())
  log(f"[{name}] jit ...")
  rows.append(dict(model=name, label=label, method="jit", **estimated(none),
                   **compiled(jax.jit(step), args, target, before("jit"))))
  for pol in POLICIES:
    log(f"[{name}] policy:{pol} ...")
    pstep, pargs = module.build(**kw, remat_policy=pol)
    prog = analyse(pstep, pargs)
    est = estimated(common.finish(prog, (), prog.peak_bytes, "none", ()))
    est["overhead"] = est["sim_s"] / rows[0]["sim_s"] - 1
    rows.append(dict(model=name, label=label, method=f"policy:{pol}", **est,
                     **compiled(jax.jit(pstep), pargs, target, before(f"policy:{pol}"))))
  for frac in FRACTIONS:
    log(f"[{name}] auto({frac}) ...")
    t = time.perf_counter()
    plan = jaxmem.get_planner("auto")(plain, int(frac * plain.peak_bytes), PROFILE)
    rows.append(planned(f"auto({frac})", plan, time.perf_counter() - t))
  for spec in (*(f"{frac}:flops:selective" for frac in FLOPS_FRACTIONS), *plans):
    frac, device, planner = spec.split(":")
    log(f"[{name}] {planner}/{device}({frac}) ...")
    t = time.perf_counter()
    plan = jaxmem.get_planner(planner)(plain, int(float(frac) * plain.peak_bytes), device)
    rows.append(planned(f"{planner}/{device}({frac})", plan, time.perf_counter() - t))
  for spec in fits:
    log(f"[{name}] fit {spec} ...")
    old = None if refit else before(fit_method(spec))
    rows.append(dict(old) if old is not None else run_fit(name, step, args, spec))
  base = rows[0]
  for r in rows:
    for key in ("est_peak", "est_flops", "est_accessed", "peak", "flops", "accessed"):
      if r.get(key) is not None and base.get(key):
        r[f"{key}_ratio"] = r[key] / base[key]
    log(f"[{name}] {r['method']}: est peak {r['est_peak_ratio']:.2f} compiled "
        f"{r['peak_ratio']:.2f}; est bytes {r['est_accessed_ratio']:.3f} compiled "
        f"{r.get('accessed_ratio', float('nan')):.3f}; est FLOPs {r['est_flops_ratio']:.3f} "
        f"compiled {r.get('flops_ratio', float('nan')):.3f}; sim {r['overhead']:+.1%}")
  return rows


def _pct(x: float | None) -> str:
  return "-" if x is None or not np.isfinite(x) else f"{x:.2f}"


def render(res: dict[str, Any]) -> list[str]:
  m = res["meta"]
  rows = res["rows"]
  at = m["commit"]
  if m.get("compiled_at", at) != at:
    at += (f" (compiled figures from {m['compiled_at']}; the planned rows whose plan changed "
           "since, and the rows it had not recorded, compiled again)")
  flags = " ".join(m.get("argv", [f"--models {','.join(m['models'])}"]))
  lines = [f"`python bench/compiled_traffic.py {flags}` at {at} "
           f"(jax {m['jax']}, libtpu {m['libtpu']}, {m['date']}): XLA:TPU's compiled program for "
           "a TPU v5e chip, compiled ahead of time on a CPU-only machine (nothing ran on a TPU), "
           "beside jaxmem's estimate of the same step. Every ratio is to plain `jax.jit` of the "
           "same model (estimate to estimate, compiled to compiled). Models: "
           + "; ".join(f"{k}: {MODELS[k][0]}" for k in m["models"]) + ".", "",
           "| model | method | est peak | compiled peak | est FLOPs | compiled FLOPs | "
           "est bytes | compiled bytes | compiled GB accessed | simulated (tpu-v5e) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    method = r["method"] + (f" = {r['planner']}" if "planner" in r else "")
    if r.get("host"):
      method += f" (+{r['host'] / 2**20:.0f} MiB on the host)"
    acc = "-" if r.get("accessed") is None else f"{r['accessed'] / 1e9:.2f}"
    lines.append(f"| {r['model']} | {method} | {_pct(r.get('est_peak_ratio'))} | "
                 f"{_pct(r.get('peak_ratio'))} | {_pct(r.get('est_flops_ratio'))} | "
                 f"{_pct(r.get('flops_ratio'))} | {_pct(r.get('est_accessed_ratio'))} | "
                 f"{_pct(r.get('accessed_ratio'))} | {acc} | {r['overhead']:+.1%} |")
  # How far the estimate's traffic is from the compiled traffic, per row kind.
  errs: dict[str, list[float]] = {}
  for r in rows:
    if r.get("accessed") and r.get("est_accessed"):
      kind = r["method"].split(":")[0].split("(")[0]
      errs.setdefault(kind, []).append(r["est_accessed"] / r["accessed"] - 1)
  lines += ["", "Estimated bytes over compiled bytes accessed, by kind of row (median, range): "
            + "; ".join(f"{k} {np.median(v):+.0%} ({min(v):+.0%} .. {max(v):+.0%}, {len(v)} rows)"
                        for k, v in errs.items()) + "."]
  return lines


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS))
  p.add_argument("--render", action="store_true", help="rewrite the report from the JSON")
  p.add_argument("--fits", default="",
                 help="comma-separated MODEL:FRACTION:DEVICE:PLANNER of `jaxmem.fit` rows to "
                      "add (compiled through fit on the target), e.g. gpt:0.69:flops:selective; "
                      "`default` leaves the device or the planner out: gpt:0.5:default:default")
  p.add_argument("--plans", default="",
                 help="comma-separated MODEL:FRACTION:DEVICE:PLANNER of planned rows to add "
                      "(FRACTION of the estimated peak), e.g. gpt:0.35:tpu-v5e:segments-modules")
  p.add_argument("--estimates-only", action="store_true",
                 help="estimate again beside the compiled figures of the JSON; compile only "
                      "the planned rows whose plan changed and the rows it has not recorded")
  p.add_argument("--refit", action="store_true",
                 help="with --estimates-only, run the --fits rows again (fit's search changed) "
                      "instead of reusing the recorded ones")
  a = p.parse_args()
  path = RESULTS / "compiled_traffic.json"
  if a.render:
    res = json.loads(path.read_text())
  else:
    names = [n for n in a.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
      p.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    import importlib.metadata
    started = commit()
    target = get_target(TARGET)
    earlier: dict[str, dict[str, dict]] = {}
    compiled_at = started
    if a.estimates_only:
      old = json.loads(path.read_text())
      compiled_at = old["meta"].get("compiled_at", old["meta"]["commit"])
      for r in old["rows"]:
        earlier.setdefault(r["model"], {})[r["method"]] = r
    extra = {}
    for flag, value in (("--fits", a.fits), ("--plans", a.plans)):
      extra[flag] = [f.split(":", 1) for f in value.split(",") if f]
      if any(len(f) != 2 or f[0] not in names or f[1].count(":") != 2 for f in extra[flag]):
        p.error(f"{flag}: MODEL:FRACTION:DEVICE:PLANNER with MODEL among {names}, "
                f"got {value!r}")
    rows = [r for n in names for r in run_model(
        n, target, earlier.get(n) if a.estimates_only else None,
        tuple(spec for model, spec in extra["--fits"] if model == n),
        tuple(spec for model, spec in extra["--plans"] if model == n), a.refit)]
    res = dict(meta=dict(commit=started, compiled_at=compiled_at, jax=jax.__version__,
                         libtpu=importlib.metadata.version("libtpu"),
                         date=time.strftime("%Y-%m-%d %H:%M"), models=names,
                         argv=sys.argv[1:],
                         wall_s=time.perf_counter() - T0), rows=rows)
    path.write_text(json.dumps(res, indent=1))
  lines = render(res)
  write_report("compiled_traffic", lines, "\n".join(lines))


if __name__ == "__main__":
  main()
