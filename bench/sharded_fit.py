"""Per-device budgets under a mesh: `jaxmem.fit(0.5)` of sharded steps, verified per device.

Parallel layouts of the examples' models (and of MLP blocks), each fitted to half of its
unplanned compiled peak *per device* and checked on the compiled executable:

* **DP + FSDP ResNet**: the batch split over one mesh axis, every kernel and
  its optimizer state split along its first dimension that divides evenly
  (parameters gathered for use by the partitioner, as FSDP does).
* **TP transformer** (Megatron-style): a ``data x model`` mesh; the batch over
  ``data``; query/key/value and the MLP's first kernel split by output
  (heads, columns) over ``model``, the attention output and the MLP's second
  kernel by input.
* **TP MLP blocks written with** ``with_sharding_constraint`` **or**
  ``shard_map`` (``bench/tp_blocks.py``; CPU only): the two other ways JAX
  code splits matmuls over a ``model`` axis.

On 8 CPU devices (``--xla_force_host_platform_device_count=8``, the ``ffi``
backend: jaxmem's ops on each device's shard) the fitted step is also run
and its results compared with plain ``jax.jit``'s. On a 4-chip TPU v5e
(``tpu:v5e:2x2``, compiled ahead of time with shape-only arguments; the
``xla`` backend) at sizes whose unplanned per-device peak is over 1 GiB.

For each: the unplanned per-device peak, jaxmem's estimate of it (error),
the fitted peak and its fraction, the plan's decisions, planning time, and
(CPU) whether results are bit-identical to ``jax.jit`` or only within float
rounding (``allclose`` at rtol 1e-5, atol 1e-6 on every leaf but the
attention key bias, whose gradient is exactly zero in exact arithmetic and
whose adam update is float noise).

Run: ``python bench/sharded_fit.py [--only cpu|tpu]`` (``--only`` keeps the other part's
rows of an earlier run); writes
``bench/results/sharded_fit.{json,md}``. About 30 minutes on 2 CPUs (the
ResNet-50 on the TPU target most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
MiB = 2 ** 20

# What each case builds: (example module, build keywords, layout).
CPU_CASES = {
    "resnet18_dp_fsdp": ("resnet", dict(batch_size=64, depth=18, image_size=64, width=16,
                                        classes=16), "fsdp"),
    "gpt_tp": ("transformer", dict(batch_size=16, seq_len=128, vocab=256, dim=256, heads=8,
                                   layers=4), "tp"),
    # The decoder blocks as one `nn.scan` over stacked parameters: fit rewrites
    # the scan to recompute part of its residuals per iteration.
    "gpt_scan_tp": ("transformer", dict(batch_size=16, seq_len=128, vocab=256, dim=256, heads=8,
                                        layers=8, scan_layers=True), "tp"),
    # MLP blocks split over "model" by activation constraints (weights left
    # for the partitioner to place) or written with shard_map (bench/tp_blocks.py).
    "mlp_tp_constraints": ("tp_blocks", dict(form="constraints"), "as built"),
    "mlp_tp_shard_map": ("tp_blocks", dict(form="shard_map"), "as built"),
}
TPU_CASES = {
    "resnet50_dp_fsdp": ("resnet", dict(batch_size=128, depth=50, image_size=224, abstract=True),
                         "fsdp"),
    "gpt_tp": ("transformer", dict(batch_size=64, seq_len=256, vocab=256, dim=512, heads=8,
                                   layers=8), "tp"),
}


def _layout(kind: str, args: tuple[Any, ...], mesh: Any, place: Any) -> tuple[Any, ...]:
  """The step's arguments laid out over ``mesh``; ``place(leaf, spec)`` puts one leaf."""
  import jax
  from jax.sharding import PartitionSpec as P
  from _common import fsdp_spec
  from transformer import tensor_parallel_spec
  if kind == "fsdp":
    axis = mesh.axis_names[0]
    *state, x, y = args
    return (*jax.tree.map(lambda a: place(a, fsdp_spec(a, mesh.shape[axis], axis)), tuple(state)),
            place(x, P(axis)), place(y, P(axis)))
  params, opt, tokens = args
  tp = lambda path, a: place(a, tensor_parallel_spec(path, a))  # noqa: E731
  return (jax.tree_util.tree_map_with_path(tp, params), jax.tree_util.tree_map_with_path(tp, opt),
          place(tokens, P("data")))


def _compare_results(out: Any, ref: Any) -> str:
  import jax
  import numpy as np
  flat_out = jax.tree_util.tree_flatten_with_path(out)[0]
  flat_ref = jax.tree.leaves(ref)
  if all(np.array_equal(x, y) for (_, x), y in zip(flat_out, flat_ref)):
    return "bit-identical"
  bad = [jax.tree_util.keystr(p) for (p, x), y in zip(flat_out, flat_ref)
         if not np.allclose(x, y, rtol=1e-5, atol=1e-6) and "['key']['bias']" not in
         jax.tree_util.keystr(p)]
  if not bad:
    return "float rounding"
  # Adam divides each gradient by its own root mean square, so a last-bit
  # difference in a gradient that is noise (zero in exact arithmetic) moves
  # its parameter by a full step: the first moment, linear in the
  # gradients, tells rounding from a wrong result.
  # (An attention key's bias has no gradient in exact arithmetic: noise.)
  moments = [(x, y) for (p, x), y in zip(flat_out, flat_ref)
             if ".mu" in jax.tree_util.keystr(p) and "['key']['bias']" not in jax.tree_util.keystr(p)]
  if moments:
    worst = max(float(np.max(np.abs(np.asarray(x, np.float64) - y)))
                / max(float(np.max(np.abs(y))), 1e-30) for x, y in moments)
    if worst <= 1e-5:
      return (f"float rounding ({len(bad)} parameters moved by adam; its first moment agrees "
              f"to {worst:.0e} of each leaf's largest)")
  return f"DIFFERENT ({len(bad)} leaves)"


def run_case(where: str, name: str, budget: float) -> dict[str, Any]:
  """One case in this process (XLA_FLAGS / TPU environment already set)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  sys.path.insert(0, str(HERE.parent / "examples"))
  import jaxmem
  from jaxmem._src.estimate.targets import get_target
  module, kw, kind = (CPU_CASES if where == "cpu" else TPU_CASES)[name]
  sys.path.insert(0, str(HERE))
  mod = __import__(module)
  target = None
  if where == "cpu":
    devices = np.array(jax.devices()[:8])
    mesh_shape = (8,) if kind == "fsdp" else (2, 4)

    def place(a: Any, spec: Any) -> Any:
      return jax.device_put(a, NamedSharding(mesh, spec))
  else:
    target = "tpu:v5e:2x2"
    devices = np.array(get_target(target).devices)
    mesh_shape = (4,) if kind == "fsdp" else (2, 2)

    def place(a: Any, spec: Any) -> Any:
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  names = ("data",) if kind == "fsdp" else ("data", "model")
  mesh = jax.sharding.Mesh(devices.reshape(mesh_shape), names)
  if kind == "as built":     # the step places its own arguments over the mesh
    step, args = mod.build(mesh, **kw)
  else:
    step, args = mod.build(**kw)
    if where != "cpu":
      args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    args = _layout(kind, args, mesh, place)
  row: dict[str, Any] = dict(where=where, case=name, mesh=dict(mesh.shape), budget=budget)
  t0 = time.perf_counter()
  cmp = jaxmem.compare(step, *args, target=target, verbose=False)
  row.update(unplanned_mib=cmp.compiled.peak_bytes / MiB,
             estimate_mib=cmp.estimated_peak_bytes / MiB,
             estimate_error=cmp.relative_error, compare_s=time.perf_counter() - t0)
  print(f"[{where}/{name}] unplanned {row['unplanned_mib']:.1f} MiB per device, estimate "
        f"{row['estimate_mib']:.1f} ({row['estimate_error']:+.1%})", flush=True)
  fitted = jaxmem.fit(budget, target=target, verbose=True)(step)
  t0 = time.perf_counter()
  try:
    res = fitted.fit_result(*args)
  except jaxmem.BudgetError as e:
    row.update(fitted=False, error=str(e).splitlines()[0], fit_s=time.perf_counter() - t0,
               floor_mib=e.smallest_bytes / MiB)
    print(f"[{where}/{name}] BudgetError: {row['error']}", flush=True)
    return row
  row.update(fitted=True, fit_s=time.perf_counter() - t0, peak_mib=res.peak_bytes / MiB,
             budget_mib=res.budget_bytes / MiB, fraction=res.peak_bytes / res.unplanned_peak_bytes,
             backend=res.backend, rounds=res.rounds, remat=res.plan.num_remat,
             offload=res.plan.num_offload, host_mib=res.memory.host_temp_bytes / MiB)
  if where == "cpu":
    reference, against = step, "jax.jit"
    out = fitted(*args)
    if res.scans.startswith("recomputed by cost"):
      # Part of each block recomputed: no JAX policy computes the same, and
      # adamw's first update is lr * sign(g), which flips where a gradient is
      # rounding noise. The largest difference after that step is reported
      # (the gradients themselves: tests/api/test_sharded_fit.py).
      ref = jax.jit(step)(*args)
      worst = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                  for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
      row["results"] = f"max abs difference {worst:.1e} to jax.jit after one adamw step"
    else:
      if res.scans:   # the scans' residuals recomputed: JAX's policy on the scanned block
        policy = "dots_saveable" if "matmul" in res.scans else "nothing_saveable"
        reference = mod.build(**kw, remat_policy=policy)[0]
        against = f"nn.remat({policy})"
      row["results"] = f"{_compare_results(out, jax.jit(reference)(*args))} to {against}"
    row["scans"] = res.scans
  print(f"[{where}/{name}] fit({budget}): {row['peak_mib']:.1f} MiB ({row['fraction']:.2f}) in "
        f"{row['fit_s']:.0f} s, {row.get('results', '')}", flush=True)
  return row


def _subprocess(where: str, name: str, budget: float) -> dict[str, Any]:
  env = dict(os.environ)
  if where == "cpu":
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  else:
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  proc = subprocess.run([sys.executable, __file__, "--case", where, name, str(budget)], env=env,
                        capture_output=True, text=True, check=False)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[") or ln.startswith("{")]
  for ln in lines:
    if not ln.startswith("{"):
      print(ln, flush=True)
  if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
    return dict(where=where, case=name, budget=budget, fitted=False,
                error=(proc.stderr.strip().splitlines() or ["?"])[-1])
  return json.loads(lines[-1])


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  out = ["# Per-device budgets under a mesh (`bench/sharded_fit.py`)", "",
         f"jax {meta['jax']}, commit `{meta['commit']}`, {meta['machine']}. CPU rows: 8 host "
         "devices, the `ffi` backend, results compared with `jax.jit`'s. TPU rows: a 4-chip v5e "
         "(`tpu:v5e:2x2`) compiled ahead of time from shape-only arguments, the `xla` backend. "
         "Peaks are per device, from the compiled executable's `memory_analysis()`.", "",
         "| where | step | mesh | unplanned peak | estimate (error) | fit(0.5) peak | fraction | "
         "decisions | planning | results |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    mesh = " x ".join(f"{k}={v}" for k, v in r.get("mesh", {}).items())
    est = (f"{r['estimate_mib']:.1f} MiB ({r['estimate_error']:+.1%})"
           if "estimate_mib" in r else "")
    if r.get("fitted"):
      dec = f"{r['remat']} remat, {r['offload']} offload"
      out.append(f"| {r['where']} | {r['case']} | {mesh} | {r['unplanned_mib']:.1f} MiB | {est} | "
                 f"{r['peak_mib']:.1f} MiB | {r['fraction']:.2f} | {dec} | {r['fit_s']:.0f} s | "
                 f"{r.get('results', 'not run (shape-only)')} |")
    else:
      unpl = f"{r['unplanned_mib']:.1f} MiB" if "unplanned_mib" in r else ""
      if "floor_mib" in r:      # an honest BudgetError: the smallest peak reachable
        why = (f"`BudgetError`: smallest reachable {r['floor_mib']:.1f} MiB "
               f"({r['floor_mib'] / r['unplanned_mib']:.2f})")
      else:
        why = f"**not fitted**: {r.get('error', '')}"
      out.append(f"| {r['where']} | {r['case']} | {mesh} | {unpl} | {est} | {why} | | | "
                 f"{r['fit_s']:.0f} s | |" if "fit_s" in r else
                 f"| {r['where']} | {r['case']} | {mesh} | {unpl} | {est} | {why} | | | | |")
  return "\n".join(out) + "\n"


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--case":
    where, name, budget = sys.argv[2], sys.argv[3], float(sys.argv[4])
    print(json.dumps(run_case(where, name, budget)), flush=True)
    return
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", choices=("cpu", "tpu"), default=None)
  p.add_argument("--budget", type=float, default=0.5)
  p.add_argument("--out", type=pathlib.Path, default=RESULTS)
  a = p.parse_args()
  sys.path.insert(0, str(HERE))
  from _results import commit, write_excerpt
  import jax
  rows = []
  for where, cases in (("cpu", CPU_CASES), ("tpu", TPU_CASES)):
    if a.only and a.only != where:
      continue
    for name in cases:
      rows.append(_subprocess(where, name, a.budget))
  meta = dict(jax=jax.__version__, commit=commit(), machine=f"{platform.machine()}, "
              f"{os.cpu_count()} CPUs")
  old = a.out / "sharded_fit.json"
  if a.only and old.exists():
    # Only one part rerun: the other part's rows stay, with the commit each ran at.
    prev = json.loads(old.read_text())
    for r in prev["rows"]:
      r.setdefault("commit", prev["meta"]["commit"])
    rows = [r for r in prev["rows"] if r["where"] != a.only] + [
        dict(r, commit=meta["commit"]) for r in rows]
    rows.sort(key=lambda r: r["where"])
    meta["commit"] = ", ".join(sorted({r["commit"] for r in rows}))
  a.out.mkdir(parents=True, exist_ok=True)
  (a.out / "sharded_fit.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  md = render(rows, meta)
  (a.out / "sharded_fit.md").write_text(md)
  head = md.split("\n", 2)[2]   # the table and its caption, without the title
  write_excerpt("sharded_fit", f"`python bench/sharded_fit.py` " + head, a.out)
  print(md)


if __name__ == "__main__":
  main()
