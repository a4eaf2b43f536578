"""How far each planner's recomputation is from Checkmate's optimum, in Checkmate's own model.

For a corpus of small train steps generated here (MLPs of 2-3 layers with
tanh, ReLU or GELU, with or without residual connections or biases, widths
256 and 1024, batch 8192: 36 steps of 33-111 ops; none of them tuned to;
shape-only arguments), each remat-only planner
plans at fractions of the step's estimated peak on ``h100-sxm``. Each plan is
read as a Checkmate schedule (:func:`jaxmem._src.planners.checkmate.rs_of_plan`):
its peak ``P`` and its recomputation time ``C`` in Checkmate's memory model,
with the simulator's op times. Checkmate's exact MILP then gives the least
recomputation ``C*`` of any schedule with a peak of at most ``P``; the gap is
``C - C*``, as a share of the step's time. Only plans whose Checkmate peak is
below the schedule that recomputes nothing are compared (elsewhere the plan
saves nothing in that model, and ``C*`` is 0).

The model is Checkmate's (per-node results, no XLA temporaries), not the
whole estimate ``fit`` plans with; what it measures is how much recomputation
a planner spends for the bytes it frees, against the optimum.

Run: ``python bench/checkmate_gap.py [--quick]``; writes bench/results/checkmate_gap.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxmem  # noqa: E402
from _results import commit, write_report  # noqa: E402
from jaxmem._src.planners import checkmate as cm  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEVICE = "h100-sxm"
FRACTIONS = (0.9, 0.8, 0.7, 0.6)
TIME_LIMIT_S = 10.0
BATCH = 8192
ACTS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": jax.nn.gelu}


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def corpus(quick: bool):
  """(name, program) of every generated step."""
  depths = (2,) if quick else (2, 3)
  widths = (256,) if quick else (256, 1024)
  for act, depth, width, residual, bias in itertools.product(
      ACTS, depths, widths, (False, True), (False,) if quick else (False, True)):
    if bias and residual:
      continue
    f = ACTS[act]

    def loss(params, x, f=f, residual=residual):
      for w, b in params:
        y = f(x @ w + b)
        x = x + y if residual else y
      return (x ** 2).mean()

    def step(params, x, loss=loss):
      grads = jax.grad(loss)(params, x)
      return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((width, width), f32),
               jax.ShapeDtypeStruct((width,) if bias else (), f32)) for _ in range(depth)]
    name = f"{act}-d{depth}-w{width}{'-res' if residual else ''}{'-bias' if bias else ''}"
    # Shape-only arguments at a batch whose ops cost more than their launch.
    yield name, jaxmem.analyze(step, params, jax.ShapeDtypeStruct((BATCH, width), f32))


def planners(prog, budget):
  """Remat-only plans of every planner that makes them (auto only when its winner does)."""
  get = jaxmem.get_planner
  yield "greedy", get("greedy")(prog, budget, DEVICE, allow_offload=False)
  yield "segments", get("segments")(prog, budget, DEVICE)
  yield "selective", get("selective")(prog, budget, DEVICE)
  yield "optimal", get("optimal")(prog, budget, DEVICE, allow_offload=False)
  yield "auto", get("auto")(prog, budget, DEVICE)
  # The same without its final reverse delete (planners/prune.py): what that step buys.
  yield "auto, no prune", get("auto")(prog, budget, DEVICE, prune_estimates=0)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--render", action="store_true",
                  help="only re-render the .md and README excerpt from the .json")
  a = ap.parse_args()
  if a.render:
    write(json.loads((RESULTS / "checkmate_gap.json").read_text()))
    return
  t0 = time.perf_counter()
  started = commit()   # what this run imported, not what the tree holds when it ends
  rows = []
  for name, prog in corpus(a.quick):
    g = cm.graph_of(prog, DEVICE)
    full = cm.memory_peak(g, *cm.checkpoint_all(g))
    step_s = sum(g.costs)
    solved: dict[int, cm.Solution | None] = {}
    log(f"[{name}] {g.n} ops, Checkmate peak {full / 2**20:.2f} MiB")
    for frac in FRACTIONS:
      budget = int(frac * prog.peak_bytes)
      for planner, plan in planners(prog, budget):
        row = dict(step=name, ops=g.n, fraction=frac, planner=planner, label=plan.planner,
                   fits=plan.estimated_peak_bytes <= budget, remat=plan.num_remat,
                   offload=plan.num_offload)
        if plan.num_offload:
          rows.append({**row, "comparable": False, "why": "offloads"})
          continue
        R, S = cm.rs_of_plan(g, plan)
        peak = cm.memory_peak(g, R, S)
        cost = cm.schedule_cost(g, R)
        row.update(cm_peak=peak, cm_full=full, extra_s=cost, step_s=step_s)
        if peak >= full:
          rows.append({**row, "comparable": False, "why": "saves nothing in Checkmate's model"})
          continue
        if peak not in solved:
          log(f"[{name}] {frac} solving at {peak / full:.3f} of the Checkmate peak ...")
          solved[peak] = cm.solve(g, peak, time_limit_s=TIME_LIMIT_S)
        sol = solved[peak]
        if sol is None:
          rows.append({**row, "comparable": False, "why": "no solution in the time limit"})
          continue
        rows.append({**row, "comparable": True, "optimum_s": sol.extra_s, "proven": sol.proven,
                     "mip_gap": sol.gap, "solve_s": sol.seconds,
                     "gap": (cost - sol.extra_s) / step_s})
  res = dict(meta=dict(commit=started, jax=jax.__version__, device=DEVICE, quick=a.quick,
                       time_limit_s=TIME_LIMIT_S, date=time.strftime("%Y-%m-%d %H:%M"),
                       wall_s=time.perf_counter() - t0), rows=rows)
  (RESULTS / "checkmate_gap.json").write_text(json.dumps(res, indent=1))
  write(res)


def write(res: dict) -> None:
  lines = render(res)
  write_report("checkmate_gap", lines, "\n".join(lines[2:]))


def render(res: dict) -> list[str]:
  m = res["meta"]
  rows = res["rows"]
  steps = sorted({r["step"] for r in rows})
  ops = [r["ops"] for r in rows]
  lines = ["# Planners against Checkmate's optimum (recomputation only)", "",
           f"`python bench/checkmate_gap.py{' --quick' if m['quick'] else ''}` at {m['commit']} "
           f"(jax {m['jax']}, {m['date']}; {m['wall_s']:.0f} s): {len(steps)} generated steps of "
           f"{min(ops)}-{max(ops)} ops, plans for `{m['device']}` at "
           f"{', '.join(str(f) for f in FRACTIONS)} of the estimated peak. Gap: the plan's "
           "recomputation time less the optimum's at the plan's own Checkmate peak, in % of "
           f"the step's time (HiGHS, {m['time_limit_s']:.0f} s per solve).", "",
           "| planner | plans | remat-only, saving in the model | optimum proven | gap 0 | "
           "median gap | largest gap |", "|---|---|---|---|---|---|---|"]
  for planner in dict.fromkeys(r["planner"] for r in rows):
    mine = [r for r in rows if r["planner"] == planner]
    comp = [r for r in mine if r["comparable"]]
    gaps = [r["gap"] for r in comp]
    zero = sum(g <= 1e-6 for g in gaps)
    lines.append(f"| {planner} | {len(mine)} | {len(comp)} | {sum(r['proven'] for r in comp)} | "
                 f"{zero} | {statistics.median(gaps) if gaps else float('nan'):+.2%} | "
                 f"{max(gaps) if gaps else float('nan'):+.2%} |")
  why: dict[str, int] = {}
  for r in rows:
    if not r["comparable"]:
      why[r["why"]] = why.get(r["why"], 0) + 1
  lines += ["", "Not compared: " + ", ".join(f"{n} ({w})" for w, n in why.items()) + "."]
  return lines


if __name__ == "__main__":
  main()
