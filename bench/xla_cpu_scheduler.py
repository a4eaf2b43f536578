"""XLA:CPU's two schedulers on every corpus step: the compiled peak and step time of each.

XLA:CPU orders a program's instructions with one of two schedulers
(``CpuCompiler::CreateHloSchedule``): a breadth-first one "optimized for
extracting concurrency ... by trading off extra memory pressure", the default
in jax 0.10.2 (``xla_cpu_enable_concurrency_optimized_scheduler=true``), or
XLA's depth-first memory scheduler (``=false``). The option is read from the
process's ``XLA_FLAGS`` only: passed to ``.compile(compiler_options=...)`` it is
accepted and has no effect (measured with jax 0.10.2: a MobileNetV2 step
compiles to the same peak either way, 21.05 MiB, and to 10.9 MiB under the
flag), so ``jaxmem.fit`` cannot choose it per step, and this bench compiles
each setting in a subprocess of its own.

For each corpus step (all five sets): the compiled peak of plain ``jax.jit``
(``memory_analysis()``, donated arguments as the corpus entry says) and the
median wall time of the compiled step under each scheduler, and jaxmem's
estimate (``jaxmem.analyze``, which models the default) against each peak.
Writes ``bench/results/xla_cpu_scheduler.{json,md}``.

Run: ``python bench/xla_cpu_scheduler.py`` (about 40 minutes on 2 CPUs: a fresh process per
step and scheduler);
``--only NAME`` measures the steps whose name contains ``NAME`` and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
MiB = 2 ** 20
FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
#: Rows of a run that was interrupted, reused by the next (deleted when a run completes).
PARTIAL = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "jaxmem_xla_cpu_scheduler.partial.json"
#: Step runs timed per scheduler (after one warm-up run).
RUNS = 3


def _measure_child(name: str, out: str) -> None:
  """In a subprocess whose XLA_FLAGS pick the scheduler: one step's compiled peak and time."""
  import jax
  import jaxmem
  sys.path.insert(0, str(HERE))
  from corpus import EVERY, all_entries

  rows = {}
  entries = [e for e in all_entries(EVERY) if e.name == name]
  for entry in entries:
    step, args = entry.make()
    jitted = jax.jit(step, donate_argnums=entry.donate)
    compiled = jitted.lower(*args).compile()
    peak = jaxmem.compiled_memory(compiled).peak_bytes
    times = []
    for k in range(RUNS + 1):
      # Donated arguments are consumed by a run: every run gets fresh ones,
      # each leaf a buffer of its own (an actor-critic's target networks
      # start as the same arrays as its networks: donating one buffer twice
      # is an error).
      step, args = entry.make()
      args = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args)
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      if k:
        times.append(time.perf_counter() - t0)
    rows[entry.name] = dict(peak_mib=round(peak / MiB, 2),
                            step_ms=round(1e3 * statistics.median(times), 2))
  pathlib.Path(out).write_text(json.dumps(rows))


def _run_child(name: str, concurrency: bool, out: pathlib.Path) -> dict:
  """Step ``name`` measured in a fresh process under one scheduler."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if FLAG not in f)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{flags} --{FLAG}={'true' if concurrency else 'false'}".strip())
  subprocess.run([sys.executable, __file__, "--child", str(out), "--name", name], env=env,
                 check=True)
  return json.loads(out.read_text())[name]


def _estimates(only: str) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jaxmem
  sys.path.insert(0, str(HERE))
  from corpus import EVERY, all_entries

  out = {}
  for entry in all_entries(EVERY):
    if only in entry.name:
      step, args = entry.make()
      out[entry.name] = round(
          jaxmem.analyze(step, *args, donate_argnums=entry.donate).peak_bytes / MiB, 2)
  return out


def render(rows: list[dict], meta: dict) -> tuple[str, str]:
  """The full table and the README excerpt."""
  ratios = [r["dfs_mib"] / r["bfs_mib"] for r in rows]
  lower = [r for r in rows if r["dfs_mib"] < 0.95 * r["bfs_mib"]]
  higher = [r for r in rows if r["dfs_mib"] > 1.05 * r["bfs_mib"]]
  slow = [r["dfs_ms"] / r["bfs_ms"] for r in rows if r["bfs_ms"] > 0]
  within_bfs = sum(abs(r["estimate_mib"] / r["bfs_mib"] - 1) <= 0.10 for r in rows)
  within_dfs = sum(abs(r["estimate_mib"] / r["dfs_mib"] - 1) <= 0.10 for r in rows)
  summary = [
      f"`python bench/xla_cpu_scheduler.py` jax {meta['jax']}, commit `{meta['commit']}`, "
      f"{meta['machine']}: plain `jax.jit` of {len(rows)} corpus steps compiled under XLA:CPU's "
      f"breadth-first scheduler (the default) and its depth-first memory scheduler "
      f"(`XLA_FLAGS=--{FLAG}=false`)."
      + (f" Peaks and times of {meta['resumed']} (kept; they do not depend on jaxmem); "
         f"estimates of this commit." if meta.get("resumed") else ""),
      "",
      f"* Memory scheduler / default, compiled peak: median {statistics.median(ratios):.2f}, "
      f"from {min(ratios):.2f} to {max(ratios):.2f}; more than 5% lower on {len(lower)} of "
      f"{len(rows)} steps, more than 5% higher on {len(higher)}.",
      f"* Step time, memory scheduler / default: median {statistics.median(slow):.2f} "
      f"(from {min(slow):.2f} to {max(slow):.2f}; the median of {RUNS} runs of each, "
      f"on a shared machine).",
      f"* jaxmem's estimate (which models the default) within ±10% of the default's peak on "
      f"{within_bfs} of {len(rows)}, of the memory scheduler's on {within_dfs}.",
  ]
  table = ["| step | default: peak MiB | memory scheduler: peak MiB | ratio | default ms | "
           "memory scheduler ms | estimate vs default | estimate vs memory scheduler |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    table.append(
        f"| {r['name']} | {r['bfs_mib']:.1f} | {r['dfs_mib']:.1f} | "
        f"{r['dfs_mib'] / r['bfs_mib']:.2f} | {r['bfs_ms']:.1f} | {r['dfs_ms']:.1f} | "
        f"{100 * (r['estimate_mib'] / r['bfs_mib'] - 1):+.1f}% | "
        f"{100 * (r['estimate_mib'] / r['dfs_mib'] - 1):+.1f}% |")
  full = ("# XLA:CPU's schedulers on the corpus (`bench/xla_cpu_scheduler.py`)\n\n"
          + "\n".join(summary) + "\n\n" + "\n".join(table) + "\n")
  return full, "\n".join(summary) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="the steps whose name contains this")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--name", default=None, help=argparse.SUPPRESS)
  opts = parser.parse_args()
  if opts.child:
    _measure_child(opts.name, opts.child)
    return
  import tempfile
  import jax
  estimates = _estimates(opts.only)
  rows = []
  # Steps measured by an interrupted run (the compiled peaks and times do
  # not depend on jaxmem, only on jax and the corpus): kept, not measured again.
  done, resumed, source = {}, "", "an interrupted run of this script"
  if PARTIAL.exists() and not opts.only:
    saved = json.loads(PARTIAL.read_text())
    if saved["jax"] == jax.__version__:
      done = {r["name"]: r for r in saved["rows"]}
      source = saved.get("source", source)
      resumed = f"{len(done)} steps measured by {source}"
      print(f"{resumed} ({PARTIAL})")
  with tempfile.TemporaryDirectory(prefix="jaxmem-scheduler-") as tmp:
    # Each step under both schedulers, one after the other, so that their
    # times share the machine's state.
    for i, name in enumerate(estimates):
      if name in done:
        r = done[name]
        bfs = dict(peak_mib=r["bfs_mib"], step_ms=r["bfs_ms"])
        dfs = dict(peak_mib=r["dfs_mib"], step_ms=r["dfs_ms"])
      else:
        bfs = _run_child(name, True, pathlib.Path(tmp) / "bfs.json")
        dfs = _run_child(name, False, pathlib.Path(tmp) / "dfs.json")
      rows.append(dict(name=name, bfs_mib=bfs["peak_mib"], dfs_mib=dfs["peak_mib"],
                       bfs_ms=bfs["step_ms"], dfs_ms=dfs["step_ms"],
                       estimate_mib=estimates[name]))
      if not opts.only:
        PARTIAL.write_text(json.dumps(dict(
            jax=jax.__version__, source=source,
            rows=[{k: v for k, v in r.items() if k != "estimate_mib"} for r in rows]
            + [r for n, r in done.items() if n not in {x["name"] for x in rows}])))
      print(f"[{i + 1}/{len(estimates)}] {name:30} {bfs['peak_mib']:8.1f} -> {dfs['peak_mib']:8.1f}"
            f" MiB, {bfs['step_ms']:8.1f} -> {dfs['step_ms']:8.1f} ms", flush=True)
  sys.path.insert(0, str(HERE))
  from _results import commit, write_excerpt
  meta = dict(jax=jax.__version__, commit=commit(),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs", resumed=resumed)
  full, excerpt = render(rows, meta)
  if not opts.only:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "xla_cpu_scheduler.json").write_text(json.dumps(dict(meta=meta, rows=rows),
                                                               indent=1))
    (RESULTS / "xla_cpu_scheduler.md").write_text(full)
    PARTIAL.unlink(missing_ok=True)
    write_excerpt("xla_cpu_scheduler", excerpt)
  print(full)


if __name__ == "__main__":
  main()
