"""Step cost on a GPU read from XLA:GPU's own compiled program, without a GPU.

Two parts, both on the ``gpu:h100`` target (XLA:GPU compiled ahead of time
through jax's CUDA plugin; nothing runs on a GPU):

1. **Against measured step times.** The steps an H200 ran
   (``bench/results/gpu.json``: the GPT and the MLP by their GPU busy time,
   ResNet-18 by its waited step time), plain ``jax.jit`` and JAX's policies
   per block, compiled here; each program priced kernel by kernel
   (:func:`jaxmem._src.verify.hlo_cost.hlo_kernels`, XLA's GPU performance
   model's roofline: per kernel the longer of compute and memory time, plus
   a launch) on the ``h200`` profile. Beside it, the cost model's simulated
   ratio (``bench/results/cost_calibration.json``, the ``published`` column).
   What planners decide by is the ratio to ``jax.jit``; the table says which
   of the two predicts the measured ratio.
2. **Policies and `jaxmem.fit` on the compiled program.** ResNet-50 (224²,
   batch 64) and the GPT of part 1: JAX's policies applied per block by hand
   and ``jaxmem.fit(f, target="gpu:h100")`` at 0.5 and at each policy's
   compiled peak, priced the same way on the ``h100-sxm`` profile. A fit
   *dominates* a policy when its compiled peak is at most the policy's at no
   more roofline time.

Needs ``pip install "jax[cuda12]"`` (the CUDA plugin matching jax; no GPU).
Run: ``python bench/gpu_cost.py [--models resnet50,gpt] [--no-fit]``; writes
bench/results/gpu_cost.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compile for the GPU; run nothing on one

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

import gpu_bench  # noqa: E402  (the measured steps, at their sizes)
import jaxmem  # noqa: E402
from _results import RESULTS, commit, write_report  # noqa: E402
from gpu_aot import cuda_plugin  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402

TARGET = "gpu:h100"
MEASURED = RESULTS / "gpu.json"
CALIBRATION = RESULTS / "cost_calibration.json"
VALIDATE = ("gpt", "mlp", "resnet18")
POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
            "offload_dot_with_no_batch_dims")
MIB = 2 ** 20
T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def priced(compiled: Any, profile: str) -> dict[str, Any]:
  cost = jaxmem.compiled_cost(compiled, from_hlo=True)
  return dict(peak=jaxmem.compiled_memory(compiled).peak_bytes, flops=cost.flops,
              bytes=cost.bytes_accessed, kernels=len(cost.kernels),
              seconds=cost.seconds(jaxmem.device_profile(profile)))


def simulated_ratios() -> dict[tuple[str, str], float]:
  """The cost model's x jit per (model, method), from bench/results/cost_calibration.json."""
  sim: dict[tuple[str, str], float] = {}
  if CALIBRATION.exists():
    cal = json.loads(CALIBRATION.read_text())
    sim.update({(r["model"], r["method"]): r["published_ratio"] for r in cal["rows"]})
    sim.update({(r["model"], r["method"]): r["simulated_ratio"] for r in cal.get("waited", [])})
  return sim


def validate() -> list[dict[str, Any]]:
  """Part 1: compiled roofline and simulated ratios against the H200's measured ones."""
  target = get_target(TARGET)
  measured = {(r["model"], r["method"]): r for r in json.loads(MEASURED.read_text())["rows"]}
  sim = simulated_ratios()
  rows = []
  for name in VALIDATE:
    model = gpu_bench.MODELS[name]
    base = None
    for method, policy in [("jit", None), *((f"policy:{p}", p) for p in gpu_bench.POLICIES)]:
      m = measured.get((name, method))
      if m is None:
        continue
      step, args = gpu_bench.build(model, policy)
      row = dict(model=name, method=method, **priced(jax.jit(step).lower(
          *target.place(args)).compile(), "h200"))
      busy = (m.get("profile") or {}).get("busy_ms")
      row.update(measured_peak=m.get("peak"), measured_ms=busy if busy else m["step_s"] * 1e3,
                 measured_kind="busy" if busy else "waited", host=m.get("host") or 0)
      if base is None:
        base = row
      row["compiled_ratio"] = row["seconds"] / base["seconds"]
      row["measured_ratio"] = row["measured_ms"] / base["measured_ms"]
      row["simulated_ratio"] = 1.0 if method == "jit" else sim.get((name, method))
      rows.append(row)
      log(f"[{name}] {method}: roofline {row['seconds'] * 1e3:.2f} ms "
          f"x{row['compiled_ratio']:.3f}, measured x{row['measured_ratio']:.3f}")
  return rows


def build(name: str, policy: str | None) -> tuple[Any, tuple[Any, ...], tuple[int, ...]]:
  """A measured step of ``bench/gpu_bench.py``, or a frontier model (state donated)."""
  if name in gpu_bench.MODELS:
    step, args = gpu_bench.build(gpu_bench.MODELS[name], policy)
    return step, args, ()
  import importlib

  import frontier as frontier_bench
  _, mod, kw = frontier_bench.MODELS[name]
  step, args = importlib.import_module(mod).build(
      **kw, **({"remat_policy": policy} if policy else {}))
  return step, args, (0, 1, 2)

BODY_MODELS = ("resnet18", "resnet50", "vgg16", "unet", "densenet")


def body_rule() -> list[dict[str, Any]]:
  """Part 3: the cost model's price of per-block policies against the compiled roofline.

  The cost model prices a policy's ``jax.jit`` bodies by ``cost._body_fused``;
  on a GPU what a convolution reads is stored there, unless it is an epilogue
  of a convolution (``DeviceProfile.fuses_into_convolutions`` False). The
  same programs priced with convolution inputs fused (the rule before) are
  the third column.
  """
  import dataclasses

  from jaxmem._src.estimate.analysis import analyze_program
  from jaxmem._src.ir.trace import trace
  from jaxmem._src.plan.simulate import program_time
  target = get_target(TARGET)
  rows = []
  for name in BODY_MODELS:
    # ResNet-18 at the H200's size and on its profile; the others at the frontier's.
    profile = jaxmem.device_profile("h200" if name in gpu_bench.MODELS else "h100-sxm")
    fused = dataclasses.replace(profile, fuses_into_convolutions=True)
    base = None
    for policy in (None, "nothing_saveable", "dots_saveable"):
      step, args, _ = build(name, policy)
      shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
      prog = jaxmem.Program.of(analyze_program(trace(step, shapes, backend="gpu")))
      compiled = jax.jit(step).lower(*target.place(shapes)).compile()
      row = dict(model=name, policy=policy or "jit", profile=profile.name,
                 compiled=jaxmem.compiled_cost(compiled, from_hlo=True).seconds(profile),
                 stored=program_time(prog, profile), fused=program_time(prog, fused))
      base = base or row
      for k in ("compiled", "stored", "fused"):
        row[f"{k}_ratio"] = row[k] / base[k]
      rows.append(row)
      log(f"[{name}] {row['policy']}: compiled x{row['compiled_ratio']:.3f}, "
          f"stored x{row['stored_ratio']:.3f}, fused x{row['fused_ratio']:.3f}")
  return rows


def frontier(names: list[str], fit: bool) -> list[dict[str, Any]]:
  """Part 2: policies by hand and `jaxmem.fit` on XLA:GPU's compiled program."""
  target = get_target(TARGET)
  rows = []
  for name in names:
    step, args, donate = build(name, None)
    base = dict(model=name, method="jit", **priced(
        jax.jit(step, donate_argnums=donate).lower(*target.place(args)).compile(), "h100-sxm"))
    rows.append(base)
    log(f"[{name}] jit: {base['peak'] / MIB:.1f} MiB, {base['seconds'] * 1e3:.2f} ms")
    fractions = {0.5}
    for p in POLICIES:
      pstep, pargs, _ = build(name, p)
      row = dict(model=name, method=f"policy:{p}", **priced(
          jax.jit(pstep, donate_argnums=donate).lower(*target.place(pargs)).compile(),
          "h100-sxm"))
      rows.append(row)
      if row["peak"] < base["peak"]:
        fractions.add(round(row["peak"] / base["peak"], 4))
      log(f"[{name}] {p}: {row['peak'] / MIB:.1f} MiB, {row['seconds'] * 1e3:.2f} ms")
    for f in sorted(fractions, reverse=True) if fit else ():
      t = time.perf_counter()
      row: dict[str, Any] = dict(model=name, method=f"fit({f:g})", fraction=f)
      try:
        res = jaxmem.fit(f, target=TARGET, donate_argnums=donate)(step).fit_result(*args)
        cost = res.cost
        row.update(peak=res.peak_bytes, flops=cost.flops, bytes=cost.bytes_accessed,
                   kernels=len(cost.kernels),
                   seconds=cost.seconds(jaxmem.device_profile("h100-sxm")),
                   planner=res.plan.planner, remat=res.plan.num_remat,
                   offload=res.plan.num_offload, budget=res.budget_bytes,
                   compared=[list(c) for c in res.compared])
      except jaxmem.BudgetError as e:
        row.update(status="BudgetError", budget=e.budget_bytes, smallest=e.smallest_bytes)
      row["wall_s"] = time.perf_counter() - t
      rows.append(row)
      log(f"[{name}] fit({f:g}): {row.get('peak', row.get('smallest', 0)) / MIB:.1f} MiB "
          f"{row.get('planner', row.get('status'))} ({row['wall_s']:.0f} s)")
    for row in rows:
      if row["model"] == name and "seconds" in row:
        row["peak_ratio"] = row["peak"] / base["peak"]
        row["time_ratio"] = row["seconds"] / base["seconds"]
        row["flops_ratio"] = row["flops"] / base["flops"]
        row["bytes_ratio"] = row["bytes"] / base["bytes"]
  for row in rows:
    if not row["method"].startswith("policy:") or row["peak_ratio"] >= 1:
      continue
    fits = [r for r in rows if r["model"] == row["model"] and r["method"].startswith("fit(")
            and "seconds" in r and r["peak"] <= row["peak"]]
    best = min(fits, key=lambda r: r["seconds"], default=None)
    row["fit"] = best["method"] if best else None
    row["dominated"] = bool(best and best["seconds"] <= row["seconds"])
  return rows


def pct(x: float | None) -> str:
  return "-" if x is None else f"{x - 1:+.1%}"


def markdown(val: list[dict[str, Any]], front: list[dict[str, Any]], meta: dict[str, Any],
             body: list[dict[str, Any]] | None = None) -> list[str]:
  out = [
      "# Step cost on a GPU from XLA:GPU's compiled program",
      "",
      f"`{meta['command']}` ({meta['date']}, commit {meta['commit']}; jax {meta['jax']}, "
      f"{meta['plugin']}; nothing ran on a GPU). Every program is XLA:GPU's, compiled ahead of "
      f"time for `{TARGET}` on this machine; its cost is read kernel by kernel from the "
      "compiled HLO (`jaxmem._src.verify.hlo_cost`) and priced as XLA's GPU performance model "
      "does: per kernel the longer of its compute and memory time, plus a launch.",
      "",
      "## 1. Against an H200's measured step times",
      "",
      f"Measured: `bench/results/gpu.json` ({meta.get('measured_on')}, jax "
      f"{meta.get('measured_jax')}): GPU busy time per step for the GPT and the MLP, the "
      "waited step time for ResNet-18 (it includes the host's dispatch, so its ratios are "
      "diluted). Compiled roofline on the `h200` profile; simulated: the cost model "
      "(`bench/results/cost_calibration.json` as last run, published efficiencies).",
      "",
      "| model | method | compiled peak here MiB | measured peak MiB | measured ms | x jit "
      "| compiled roofline ms | x jit | simulated x jit | over jit, measured ms | "
      "over jit, roofline ms |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in val:
    mp = r.get("measured_peak")
    sim = r["simulated_ratio"]
    jit = next(x for x in val if x["model"] == r["model"] and x["method"] == "jit")
    out.append(
        f"| {r['model']} | {r['method']} | {r['peak'] / MIB:.1f} | "
        f"{'-' if not mp else format(mp / MIB, '.1f')} | {r['measured_ms']:.2f} "
        f"({r['measured_kind']}) | {r['measured_ratio']:.3f} | {r['seconds'] * 1e3:.2f} | "
        f"{r['compiled_ratio']:.3f} | {'-' if sim is None else format(sim, '.3f')} | "
        f"{r['measured_ms'] - jit['measured_ms']:+.2f} | "
        f"{(r['seconds'] - jit['seconds']) * 1e3:+.2f} |")
  def err(r: dict[str, Any], key: str) -> str:
    return "-" if r[key] is None else f"{r[key] / r['measured_ratio'] - 1:+.1%}"
  same = [r for r in val if r.get("measured_peak")
          and abs(r["peak"] / r["measured_peak"] - 1) < 0.1]
  out += [
      "",
      "Ratio errors (predicted x jit over measured x jit), compiled roofline / simulated:",
      "",
      *(f"* {r['model']} {r['method']}: {err(r, 'compiled_ratio')} / {err(r, 'simulated_ratio')}"
        + (f" ({r['host'] / MIB:.0f} MiB to host and back: the H200's copies ran far below "
           "the link rate the profile assumes, `bench/results/cost_calibration.md`)"
           if r["host"] else "")
        for r in val if r["method"] != "jit"),
      "",
      "* Rows whose program here is the measured one (compiled peak within 10% of the "
      "measured): " + (", ".join(r["model"] + " " + r["method"] for r in same) or "none")
      + ". The H200 compiled with jax " + str(meta.get("measured_jax")) + ", this machine "
      "with " + meta["jax"] + ": where the peaks differ, the programs differ.",
      "",
      "## 2. JAX's policies and `jaxmem.fit` on the compiled program (`h100-sxm` profile)",
      "",
      "| model | method | compiled peak MiB | of jit | roofline ms | x jit | FLOPs x jit "
      "| bytes x jit | planner | dominated by |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in front:
    if "seconds" not in r:
      out.append(f"| {r['model']} | {r['method']} | `BudgetError`: smallest "
                 f"{r['smallest'] / MIB:.1f} | - | - | - | - | - | - | - |")
      continue
    dom = ("-" if not r["method"].startswith("policy:") or r["peak_ratio"] >= 1 else
           f"{r['fit']} (yes)" if r.get("dominated") else f"{r['fit'] or 'no fit'} (**no**)")
    out.append(f"| {r['model']} | {r['method']} | {r['peak'] / MIB:.1f} | {r['peak_ratio']:.2f} "
               f"| {r['seconds'] * 1e3:.2f} | {r['time_ratio']:.3f} | {r['flops_ratio']:.3f} | "
               f"{r['bytes_ratio']:.3f} | {r.get('planner', '-')} | {dom} |")
  pol = [r for r in front if r["method"].startswith("policy:") and r.get("peak_ratio", 1) < 1]
  out += ["", f"* `fit` dominates {sum(r.get('dominated', False) for r in pol)} of {len(pol)} "
          "policy points that lower the peak, on the compiled program."]
  for r in front:
    if r["method"] == "fit(0.5)" and "seconds" in r:
      out.append(f"* {r['model']} at 0.5: `fit` compiles to {r['peak_ratio']:.2f} of `jax.jit`'s "
                 f"peak at {pct(r['time_ratio'])} roofline time.")
  out += _body_rule_lines(body or [], meta)
  return out


def _body_rule_lines(body: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
  if not body:
    return []
  out = ["", "## 3. The cost model's price of the policies against the compiled roofline", "",
         "Per-block policies x `jax.jit`: XLA:GPU's compiled kernels, and the cost model with "
         "what a convolution reads inside a `jax.checkpoint` body stored unless it is a "
         "convolution's epilogue (the rule now), or fused (the rule before). DenseNet-121 was "
         "not looked at before the rule was fixed; the epilogue refinement was made on VGG-16 "
         "and the UNet." + (f" (`{run['command']}`, {run['date']}, commit {run['commit']}.)"
                            if (run := meta.get("body_rule_run")) else ""), "",
         "| model | policy | profile | compiled roofline | stored (now) | fused (before) |",
         "|---|---|---|---|---|---|"]
  errs: dict[str, list[float]] = {"stored": [], "fused": []}
  for r in body:
    if r["policy"] == "jit":
      continue
    cells = []
    for k in ("stored", "fused"):
      e = r[f"{k}_ratio"] / r["compiled_ratio"] - 1
      errs[k].append(e)
      cells.append(f"{r[f'{k}_ratio']:.3f} ({e:+.1%})")
    out.append(f"| {r['model']} | {r['policy']} | {r['profile']} | {r['compiled_ratio']:.3f} | "
               + " | ".join(cells) + " |")
  out.append("")
  for k, label in (("stored", "now"), ("fused", "before")):
    e = errs[k]
    out.append(f"* The rule {label}: within 10% on {sum(abs(x) <= 0.10 for x in e)} of {len(e)}, "
               f"mean |error| {sum(abs(x) for x in e) / len(e):.1%}, largest "
               f"{max(e, key=abs):+.1%}.")
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="resnet50,gpt")
  p.add_argument("--no-fit", action="store_true")
  p.add_argument("--no-validate", action="store_true")
  p.add_argument("--body-rule-only", action="store_true",
                 help="run part 3 only, keeping parts 1 and 2 of bench/results/gpu_cost.json")
  p.add_argument("--render", action="store_true",
                 help="rewrite the report from bench/results/gpu_cost.json, compiling nothing")
  a = p.parse_args()
  if a.render:
    res = json.loads((RESULTS / "gpu_cost.json").read_text())
    sim = simulated_ratios()     # the cost model's figures as last calibrated
    for r in res["validation"]:
      if r["method"] != "jit":
        r["simulated_ratio"] = sim.get((r["model"], r["method"]))
    (RESULTS / "gpu_cost.json").write_text(json.dumps(res, indent=1))
    lines = markdown(res["validation"], res["frontier"], res["meta"], res.get("body_rule"))
    write_report("gpu_cost", lines, "\n".join(lines[2:]))
    return
  if a.body_rule_only:
    res = json.loads((RESULTS / "gpu_cost.json").read_text())
    res["body_rule"] = body_rule()
    res["meta"]["body_rule_run"] = dict(commit=commit(), date=time.strftime("%Y-%m-%d %H:%M"),
                                        command="python bench/gpu_cost.py --body-rule-only")
    (RESULTS / "gpu_cost.json").write_text(json.dumps(res, indent=1))
    lines = markdown(res["validation"], res["frontier"], res["meta"], res["body_rule"])
    write_report("gpu_cost", lines, "\n".join(lines[2:]))
    return
  val = [] if a.no_validate else validate()
  front = frontier([m for m in a.models.split(",") if m], not a.no_fit)
  body = body_rule()
  measured_meta = json.loads(MEASURED.read_text())["meta"]
  meta = dict(command="python bench/gpu_cost.py " + " ".join(sys.argv[1:]),
              date=time.strftime("%Y-%m-%d %H:%M"), commit=commit(), jax=jax.__version__,
              plugin=cuda_plugin(), measured_on=measured_meta.get("device"),
              measured_jax=measured_meta.get("jax"), wall_s=time.perf_counter() - T0)
  (RESULTS / "gpu_cost.json").write_text(json.dumps(dict(meta=meta, validation=val,
                                                         frontier=front, body_rule=body), indent=1))
  lines = markdown(val, front, meta, body)
  write_report("gpu_cost", lines, "\n".join(lines[2:]))


if __name__ == "__main__":
  main()
