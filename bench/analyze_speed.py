"""How fast is jaxmem's analysis of a large program? Target: a 20,000-equation step in under 2 s.

The program is the full train step (forward, backward, optax adam update) of a deep, narrow
flax MLP; its arguments are ``jax.ShapeDtypeStruct``s (``jax.eval_shape`` of the inits), so
nothing is initialised or compiled and only the analysis is measured. Each stage is timed
``--reps`` times (min / median / max reported):

  (a) trace      ``jax.make_jaxpr`` of the flattened step (JAX's time, not jaxmem's)
  (b) analyze    jaxmem's own part: flattening into a Program (roles, sources) + lifetimes
                 (``trace(..., closed_jaxpr=...)`` and ``analyze_program``)
  (c) report     ``prog.report()``
  (d) to_json    ``prog.to_json()`` (plus ``json.dumps`` of it, listed separately)
  (e) plan       the greedy planner at 0.5 of the estimated peak (batch 1024 makes the
                 activations, not the parameters, hold the peak, so the planner has work;
                 the batch does not change the equation count). When one run takes longer
                 than --plan-give-up-s its remaining repetitions are skipped.

Then jaxmem's part (b) is profiled with cProfile, and, when it is slower than the target,
the planner on a smaller program of the same model (--plan-profile-depth, default 100).

Run: ``python bench/analyze_speed.py [--depth 432] [--reps 3] [--no-plan]``; writes
``bench/results/analyze_speed.{json,md}``. About 35 s on 2 CPUs (before the planner batched its
decisions it took minutes per run at this size; ``--no-plan`` skips it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import platform
import pstats
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import jaxmem
from _results import write_excerpt  # noqa: E402
from jaxmem._src import _compat
from jaxmem._src.api.program import Program
from jaxmem._src.estimate.analysis import analyze_program
from jaxmem._src.ir.trace import trace as trace_program

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET_S = 2.0


def build(depth: int = 432, width: int = 32, batch: int = 1024) -> tuple[Callable[..., Any], tuple]:
  """Adam train step of a ``depth``-layer flax MLP; ~46 equations per layer (432 -> ~20,000)."""
  import flax.linen as nn
  import optax

  class DeepMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(depth):
        x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(10)(x)

  model, tx = DeepMLP(), optax.adam(1e-3)
  x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
  opt_state = jax.eval_shape(tx.init, params)

  def step(params, opt_state, x, y):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, x, y)


def trace(step: Callable[..., Any], args: tuple) -> Any:
  """Stage (a): the closed jaxpr exactly as ``Program`` traces it."""
  flat_args, in_tree = jax.tree_util.tree_flatten(tuple(args))

  def flat_fun(*leaves):
    return jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(in_tree, leaves)))

  return _compat.make_jaxpr(flat_fun, *flat_args)


def analyze_traced(step: Callable[..., Any], args: tuple, closed: Any) -> Program:
  """Stage (b): jaxmem's flattening and lifetimes of an already traced step."""
  return Program.of(analyze_program(trace_program(step, args, closed_jaxpr=closed)))


def timed(fn: Callable[[], Any], reps: int, give_up_s: float | None = None) -> tuple[list[float], Any]:
  times, out = [], None
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
    if give_up_s is not None and times[-1] > give_up_s:
      break
  return times, out


def top_functions(stats_text_source: cProfile.Profile, n: int = 25) -> tuple[str, list[dict]]:
  s = io.StringIO()
  st = pstats.Stats(stats_text_source, stream=s)
  st.sort_stats("cumulative").print_stats(n)
  rows = []
  for (file, line, func), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][3]):
    rows.append({"function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}"
                             f"({func})", "calls": nc, "tottime_s": round(tt, 4),
                 "cumtime_s": round(ct, 4)})
    if len(rows) >= n:
      break
  return s.getvalue(), rows


def _unpack(built: tuple) -> tuple:
  step, args = built
  return (step, *args)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--depth", type=int, default=432, help="MLP layers (432 -> ~20,000 equations)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--plan-give-up-s", type=float, default=60.0,
                  help="after one planner run slower than this, skip its remaining repetitions")
  ap.add_argument("--no-plan", action="store_true")
  ap.add_argument("--recursion-limit", type=int, default=100_000,
                  help="recursion limit for a retry of the planner after a RecursionError")
  ap.add_argument("--plan-profile-depth", type=int, default=100,
                  help="depth of the (smaller) program the planner is profiled on")
  ap.add_argument("--out", default=str(RESULTS / "analyze_speed"))
  a = ap.parse_args()

  step, args = build(a.depth)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} CPUs, python "
        f"{platform.python_version()}; deep MLP depth {a.depth}, adam", file=sys.stderr)

  trace(step, args)                                   # warm up JAX's caches once
  print("(a) tracing ...", file=sys.stderr, flush=True)
  t_trace, closed = timed(lambda: trace(step, args), a.reps)
  print("(b) flattening + lifetimes ...", file=sys.stderr, flush=True)
  t_anal, prog = timed(lambda: analyze_traced(step, args, closed), a.reps)
  t_total, _ = timed(lambda: jaxmem.analyze(step, *args), 1)
  n_ops = prog.num_ops
  print(f"program: {n_ops} equations, {len(prog.vars)} values, estimated peak "
        f"{jaxmem.format_bytes(prog.peak_bytes)}", file=sys.stderr)
  t_report, text = timed(lambda: prog.report(), a.reps)
  t_json, data = timed(lambda: prog.to_json(), a.reps)
  t_dumps, dumped = timed(lambda: json.dumps(data), a.reps)

  budget = prog.peak_bytes // 2
  plan_times: list[float] = []
  plan = None
  plan_error = None
  if not a.no_plan:
    planner = jaxmem.get_planner("greedy")
    print(f"planning (greedy) for {jaxmem.format_bytes(budget)} ...", file=sys.stderr, flush=True)
    try:
      plan_times, plan = timed(lambda: planner(prog, budget, None), a.reps, a.plan_give_up_s)
    except RecursionError as e:
      # greedy.find_chain recurses once per op of a dependency chain; record the failure and
      # measure the planner anyway with a higher limit (Python 3.11 frames are cheap).
      plan_error = f"RecursionError at the default limit {sys.getrecursionlimit()}: {e}"
      print(f"  {plan_error}; retrying with sys.setrecursionlimit({a.recursion_limit})",
            file=sys.stderr, flush=True)
      old_limit = sys.getrecursionlimit()
      sys.setrecursionlimit(a.recursion_limit)
      try:
        plan_times, plan = timed(lambda: planner(prog, budget, None), a.reps, a.plan_give_up_s)
      finally:
        sys.setrecursionlimit(old_limit)

  # cProfile of jaxmem's own part (b), and of the planner when it is slow
  pr = cProfile.Profile()
  pr.enable()
  analyze_traced(step, args, closed)
  pr.disable()
  prof_text, prof_rows = top_functions(pr)
  plan_prof_text, plan_prof_rows = "", []
  plan_small = None
  if plan_times and min(plan_times) > TARGET_S:
    small = jaxmem.analyze(*_unpack(build(a.plan_profile_depth)))
    print(f"profiling the planner on depth {a.plan_profile_depth} ({small.num_ops} equations) ...",
          file=sys.stderr, flush=True)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, a.recursion_limit))
    pr.enable()
    try:
      p_small = jaxmem.get_planner("greedy")(small, small.peak_bytes // 2, None)
    finally:
      pr.disable()
      sys.setrecursionlimit(old_limit)
    plan_small = {"depth": a.plan_profile_depth, "num_ops": small.num_ops,
                  "decisions": len(p_small.decisions),
                  "seconds_under_cprofile": time.perf_counter() - t0}
    plan_prof_text, plan_prof_rows = top_functions(pr)

  def row(name: str, times: list[float], note: str = "") -> dict:
    return {"stage": name, "reps": len(times), "min_s": min(times), "median_s": statistics.median(times),
            "max_s": max(times), "note": note}

  rows = [
      row("(a) trace: jax.make_jaxpr", t_trace, "JAX"),
      row("(b) analyze: flatten + lifetimes", t_anal, "jaxmem"),
      row("(c) report()", t_report, "jaxmem"),
      row("(d) to_json()", t_json, "jaxmem"),
      row("    json.dumps(to_json())", t_dumps, f"{len(dumped) / 2**20:.1f} MiB"),
      row("jaxmem.analyze end to end (a+b)", t_total, "1 run"),
  ]
  if plan_times:
    rows.append(row("(e) greedy plan at 0.5 of estimate", plan_times,
                    f"{len(plan.decisions)} decisions, est. {jaxmem.format_bytes(plan.estimated_peak_bytes)}"
                    f" for target {jaxmem.format_bytes(budget)}"
                    + ("; RecursionError at the default recursion limit, timed with a raised "
                       "limit" if plan_error else "")
                    + (f"; {len(plan_times)} of {a.reps} reps (one took > {a.plan_give_up_s:g} s)"
                       if len(plan_times) < a.reps else "")))
  jaxmem_s = statistics.median(t_anal)
  met = jaxmem_s < TARGET_S
  analysis_incl_trace = statistics.median(t_trace) + jaxmem_s

  lines = [
      f"# jaxmem analysis speed ({n_ops} equations)",
      "",
      f"`python bench/analyze_speed.py --depth {a.depth}`: adam train step of a {a.depth}-layer flax MLP "
      f"(width 32, batch 1024; arguments are ShapeDtypeStructs), {n_ops} equations, {len(prog.vars)} values. "
      f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} CPUs. Seconds over "
      f"{a.reps} repetitions.",
      "",
      "| stage | min s | median s | max s | note |",
      "|---|---|---|---|---|",
  ]
  lines += [f"| {r['stage'].strip()} | {r['min_s']:.3f} | {r['median_s']:.3f} | {r['max_s']:.3f} | "
            f"{r['note']} |" for r in rows]
  lines += [
      "",
      f"Target: analysis of a 20,000-equation program in under {TARGET_S:g} s. "
      f"jaxmem's own part (b): {jaxmem_s:.2f} s — **{'met' if met else 'not met'}**; "
      f"with JAX's tracing (a + b): {analysis_incl_trace:.2f} s "
      f"({'met' if analysis_incl_trace < TARGET_S else 'not met'}).",
      "",
      "cProfile of (b), top functions by cumulative time:",
      "",
      "| function | calls | tottime s | cumtime s |",
      "|---|---|---|---|",
  ]
  lines += [f"| `{r['function']}` | {r['calls']} | {r['tottime_s']:.3f} | {r['cumtime_s']:.3f} |"
            for r in prof_rows[:15]]
  if plan_prof_rows:
    lines += ["", f"cProfile of the greedy planner on depth {plan_small['depth']} "
              f"({plan_small['num_ops']} equations, {plan_small['decisions']} decisions, "
              f"{plan_small['seconds_under_cprofile']:.1f} s under cProfile), top functions by "
              "cumulative time:", "",
              "| function | calls | tottime s | cumtime s |", "|---|---|---|---|"]
    lines += [f"| `{r['function']}` | {r['calls']} | {r['tottime_s']:.3f} | {r['cumtime_s']:.3f} |"
              for r in plan_prof_rows[:15]]
  md = "\n".join(lines) + "\n"

  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  result = {
      "benchmark": "analyze_speed", "jax": jax.__version__, "backend": jax.default_backend(),
      "cpus": os.cpu_count(), "depth": a.depth, "num_ops": n_ops, "num_values": len(prog.vars),
      "estimated_peak_bytes": prog.peak_bytes, "target_s": TARGET_S, "jaxmem_median_s": jaxmem_s,
      "target_met": met, "trace_plus_analyze_median_s": analysis_incl_trace, "stages": rows,
      "profile_analyze": prof_rows, "profile_plan": plan_prof_rows, "profile_plan_program": plan_small,
      "plan": None if plan is None else {
          "budget_bytes": budget, "decisions": len(plan.decisions),
          "estimated_peak_bytes": plan.estimated_peak_bytes, "error_at_default_limit": plan_error},
  }
  out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
  out.with_suffix(".md").write_text(md)
  excerpt = (f"`python bench/analyze_speed.py` (`bench/results/analyze_speed.md`): a "
             f"{n_ops:,}-equation train step (a {a.depth}-layer MLP with adam) is traced by JAX in "
             f"{statistics.median(t_trace):.2f} s and analyzed by jaxmem in {jaxmem_s:.2f} s "
             f"(median of {a.reps}); target under {TARGET_S:g} s: "
             f"**{'met' if met else 'not met'}**."
             + (f" The greedy planner takes {statistics.median(plan_times):.1f} s on it."
                if plan_times else ""))
  print(f"wrote {write_excerpt('analyze_speed', excerpt, out.parent)}")
  print(md)
  print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", file=sys.stderr)
  print("\n--- cProfile of (b) ---\n" + prof_text, file=sys.stderr)
  if plan_prof_text:
    print("\n--- cProfile of (e) ---\n" + plan_prof_text, file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
