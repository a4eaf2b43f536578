"""jaxmem on the corpus (``bench/corpus/``) for a target compiled ahead of time (XLA:GPU, XLA:TPU).

``bench/corpus_bench.py`` measures the corpus on this machine's CPU. This
bench measures the same train steps for an accelerator's compiler, on a
machine without that accelerator (``target="gpu:h100"`` needs jax's CUDA
plugin, ``pip install "jax[cuda12]"``; ``tpu:*`` needs ``jax[tpu]``), per
step and side by side in one run:

* the target's unplanned compiled peak (``jax.jit`` with the entry's donated
  arguments, lowered for the target) and jaxmem's estimate of it
  (``jaxmem.analyze(..., target=...)``);
* ``jaxmem.fit(0.5, target=...)``: the compiled peak reached, or the
  ``BudgetError``'s smallest reachable peak, and whether that figure is
  honest (``fit`` with it as the budget succeeds on the same target).

Results are not compared here: the ``xla`` backend's values on the CPU equal
``jax.jit``'s (``tests/lower/``), and a target compiled ahead of time runs
nothing. The corpus was written for the CPU (peaks of 4-200 MiB there); its
steps were not looked at while jaxmem's GPU rules were written.

Run: ``python bench/target_corpus.py --target gpu:h100 [--set heldout] [--only S]``;
writes ``bench/results/corpus_<target>.{json,md}`` (``heldout_<target>`` for
``--set heldout``); the JSON after every step, so a run stopped early keeps
its rows (``--render`` writes the table from it). About 1-2 minutes a step
on 2 CPUs (each ``fit`` compiles several plans with XLA:GPU, and a
``BudgetError``'s figure is fitted again).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

import jaxmem  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import commit  # noqa: E402
from corpus import FAMILIES, HELDOUT, all_entries  # noqa: E402
from corpus_bench import smallest_reached  # noqa: E402

MiB = 2 ** 20
FRACTION = 0.5
T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def measure(entry: Any, target: Any) -> dict[str, Any]:
  """One corpus step on ``target``: unplanned peak, estimate, ``fit(0.5)`` and its honesty."""
  row: dict[str, Any] = dict(name=entry.name, family=entry.family)
  t0 = time.perf_counter()
  step, args = entry.make()
  donate = entry.donate
  placed = target.place(tuple(args))
  base = jaxmem.compiled_memory(
      jax.jit(step, donate_argnums=donate).lower(*placed).compile()).peak_bytes
  row["unplanned_mib"] = round(base / MiB, 2)
  try:
    estimate = jaxmem.analyze(step, *args, donate_argnums=donate, target=target).peak_bytes
    row["estimate_mib"] = round(estimate / MiB, 2)
    row["estimate_error"] = round((estimate - base) / base, 4)
  except Exception as e:  # noqa: BLE001 (a failure is a result)
    row["estimate_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  t1 = time.perf_counter()
  try:
    res = jaxmem.fit(FRACTION, donate_argnums=donate, target=target)(step).fit_result(*args)
    row.update(fit="fits", fit_mib=round(res.peak_bytes / MiB, 2),
               fit_fraction=round(res.peak_bytes / base, 3), planner=res.plan.planner,
               backend=res.backend, scans=res.scans)
  except jaxmem.BudgetError as e:
    smallest = e.smallest_bytes
    row.update(fit="BudgetError", smallest_mib=round(smallest / MiB, 2),
               smallest_fraction=round(smallest / base, 3))
    row["fit_s"] = round(time.perf_counter() - t1, 1)
    row.update(smallest_reached(step, args, smallest, donate_argnums=donate, target=target))
  except Exception as e:  # noqa: BLE001
    row.update(fit="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    traceback.print_exc()
  row.setdefault("fit_s", round(time.perf_counter() - t1, 1))
  row["total_s"] = round(time.perf_counter() - t0, 1)
  return row


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
  est = [r for r in rows if "estimate_error" in r]
  fits = [r for r in rows if r.get("fit") == "fits"]
  errors = [r for r in rows if r.get("fit") == "BudgetError"]
  honest = [r for r in errors if r.get("smallest_reached")]
  within = sum(abs(r["estimate_error"]) <= 0.15 for r in est)
  total = meta.get("entries", len(rows))
  stopped = (f" **Stopped after {len(rows)} of {total} steps** (the run's time ran out; "
             "the steps are measured in the corpus's order)." if len(rows) < total else "")
  lines = [
      f"# The corpus on `{meta['target']}` ({meta['set']} set)",
      "",
      f"`{meta['command']}` ({meta['date']}, commit {meta['commit']}, jax {meta['jax']}; "
      f"compiled ahead of time on a CPU-only machine; the `xla` backend).{stopped}",
      "",
      f"* estimate within ±15% of the target's compiled peak: **{within} of {len(est)}** "
      f"(median error {statistics.median(r['estimate_error'] for r in est) * 100:+.1f}%)"
      if est else "* no estimate",
      f"* `fit({FRACTION})` fits **{len(fits)} of {len(rows)}**; "
      f"`BudgetError` on {len(errors)}, whose smallest reachable peak was reached when "
      f"asked for on **{len(honest)} of {len(errors)}**"
      + (f"; the target's compiler failed on {len(rows) - len(fits) - len(errors)} "
         "(the error is in the table)" if len(rows) > len(fits) + len(errors) else ""),
      "",
      "| step | unplanned | estimate (error) | fit(0.5) | planner | time |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows:
    est_s = (f"{r['estimate_mib']:.1f} MiB ({r['estimate_error'] * 100:+.1f}%)"
             if "estimate_mib" in r else f"failed: {r.get('estimate_failed', '')[:60]}")
    if r.get("fit") == "fits":
      fit_s = f"{r['fit_fraction']:.2f}"
    elif r.get("fit") == "BudgetError":
      fit_s = (f"BudgetError, smallest {r['smallest_fraction']:.2f} "
               f"({'reached' if r.get('smallest_reached') else 'NOT reached'})")
    else:
      fit_s = f"failed: {r.get('error', '')[:60]}"
    lines.append(f"| {r['name']} | {r['unplanned_mib']:.1f} MiB | {est_s} | {fit_s} | "
                 f"{r.get('planner', '')} | {r['total_s']:.0f} s |")
  return "\n".join(lines) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", default="gpu:h100")
  p.add_argument("--set", choices=("main", "heldout"), default="main")
  p.add_argument("--only", default="", help="measure the entries whose name contains this")
  p.add_argument("--render", action="store_true", help="the table again from the JSON")
  p.add_argument("--out", default=str(HERE / "results"))
  a = p.parse_args()
  stem = ("corpus" if a.set == "main" else "heldout") + "_" + a.target.replace(":", "_")
  out = pathlib.Path(a.out)
  if a.render:
    data = json.loads((out / f"{stem}.json").read_text())
    (out / f"{stem}.md").write_text(render(data["meta"], data["rows"]))
    return
  target = jaxmem.get_target(a.target)
  entries = all_entries(FAMILIES if a.set == "main" else HELDOUT)
  entries = [e for e in entries if a.only in e.name]
  command = f"python bench/target_corpus.py --target {a.target}" + (
      f" --set {a.set}" if a.set != "main" else "") + (f" --only {a.only}" if a.only else "")
  meta = dict(target=a.target, set=a.set, command=command, commit=commit(),
              jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"), entries=len(entries))
  # `--only` re-measures some entries: the others keep their rows and the
  # file keeps the full run's header, with this run noted under `updated`.
  previous = None
  if a.only and (out / f"{stem}.json").exists():
    previous = json.loads((out / f"{stem}.json").read_text())
    meta = dict(previous["meta"], updated=[*previous["meta"].get("updated", []),
                                           dict(command=command, commit=meta["commit"],
                                                date=meta["date"])])

  def merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if previous is None:
      return rows
    new = {r["name"]: r for r in rows}
    old = [r["name"] for r in previous["rows"]]
    return ([new.get(r["name"], r) for r in previous["rows"]]
            + [r for r in rows if r["name"] not in old])

  rows: list[dict[str, Any]] = []
  for k, entry in enumerate(entries):
    log(f"{k + 1}/{len(entries)} {entry.name}")
    try:
      rows.append(measure(entry, target))
    except Exception as e:  # noqa: BLE001 (the unplanned compile failed: a result too)
      traceback.print_exc()
      rows.append(dict(name=entry.name, family=entry.family, unplanned_mib=0.0, total_s=0.0,
                       fit="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    log(f"   {json.dumps(rows[-1])}")
    # Written after every step: a run stopped early keeps what it measured.
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=merged(rows)), indent=1)
                                      + "\n")
  text = render(meta, merged(rows))
  (out / f"{stem}.md").write_text(text)
  print(text)


if __name__ == "__main__":
  main()
