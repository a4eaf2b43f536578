"""The DQN planner beside AutoSwap, the window scheduler, the MILP and ``auto`` (issue 16).

For each model and budget (a fraction of the estimated unplanned peak), every
planner plans for the device; the table gives its estimated peak (``fits``
when within the budget), the overhead :func:`jaxmem.simulate` predicts, and
the plan time, which for ``dqn`` includes training (its episodes run on the
program being planned). Rows:

* ``dqn``: trained from scratch on the program (``--episodes`` episodes);
* ``dqn greedy``: the same network's last episode, run greedily (no
  exploration): what the trained agent does on its own, where ``dqn`` is the
  best episode found while training (the paper's Figure 3);
* ``dqn fine-tuned``: weights trained on the small MLP first, then
  ``--finetune`` episodes on the program (the transfer of §4.4.2); its plan
  time counts the fine-tuning only, the pre-training is in the header.

Models: the examples' MLP (8x512, batch 8192) and GPT (4 layers x 128, batch
16), the CNN, the char-LSTM; device ``h100-pcie`` (``--devices`` takes a
comma-separated list, e.g. the paper's ``gtx-1080ti``).

Run: ``python bench/dqn_bench.py [--episodes 30] [--finetune 10]``; writes
bench/results/dqn.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import jaxmem  # noqa: E402
from jaxmem._src.planners.dqn import DqnDiagnostics, dqn  # noqa: E402
from jaxmem._src.planners.registry import PLANNERS  # noqa: E402

OTHERS = ("autoswap", "window", "optimal", "auto")
FRACTIONS = (0.9, 0.7, 0.5)


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def models():
  import cnn
  import lstm
  import mlp
  import transformer
  return [("mlp 8x512 b8192", mlp, dict(batch_size=8192)),
          ("cnn b64", cnn, dict(batch_size=64)),
          ("lstm b32", lstm, dict(batch_size=32)),
          ("gpt 4x128 b16", transformer, dict(batch_size=16))]


def row(prog, plan, budget, device, seconds, name):
  return dict(planner=name, chosen=plan.planner, estimated=plan.estimated_peak_bytes,
              fits=plan.estimated_peak_bytes <= budget, remat=plan.num_remat,
              offload=plan.num_offload, overhead=jaxmem.simulate(plan, device).overhead,
              plan_s=seconds)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--episodes", type=int, default=30)
  ap.add_argument("--finetune", type=int, default=10)
  ap.add_argument("--devices", default="h100-pcie")
  ap.add_argument("--only", default=None, help="models whose label contains this")
  ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dqn"))
  args = ap.parse_args()
  devices = args.devices.split(",")
  rows = []
  # Pre-training on the small MLP (the fine-tuned rows start from it).
  import mlp
  step, sargs = mlp.build(batch_size=1024, width=256, depth=4)
  small = jaxmem.analyze(step, *sargs)
  pre = {}
  for device in devices:
    t = time.perf_counter()
    w = None
    for frac in FRACTIONS:
      plan = dqn(small, int(frac * small.peak_bytes), device, episodes=args.episodes, weights=w)
      w = plan.diagnostic(DqnDiagnostics).weights
    pre[device] = (w, time.perf_counter() - t)
    log(f"pre-trained on mlp 4x256 b1024 for {device}: {pre[device][1]:.1f} s")
  for label, module, kw in models():
    if args.only and args.only not in label:
      continue
    step, margs = module.build(**kw)
    prog = jaxmem.analyze(step, *margs)
    for device in devices:
      for frac in FRACTIONS:
        budget = int(frac * prog.peak_bytes)
        log(f"[{label}] {device} {frac} ...")
        base = dict(model=label, ops=prog.num_ops, device=device, fraction=frac, budget=budget,
                    unplanned=prog.peak_bytes)
        t = time.perf_counter()
        plan = dqn(prog, budget, device, episodes=args.episodes)
        dt = time.perf_counter() - t
        diag = plan.diagnostic(DqnDiagnostics)
        rows.append(dict(base, **row(prog, plan, budget, device, dt, "dqn"),
                         nodes=diag.nodes, actions=diag.actions, sgd_steps=diag.sgd_steps,
                         episodes_fit=sum(diag.episode_fits), best_episode=diag.best_episode))
        rows.append(dict(base, planner="dqn greedy", chosen="dqn",
                         fits=diag.episode_fits[-1], overhead=diag.episode_overheads[-1],
                         plan_s=dt))
        t = time.perf_counter()
        tuned = dqn(prog, budget, device, episodes=args.finetune, weights=pre[device][0])
        rows.append(dict(base, **row(prog, tuned, budget, device, time.perf_counter() - t,
                                     "dqn fine-tuned")))
        for name in OTHERS:
          t = time.perf_counter()
          kwargs = {"copies": "async"} if name in ("auto", "optimal") else {}
          other = PLANNERS[name](prog, budget, device, **kwargs)
          rows.append(dict(base, **row(prog, other, budget, device, time.perf_counter() - t,
                                       name)))
        log("  " + ", ".join(f"{r['planner']}: {'fits' if r['fits'] else 'over'} "
                             f"{r['overhead']:+.1%} {r['plan_s']:.1f} s"
                             for r in rows if r['model'] == label and r['device'] == device
                             and r['fraction'] == frac))
  meta = dict(jax=jax.__version__, episodes=args.episodes, finetune=args.finetune,
              date=time.strftime("%Y-%m-%d %H:%M"),
              pretrain_s={d: round(s, 1) for d, (_, s) in pre.items()})
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  out.with_suffix(".md").write_text(render(meta, rows))
  print(render(meta, rows))


def render(meta, rows) -> str:
  lines = [
      "# The DQN planner beside AutoSwap, the window scheduler, the MILP and `auto`",
      "",
      f"`python bench/dqn_bench.py --episodes {meta['episodes']} --finetune {meta['finetune']}` "
      f"(jax {meta['jax']}, {meta['date']}, 2 shared CPU cores; simulated, nothing compiled). "
      "Budgets are fractions of the estimated unplanned peak; `overhead` is "
      "`jaxmem.simulate`'s on the device the plan was made for; `plan s` includes the DQN's "
      "training on the program. `dqn` is the best episode's plan (the paper's Figure 3), "
      "`dqn greedy` the trained network's own last episode (no exploration), `dqn fine-tuned` "
      f"starts from weights trained on a 4x256 MLP (pre-training: {meta['pretrain_s']} s) and "
      f"runs {meta['finetune']} episodes.",
      "",
  ]
  # Summary: where dqn wins and loses against each other planner (fitting plans).
  cells = {}
  for r in rows:
    cells.setdefault((r["model"], r["device"], r["fraction"]), {})[r["planner"]] = r
  lines += ["| against | budgets | dqn fits, other not | both fit: dqn faster | both fit: dqn slower "
            "| other fits, dqn not |", "|---|---|---|---|---|---|"]
  for other in OTHERS:
    w = wf = lf = l_ = 0
    for c in cells.values():
      a, b = c.get("dqn"), c.get(other)
      if not a or not b:
        continue
      if a["fits"] and not b["fits"]:
        w += 1
      elif a["fits"] and b["fits"]:
        if a["overhead"] < b["overhead"] - 1e-9:
          wf += 1
        elif a["overhead"] > b["overhead"] + 1e-9:
          lf += 1
      elif b["fits"]:
        l_ += 1
    lines.append(f"| {other} | {len(cells)} | {w} | {wf} | {lf} | {l_} |")
  lines += ["", "| model | device | budget | planner | estimated MiB | fits | remat/offload "
            "| overhead | plan s |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    est = f"{r['estimated'] / 2**20:.1f}" if "estimated" in r else "-"
    ro = f"{r['remat']}/{r['offload']}" if "remat" in r else "-"
    lines.append(f"| {r['model']} | {r['device']} | {r['fraction']} | {r['planner']} | {est} | "
                 f"{'yes' if r['fits'] else 'NO'} | {ro} | {r['overhead']:+.1%} | "
                 f"{r['plan_s']:.1f} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
