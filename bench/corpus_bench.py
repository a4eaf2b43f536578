"""jaxmem on the corpus of train steps it was not tuned to (``bench/corpus/``, issue 14).

For every entry, on this machine's CPU (the ``ffi`` backend), side by side in
one run:

* the unplanned compiled peak (``jax.jit`` with the entry's donated arguments)
  and jaxmem's estimate of it (``jaxmem.analyze``): the error the budget
  arithmetic starts from;
* ``jaxmem.fit(0.5)``: the compiled peak it reached, or the ``BudgetError``'s
  smallest reachable peak; then whether that figure is honest: it is at most
  the unplanned peak, and ``fit`` with it as the budget succeeds;
* results: the fitted step's outputs against ``jax.jit``'s, bit for bit (or
  the largest relative difference);
* where ``fit(0.5)`` fits, ``jaxmem.fit(0.3)``: the peak, or the floor its
  ``BudgetError`` reports (not re-checked: honesty is checked at 0.5);
* for every ``BudgetError``, what holds its floor by kind
  (``BudgetError.floor``), and ``fit``'s time per budget (planning,
  rewriting, compiling and checking: the plan time the issue bounds).

The corpus is measured as it is. Two changes to jaxmem's estimate followed
its first run, both about donated state (results paired with donated
arguments as XLA pairs them; XLA:CPU's copies of donated parameters the
backward pass reads); that run's results are kept in
``bench/results/corpus_before_aliasing.json`` and summarized next to the
current ones. Run:
``python bench/corpus_bench.py [--only SUBSTRING] [--render]``; writes
``bench/results/corpus.{json,md}`` and the README excerpt (``--only`` keeps the
other entries' rows from the last run). About 35 minutes on 2 CPUs.

``--set heldout`` measures the held-out steps of ``bench/corpus/heldout.py``
instead (written after the estimate was last changed) into
``bench/results/heldout.{json,md}``: how the main corpus's figures generalise.
One change to the estimate followed their first run (XLA's code-duplication
limit, found on the state-space model); that run is kept in
``bench/results/heldout_first.json`` and summarized next to the current one.
About 15 minutes.

``--set fresh`` measures ``bench/corpus/fresh.py``: steps written after the
last estimate change of issue 14, when the held-out steps had served to
diagnose the estimate; into ``bench/results/fresh.{json,md}``. About 10 minutes.
Its graph attention step led to estimate changes after its first run, which is
kept in ``bench/results/fresh_first.json`` and summarized next to the current one.

``--set unseen`` measures ``bench/corpus/unseen.py``: steps written after those
changes, when the fresh set had served to diagnose the estimate; into
``bench/results/unseen.{json,md}``. About 12 minutes. Its capsule and Sinkhorn
steps led to estimate changes after its first run, which is kept in
``bench/results/unseen_first.json`` and summarized next to the current one.

``--set novel`` measures ``bench/corpus/novel.py``: steps written after the
unseen set had served to diagnose the estimate; into
``bench/results/novel.{json,md}``. Its first run is kept in
``bench/results/novel_first.json``; its Fourier neural operator led to an
estimate change after it.

``--set untried`` measures ``bench/corpus/untried.py``: steps written after the
novel set had served to diagnose the estimate; into
``bench/results/untried.{json,md}``. Its first run is kept in
``bench/results/untried_first.json`` before anything is changed because of it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxmem  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit, write_excerpt  # noqa: E402
from corpus import FAMILIES, FRESH, HELDOUT, NOVEL, UNSEEN, UNTRIED, all_entries  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20
FRACTION = 0.5
#: The second budget asked of the steps that fit ``FRACTION``.
LOW = 0.3
#: The first run on the corpus, before a change made after measuring it.
BEFORE = RESULTS / "corpus_before_aliasing.json"
#: The first run on the held-out steps, before the change made after measuring them.
HELDOUT_FIRST = RESULTS / "heldout_first.json"
#: The first run on the fresh steps, before the changes made after measuring them.
FRESH_FIRST = RESULTS / "fresh_first.json"
#: The first run on the unseen steps, before the changes made after measuring them.
UNSEEN_FIRST = RESULTS / "unseen_first.json"
#: The first run on the novel steps, before any change made after measuring them.
NOVEL_FIRST = RESULTS / "novel_first.json"
#: The first run on the untried steps, before any change made after measuring them.
UNTRIED_FIRST = RESULTS / "untried_first.json"
#: Per ``--set``: the family modules, the results files' stem, and the first
#: run summarized beside the current one.
SETS = {"main": (FAMILIES, "corpus", BEFORE), "heldout": (HELDOUT, "heldout", HELDOUT_FIRST),
        "fresh": (FRESH, "fresh", FRESH_FIRST), "unseen": (UNSEEN, "unseen", UNSEEN_FIRST),
        "novel": (NOVEL, "novel", NOVEL_FIRST), "untried": (UNTRIED, "untried", UNTRIED_FIRST)}


def _fresh(args: Any) -> Any:
  """Copies of ``args``: a step that donates them consumes its inputs."""
  return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, args)


def _data(x: Any) -> Any:
  """``x``, or the bits of a typed PRNG key array (nnx keeps them in its state)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x


#: Relative differences up to this are float rounding of a reordered sum.
ROUNDING = 1e-4


def _compare(got: Any, want: Any) -> str:
  flat = jax.tree_util.tree_flatten_with_path(got)[0]
  want = jax.tree.leaves(want)
  if len(flat) != len(want):
    return "different outputs"
  worst, differ = 0.0, 0
  moment_diff, moment_scale = 0.0, 0.0
  # Per output of the step (parameters, optimizer state, ...): the largest
  # difference and the largest magnitude of any of its leaves.
  output_diff: dict[Any, float] = {}
  output_scale: dict[Any, float] = {}
  for (path, a), b in zip(flat, want):
    a, b = np.asarray(_data(a)), np.asarray(_data(b))
    if a.shape != b.shape:
      return "different shapes"
    top = jax.tree_util.keystr(path[:1])
    is_moment = re.search(r"[.'\[]mu\b", jax.tree_util.keystr(path)) is not None
    if b.size and np.issubdtype(b.dtype, np.floating):
      scale = float(np.max(np.abs(b.astype(np.float64))))
      output_scale[top] = max(output_scale.get(top, 0.0), scale)
      if is_moment:
        moment_scale = max(moment_scale, scale)
    if np.array_equal(a, b, equal_nan=True):
      continue
    differ += 1
    diff = float(np.max(np.abs(a.astype(np.float64) - b)))
    worst = max(worst, diff / max(float(np.max(np.abs(b.astype(np.float64)))), 1e-30))
    output_diff[top] = max(output_diff.get(top, 0.0), diff)
    if is_moment:
      moment_diff = max(moment_diff, diff)
  # Relative to the leaf's largest element: adam turns a last-bit difference
  # in a gradient that is zero in exact arithmetic (an attention key's bias,
  # whose first moment is 1e-10 where the others' are 1e-2) into a full-size
  # update of that leaf. Adam's first moment, linear in the gradients and
  # compared with its largest element over all leaves, tells that rounding
  # from a wrong result; so does a difference compared with the largest
  # element of the whole output it is in (a convolution's bias before a
  # BatchNorm, whose gradient is zero in exact arithmetic, under RMSProp).
  if not differ:
    return "bit-identical"
  text = f"{differ} of {len(flat)} leaves differ, max rel diff {worst:.1e}"
  if worst > ROUNDING:
    whole = max((d / max(output_scale.get(k, 0.0), 1e-30) for k, d in output_diff.items()),
                default=0.0)
    text += f"; of its output's largest {whole:.1e}"
    if moment_scale > 0:
      text += f"; adam's first moment {moment_diff / moment_scale:.1e}"
  return text


def _without_excess_precision(fitted: Any, jitted: Any, args: Any) -> str:
  """Whether the fitted step is bit-identical to ``jitted`` with XLA's excess precision off.

  XLA keeps 16-bit float values in float32 inside a fusion by default
  (``xla_allow_excess_precision``); a plan that splits the fusion rounds
  them where ``jax.jit``'s program does not.
  """
  opts = {"xla_allow_excess_precision": False}
  got = fitted.lower(*args).compile(compiler_options=opts)(*_fresh(args))
  want = jitted.lower(*args).compile(compiler_options=opts)(*_fresh(args))
  same = all(np.array_equal(np.asarray(_data(a)), np.asarray(_data(b)), equal_nan=True)
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  return ("; bit-identical without XLA's excess precision" if same
          else "; differs without XLA's excess precision too")


def _rounding_text(rounding: list[float], differing: int, excess: int = 0) -> str:
  if not differing:
    return "none differ"
  text = (f"{len(rounding)} of the other {differing} to float rounding (at most "
          f"{max(rounding, default=0.0):.0e} of a leaf's largest element, of its output's "
          "largest, or of adam's first moment's largest, where the optimizer turns a last-bit "
          "difference in a gradient that is zero in exact arithmetic into a full step)")
  if len(rounding) < differing:
    text += f", {differing - len(rounding)} beyond it"
    if excess:
      text += (f" ({excess} of them bit-identical with XLA's excess precision off: 16-bit "
               "values XLA keeps in float32 inside a fusion that the plan splits)")
  return text


def _rounding_bound(results: str) -> float | None:
  """The relative difference a row's results show as float rounding, or None if they are not."""
  m = re.search(r"max rel diff ([0-9.e+-]+)(?:; of its output's largest ([0-9.e+-]+))?"
                r"(?:; adam's first moment ([0-9.e+-]+))?", results)
  if not m:
    return None
  bound = min(float(g) for g in m.groups() if g is not None)
  return bound if bound <= ROUNDING else None


def smallest_reached(step: Any, args: Any, smallest: int, **fit_kwargs: Any) -> dict[str, Any]:
  """Whether a ``BudgetError``'s smallest reachable peak is honest: ``fit`` with it succeeds."""
  try:
    again = jaxmem.fit(int(smallest), **fit_kwargs)(step).fit_result(*args)
    return dict(smallest_reached=again.peak_bytes <= smallest)
  except jaxmem.BudgetError as e:
    return dict(smallest_reached=False,
                smallest_reached_note=f"BudgetError again: {e.smallest_bytes / MiB:.2f} MiB")


def measure(entry: Any) -> dict[str, Any]:
  row: dict[str, Any] = dict(name=entry.name, family=entry.family)
  t0 = time.perf_counter()
  step, args = entry.make()
  donate = entry.donate
  jitted = jax.jit(step, donate_argnums=donate)
  base = jaxmem.compiled_memory(jitted.lower(*args).compile()).peak_bytes
  row["unplanned_mib"] = round(base / MiB, 2)
  t1 = time.perf_counter()
  try:
    estimate = jaxmem.analyze(step, *args, donate_argnums=donate).peak_bytes
    row["estimate_mib"] = round(estimate / MiB, 2)
    row["estimate_error"] = round((estimate - base) / base, 4)
  except Exception as e:  # noqa: BLE001 (a failure is a result)
    row["estimate_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  row["analyze_s"] = round(time.perf_counter() - t1, 1)
  t1 = time.perf_counter()
  try:
    fitted = jaxmem.fit(FRACTION, donate_argnums=donate)(step)
    res = fitted.fit_result(*args)
    row.update(fit="fits", fit_mib=round(res.peak_bytes / MiB, 2),
               fit_fraction=round(res.peak_bytes / base, 3),
               within=res.peak_bytes <= res.budget_bytes, planner=res.plan.planner,
               scans=res.scans)
    row["results"] = _compare(fitted(*_fresh(args)), jitted(*_fresh(args)))
    if row["results"] != "bit-identical" and _rounding_bound(row["results"]) is None:
      row["results"] += _without_excess_precision(fitted, jitted, args)
  except jaxmem.BudgetError as e:
    smallest = e.smallest_bytes
    row.update(fit="BudgetError", smallest_mib=round(smallest / MiB, 2),
               smallest_fraction=round(smallest / base, 3), smallest_above_unplanned=smallest > base,
               floor=[[k, round(b / MiB, 2)] for k, b in e.floor], advice=e.advice)
    row["fit_s"] = round(time.perf_counter() - t1, 1)
    t2 = time.perf_counter()
    row.update(smallest_reached(step, args, smallest, donate_argnums=donate))
    row["recheck_s"] = round(time.perf_counter() - t2, 1)
  except Exception as e:  # noqa: BLE001
    row.update(fit="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    traceback.print_exc()
  row.setdefault("fit_s", round(time.perf_counter() - t1, 1))
  if row.get("fit") == "fits":
    # A step that fits half its peak: does it fit 0.3? (The floor a
    # `BudgetError` reports there is not re-checked: that is done at 0.5.)
    t1 = time.perf_counter()
    try:
      res = jaxmem.fit(LOW, donate_argnums=donate)(step).fit_result(*args)
      row.update(low="fits", low_mib=round(res.peak_bytes / MiB, 2),
                 low_fraction=round(res.peak_bytes / base, 3),
                 low_within=res.peak_bytes <= res.budget_bytes)
    except jaxmem.BudgetError as e:
      row.update(low="BudgetError", low_mib=round(e.smallest_bytes / MiB, 2),
                 low_fraction=round(e.smallest_bytes / base, 3),
                 low_floor=[[k, round(b / MiB, 2)] for k, b in e.floor])
    except Exception as e:  # noqa: BLE001
      row.update(low="failed", low_error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    row["low_s"] = round(time.perf_counter() - t1, 1)
  row["total_s"] = round(time.perf_counter() - t0, 1)
  return row


def _plan_s(r: dict[str, Any]) -> float:
  """The longest `fit` of a row (0.5, and 0.3 where it fit 0.5)."""
  return max(r.get("fit_s", 0.0), r.get("low_s", 0.0))


def _kind(kind: str) -> str:
  """A floor kind, with a source path taken relative to the repository (the checkout differs)."""
  return re.sub(r"\S*?/(bench/corpus/)", r"\1", kind)


def _floor_text(floor: list[list[Any]] | None) -> str:
  """The two largest kinds holding a floor, with their share."""
  if not floor:
    return ""
  total = sum(b for _, b in floor if b > 0) or 1.0
  return "; " + ", ".join(f"{_kind(k)} {b / total:.0%}" for k, b in floor[:2])


def _median_fraction(xs: list[float]) -> str:
  return f"{statistics.median(xs):.2f}" if xs else "—"


def _floor_kinds(rows: list[dict[str, Any]]) -> str:
  counts: dict[str, int] = {}
  for r in rows:
    if r.get("floor"):
      kind = _kind(r["floor"][0][0])
      counts[kind] = counts.get(kind, 0) + 1
  return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "—"


def _pct(x: float) -> str:
  return f"{x * 100:+.1f}%"


def _headline(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
  """(estimates within ±10%, estimates, fit(0.5) fits)."""
  errors = [r["estimate_error"] for r in rows if "estimate_error" in r]
  return (sum(abs(e) <= 0.10 for e in errors), len(errors),
          sum(r.get("fit") == "fits" for r in rows))


def render(rows: list[dict[str, Any]], meta: dict[str, Any],
           before: dict[str, Any] | None = None, which: str = "main") -> tuple[str, str]:
  """The full table and the README excerpt (the per-family summary).

  ``before``: an earlier run's results file, summarized in one line (what a
  change made after measuring the corpus did to it).
  """
  families: dict[str, list[dict[str, Any]]] = {}
  for r in rows:
    families.setdefault(r["family"], []).append(r)
  errors = [r["estimate_error"] for r in rows if "estimate_error" in r]
  within10 = sum(abs(e) <= 0.10 for e in errors)
  below5 = sum(e < -0.05 for e in errors)
  fits = [r for r in rows if r.get("fit") == "fits"]
  budget_errors = [r for r in rows if r.get("fit") == "BudgetError"]
  honest = [r for r in budget_errors
            if r.get("smallest_reached") and not r.get("smallest_above_unplanned")]
  identical = sum(r.get("results") == "bit-identical" for r in fits)
  bounds = [_rounding_bound(r.get("results", "")) for r in fits
            if r.get("results") != "bit-identical"]
  rounding = [b for b in bounds if b is not None]
  excess = sum("bit-identical without XLA's excess precision" in r.get("results", "")
               for r in fits)
  violations = sum(not r.get("within", True) for r in fits)
  failed = [r for r in rows if r.get("fit") == "failed" or "estimate_failed" in r]
  low_fits = [r for r in rows if r.get("low") == "fits"]
  low_floors = [r["low_fraction"] for r in rows if r.get("low") == "BudgetError"]
  plan_times = [_plan_s(r) for r in rows]
  head = (f"`python bench/corpus_bench.py` jax {meta['jax']}, commit `{meta['commit']}`, "
          f"{meta['machine']}: {len(rows)} train steps of {len(families)} families from "
          "`bench/corpus/` (written to measure jaxmem, not for it), on XLA:CPU with the `ffi` "
          "backend.")
  heldout = which == "heldout"
  if which in ("fresh", "unseen", "novel", "untried"):
    head = (f"`python bench/corpus_bench.py --set {which}` jax {meta['jax']}, commit "
            f"`{meta['commit']}`, {meta['machine']}: {len(rows)} train steps of "
            f"{len(families)} families from `bench/corpus/{which}.py`, written after an earlier "
            "change to jaxmem's estimate and first measured as they came, on XLA:CPU with the "
            "`ffi` backend.")
  elif heldout:
    head = (f"`python bench/corpus_bench.py --set heldout` jax {meta['jax']}, commit "
            f"`{meta['commit']}`, {meta['machine']}: {len(rows)} held-out train steps of "
            f"{len(families)} families from `bench/corpus/heldout.py`, written after jaxmem's "
            "estimate was last changed and first measured as they came, on XLA:CPU with the "
            "`ffi` backend.")
  if meta.get("remeasured"):
    by_commit: dict[str, list[str]] = {}
    for name, at in meta["remeasured"].items():
      by_commit.setdefault(at, []).append(f"`{name}`")
    head += (" Re-measured with `--only`: " + "; ".join(
        f"{', '.join(names)} at `{at}`" for at, names in by_commit.items())
        + f"; the other rows at `{meta['rows_from']}`.")
  summary = [
      head, "",
      f"* Estimates within ±10% of the compiled peak: **{within10} of {len(errors)}**; below "
      f"−5% (an under-estimate the budget arithmetic trusts): {below5}; median |error| "
      f"{statistics.median(abs(e) for e in errors) * 100:.1f}%." if errors else "* no estimates",
      f"* `fit({FRACTION})`: fits **{len(fits)} of {len(rows)}** (compiled peak over budget: "
      f"{violations}; results bit-identical to `jax.jit`: {identical} of {len(fits)}, "
      f"{_rounding_text(rounding, len(bounds), excess)}); "
      f"`BudgetError` {len(budget_errors)}, of which honest (the smallest peak it reports is at "
      f"most the unplanned peak and `fit` reaches it when asked): {len(honest)}; "
      f"failures: {len(failed)}.",
      f"* Reaching {FRACTION} of the unplanned compiled peak: **{len(fits)} of {len(rows)}** "
      f"({len(fits) / max(1, len(rows)):.0%}); reaching {LOW} (`fit({LOW})` on those): "
      f"**{len(low_fits)} of {len(rows)}** ({len(low_fits) / max(1, len(rows)):.0%}; compiled "
      f"peak over budget: {sum(not r.get('low_within', True) for r in low_fits)}); the floors "
      f"`fit({LOW})` reports for the other {len(low_floors)}: median "
      f"{_median_fraction(low_floors)} of the unplanned peak.",
      f"* Planning time (`fit`: plans, rewrites, compiles and checks; the longest of both "
      f"budgets per step): median {statistics.median(plan_times):.0f} s, longest "
      f"{max(plan_times):.0f} s ({max(rows, key=_plan_s)['name']}); over 60 s: "
      f"{sum(t > 60 for t in plan_times)}." if plan_times else "* no planning times",
      f"* What holds the floor of the {len(budget_errors)} `BudgetError`s (the largest kind "
      f"in each): {_floor_kinds(budget_errors)}." if budget_errors else "* no BudgetError",
      *([f"* Before {before['meta']['change']} (commit `{before['meta']['commit']}`, the first "
         f"run on {'this corpus' if which == 'main' else 'these steps'}): estimates within ±10% "
         f"{_headline(before['rows'])[0]} of "
         f"{_headline(before['rows'])[1]}, `fit(0.5)` fits {_headline(before['rows'])[2]} "
         f"(`bench/results/{before['meta']['file']}`)."] if before else []),
      "",
      "| family | steps | estimate error (min … max) | within ±10% | fit(0.5) fits | "
      "BudgetError honest |",
      "|---|---|---|---|---|---|"]
  for fam, rs in families.items():
    errs = [r["estimate_error"] for r in rs if "estimate_error" in r]
    be = [r for r in rs if r.get("fit") == "BudgetError"]
    ok = [r for r in be if r.get("smallest_reached") and not r.get("smallest_above_unplanned")]
    span = f"{_pct(min(errs))} … {_pct(max(errs))}" if errs else "—"
    summary.append(f"| {fam} | {len(rs)} | {span} | {sum(abs(e) <= 0.1 for e in errs)} / "
                   f"{len(errs)} | {sum(r.get('fit') == 'fits' for r in rs)} / {len(rs)} | "
                   f"{len(ok)} / {len(be)} |")
  title = (f"# jaxmem on {which} train steps (`bench/corpus_bench.py --set {which}`)"
           if which in ("fresh", "unseen", "novel")
           else "# jaxmem on held-out train steps (`bench/corpus_bench.py --set heldout`)"
           if heldout else "# jaxmem on a corpus it was not tuned to (`bench/corpus_bench.py`)")
  full = [title, "",
          *summary, "",
          "Every step (peaks in MiB; `fit` at 0.5 of the unplanned compiled peak, then at 0.3 "
          "where 0.5 fits; a `BudgetError`'s floor with the largest kinds holding it, from "
          "jaxmem's estimate of the plan at its peak; plan time is `fit`'s at 0.5, then 0.3):", "",
          "| step | unplanned | estimate (error) | fit(0.5) | results / honesty | fit(0.3) | "
          "plan time |",
          "|---|---|---|---|---|---|---|"]
  for r in rows:
    est = (f"{r['estimate_mib']:.1f} ({_pct(r['estimate_error'])})" if "estimate_error" in r
           else f"failed: {r.get('estimate_failed', '?')}")
    if r.get("fit") == "fits":
      fit = f"{r['fit_mib']:.1f} ({r['fit_fraction']:.2f})" + ("" if r["within"] else " OVER")
      if r.get("scans"):
        fit += f", scans {r['scans']}"
      extra = r.get("results", "")
    elif r.get("fit") == "BudgetError":
      fit = (f"BudgetError: {r['smallest_mib']:.1f} ({r['smallest_fraction']:.2f})"
             + _floor_text(r.get("floor")))
      extra = ("honest" if r.get("smallest_reached") and not r.get("smallest_above_unplanned")
               else "NOT reached when asked: " + r.get("smallest_reached_note", "")
               if not r.get("smallest_reached") else "above the unplanned peak")
    else:
      fit, extra = "failed", r.get("error", "")
    if r.get("low") == "fits":
      low = f"{r['low_mib']:.1f} ({r['low_fraction']:.2f})" + ("" if r["low_within"] else " OVER")
    elif r.get("low") == "BudgetError":
      low = (f"BudgetError: {r['low_mib']:.1f} ({r['low_fraction']:.2f})"
             + _floor_text(r.get("low_floor")))
    elif r.get("low") == "failed":
      low = "failed: " + r.get("low_error", "")
    else:
      low = "—"
    times = f"{r.get('fit_s', 0):.0f} s" + (f", {r['low_s']:.0f} s" if "low_s" in r else "")
    full.append(f"| {r['name']} | {r['unplanned_mib']:.1f} | {est} | {fit} | {extra} | {low} | "
                f"{times} |")
  return "\n".join(full) + "\n", "\n".join(summary) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="measure the entries whose name contains this")
  parser.add_argument("--render", action="store_true", help="the tables again from the JSON")
  parser.add_argument("--set", choices=tuple(SETS), default="main",
                      help="the main corpus, the held-out steps (bench/corpus/heldout.py), "
                           "the fresh ones (bench/corpus/fresh.py), the unseen ones "
                           "(bench/corpus/unseen.py) or the novel ones (bench/corpus/novel.py)")
  opts = parser.parse_args()
  families, stem, first = SETS[opts.set]
  path = RESULTS / f"{stem}.json"
  old = json.loads(path.read_text()) if path.exists() else dict(meta={}, rows=[])
  if opts.render:
    meta, rows = old["meta"], old["rows"]
  else:
    entries = [e for e in all_entries(families) if opts.only in e.name]
    done = {r["name"]: r for r in old["rows"]} if opts.only else {}
    for i, entry in enumerate(entries):
      print(f"[{i + 1}/{len(entries)}] {entry.name} ...", flush=True)
      done[entry.name] = row = measure(entry)
      print(json.dumps(row), flush=True)
    order = [e.name for e in all_entries(families)]
    rows = [done[n] for n in order if n in done]
    meta = dict(jax=jax.__version__, commit=commit(),
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
    if opts.only:
      # The other rows are the last full run's: say which commit measured them.
      earlier = old["meta"].get("rows_from", old["meta"].get("commit", "?"))
      measured = dict(old["meta"].get("remeasured", {}))
      measured.update((e.name, meta["commit"]) for e in entries)
      meta.update(rows_from=earlier, remeasured=dict(sorted(measured.items())))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  before = None
  if first is not None and first.exists():
    before = json.loads(first.read_text())
    before["meta"].setdefault("file", first.name)
  full, excerpt = render(rows, meta, before, opts.set)
  (RESULTS / f"{stem}.md").write_text(full)
  write_excerpt(stem, excerpt)
  print(full)


if __name__ == "__main__":
  main()
