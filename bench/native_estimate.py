"""The native lifetime model against its Python reference: same lifetimes, and how much faster.

Every train step of the corpus (``bench/corpus/``: the main families, the
held-out and the fresh sets), analysed for XLA:CPU, and the schedules of
two plans of each at 0.6 of its estimated peak (``segments``, and ``greedy``
with asynchronous copies): each flow the
estimate sees goes through both models (``lifetimes._lifetimes``, the
reference, and ``_native.estimate_lifetimes``, ``ffi/lifetimes.cc``), whose
outputs must be equal; then whole estimates (``Schedule._profile``) are
timed side by side, native and with ``JAXMEM_NATIVE_ESTIMATE=0``, plus
``auto`` on ResNet-50 (224x224, batch 32, half its estimated peak, the
``h100-pcie`` profile) both ways.

Run: ``python bench/native_estimate.py [--reps 3] [--render]``; writes
``bench/results/native_estimate.{json,md}``. About 10 minutes on 2 CPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402

import jaxmem  # noqa: E402
from _results import RESULTS, commit, write_excerpt  # noqa: E402
from corpus import FAMILIES, FRESH, HELDOUT, all_entries  # noqa: E402
from jaxmem._src.estimate import lifetimes  # noqa: E402
from jaxmem._src.plan.schedule import build_schedule  # noqa: E402

FIELDS = ("pos", "start", "end", "virtual", "copy_last", "stored_broadcasts")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def flows_of(prog: jaxmem.Program) -> list[Any]:
  """The flows the estimate sees for the unplanned step and two plans at 0.6."""
  budget = int(0.6 * prog.peak_bytes)
  plans = [jaxmem.get_planner("segments")(prog, budget, "h100-pcie"),
           jaxmem.get_planner("greedy")(prog, budget, "h100-pcie", copies="async")]
  flows: list[Any] = []
  original = lifetimes.merge_common_subexpressions
  lifetimes.merge_common_subexpressions = lambda flow: (flows.append(flow), original(flow))[1]
  try:
    build_schedule(prog, ())._profile()
    for plan in plans:
      build_schedule(prog, plan.decisions, plan.pinned, copies=plan.copies,
                     window=plan.window, budget=plan.target_bytes)._profile()
  finally:
    lifetimes.merge_common_subexpressions = original
  return flows


def compare(flow: Any) -> str | None:
  """``None`` when both models agree on ``flow``, else the first field that differs."""
  merged_flow, merged = lifetimes.merge_common_subexpressions(flow)
  want = lifetimes._lifetimes(merged_flow, merged)
  got = lifetimes._lifetimes_native(merged_flow, merged)
  for name in FIELDS:
    if list(getattr(want, name)) != list(getattr(got, name)):
      return name
  return None


def timed(fn: Any, reps: int) -> float:
  fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--limit", type=int, default=0, help="first N corpus steps only (0: all)")
  ap.add_argument("--render", action="store_true", help="the tables again from the JSON")
  a = ap.parse_args()
  if a.render:
    res = json.loads((RESULTS / "native_estimate.json").read_text())
    return render(res["meta"], res["rows"], res["auto"])
  if lifetimes._native_lifetimes() is None:
    raise SystemExit("the native model is not available (rebuild the extension, and unset "
                     "JAXMEM_NATIVE_ESTIMATE)")
  entries = all_entries(FAMILIES) + all_entries(HELDOUT) + all_entries(FRESH)
  if a.limit:
    entries = entries[:a.limit]
  rows = []
  for i, entry in enumerate(entries):
    log(f"[{i + 1}/{len(entries)}] {entry.name}")
    step, args = entry.make()
    prog = jaxmem.analyze(step, *args, donate_argnums=entry.donate)
    flows = flows_of(prog)
    diffs = [d for d in map(compare, flows) if d is not None]
    sched = build_schedule(prog, ())
    os.environ["JAXMEM_NATIVE_ESTIMATE"] = "0"
    python_s = timed(sched._profile, a.reps)
    del os.environ["JAXMEM_NATIVE_ESTIMATE"]
    native_s = timed(sched._profile, a.reps)
    rows.append(dict(name=entry.name, steps=len(sched.steps), flows=len(flows),
                     differing=len(diffs), first_field=diffs[0] if diffs else None,
                     python_ms=round(python_s * 1e3, 2), native_ms=round(native_s * 1e3, 2)))
  import resnet
  step, args = resnet.build(batch_size=32, depth=50, image_size=224, abstract=True)
  # The two models in turn, repetition by repetition (this machine is shared:
  # a slow spell then slows both alike).
  times: dict[str, list[float]] = {"python": [], "native": []}
  plans: dict[str, Any] = {}
  for _ in range(a.reps):
    for mode in ("python", "native"):
      if mode == "python":
        os.environ["JAXMEM_NATIVE_ESTIMATE"] = "0"
      prog = jaxmem.analyze(step, *args)
      t = time.perf_counter()
      plans[mode] = jaxmem.get_planner("auto")(prog, prog.peak_bytes // 2, "h100-pcie",
                                               copies="async")
      times[mode].append(time.perf_counter() - t)
      os.environ.pop("JAXMEM_NATIVE_ESTIMATE", None)
  auto = {mode: dict(median_s=round(statistics.median(times[mode]), 2),
                     planner=plans[mode].planner, estimated=plans[mode].estimated_peak_bytes)
          for mode in times}
  meta = dict(commit=commit(), jax=jax.__version__, cpus=os.cpu_count(), reps=a.reps,
              date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
  out = RESULTS / "native_estimate"
  out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, auto=auto), indent=1))
  return render(meta, rows, auto)


def render(meta: dict[str, Any], rows: list[dict[str, Any]], auto: dict[str, Any]) -> int:
  """Writes the table and the README excerpt of a run; 1 where the models differ."""
  out = RESULTS / "native_estimate"
  reps = meta["reps"]
  flows = sum(r["flows"] for r in rows)
  differing = sum(r["differing"] for r in rows)
  speedups = [r["python_ms"] / r["native_ms"] for r in rows if r["native_ms"] > 0]
  big = [r for r in rows if r["steps"] >= 1000]
  lines = ["# The native lifetime model against its Python reference", "",
           f"`python bench/native_estimate.py --reps {reps}` ({meta['date']}, commit "
           f"`{meta['commit']}`, jax {meta['jax']}, {meta['cpus']} CPUs). Corpus steps "
           "(main, held-out and fresh sets) analysed for XLA:CPU; per step the flows of the "
           "unplanned step and of two plans at 0.6 of its estimate (`segments`, `greedy` with "
           "asynchronous copies) through both models; then one estimate of the "
           f"unplanned schedule timed both ways (median of {reps}).", "",
           f"* Flows compared: **{flows}** from {len(rows)} steps; flows where the models "
           f"differ: **{differing}**.",
           f"* Whole estimate (`Schedule._profile`), Python / native: median "
           f"{statistics.median(speedups):.2f}x, {min(speedups):.2f}x to {max(speedups):.2f}x"
           + (f"; on the {len(big)} steps of 1,000 steps or more median "
              f"{statistics.median([r['python_ms'] / r['native_ms'] for r in big]):.2f}x"
              if big else "") + ".",
           f"* `auto` on ResNet-50 (224x224, batch 32, half its estimated peak, `h100-pcie`), "
           "the two models in turn in one run (`bench/results/plan_speed.md` times `auto` "
           f"alone): {auto['python']['median_s']} s with the Python model, "
           f"{auto['native']['median_s']} s native (plans `{auto['python']['planner']}` and `{auto['native']['planner']}`, "
           f"estimated {auto['python']['estimated']:,} B and {auto['native']['estimated']:,} B).",
           "", "| step | schedule steps | flows | differing | Python ms | native ms | speed-up |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['name']} | {r['steps']} | {r['flows']} | {r['differing']}"
                 f"{' (' + r['first_field'] + ')' if r['first_field'] else ''} | "
                 f"{r['python_ms']} | {r['native_ms']} | {r['python_ms'] / r['native_ms']:.2f}x |")
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines[:9]))
  excerpt = (f"`python bench/native_estimate.py` ({meta['date']}; "
             "`bench/results/native_estimate.md`): the native lifetime model and its Python "
             f"reference agree on {flows - differing} of {flows} flows of {len(rows)} corpus "
             f"steps and their plans; an estimate is {statistics.median(speedups):.1f}x faster "
             f"native (median), and `auto` on ResNet-50 takes "
             f"{auto['native']['median_s'] / auto['python']['median_s']:.2f} of the time the "
             "Python model takes, the two run in turn.")
  print(f"wrote {write_excerpt('native_estimate', excerpt, out.parent)}")
  return 0 if differing == 0 else 1


if __name__ == "__main__":
  raise SystemExit(main())
