"""How long ``jaxmem.fit`` takes on chosen corpus steps, beside a baseline commit (issue 14: under 60 s).

``bench/corpus_bench.py`` times every step of the corpus at 0.5 and 0.3 of
its unplanned compiled peak in one long run; this re-times a few of them (by
default the slowest of the last corpus runs, every set) after a change
to the search, without re-measuring everything. Per step and budget:
``fit``'s wall time (tracing, planning, rewriting, compiling and checking, as
a user waits for it), its outcome (the compiled peak, or the ``BudgetError``'s
smallest reachable peak), and the XLA compiles it made and their time (from
``jax.monitoring``'s ``backend_compile_duration`` events).

With ``--baseline REF`` every measurement is made twice, one after the
other in fresh processes: with the package of commit ``REF`` (checked out
into a temporary git worktree and imported from there; the native extension
is the installed one) and with this checkout. Times from one run on a shared
machine are comparable with each other, not with another run's.

``--budget-errors SET,SET`` takes, instead of ``--steps``, every step and
budget whose last corpus run of those sets (``bench/results/corpus.json``
for ``main``, ``heldout.json``...) ended in a ``BudgetError``; ``--ask`` then
asks this checkout for each error's smallest reachable peak, as a user
would, and records whether a budget of it is met (issue 14: honest errors).

Run: ``python bench/fit_times.py [--steps NAME,NAME | --budget-errors SET,SET]
[--fractions 0.5,0.3] [--baseline REF] [--ask] [--out NAME]``; writes
``bench/results/NAME.{json,md}`` (``fit_times`` unless told). About an hour
on 2 CPUs with a baseline and the default steps.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MiB = 2 ** 20
#: The steps whose `fit` took over 60 s in the last corpus runs (`bench/results/
#: corpus.json`, `heldout.json`, `fresh.json`, `unseen.json`), at the budget that did.
SLOWEST = ("gan/dcgan-s@0.5", "gan/dcgan-m@0.5", "attention/gpt-postln-m@0.5",
           "convnext/convnext-s@0.3", "convnext/convnext-m@0.5", "convnext/convnext-m@0.3",
           "rl/sac-s@0.3", "perceiver/latent-s@0.5", "perceiver/latent-s@0.3",
           "ctc/bigru-s@0.3", "swin/shifted-s@0.3", "ddpm/unet-s@0.5", "ddpm/unet-s@0.3")
LIMIT_S = 60.0


def time_fit(name: str, fraction: float, ask: bool = False) -> dict[str, Any]:
  """One ``fit`` of corpus step ``name`` at ``fraction`` of its peak, in this process.

  With ``ask``, a ``BudgetError``'s smallest reachable peak is then asked
  for (a second ``fit``, not timed with the first): ``asked_mib`` is the
  peak it compiled to, ``asked_met`` whether it fitted within that figure.
  """
  import jax.monitoring  # imported here: the subprocess picks the package's path first

  import jaxmem
  sys.path.insert(0, str(HERE))
  from corpus import EVERY, all_entries

  entry = next(e for e in all_entries(EVERY) if e.name == name)
  compiles: list[float] = []

  def on_event(event: str, seconds: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)

  step, args = entry.make()
  jax.monitoring.register_event_duration_secs_listener(on_event)
  t0 = time.perf_counter()
  try:
    res = jaxmem.fit(fraction, donate_argnums=entry.donate)(step).fit_result(*args)
    out: dict[str, Any] = dict(outcome="fits", peak_mib=round(res.peak_bytes / MiB, 2),
                               rounds=res.rounds)
  except jaxmem.BudgetError as e:
    out = dict(outcome="BudgetError", peak_mib=round(e.smallest_bytes / MiB, 2))
    smallest = e.smallest_bytes
  out["fit_s"] = round(time.perf_counter() - t0, 1)
  out["compiles"] = len(compiles)
  out["compile_s"] = round(sum(compiles), 1)
  if ask and out["outcome"] == "BudgetError":
    try:
      asked = jaxmem.fit(smallest, donate_argnums=entry.donate)(step).fit_result(*args)
      out.update(asked_mib=round(asked.peak_bytes / MiB, 2), asked_met=asked.peak_bytes <= smallest)
    except jaxmem.BudgetError as e:
      out.update(asked_mib=round(e.smallest_bytes / MiB, 2), asked_met=False)
  return out


def measure(name: str, fraction: float, package_root: pathlib.Path, ask: bool = False
            ) -> dict[str, Any]:
  """``time_fit`` in a fresh process that imports ``jaxmem`` from ``package_root``."""
  # This checkout after ``package_root``: a baseline's worktree has no built
  # extension, and jaxmem loads the one it finds there (`_installed_native`).
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(package_root), str(ROOT), os.environ.get("PYTHONPATH", "")]))
  # An editable install's import finder (scikit-build-core's) comes before the
  # path: without it, ``jaxmem`` is imported from ``package_root``.
  code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
          "if not type(f).__name__.startswith('ScikitBuild')]; "
          f"import json; sys.path.insert(0, {str(HERE)!r}); import fit_times; "
          f"print('RESULT ' + json.dumps(fit_times.time_fit({name!r}, {fraction!r}, {ask!r}))); "
          f"import jaxmem; print('PACKAGE ' + jaxmem.__file__)")
  # Run from the package's folder: `python -c` puts the working directory first on the path.
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        check=False, cwd=package_root)
  lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines()
               if line.startswith(("RESULT ", "PACKAGE ")))
  if "RESULT" not in lines:
    raise RuntimeError(f"{name} at {fraction} failed:\n{proc.stderr[-3000:]}")
  if not pathlib.Path(lines["PACKAGE"]).resolve().is_relative_to(package_root.resolve()):
    raise RuntimeError(f"measured jaxmem from {lines['PACKAGE']}, not from {package_root}")
  return json.loads(lines["RESULT"])


def _budget_errors(sets: list[str]) -> list[str]:
  """``NAME@FRACTION`` of every ``BudgetError`` in the last corpus runs of ``sets``.

  The sets, their results files and the two budgets are ``bench/corpus_bench.py``'s.
  """
  from corpus_bench import FRACTION, LOW, SETS
  out = []
  for which in sets:
    if which not in SETS:
      raise SystemExit(f"`--budget-errors`: unknown set {which!r}; pick from {sorted(SETS)}")
    rows = json.loads((RESULTS / f"{SETS[which][1]}.json").read_text())["rows"]
    for r in rows:
      if r.get("fit") == "BudgetError":
        out.append(f"{r['name']}@{FRACTION}")
      if r.get("low") == "BudgetError":
        out.append(f"{r['name']}@{LOW}")
  return out


def _short(ref: str) -> str:
  """The short hash of git ref ``ref``."""
  return subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True,
                        text=True, check=True).stdout.strip()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", default=",".join(SLOWEST),
                      help="NAME or NAME@FRACTION, comma-separated (NAME: all of --fractions)")
  parser.add_argument("--fractions", default="0.5,0.3")
  parser.add_argument("--baseline", default="", help="a git ref to time beside this checkout")
  parser.add_argument("--budget-errors", default="",
                      help="instead of --steps: every step and budget whose last corpus run "
                           "(these sets' results files, comma-separated) ended in a BudgetError")
  parser.add_argument("--ask", action="store_true",
                      help="ask this checkout for every BudgetError's smallest reachable peak")
  parser.add_argument("--out", default="fit_times",
                      help="results file name in bench/results/ (without .json/.md)")
  opts = parser.parse_args()
  sys.path.insert(0, str(HERE))
  from _results import commit
  from corpus import EVERY, all_entries
  known = {e.name for e in all_entries(EVERY)}
  cases = []
  if opts.budget_errors:
    opts.steps = ",".join(_budget_errors(opts.budget_errors.split(",")))
  for item in (s for s in opts.steps.split(",") if s):
    name, _, at = item.partition("@")
    if name not in known:
      raise SystemExit(f"`--steps`: unknown step {name!r}; the corpus has {sorted(known)}")
    cases += [(name, float(f)) for f in (at.split() if at else opts.fractions.split(","))]

  import jax
  meta = dict(jax=jax.__version__, commit=commit(check_import=False),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  if opts.budget_errors:
    meta["budget-errors"] = opts.budget_errors
  elif opts.steps != ",".join(SLOWEST):
    meta["steps"] = opts.steps
    meta["fractions"] = opts.fractions
  if opts.ask:
    meta["ask"] = True
  with tempfile.TemporaryDirectory() as tmp:
    roots = {"this": ROOT}
    if opts.baseline:
      meta["baseline"] = _short(opts.baseline)
      worktree = pathlib.Path(tmp) / "baseline"
      subprocess.run(["git", "worktree", "add", "--detach", str(worktree), opts.baseline],
                     cwd=ROOT, check=True, capture_output=True)
      roots = {"baseline": worktree, "this": ROOT}
    rows = []
    try:
      for i, (name, fraction) in enumerate(cases):
        row: dict[str, Any] = dict(step=name, fraction=fraction)
        for which, root in roots.items():
          print(f"[{i + 1}/{len(cases)}] {name} at {fraction}, {which} ...", flush=True)
          row[which] = measure(name, fraction, root, ask=opts.ask and which == "this")
          print("  " + json.dumps(row[which]), flush=True)
        rows.append(row)
    finally:
      if opts.baseline:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT,
                       check=False, capture_output=True)
  RESULTS.mkdir(parents=True, exist_ok=True)
  meta["out"] = opts.out
  (RESULTS / f"{opts.out}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (RESULTS / f"{opts.out}.md").write_text(render(meta, rows))
  print(render(meta, rows))


def _cell(r: dict[str, Any]) -> str:
  return (f"{r['outcome']} {r['peak_mib']} | {r['compiles']} | {r['fit_s']}")


def _asked(r: dict[str, Any]) -> str:
  """The ``--ask`` cell: the peak a budget of the error's figure compiled to."""
  if "asked_mib" not in r:
    return ""
  return f"{r['asked_mib']} {'met' if r['asked_met'] else 'NOT MET'}"


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
  over = sum(r["this"]["fit_s"] > LIMIT_S for r in rows)
  base = "baseline" in meta
  args = "".join(f" --{k} {meta[k]}" for k in ("steps", "fractions", "budget-errors", "baseline")
                 if k in meta)
  args += " --ask" if meta.get("ask") else ""
  if meta.get("out", "fit_times") != "fit_times":
    args += f" --out {meta['out']}"
  head = (f"`python bench/fit_times.py{args}` "
          f"jax {meta['jax']}, commit `{meta['commit']}`, {meta['machine']}: wall time of "
          "`jaxmem.fit` (tracing, planning, rewriting, compiling, checking), in a fresh "
          "process per measurement; the outcome is the compiled peak in MiB, or the "
          "`BudgetError`'s smallest reachable peak; compiles are XLA's (the unplanned step's "
          "included).")
  what = ("chosen" if "steps" in meta else "the `BudgetError`s of the last runs on"
          if "budget-errors" in meta else "the slowest")
  lines = [f"# `fit` time on {what} corpus steps (`bench/fit_times.py`)", "", head, ""]
  summary = f"* Over {LIMIT_S:.0f} s: **{over} of {len(rows)}** at `{meta['commit']}`"
  if base:
    was = sum(r["baseline"]["fit_s"] > LIMIT_S for r in rows)
    same = sum((r["baseline"]["outcome"], r["baseline"]["peak_mib"])
               == (r["this"]["outcome"], r["this"]["peak_mib"]) for r in rows)
    total = [sum(r[w]["fit_s"] for r in rows) for w in ("baseline", "this")]
    comp = [sum(r[w]["compiles"] for r in rows) for w in ("baseline", "this")]
    summary += (f", {was} of {len(rows)} at `{meta['baseline']}`; all steps together "
                f"{total[0]:.0f} s -> {total[1]:.0f} s, {comp[0]} -> {comp[1]} compiles; "
                f"the same outcome and peak on {same} of {len(rows)}.")
  asked = [r["this"] for r in rows if "asked_mib" in r["this"]]
  if asked:
    summary += (f" Asked for, the smallest reachable peak of each `BudgetError` was met on "
                f"**{sum(a['asked_met'] for a in asked)} of {len(asked)}**.")
  if base:
    both = [r for r in rows if r["baseline"]["outcome"] == r["this"]["outcome"] == "BudgetError"]
    lower = sum(r["this"]["peak_mib"] < r["baseline"]["peak_mib"] for r in both)
    higher = sum(r["this"]["peak_mib"] > r["baseline"]["peak_mib"] for r in both)
    newly = sum(r["baseline"]["outcome"] == "BudgetError" and r["this"]["outcome"] == "fits"
                for r in rows)
    summary += (f" Of the {len(both)} `BudgetError`s of both, {lower} report a lower smallest "
                f"peak now and {higher} a higher one; {newly} budgets fit now that did not.")
  lines += [summary, ""]
  ask_col = " asked for |" if asked else ""
  ask_sep = "---|" if asked else ""
  if base:
    lines += [f"| step | budget | `{meta['baseline']}`: outcome | compiles | fit s "
              f"| `{meta['commit']}`: outcome | compiles | fit s |{ask_col}",
              "|---|---|---|---|---|---|---|---|" + ask_sep]
    lines += [f"| {r['step']} | {r['fraction']} | {_cell(r['baseline'])} | {_cell(r['this'])} |"
              + (f" {_asked(r['this'])} |" if asked else "") for r in rows]
  else:
    lines += [f"| step | budget | outcome | compiles | fit s |{ask_col}",
              "|---|---|---|---|---|" + ask_sep]
    lines += [f"| {r['step']} | {r['fraction']} | {_cell(r['this'])} |"
              + (f" {_asked(r['this'])} |" if asked else "") for r in rows]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
