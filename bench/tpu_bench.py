"""jaxmem.fit against JAX's own remat policies on a TPU v5e, compiled ahead of time on this machine.

Nothing runs on a TPU: every row is XLA:TPU's compiled program for one TPU v5e
chip, compiled here through libtpu (``target.place(args)`` puts the arguments
on the chip of a ``jax.experimental.topologies`` topology). For three models at
sizes whose unplanned compiled peak is at least 1 GiB (a GPT, ResNet-50 and a
UNet from examples/), each of

* plain ``jax.jit`` (the reference),
* JAX's policies applied by hand to every block (``nn.remat`` through the
  examples' ``remat_policy=``): ``nothing_saveable``, ``dots_saveable``,
  ``dots_with_no_batch_dims_saveable`` and ``offload_dot_with_no_batch_dims``
  (offloaded to ``pinned_host``),
* XLA:TPU's own rematerialization told that the chip has 0.5 and 0.3 of the
  unplanned peak (``xla_tpu_max_hbm_size_mib``; the compile fails with the
  bytes it needed when it cannot get there),
* ``jaxmem.fit(0.5, target="tpu:v5e")`` and ``jaxmem.fit(0.3, target="tpu:v5e")``

(every one with the step's state donated, ``donate_argnums``, as training loops do)

gives one row: the compiled peak (``argument + output + temp - alias`` of
``memory_analysis()``), its fraction of the unplanned peak, the host bytes
(``host_temp_size_in_bytes``), the compiled FLOPs (``cost_analysis()["flops"]``)
and memory traffic (``cost_analysis()["bytes accessed"]``, XLA:TPU's figure
after its fusion) and their ratios to plain ``jax.jit``; for the fitted rows also the budget,
whether the peak is within it, the plan-compile rounds, the planning seconds,
the planner and its remat/offload decisions. A ``BudgetError`` is a row with
the smallest compiled peak jaxmem reached; an exception inside jaxmem is a row
``error: ...`` (traceback in the JSON) and the bench goes on.

Every compile of these models takes one to two minutes on the development
machine (2 cores): a full run is one to two hours.

Run: ``python bench/tpu_bench.py [--models gpt,resnet50,unet] [--quick]``; writes
bench/results/tpu.{json,md} and the README excerpt. ``--quick`` compiles small
versions of the models (a smoke check) into a scratch directory. A run with
``--models`` replaces only those models' rows in bench/results/tpu.json;
``--render`` rewrites the tables from it without compiling anything.
"""

from __future__ import annotations

import os

# libtpu looks for TPU hosts and takes a per-machine lock unless told otherwise;
# neither matters when compiling ahead of time. Set before jax is imported.
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jaxmem  # noqa: E402
from _results import bytes_accessed_of, commit, flops_of, write_excerpt  # noqa: E402
from jaxmem._src.estimate.targets import get_target  # noqa: E402

TARGET = "tpu:v5e"
POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
            "offload_dot_with_no_batch_dims")
BUDGETS = (0.5, 0.3)
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Model:
  module: str
  kwargs: dict[str, Any]   # full size: unplanned TPU v5e compiled peak >= 1 GiB
  quick: dict[str, Any]    # --quick: small, for a smoke check
  label: str               # what the size is, for the tables
  donate: tuple[int, ...]  # the step's state arguments (parameters, statistics, optimizer state)
  held_out: bool = False   # never compiled while the TPU path was built (see MODELS)


# Realistic per-chip sizes whose unplanned compiled peak on a TPU v5e is well
# above 1 GiB and made mostly of activations (each compile is 1-2 minutes on 2
# cores; the batch barely changes that). Every step donates its state
# (parameters, statistics, optimizer state) as a training loop does: the new
# state then takes the old one's buffers. Earlier runs used the smallest sizes
# past 1 GiB (ResNet-50 batch 10: 1499 MiB donated; UNet 320x320 batch 2:
# 1831 MiB donated); there parameters, optimizer state and gradients alone
# take about 0.28 of the unplanned peak, so 0.3 was out of reach of any
# activation plan. Measured on the way (donated): ResNet-50 batch 32
# 2.70 GiB, UNet 320x320 batch 4 3.45 GiB, batch 8 4.52 GiB. --quick sizes:
# XLA:TPU keeps small temporaries out of its HBM figures (a GPT of batch 32,
# seq 128 compiles to 0 temp bytes), so they stay large enough to leave a plan
# something to do.
MODELS = {
    "gpt": Model("transformer", dict(batch_size=128, seq_len=256, dim=128, heads=4, layers=4),
                 dict(batch_size=64, seq_len=256, dim=128, heads=4, layers=2),
                 "GPT 4x128, seq 256, batch 128, state donated", (0, 1)),
    "resnet50": Model("resnet", dict(batch_size=32, depth=50, image_size=224, abstract=True),
                      dict(batch_size=64, depth=50, image_size=64, width=16, classes=10,
                           stages=(1, 1, 1, 1), abstract=True),
                      "ResNet-50, 224x224, batch 32, state donated", (0, 1, 2)),
    "unet": Model("unet", dict(batch_size=4, image_size=320, abstract=True),
                  dict(batch_size=8, image_size=128, depth=3, width=16, abstract=True),
                  "UNet 4 levels x 64, 320x320, batch 4, state donated", (0, 1)),
    # Held out: added after the scheduler limit, the checkpoint offloads and
    # fit's order of TPU planners were settled on the three above, and run
    # once, to see how that generalises (nothing was changed for them).
    # VGG-16 at batch 16 compiled to 2963 MiB, 1056 MiB of it the arguments
    # (138M parameters and their optimizer state) and as much again the
    # gradients: 0.5 and 0.3 were below what any plan can remove, so it runs
    # at batch 64, where activations dominate.
    "vgg16": Model("vgg", dict(batch_size=64, image_size=224, abstract=True),
                   dict(batch_size=16, image_size=64, width=0.25, classes=10, head=256,
                        abstract=True),
                   "VGG-16, 224x224, batch 64, state donated (held out)", (0, 1), True),
    "densenet121": Model("densenet", dict(batch_size=32, image_size=224, abstract=True),
                         dict(batch_size=16, image_size=64, classes=10, abstract=True),
                         "DenseNet-121, 224x224, batch 32, state donated (held out)",
                         (0, 1, 2), True),
}

T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def measure(compiled: Any) -> dict[str, Any]:
  mem = jaxmem.compiled_memory(compiled)
  return dict(peak=mem.peak_bytes, argument=mem.argument_bytes, output=mem.output_bytes,
              temp=mem.temp_bytes, alias=mem.alias_bytes, host=mem.host_temp_bytes,
              flops=flops_of(compiled), accessed=bytes_accessed_of(compiled))


def short_error(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}".splitlines()[0]
  return text if len(text) <= 160 else text[:157] + "..."


def build(model: Model, quick: bool, remat_policy: str | None = None) -> tuple[Any, Any]:
  kw = dict(model.quick if quick else model.kwargs)
  if remat_policy is not None:
    kw["remat_policy"] = remat_policy
  return importlib.import_module(model.module).build(**kw)


def compile_baseline(model: Model, quick: bool, target: Any, policy: str | None,
                     options: dict[str, Any] | None = None) -> dict[str, Any]:
  step, args = build(model, quick, policy)
  t = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=model.donate,
                     compiler_options=options).lower(*target.place(args)).compile()
  return dict(measure(compiled), compile_s=time.perf_counter() - t)


def xla_remat(model: Model, quick: bool, target: Any, frac: float,
              unplanned: int) -> dict[str, Any]:
  """XLA:TPU's own rematerialization, told that the chip's HBM is ``frac`` of the unplanned peak.

  ``xla_tpu_max_hbm_size_mib`` is the memory XLA:TPU's rematerialization pass
  works against (a libtpu option, not a JAX API): the "other tool" a user
  has without writing a policy. When it cannot fit, the compile fails with
  the bytes it needed, which is the row's smallest figure.
  """
  budget = int(frac * unplanned)
  try:
    row = compile_baseline(model, quick, target, None,
                           {"xla_tpu_max_hbm_size_mib": budget // 2 ** 20})
  except Exception as e:  # noqa: BLE001 (XLA's RESOURCE_EXHAUSTED is a plain runtime error)
    m = re.search(r"required for HLO temporaries \(([\d.]+)([KMG])\)", str(e))
    if m is None:
      raise
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[m.group(2)]
    return dict(status="BudgetError", budget=budget, smallest=int(float(m.group(1)) * scale),
                planning_s=0.0, error=str(e).splitlines()[0])
  row.update(budget=budget, within=row["peak"] <= budget)
  return row


def fitted_compiled(fitted: Any, args: Any) -> Any:
  """The fitted program compiled for the target (``fitted.lower(*args).compile()``)."""
  return fitted.lower(*args).compile()


def run_fit(model: Model, quick: bool, frac: float) -> dict[str, Any]:
  step, args = build(model, quick)
  fitted = jaxmem.fit(frac, target=TARGET, donate_argnums=model.donate)(step)
  t = time.perf_counter()
  try:
    res = fitted.fit_result(*args)
  except jaxmem.BudgetError as e:
    return dict(status="BudgetError", budget=e.budget_bytes, smallest=e.smallest_bytes,
                planning_s=time.perf_counter() - t, error=str(e).splitlines()[0])
  planning_s = time.perf_counter() - t
  t = time.perf_counter()
  compiled = fitted_compiled(fitted, args)
  recompile_s = time.perf_counter() - t
  row = measure(compiled)
  plan = res.plan
  if row["peak"] != res.peak_bytes:
    log(f"  note: fitted.lower().compile() peak {row['peak']} != fit_result peak {res.peak_bytes}")
  row.update(status="ok", budget=res.budget_bytes, fit_peak=res.peak_bytes,
             fit_host=res.memory.host_temp_bytes, within=res.peak_bytes <= res.budget_bytes,
             unplanned_by_fit=res.unplanned_peak_bytes, rounds=res.rounds,
             planning_s=res.planning_s, planning_wall_s=planning_s, compile_s=recompile_s,
             planner=plan.planner, remat=plan.num_remat, offload=plan.num_offload,
             decisions=len(plan.decisions), backend=res.backend, target=res.target,
             estimate=plan.estimated_peak_bytes)
  return row


def run(names: list[str], quick: bool, budgets: tuple[float, ...] = BUDGETS
        ) -> list[dict[str, Any]]:
  target = get_target(TARGET)
  log(f"target {target} ({target.devices[0].device_kind}), models {', '.join(names)}"
      f"{' (quick)' if quick else ''}")
  rows: list[dict[str, Any]] = []
  for name in names:
    model = MODELS[name]
    label = "quick: " + ", ".join(f"{k}={v}" for k, v in model.quick.items()
                                  if k != "abstract") if quick else model.label
    methods = [("jit", None), *((f"policy:{p}", p) for p in POLICIES),
               *((f"xla-remat({f})", f) for f in budgets),
               *((f"fit({f})", f) for f in budgets)]
    base: dict[str, Any] | None = None
    for method, arg in methods:
      log(f"[{name}] {method} ...")
      row: dict[str, Any] = dict(model=name, size=label, method=method)
      t = time.perf_counter()
      try:
        if method.startswith("fit"):
          row.update(run_fit(model, quick, arg))
        elif method.startswith("xla-remat"):
          if base is None:
            raise RuntimeError("no unplanned peak to take a fraction of")
          result = xla_remat(model, quick, target, arg, base["peak"])
          result.setdefault("status", "ok")
          row.update(result)
        else:
          row.update(compile_baseline(model, quick, target, arg), status="ok")
      except Exception as e:  # noqa: BLE001 (recorded as the row; the bench goes on)
        tb = traceback.format_exc()
        in_jaxmem = "jaxmem/" in tb.replace("\\", "/") and method.startswith("fit")
        row.update(status="error", error=short_error(e), traceback=tb, in_jaxmem=in_jaxmem)
        log(f"[{name}] {method}: error{' inside jaxmem' if in_jaxmem else ''}\n{tb}")
      row["wall_s"] = time.perf_counter() - t
      if method == "jit":
        base = row if row["status"] == "ok" else None
        if base is not None and base["peak"] < GIB and not quick:
          log(f"[{name}] warning: unplanned peak {mib(base['peak'])} MiB is below 1 GiB")
      if base is not None and row["status"] == "ok":
        row["peak_fraction"] = row["peak"] / base["peak"]
        if row.get("flops") and base.get("flops"):
          row["flops_ratio"] = row["flops"] / base["flops"]
        if row.get("accessed") and base.get("accessed"):
          row["accessed_ratio"] = row["accessed"] / base["accessed"]
      if base is not None:
        row["unplanned_peak"] = base["peak"]
      rows.append(row)
      log(f"[{name}] {method}: {describe(row)} ({row['wall_s']:.1f} s)")
  return rows


def mib(x: float) -> str:
  return f"{x / 2**20:.1f}"


def describe(r: dict[str, Any]) -> str:
  if r["status"] == "BudgetError":
    return f"BudgetError: budget {mib(r['budget'])} MiB, smallest reachable {mib(r['smallest'])} MiB"
  if r["status"] != "ok":
    return r["status"] + ": " + r["error"]
  s = f"peak {mib(r['peak'])} MiB"
  if "peak_fraction" in r:
    s += f" ({r['peak_fraction']:.2f} of jit)"
  s += f", host {mib(r['host'])} MiB"
  if r.get("flops") is not None:
    s += f", {r['flops'] / 1e9:.1f} GFLOP"
  if "budget" in r:
    s += f", budget {mib(r['budget'])} MiB {'within' if r['within'] else 'OVER'}"
  if "rounds" in r:
    s += (f", {r['rounds']} rounds, {r['planning_s']:.1f} s, {r['planner']} "
          f"{r['remat']} remat / {r['offload']} offload")
  return s


def fmt_flops(r: dict[str, Any]) -> str:
  return "-" if r.get("flops") is None else f"{r['flops'] / 1e9:.1f}"


def fmt_accessed(r: dict[str, Any]) -> str:
  return "-" if r.get("accessed") is None else f"{r['accessed'] / 1e9:.2f}"


def fmt_ratio(r: dict[str, Any], key: str) -> str:
  return f"{r[key]:.2f}" if key in r else "-"


def refused(r: dict[str, Any]) -> str:
  """The peak cell of a fit that raised `BudgetError` (or of XLA's remat that failed)."""
  frac = f" ({r['smallest'] / r['unplanned_peak']:.2f} of jit)" if "unplanned_peak" in r else ""
  if r["method"].startswith("xla-remat"):
    return f"compile fails: XLA needs {mib(r['smallest'])} MiB{frac}"
  return f"`BudgetError`: smallest reachable {mib(r['smallest'])} MiB{frac}"


HEAD = ("| model | method | TPU peak MiB | of jit | host MiB | GFLOP | FLOPs vs jit | GB accessed "
        "| accessed vs jit | budget MiB "
        "| within | rounds | planning s | planner: remat / offload |")


def table(rows: list[dict[str, Any]]) -> str:
  lines = [HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
  for r in rows:
    head = f"| {r['model']} | {r['method']} "
    if r["status"] == "BudgetError":
      lines.append(head + f"| {refused(r)} "
                   f"| - | - | - | - | - | - | {mib(r['budget'])} | no | - | {r['planning_s']:.1f} "
                   "| - |")
      continue
    if r["status"] != "ok":
      err = r["error"].replace("|", "\\|")
      lines.append(head + f"| error: {err} | - | - | - | - | - | - | - | - | - | - | - |")
      continue
    cells = [mib(r["peak"]), fmt_ratio(r, "peak_fraction"), mib(r["host"]), fmt_flops(r),
             fmt_ratio(r, "flops_ratio"), fmt_accessed(r), fmt_ratio(r, "accessed_ratio")]
    if "rounds" in r:
      cells += [mib(r["budget"]), "yes" if r["within"] else "**NO**", str(r["rounds"]),
                f"{r['planning_s']:.1f}", f"{r['planner']}: {r['remat']} / {r['offload']}"]
    elif "budget" in r:
      cells += [mib(r["budget"]), "yes" if r["within"] else "**NO**"] + ["-"] * 3
    else:
      cells += ["-"] * 5
    lines.append(head + "| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def sizes(rows: list[dict[str, Any]]) -> str:
  seen = dict.fromkeys((r["model"], r["size"]) for r in rows)
  return "; ".join(f"{m}: {s}" for m, s in seen)


def summary(rows: list[dict[str, Any]]) -> str:
  fits = [r for r in rows if r["method"].startswith("fit")]
  ok = [r for r in fits if r["status"] == "ok"]
  over = sum(not r["within"] for r in ok)
  errors = sum(r["status"] == "error" and r.get("in_jaxmem", False) for r in fits)
  other = sum(r["status"] == "error" for r in rows) - errors
  refused = sum(r["status"] == "BudgetError" for r in fits)
  s = f"{len(ok) - over} of {len(fits)} fitted steps compiled within their budget"
  if over:
    s += f", **{over} compiled above it**"
  if refused:
    s += f", {refused} `BudgetError`"
  if errors:
    s += f", **{errors} errors inside jaxmem**"
  if other:
    s += f"; {other} rows failed outside jaxmem"
  return s


def command(meta: dict[str, Any]) -> str:
  """The command line of the run that wrote ``meta``."""
  cmd = "python bench/tpu_bench.py"
  if meta.get("models") and meta["models"] != list(MODELS):
    cmd += " --models " + ",".join(meta["models"])
  if meta.get("budgets") and tuple(meta["budgets"]) != BUDGETS:
    cmd += " --budgets " + ",".join(map(str, meta["budgets"]))
  return cmd + (" --quick" if meta.get("quick") else "")


def meta_line(meta: dict[str, Any]) -> str:
  runs = [meta, *meta.get("earlier_runs", [])]
  when = "; ".join(f"{', '.join(r.get('models', []))}: {r['date']} at {r.get('commit', '?')}"
                   for r in runs)
  return (f"jax {meta['jax']}, libtpu {meta['libtpu']}; {when}: XLA:TPU's compiled "
          f"program for one {meta['device_kind']} chip (`target=\"{meta['target']}\"`), compiled "
          "ahead of time on a CPU-only machine; no step was run on a TPU")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  return "\n".join([
      "# jaxmem.fit on a TPU v5e, compiled ahead of time",
      "",
      f"`{command(meta)}` ({meta_line(meta)}).",
      "",
      f"Models: {sizes(rows)}. \"state donated\": every step of that model donates its "
      "state (parameters, statistics, optimizer state: `donate_argnums`), as a training loop "
      "does. Peak = argument + output + temp - alias bytes of the compiled "
      "program's `memory_analysis()`; host = its `host_temp_size_in_bytes`; GFLOP = "
      "`cost_analysis()[\"flops\"]` / 1e9; GB accessed = `cost_analysis()[\"bytes accessed\"]` "
      "/ 1e9, the compiled program's memory traffic (\"-\": rows measured before it was "
      "recorded). `policy:` rows apply JAX's "
      "`jax.checkpoint_policies` by hand to every block (`nn.remat`; `offload_*` to "
      "`pinned_host`); `fit(f)` rows are `jaxmem.fit(f, target=\"tpu:v5e\")`, planning s "
      "being its plan-and-compile time (every compile included). Nothing ran on a TPU, so "
      "there is no step time: the extra FLOPs are the recomputation's cost, and the host "
      "bytes cross the host link twice per step (at the `tpu-v5e` profile's assumed "
      "25.6 GB/s, 100 MiB out and back take about 8 ms unless overlapped with compute). "
      "`xla-remat(f)` rows compile plain `jax.jit` with `xla_tpu_max_hbm_size_mib` at f "
      "of the unplanned peak: XLA:TPU's own rematerialization, which fails the compile "
      "with the bytes it needed when it cannot get there (a libtpu option, not a JAX API).",
      "",
      f"{summary(rows)}.",
      "",
      table(rows),
      "",
  ])


def readme_excerpt(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  lines = [
      f"`{command(meta)}` ({meta_line(meta)}; full table `bench/results/tpu.md`). "
      f"{sizes(rows)}. {summary(rows)}.",
      "",
      "| model | method | TPU peak | of jit | host | FLOPs vs jit | fit: budget, rounds, planning, "
      "planner: remat / offload |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    head = f"| {r['model']} | {r['method']} "
    if r["status"] == "BudgetError":
      lines.append(head + f"| {refused(r)} "
                   f"| | | | budget {mib(r['budget'])} MiB, {r['planning_s']:.0f} s |")
    elif r["status"] != "ok":
      lines.append(head + "| error (see `bench/results/tpu.md`) | | | | |")
    else:
      fit = (f"{mib(r['budget'])} MiB {'within' if r['within'] else '**OVER**'}"
             if "budget" in r else "")
      if "rounds" in r:
        fit += (f", {r['rounds']} rounds, {r['planning_s']:.0f} s, {r['planner']}: "
                f"{r['remat']} / {r['offload']}")
      flops = f"{r['flops_ratio']:.2f}x" if "flops_ratio" in r else "-"
      lines.append(head + f"| {mib(r['peak'])} MiB | {fmt_ratio(r, 'peak_fraction')} | "
                   f"{mib(r['host'])} MiB | {flops} | {fit} |")
  return "\n".join(lines)


def merge(path: pathlib.Path, rows: list[dict[str, Any]], names: list[str]
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """The rows of ``path``'s earlier run for the models not run now, with ``rows``, in model order."""
  if not path.exists() or set(names) == set(MODELS):
    return rows, []
  old = json.loads(path.read_text())
  kept = [r for r in old.get("rows", []) if r["model"] not in names]
  order = {m: i for i, m in enumerate(MODELS)}
  merged = sorted(kept + rows, key=lambda r: order.get(r["model"], len(order)))
  # Each kept row stays attributed to the run that measured it (that run's
  # meta, or one of the runs it had kept in turn).
  kept_models = {r["model"] for r in kept}
  old_meta = old.get("meta", {})
  earlier = []
  for run in [old_meta, *old_meta.get("earlier_runs", [])]:
    models = [m for m in run.get("models", []) if m in kept_models]
    if models:
      earlier.append({**{k: v for k, v in run.items() if k != "earlier_runs"}, "models": models})
  return merged, earlier


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS),
                 help=f"comma-separated, from {', '.join(MODELS)}")
  p.add_argument("--quick", action="store_true",
                 help="small versions of the models (a smoke check; written to a scratch "
                      "directory unless --out says otherwise)")
  p.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                 help="comma-separated fractions of the unplanned compiled peak for the "
                      "xla-remat and fit rows (default %(default)s)")
  p.add_argument("--out", default=None, help="results directory (default bench/results)")
  p.add_argument("--render", action="store_true",
                 help="compile nothing: rewrite tpu.md and the README excerpt from tpu.json")
  a = p.parse_args()
  names = [m.strip() for m in a.models.split(",") if m.strip()]
  unknown = [m for m in names if m not in MODELS]
  if unknown:
    p.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
  if a.out is not None:
    out = pathlib.Path(a.out)
  elif a.quick:
    out = pathlib.Path(tempfile.gettempdir()) / "jaxmem_tpu_bench_quick"
  else:
    out = ROOT / "bench" / "results"
  if a.render:
    data = json.loads((out / "tpu.json").read_text())
    write(out, data["rows"], data["meta"])
    return
  started_at = commit()   # what this run imported, not what the tree holds when it ends
  try:
    budgets = tuple(float(f) for f in a.budgets.split(",") if f.strip())
  except ValueError:
    p.error(f"--budgets must be comma-separated fractions, got {a.budgets!r}")
  if not budgets or not all(0 < f < 1 for f in budgets):
    p.error(f"--budgets must be fractions in (0, 1), got {a.budgets!r}")
  rows = run(names, a.quick, budgets)
  target = get_target(TARGET)
  meta = dict(jax=jax.__version__, libtpu=importlib.metadata.version("libtpu"),
              jaxmem=getattr(jaxmem, "__version__", "?"), target=TARGET,
              device_kind=target.devices[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M"),
              quick=a.quick, models=names, budgets=list(budgets), wall_s=time.perf_counter() - T0,
              commit=started_at,
              note="XLA:TPU compiled program for TPU v5e, compiled ahead of time on a CPU-only "
                   "machine; no step was run on a TPU")
  out.mkdir(parents=True, exist_ok=True)
  rows, earlier = merge(out / "tpu.json", rows, names)
  if earlier:
    meta["earlier_runs"] = earlier
  (out / "tpu.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  write(out, rows, meta)


def write(out: pathlib.Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
  """Prints the table and writes ``tpu.md`` and the README excerpt."""
  print(table(rows))
  (out / "tpu.md").write_text(markdown(rows, meta))
  print(f"{summary(rows)}; wrote {out / 'tpu.json'}, {out / 'tpu.md'}")
  print(f"wrote {write_excerpt('tpu_bench', readme_excerpt(rows, meta), out)}")
  log("done")


if __name__ == "__main__":
  main()
