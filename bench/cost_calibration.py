"""The cost model against a GPU's measured step times: are recomputation and copies priced alike?

Every planner chooses between recomputation and copies by the simulator's
prices (:mod:`jaxmem._src.estimate.cost`), so what matters is not the absolute
step time but the *ratios*: does the model say what a remat policy costs
over plain ``jax.jit`` on a real GPU, and what a host copy costs?

The measurements are the GPU busy times of ``bench/results/gpu.json`` (one
NVIDIA H200, jax 0.11.2, ``bench/gpu_bench.py --profile``: per step, the union
of the device's kernel events). For each measured row with a program jaxmem
can rebuild here (the example GPT and MLP, plain and under JAX's
``nothing_saveable``/``dots_saveable`` policies per block; the ResNet-18,
measured by its waited step time only, is compared by ratios), this bench
analyses the same step at the same size for the ``gpu:h100`` target's
compiler model (shape-only arguments, nothing allocated) and simulates it on
the ``h200`` profile three ways:

* ``peak``: the datasheet's rates (every efficiency 1; how the model priced
  before it had efficiencies);
* ``published``: :data:`jaxmem.Efficiency` fractions from published
  measurements (:data:`~jaxmem._src.estimate.devices.GPU_EFFICIENCY`, the
  profile's own);
* ``fitted``: matmul and memory fractions fitted to these rows (a grid
  search minimising the squared log error of the absolute times), shown to
  say how far the published fractions are from this GPU, and *checked out of
  sample*: fitted on one model, the error on the other.

Copies are measured on the rows that stage to host (``host`` bytes in the
compiled program): the bytes both ways over the copy streams' busy time give
the link rate XLA:GPU reached, beside the profile's.

Run: ``python bench/cost_calibration.py``; writes bench/results/cost_calibration.{json,md}.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402

import jaxmem  # noqa: E402
from _results import commit, write_report  # noqa: E402
from jaxmem._src.estimate.devices import PROFILES  # noqa: E402
from jaxmem._src.estimate.analysis import analyze_program  # noqa: E402
from jaxmem._src.ir.trace import trace  # noqa: E402
from jaxmem._src.plan.simulate import program_time  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MEASURED = RESULTS / "gpu.json"
PROFILE = "h200"
TARGET = "gpu:h100"        # XLA:GPU's compiler model (the estimate's fusion rules)
POLICIES = {"jit": None, "policy:nothing_saveable": "nothing_saveable",
            "policy:dots_saveable": "dots_saveable"}
GRID_MATMUL = [x / 20 for x in range(4, 21)]       # 0.20 .. 1.00
GRID_MEMORY = [x / 20 for x in range(8, 21)]       # 0.40 .. 1.00


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def measured_rows() -> tuple[dict, list[dict]]:
  data = json.loads(MEASURED.read_text())
  rows = [r for r in data["rows"] if r["method"] in POLICIES and (r.get("profile") or {})
          .get("busy_ms")]
  return data["meta"], rows


def programs(meta: dict, rows: list[dict]) -> dict[tuple[str, str], jaxmem.Program]:
  """The analysed program of every measured row, at its measured size (shape-only)."""
  import gpu_bench
  out = {}
  for r in rows:
    model = gpu_bench.MODELS[r["model"]]
    log(f"[{r['model']} {r['method']}] analysing ({model.label}) ...")
    step, args = gpu_bench.build(model, POLICIES[r["method"]])
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    # XLA:GPU's fusion model without jax's CUDA plugin (which `target=` needs
    # to place arguments on GPU devices; one device needs no placement).
    traced = trace(step, shapes, backend="gpu", target=TARGET)
    out[r["model"], r["method"]] = jaxmem.Program.of(analyze_program(traced))
  return out


def simulated_s(prog: jaxmem.Program, profile: jaxmem.DeviceProfile) -> float:
  """The unplanned step's simulated time (what `jaxmem.simulate` compares plans with)."""
  return program_time(prog, profile)


def with_efficiency(base: jaxmem.DeviceProfile, **fractions: float) -> jaxmem.DeviceProfile:
  eff = dataclasses.replace(base.efficiency, **fractions,
                            source=f"fitted by bench/cost_calibration.py: {fractions}")
  return dataclasses.replace(base, efficiency=eff)


def fit(progs: dict, rows: list[dict], keys: set[tuple[str, str]]) -> tuple[float, float, float]:
  """(matmul, memory, rms log error) minimising the squared log error over the rows in ``keys``."""
  base = PROFILES[PROFILE]
  best = None
  for mm, mem in itertools.product(GRID_MATMUL, GRID_MEMORY):
    prof = with_efficiency(base, matmul=mm, memory=mem, reduction=mem)
    err = [math.log(simulated_s(progs[k], prof) * 1e3 / r["profile"]["busy_ms"])
           for r in rows if (k := (r["model"], r["method"])) in keys]
    rms = math.sqrt(sum(e * e for e in err) / len(err))
    if best is None or rms < best[2]:
      best = (mm, mem, rms)
  return best


def waited_rows(rows_all: list[dict]) -> list[dict]:
  """The policy rows measured only by their waited step time (no busy time): ResNet-18's.

  A waited step time includes the host's dispatch and the wait, so only its
  ratio to the same model's ``jax.jit`` row is compared.
  """
  busy_models = {r["model"] for r in rows_all if (r.get("profile") or {}).get("busy_ms")}
  return [r for r in rows_all if r["method"] in POLICIES and r.get("step_s")
          and r["model"] not in busy_models]


def waited_ratios(rows_all: list[dict], profile: jaxmem.DeviceProfile) -> list[dict]:
  """Per policy row of :func:`waited_rows`, measured and simulated time over ``jax.jit``'s."""
  import gpu_bench
  rows = waited_rows(rows_all)
  sims = {}
  for r in rows:
    log(f"[{r['model']} {r['method']}] analysing (waited step time only) ...")
    step, args = gpu_bench.build(gpu_bench.MODELS[r["model"]], POLICIES[r["method"]])
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    prog = jaxmem.Program.of(analyze_program(trace(step, shapes, backend="gpu", target=TARGET)))
    sims[r["model"], r["method"]] = simulated_s(prog, profile)
  out = []
  for r in rows:
    if r["method"] == "jit":
      continue
    jit = next((x for x in rows if x["model"] == r["model"] and x["method"] == "jit"), None)
    if jit is None:
      continue
    out.append(dict(model=r["model"], method=r["method"], measured_ratio=r["step_s"] / jit["step_s"],
                    simulated_ratio=sims[r["model"], r["method"]] / sims[r["model"], "jit"]))
  return out


def copy_rows(rows_all: list[dict]) -> list[dict]:
  """Per measured row that stages to host: bytes both ways over the copy streams' busy time."""
  out = []
  for r in rows_all:
    lines = (r.get("profile") or {}).get("lines") or {}
    copy_us = sum(v["us"] for k, v in lines.items() if "Memcpy" in k and "Compute" not in k)
    if not r.get("host") or not copy_us:
      continue
    moved = 2 * r["host"]                         # offloaded, then fetched back
    out.append(dict(model=r["model"], method=r["method"], host=r["host"], copy_ms=copy_us / 1e3,
                    rate=moved / (copy_us / 1e6)))
  return out


def main() -> None:
  t0 = time.perf_counter()
  meta, rows = measured_rows()
  progs = programs(meta, rows)
  base = PROFILES[PROFILE]
  peak = dataclasses.replace(base, efficiency=jaxmem.Efficiency())
  all_keys = {(r["model"], r["method"]) for r in rows}
  log("fitting on every row ...")
  mm, mem, rms = fit(progs, rows, all_keys)
  fitted = with_efficiency(base, matmul=mm, memory=mem, reduction=mem)
  out_of_sample = {}
  models = sorted({r["model"] for r in rows})
  for held in models:
    log(f"fitting without {held} ...")
    keys = {k for k in all_keys if k[0] != held}
    f_mm, f_mem, _ = fit(progs, rows, keys)
    prof = with_efficiency(base, matmul=f_mm, memory=f_mem, reduction=f_mem)
    errs = [simulated_s(progs[k], prof) * 1e3 / r["profile"]["busy_ms"] - 1
            for r in rows if (k := (r["model"], r["method"]))[0] == held]
    out_of_sample[held] = dict(matmul=f_mm, memory=f_mem, errors=errs)
  table = []
  for r in rows:
    k = (r["model"], r["method"])
    jit_ms = next(x["profile"]["busy_ms"] for x in rows
                  if x["model"] == r["model"] and x["method"] == "jit")
    row = dict(model=r["model"], size=r["size"], method=r["method"],
               measured_ms=r["profile"]["busy_ms"], measured_ratio=r["profile"]["busy_ms"] / jit_ms)
    for name, prof in (("peak", peak), ("published", base), ("fitted", fitted)):
      row[f"{name}_ms"] = simulated_s(progs[k], prof) * 1e3
    table.append(row)
  for row in table:
    jit = next(x for x in table if x["model"] == row["model"] and x["method"] == "jit")
    for name in ("peak", "published", "fitted"):
      row[f"{name}_ratio"] = row[f"{name}_ms"] / jit[f"{name}_ms"]
  copies = copy_rows(json.loads(MEASURED.read_text())["rows"])
  waited = waited_ratios(json.loads(MEASURED.read_text())["rows"], base)
  result = dict(meta=dict(commit=commit(), jax=jax.__version__, measured=str(MEASURED.name),
                          measured_on=meta.get("device"), measured_jax=meta.get("jax"),
                          measured_commit=meta.get("commit"), profile=PROFILE, target=TARGET,
                          published=dataclasses.asdict(base.efficiency),
                          fitted=dict(matmul=mm, memory=mem, rms_log_error=rms),
                          out_of_sample=out_of_sample,
                          link_bytes_per_s=base.host_bytes_per_s,
                          profile_copy_bytes_per_s=base.copy_bytes_per_s,
                          wall_s=time.perf_counter() - t0),
                rows=table, copies=copies, waited=waited)
  (RESULTS / "cost_calibration.json").write_text(json.dumps(result, indent=1))
  lines = render(result)
  write_report("cost_calibration", lines, "\n".join(lines[2:]))


def _waited_deltas(res: dict) -> str:
  """The waited rows' extra milliseconds over `jax.jit`, measured and compiled, from gpu_cost.json."""
  path = RESULTS / "gpu_cost.json"
  if not path.exists():
    return ""
  val = json.loads(path.read_text())["validation"]
  parts = []
  for w in res["waited"]:
    row = next((r for r in val if (r["model"], r["method"]) == (w["model"], w["method"])), None)
    jit = next((r for r in val if (r["model"], r["method"]) == (w["model"], "jit")), None)
    if row and jit:
      parts.append(f"{w['model']} {w['method']}: {row['measured_ms'] - jit['measured_ms']:+.2f} ms "
                   f"measured, {(row['seconds'] - jit['seconds']) * 1e3:+.2f} ms priced")
  return " (" + "; ".join(parts) + ")" if parts else ""


def render(res: dict) -> list[str]:
  m = res["meta"]
  pub = m["published"]
  lines = [
      "# The cost model against a GPU's measured step times", "",
      f"`python bench/cost_calibration.py` at {m['commit']} (jax {m['jax']}). Measured: "
      f"`bench/results/{m['measured']}` ({m['measured_on']}, jax {m['measured_jax']}, "
      f"commit {m['measured_commit']}; GPU busy time per step). Simulated: the same steps "
      f"analysed for `{m['target']}` and priced on the `{m['profile']}` profile.", "",
      "Efficiencies (fractions of the datasheet's rates):", "",
      "| set | matmul | memory | reduction | copy | per-copy latency |",
      "|---|---|---|---|---|---|",
      "| peak (the model before efficiencies) | 1 | 1 | 1 | 0.80 | 0 |",
      f"| published (`GPU_EFFICIENCY`) | {pub['matmul']:.2f} | {pub['memory']:.2f} | "
      f"{pub['reduction']:.2f} | {pub['copy']:.2f} | {pub['copy_latency_s'] * 1e6:.0f} us |",
      f"| fitted here (all rows) | {m['fitted']['matmul']:.2f} | {m['fitted']['memory']:.2f} | "
      f"{m['fitted']['memory']:.2f} | - | - |", "",
      "| model | method | measured ms | x jit | peak ms | x jit | published ms | x jit | "
      "fitted ms | x jit |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in res["rows"]:
    lines.append(f"| {r['model']} | {r['method']} | {r['measured_ms']:.2f} | "
                 f"{r['measured_ratio']:.2f} | {r['peak_ms']:.2f} | {r['peak_ratio']:.2f} | "
                 f"{r['published_ms']:.2f} | {r['published_ratio']:.2f} | {r['fitted_ms']:.2f} | "
                 f"{r['fitted_ratio']:.2f} |")
  lines += ["", "What a planner decides by is the ratio to `jax.jit`; its error, "
            "simulated x jit over measured x jit, over the policy rows:", ""]
  for name in ("peak", "published", "fitted"):
    errs = [r[f"{name}_ratio"] / r["measured_ratio"] - 1 for r in res["rows"]
            if r["method"] != "jit"]
    lines.append(f"- {name}: " + ", ".join(f"{e:+.1%}" for e in errs)
                 + f" (largest |error| {max(abs(e) for e in errs):.1%})")
  if res.get("waited"):
    lines += ["", "Rows measured by their waited step time only (no busy time), as a ratio to "
              "the same model's `jax.jit`, simulated with the published efficiencies:", "",
              "| model | method | measured x jit | simulated x jit | error |", "|---|---|---|---|---|"]
    for w in res["waited"]:
      lines.append(f"| {w['model']} | {w['method']} | {w['measured_ratio']:.3f} | "
                   f"{w['simulated_ratio']:.3f} | "
                   f"{w['simulated_ratio'] / w['measured_ratio'] - 1:+.1%} |")
    lines += ["", "A waited step time carries the host's dispatch, so these ratios understate "
              "the GPU's; `bench/results/gpu_cost.md` compares the extra milliseconds over "
              "`jax.jit` with XLA:GPU's compiled kernels instead" + _waited_deltas(res) + "."]
  lines += ["", "Out of sample (fitted on the other model, error of the absolute time on this "
            "one):", ""]
  for held, o in m["out_of_sample"].items():
    errs = ", ".join(f"{e:+.0%}" for e in o["errors"])
    lines.append(f"- {held}: fitted matmul {o['matmul']:.2f}, memory {o['memory']:.2f}; "
                 f"errors {errs}")
  lines += ["", "Host copies XLA:GPU made (bytes both ways over the copy streams' summed busy "
            f"time), against the profile's {m['profile_copy_bytes_per_s'] / 1e9:.1f} GB/s per "
            f"direction ({m['link_bytes_per_s'] / 1e9:.0f} GB/s link):", "",
            "| model | method | host MiB | copy streams ms | GB/s | of the link |",
            "|---|---|---|---|---|---|"]
  for c in res["copies"]:
    lines.append(f"| {c['model']} | {c['method']} | {c['host'] / 2**20:.0f} | "
                 f"{c['copy_ms']:.2f} | {c['rate'] / 1e9:.1f} | "
                 f"{c['rate'] / m['link_bytes_per_s']:.2f} |")
  return lines


if __name__ == "__main__":
  main()
