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

With ``--paper``: the architectures of the paper's §5 (ResNet and VGG at two
depths on CIFAR-sized images, UNet, K-means, a char-LSTM) on its GTX 1080 Ti
profile, with a table of its §5.2 claims against what the ``dqn`` rows show.

Run: ``python bench/dqn_bench.py [--episodes 30] [--finetune 10]``; writes
bench/results/dqn.{json,md}. ``python bench/dqn_bench.py --paper --finetune 0``
writes bench/results/dqn_paper.{json,md} (about 30 minutes on 2 cores).
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


def paper_models():
  """The architectures of the DQN paper's §5 at sizes this machine allows.

  The paper trains on CIFAR-10 (32x32 images) and Karpathy's char-RNN data on
  a GTX 1080 Ti (11 GB): ResNet and VGG at two depths each, UNet, K-means and
  an LSTM. Its sizes are not given beyond that; these are scaled to plan in
  minutes on 2 CPU cores (shapes only: nothing is run).
  """
  import lstm
  import resnet
  import unet
  import vgg
  sys.path.insert(0, str(ROOT / "bench"))
  from corpus import structured
  kmeans = next(e for e in structured.entries() if e.name == "kmeans/lloyd-s")

  class KMeans:   # the corpus entry, with the examples' build() signature
    @staticmethod
    def build(**_):
      return kmeans.make()

  cifar = dict(batch_size=32, image_size=32, classes=10, abstract=True)
  return [("resnet-18 cifar b32", resnet, dict(cifar, depth=18)),
          ("resnet-34 cifar b32", resnet, dict(cifar, depth=34)),
          ("vgg-11 cifar b32", vgg, dict(cifar, head=512,
                                         stages=((1, 64), (1, 128), (2, 256), (2, 512), (2, 512)))),
          ("vgg-16 cifar b32", vgg, dict(cifar, head=512)),
          ("unet 64x64 b8", unet, dict(batch_size=8, image_size=64, depth=3, width=32,
                                       abstract=True)),
          ("kmeans 24000x24 k61", KMeans, {}),
          ("char-lstm 2x512 seq64 b32", lstm, dict(batch_size=32, seq_len=64, abstract=True))]


# The paper's claims about its architectures (§5.2), checked on the `dqn` rows:
# (claim, the model families compared, how the overheads must compare).
PAPER_CLAIMS = (
    ("\"For ResNet and VGG, they have similar architectures and get similar results\"",
     "resnet", "vgg", "similar"),
    ("\"results on UNet is worse than ResNet and VGG\"", "unet", "resnet|vgg", "worse"),
    ("\"the overhead of LSTM is longer than that of ResNet and VGG\"", "char-lstm", "resnet|vgg",
     "worse"),
    ("\"our method can work well on ... K-means\" (a non-DNN iterative step)", "kmeans", None,
     "fits"),
)


def action_space_reach(prog, device) -> dict:
  """How low the DQN's own actions can take the estimated peak.

  The estimated peak (a fraction of the unplanned one) with every swap-out
  action taken, and with every remove action taken: a budget below both is
  out of the action space's reach whatever the network learns (a rough
  bound: a mix can reach a little lower).
  """
  from jaxmem._src.planners.dqn import MemoryEnv, build_graph
  graph = build_graph(prog, device)
  env = MemoryEnv(prog, graph, prog.peak_bytes, device)
  out = dict(actions=len(graph.candidates))
  for kind in ("offload", "remat"):
    chosen = [i for i, c in enumerate(graph.candidates) if c.decision.action.name.lower() == kind]
    plan = env.evaluate(chosen)[2]
    out[f"all_{kind}"] = plan.estimated_peak_bytes / prog.peak_bytes
    out[f"num_{kind}"] = len(chosen)
  return out


def row(prog, plan, budget, device, seconds, name):
  return dict(planner=name, chosen=plan.planner, estimated=plan.estimated_peak_bytes,
              fits=plan.estimated_peak_bytes <= budget, remat=plan.num_remat,
              offload=plan.num_offload, overhead=jaxmem.simulate(plan, device).overhead,
              plan_s=seconds)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--episodes", type=int, default=30)
  ap.add_argument("--finetune", type=int, default=10)
  ap.add_argument("--devices", default=None,
                  help="comma-separated device profiles (default h100-pcie; with --paper the "
                       "paper's gtx-1080ti)")
  ap.add_argument("--only", default=None, help="models whose label contains this")
  ap.add_argument("--paper", action="store_true",
                  help="the paper's own architectures (ResNet, VGG, UNet, K-means, LSTM) on its "
                       "GTX 1080 Ti, beside its §5.2 claims; writes bench/results/dqn_paper.*")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  devices = (args.devices or ("gtx-1080ti" if args.paper else "h100-pcie")).split(",")
  out_default = ROOT / "bench" / "results" / ("dqn_paper" if args.paper else "dqn")
  args.out = args.out or str(out_default)
  rows = []
  # Pre-training on the small MLP (the fine-tuned rows start from it).
  pre = {}
  if args.finetune:
    import mlp
    step, sargs = mlp.build(batch_size=1024, width=256, depth=4)
    small = jaxmem.analyze(step, *sargs)
  for device in devices if args.finetune else ():
    t = time.perf_counter()
    w = None
    for frac in FRACTIONS:
      plan = dqn(small, int(frac * small.peak_bytes), device, episodes=args.episodes, weights=w)
      w = plan.diagnostic(DqnDiagnostics).weights
    pre[device] = (w, time.perf_counter() - t)
    log(f"pre-trained on mlp 4x256 b1024 for {device}: {pre[device][1]:.1f} s")
  for label, module, kw in (paper_models() if args.paper else models()):
    if args.only and args.only not in label:
      continue
    step, margs = module.build(**kw)
    prog = jaxmem.analyze(step, *margs)
    for device in devices:
      reach = action_space_reach(prog, device)
      log(f"[{label}] {device}: the DQN's actions reach {reach}")
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
                         episodes_fit=sum(diag.episode_fits), best_episode=diag.best_episode,
                         reach=reach))
        rows.append(dict(base, planner="dqn greedy", chosen="dqn",
                         fits=diag.episode_fits[-1], overhead=diag.episode_overheads[-1],
                         plan_s=dt))
        if args.finetune:
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
              paper=args.paper,
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
      f"`python bench/dqn_bench.py{' --paper' if meta.get('paper') else ''} "
      f"--episodes {meta['episodes']} --finetune {meta['finetune']}` "
      f"(jax {meta['jax']}, {meta['date']}, 2 shared CPU cores; simulated, nothing compiled). "
      "Budgets are fractions of the estimated unplanned peak; `overhead` is "
      "`jaxmem.simulate`'s on the device the plan was made for; `plan s` includes the DQN's "
      "training on the program. `dqn` is the best episode's plan (the paper's Figure 3), "
      "`dqn greedy` the trained network's own last episode (no exploration)"
      + (f", `dqn fine-tuned` starts from weights trained on a 4x256 MLP (pre-training: "
         f"{meta['pretrain_s']} s) and runs {meta['finetune']} episodes." if meta["finetune"]
         else "."),
      "",
  ]
  if meta.get("paper"):
    lines += [claims_markdown(rows), ""]
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
  lines += ["", "What the DQN's action space can reach (`action_space_reach` in this script): the "
            "estimated peak, as a fraction of the unplanned one, with every swap-out action taken "
            "and with every remove action taken. A budget below both is out of its reach whatever "
            "the network learns.", "",
            "| model | device | actions | every swap-out taken | every remove taken |",
            "|---|---|---|---|---|"]
  seen = set()
  for r in rows:
    if "reach" in r and (r["model"], r["device"]) not in seen:
      seen.add((r["model"], r["device"]))
      q = r["reach"]
      lines.append(f"| {r['model']} | {r['device']} | {q['actions']} | "
                   f"{q['all_offload']:.2f} ({q['num_offload']}) | "
                   f"{q['all_remat']:.2f} ({q['num_remat']}) |")
  lines += ["", "| model | device | budget | planner | estimated MiB | fits | remat/offload "
            "| overhead | plan s |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    est = f"{r['estimated'] / 2**20:.1f}" if "estimated" in r else "-"
    ro = f"{r['remat']}/{r['offload']}" if "remat" in r else "-"
    lines.append(f"| {r['model']} | {r['device']} | {r['fraction']} | {r['planner']} | {est} | "
                 f"{'yes' if r['fits'] else 'NO'} | {ro} | {r['overhead']:+.1%} | "
                 f"{r['plan_s']:.1f} |")
  return "\n".join(lines) + "\n"


def claims_markdown(rows) -> str:
  """The paper's §5.2 claims about its architectures, against the `dqn` rows.

  A model's figure is the mean simulated overhead of the `dqn` plans over the
  budgets they fit (with how many of the budgets that is). "similar": the two
  means within 5 points or a factor of 1.5; "worse": fewer budgets fitted, or
  as many and a higher mean, than every model compared with (pairs where
  neither fits a budget are left out).
  """
  per = {}
  for r in rows:
    if r["planner"] in ("dqn", "auto"):
      d = per.setdefault((r["model"], r["planner"]), {"fits": 0, "budgets": 0, "over": []})
      d["budgets"] += 1
      if r["fits"]:
        d["fits"] += 1
        d["over"].append(r["overhead"])
  models_ = list(dict.fromkeys(m for m, _ in per))

  def cell(m, planner):
    d = per.get((m, planner))
    if not d:
      return "-"
    mean = f"{sum(d['over']) / len(d['over']):+.1%}" if d["over"] else "none fit"
    return f"{d['fits']}/{d['budgets']} fit, mean {mean}"

  lines = ["## The paper's claims (§5.2) on its own architectures", "",
           "| model | dqn: budgets fitted, mean overhead where it fits | auto: the same |",
           "|---|---|---|"]
  lines += [f"| {m} | {cell(m, 'dqn')} | {cell(m, 'auto')} |" for m in models_]

  def stat(prefixes: str):
    out = []
    for m in models_:
      if any(m.startswith(p) for p in prefixes.split("|")):
        d = per[(m, "dqn")]
        out.append((m, d["fits"] / d["budgets"],
                    sum(d["over"]) / len(d["over"]) if d["over"] else float("inf")))
    return out

  lines += ["", "| claim | measured (dqn) | holds here |", "|---|---|---|"]
  for text, a, b, how in PAPER_CLAIMS:
    sa = stat(a)
    if not sa:
      continue
    fmt = lambda xs: "; ".join(f"{m}: {f:.0%} fit, {o:+.1%}" if o != float("inf") else
                               f"{m}: none fit" for m, f, o in xs)
    if how == "fits":
      others_fit = any(per.get((m, "auto"), {}).get("fits", 0) for m, _, _ in sa)
      verdict = ("yes" if any(f > 0 for _, f, _ in sa) else "no" if others_fit else
                 "cannot tell (`auto` fits no budget either: nothing idle to move)")
      lines.append(f"| {text} | {fmt(sa)} | {verdict} |")
      continue
    sb = stat(b)
    if how == "similar":
      ma = [o for _, _, o in sa if o != float("inf")]
      mb = [o for _, _, o in sb if o != float("inf")]
      if not ma and not mb:
        verdict = "cannot tell (neither fits a budget)"
      elif not ma or not mb:
        verdict = "no (one fits no budget)"
      else:
        x, y = sum(ma) / len(ma), sum(mb) / len(mb)
        verdict = "yes" if abs(x - y) <= 0.05 or max(x, y) <= 1.5 * max(1e-9, min(x, y)) else "no"
      lines.append(f"| {text} | {fmt(sa)}; {fmt(sb)} | {verdict} |")
    else:
      # Pairs where neither fits a budget say nothing either way.
      pairs = [(fa, oa, fb, ob) for _, fa, oa in sa for _, fb, ob in sb if fa > 0 or fb > 0]
      worse = all(fa < fb or (fa == fb and oa > ob) for fa, oa, fb, ob in pairs)
      verdict = ("cannot tell (neither fits a budget)" if not pairs else "yes" if worse else "no")
      lines.append(f"| {text} | {fmt(sa)}; vs {fmt(sb)} | {verdict} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
