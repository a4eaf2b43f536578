"""Memory against simulated overhead: `auto` beside JAX's own remat policies applied by hand.

A user who runs out of memory today wraps every block of the model in
``nn.remat`` with one of JAX's policies and hopes. For each example model and
each device profile this bench places every such policy as a point (its
estimated peak as a fraction of the plain step's, its simulated step time
over the plain step's) and asks `auto` for a plan at that policy's peak: it
*dominates* the policy when it fits that budget at no more simulated time.
`auto`'s own frontier at 0.9 .. 0.3 of the plain peak is drawn beside them.

Everything is estimated and simulated (no compile): each step is analysed for
the compiler the profile stands for (XLA:GPU's model for the GPU profiles,
XLA:TPU's for ``tpu-v5e``; shape-only arguments, nothing allocated) and
simulated on the profile with its calibrated efficiencies
(``bench/cost_calibration.py``). A policy's time is its program's plain
simulated time (its recomputation is in its program), over the plain step's.

Run: ``python bench/frontier.py [--quick] [--models mlp,gpt]``; writes
bench/results/frontier.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402

import jaxmem  # noqa: E402
from _results import commit, write_report  # noqa: E402
from jaxmem._src.estimate.analysis import analyze_program  # noqa: E402
from jaxmem._src.ir.trace import trace  # noqa: E402
from jaxmem._src.plan.simulate import program_time  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
            "offload_dot_with_no_batch_dims")
DEVICES = {"h100-sxm": "gpu", "h100-pcie": "gpu", "a100-40g": "gpu", "tpu-v5e": "tpu"}
FRACTIONS = (0.9, 0.7, 0.5, 0.3)
# (label, example module, build kwargs). Sizes: realistic batches whose
# analysis takes seconds on 2 CPU cores.
MODELS = {
    "mlp": ("MLP 8x512, batch 8192", "mlp", dict(batch_size=8192)),
    "gpt": ("GPT 4x128, seq 128, batch 16", "transformer", dict(batch_size=16)),
    "lstm": ("char-LSTM 2x512, seq 128, batch 64", "lstm", dict(batch_size=64, abstract=True)),
    "vgg16": ("VGG-16, 224x224, batch 16", "vgg", dict(batch_size=16, abstract=True)),
    "unet": ("UNet depth 4, 256x256, batch 8", "unet", dict(batch_size=8, abstract=True)),
    "resnet50": ("ResNet-50, 224x224, batch 64", "resnet",
                 dict(batch_size=64, depth=50, image_size=224, abstract=True)),
    "densenet": ("DenseNet-121, 224x224, batch 16", "densenet",
                 dict(batch_size=16, abstract=True)),
}
QUICK = {"mlp": dict(batch_size=1024), "gpt": dict(batch_size=4)}


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def analyse(module: Any, kw: dict, policy: str | None, backend: str) -> jaxmem.Program:
  step, args = module.build(**kw, **({"remat_policy": policy} if policy else {}))
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  # The compiler model of the profile's platform, without its devices (one
  # device needs no placement; a GPU target would need jax's CUDA plugin).
  return jaxmem.Program.of(analyze_program(trace(step, shapes, backend=backend)))


def auto_point(prog: jaxmem.Program, budget: int, device: str) -> dict:
  t = time.perf_counter()
  plan = jaxmem.get_planner("auto")(prog, budget, device)
  dt = time.perf_counter() - t
  sim = jaxmem.simulate(plan, device)
  return dict(planner=plan.planner, estimated=plan.estimated_peak_bytes,
              fits=plan.estimated_peak_bytes <= budget, overhead=sim.overhead, plan_s=dt)


def run_model(name: str, quick: bool) -> list[dict]:
  import importlib
  label, mod_name, kw = MODELS[name]
  kw = {**kw, **(QUICK.get(name, {}) if quick else {})}
  module = importlib.import_module(mod_name)
  rows = []
  for backend in sorted(set(DEVICES.values())):
    log(f"[{name}] analysing for {backend} ...")
    progs = {None: analyse(module, kw, None, backend)}
    for pol in POLICIES:
      try:
        progs[pol] = analyse(module, kw, pol, backend)
      except Exception as e:  # noqa: BLE001 - a policy a model cannot trace is reported
        log(f"  {pol}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    plain = progs[None]
    for device, dev_backend in DEVICES.items():
      if dev_backend != backend:
        continue
      base_s = program_time(plain, device)
      for pol, prog in progs.items():
        if pol is None:
          continue
        point = dict(model=name, label=label, device=device, kind="policy", policy=pol,
                     fraction=prog.peak_bytes / plain.peak_bytes,
                     overhead=program_time(prog, device) / base_s - 1,
                     host=pol.startswith("offload"))
        if prog.peak_bytes < plain.peak_bytes:
          log(f"[{name}] {device} auto at {pol}'s peak ({point['fraction']:.2f}) ...")
          a = auto_point(plain, prog.peak_bytes, device)
          point["auto"] = a
          point["dominated"] = a["fits"] and a["overhead"] <= point["overhead"] + 1e-9
        rows.append(point)
      for frac in FRACTIONS:
        log(f"[{name}] {device} auto at {frac} ...")
        a = auto_point(plain, int(frac * plain.peak_bytes), device)
        rows.append(dict(model=name, label=label, device=device, kind="auto", budget=frac,
                         fraction=a["estimated"] / plain.peak_bytes, **a))
  return rows


def render(res: dict) -> list[str]:
  m = res["meta"]
  runs = m.get("runs") or {}
  at = (f"at {m['commit']} (jax {m['jax']}, {m['date']}" if len(
      {(r["commit"], r["date"]) for r in runs.values()}) <= 1 else
      "(" + "; ".join(f"{n}: {r['commit']}, {r['date']}" for n, r in runs.items())
      + f"; jax {m['jax']}")
  lines = [f"`python bench/frontier.py` {at}"
           f"{', quick' if m['quick'] else ''}): every figure estimated and simulated, nothing "
           "compiled. A policy is JAX's, applied per block by hand; `auto` is asked for that "
           "policy's estimated peak and *dominates* it when it fits at no more simulated time.",
           ""]
  pol_rows = [r for r in res["rows"] if r["kind"] == "policy"]
  below = [r for r in pol_rows if "auto" in r]
  dom = sum(r["dominated"] for r in below)
  lines += [f"`auto` dominates **{dom} of {len(below)}** policy points that lower the peak "
            f"({len(pol_rows) - len(below)} more raise it: nothing to beat).", "",
            "| model | device | policy | peak (of plain) | overhead | auto at that peak | "
            "auto overhead | dominates |", "|---|---|---|---|---|---|---|---|"]
  for r in pol_rows:
    a = r.get("auto")
    if a is None:
      lines.append(f"| {r['model']} | {r['device']} | {r['policy']} | {r['fraction']:.2f} | "
                   f"{r['overhead']:+.1%} | - | - | (raises the peak) |")
      continue
    lines.append(f"| {r['model']} | {r['device']} | {r['policy']} | {r['fraction']:.2f} | "
                 f"{r['overhead']:+.1%} | {a['estimated'] / 2**20:.0f} MiB "
                 f"({'fits' if a['fits'] else 'NO'}, {a['planner']}) | {a['overhead']:+.1%} | "
                 f"{'yes' if r['dominated'] else '**no**'} |")
  lines += ["", "`auto` at fractions of the plain peak:", "",
            "| model | device | " + " | ".join(str(f) for f in FRACTIONS) + " |",
            "|---|---|" + "---|" * len(FRACTIONS)]
  for (model, device) in dict.fromkeys((r["model"], r["device"]) for r in res["rows"]):
    cells = []
    for f in FRACTIONS:
      r = next((x for x in res["rows"] if x["kind"] == "auto" and x["model"] == model
                and x["device"] == device and x["budget"] == f), None)
      cells.append("-" if r is None else (f"{r['overhead']:+.1%}" if r["fits"]
                                          else f"NO ({r['fraction']:.2f})"))
    lines.append(f"| {model} | {device} | " + " | ".join(cells) + " |")
  sizes = "; ".join(f"{k}: {MODELS[k][0]}" for k in dict.fromkeys(r["model"] for r in res["rows"]))
  lines += ["", f"Models: {sizes}."]
  return lines


def plot(res: dict, path: pathlib.Path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  models = list(dict.fromkeys(r["model"] for r in res["rows"]))
  device = "h100-sxm"
  cols = min(4, len(models))
  nrows = math.ceil(len(models) / cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.4 * nrows), squeeze=False)
  for ax, model in zip(axes.flat, models):
    rows = [r for r in res["rows"] if r["model"] == model and r["device"] == device]
    auto = sorted((r["fraction"], r["overhead"]) for r in rows if r["kind"] == "auto" and r["fits"])
    if auto:
      ax.plot([a for a, _ in auto], [100 * b for _, b in auto], "o-", label="auto")
    for r in rows:
      if r["kind"] == "policy":
        ax.plot(r["fraction"], 100 * r["overhead"], "s", label=r["policy"])
    ax.set_title(f"{model} ({device})", fontsize=9)
    ax.set_xlabel("peak / plain peak")
    ax.set_ylabel("simulated overhead %")
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=6)
  for ax in list(axes.flat)[len(models):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="small sizes, MLP and GPT only")
  ap.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(MODELS))
  ap.add_argument("--merge", action="store_true",
                  help="replace only these models' rows of bench/results/frontier.json")
  a = ap.parse_args()
  names = a.models.split(",") if a.models else (["mlp", "gpt"] if a.quick else list(MODELS))
  for n in names:
    if n not in MODELS:
      raise SystemExit(f"--models: unknown model {n!r}; choose from {', '.join(MODELS)}")
  t0 = time.perf_counter()
  started = commit()   # what this run imported, not what the tree holds when it ends
  rows = []
  for n in names:
    rows += run_model(n, a.quick)
  date = time.strftime("%Y-%m-%d %H:%M")
  runs = {n: dict(commit=started, date=date) for n in names}
  if a.merge:
    old = json.loads((RESULTS / "frontier.json").read_text())
    kept = [r for r in old["rows"] if r["model"] not in names]
    runs = {**{n: dict(commit=old["meta"]["commit"], date=old["meta"]["date"])
               for n in dict.fromkeys(r["model"] for r in kept)},
            **old["meta"].get("runs", {}), **runs}
    order = list(MODELS)
    rows = sorted(kept + rows, key=lambda r: order.index(r["model"]))
  res = dict(meta=dict(commit=started, jax=jax.__version__, date=date, quick=a.quick,
                       devices=list(DEVICES), wall_s=time.perf_counter() - t0,
                       runs={n: runs[n] for n in dict.fromkeys(r["model"] for r in rows)}),
             rows=rows)
  (RESULTS / "frontier.json").write_text(json.dumps(res, indent=1))
  write(res)


def write(res: dict) -> None:
  lines = render(res)
  write_report("frontier", ["# Memory against overhead: auto and JAX's policies", "", *lines],
               "\n".join(lines[:4]))
  plot(res, RESULTS / "frontier.png")


if __name__ == "__main__":
  main()
