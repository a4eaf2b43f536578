"""flax nnx models written with `nnx.scan`: `jaxmem.fit` at 0.5 and 0.7, on the CPU and a TPU target.

Two stacked-layer models, their layers created by ``nnx.vmap`` and applied
by ``nnx.scan`` over stacked parameters:

* ``nnx_mlp``: the examples' nnx MLP with ``scan_layers=True`` (Linear + ReLU,
  softmax cross-entropy, optax adam), and JAX's policies by hand on the scanned
  layer (``nnx.remat``);
* ``tanh_sgd``: Linear + tanh layers, a sum-of-squares loss and a plain SGD
  update over ``nnx.split`` state (tests/api/test_fit.py's nnx.scan model).

On this machine's CPU (the ``ffi`` backend) at a small size, the fitted step
is run and compared with ``jax.jit``'s results; on a TPU v5e compiled ahead of
time (shape-only arguments, the ``xla`` backend) at a size whose unplanned
peak is over 1 GiB. ``fit`` rewrites a scan to recompute its residuals per
iteration (``jaxmem/_src/ir/scan_remat.py``); what stays is each iteration's
carry, stacked over the layers, as with ``nothing_saveable`` by hand. When
that is not enough, the stacks leave device memory one slice per iteration:
to host memory kinds on the TPU, to jaxmem's host store (our FFI ops) on the
CPU.

Run: ``python bench/nnx_scan.py [--render]``; writes ``bench/results/nnx_scan.{json,md}``
(``--render``: the tables again from the JSON).
About 5 minutes on 2 CPUs.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxmem  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))
import nnx_mlp  # noqa: E402
from _results import commit, flops_of, write_excerpt  # noqa: E402

RESULTS = HERE / "results"
MiB = 2 ** 20
SIZES = {"cpu": dict(batch_size=2048, width=256, depth=12),
         "tpu": dict(batch_size=16384, width=1024, depth=12)}


class _TanhBlock(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.tanh(self.linear(x))


class _TanhScanned(nnx.Module):
  def __init__(self, layers: int, width: int, rngs: nnx.Rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key: jax.Array) -> _TanhBlock:
      return _TanhBlock(width, nnx.Rngs(key))
    self.blocks = create(jax.random.split(rngs.params(), layers))

  def __call__(self, x: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def layer(x: jax.Array, block: _TanhBlock) -> jax.Array:
      return block(x)
    return layer(x, self.blocks)


def tanh_sgd(batch_size: int, width: int, depth: int, abstract: bool) -> tuple[Any, tuple[Any, ...]]:
  make = lambda: _TanhScanned(depth, width, nnx.Rngs(0))  # noqa: E731
  graphdef, params = nnx.split(nnx.eval_shape(make) if abstract else make())

  def step(params: Any, x: jax.Array) -> Any:
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

  x = (jax.ShapeDtypeStruct((batch_size, width), jnp.float32) if abstract
       else jax.random.normal(jax.random.PRNGKey(1), (batch_size, width)))
  if abstract:
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  return step, (params, x)


#: Budgets asked, as fractions of the unplanned compiled peak. At 0.7 a
#: point of the scan policy may keep some of its stacks on the device and
#: send only the others out (`ScanPair.on_device`).
FRACTIONS = (0.5, 0.7)


def build(model: str, where: str, policy: str | None = None) -> tuple[Any, tuple[Any, ...]]:
  abstract = where == "tpu"
  if model == "nnx_mlp":
    return nnx_mlp.build(**SIZES[where], scan_layers=True, abstract=abstract,
                         remat_policy=policy)
  return tanh_sgd(**SIZES[where], abstract=abstract)


def measure(model: str, where: str) -> list[dict[str, Any]]:
  target = "tpu:v5e" if where == "tpu" else None
  t = jaxmem.get_target(target)
  rows: list[dict[str, Any]] = []
  step, args = build(model, where)
  jit = jax.jit(step).lower(*t.place(args)).compile()
  base = jaxmem.compiled_memory(jit).peak_bytes
  base_flops = flops_of(jit)

  def add(method: str, peak: int | None, flops: float | None, **extra: Any) -> None:
    row = dict(model=model, where=where, method=method, **extra)
    if peak is not None:
      row.update(peak_mib=round(peak / MiB, 1), of_jit=round(peak / base, 2))
    if flops and base_flops:
      row["flops_x"] = round(flops / base_flops, 3)
    rows.append(row)
    print(json.dumps(row), flush=True)

  add("jit", base, base_flops)
  if model == "nnx_mlp":
    for policy in ("nothing_saveable", "dots_saveable"):
      s2, a2 = build(model, where, policy)
      c = jax.jit(s2).lower(*t.place(a2)).compile()
      add(f"nnx.remat({policy})", jaxmem.compiled_memory(c).peak_bytes, flops_of(c))
  for fraction in FRACTIONS:
    t0 = time.perf_counter()
    try:
      fitted = jaxmem.fit(fraction, target=target)(step)
      res = fitted.fit_result(*args)
      extra = dict(fit_s=round(time.perf_counter() - t0, 1), scans=res.scans,
                   within=res.peak_bytes <= res.budget_bytes)
      if where == "cpu":
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fitted(*args)),
                                                        jax.tree.leaves(jax.jit(step)(*args))))
        extra["results"] = "bit-identical" if same else "differ"
      add(f"fit({fraction})", res.peak_bytes, flops_of(fitted.lower(*args).compile()), **extra)
    except jaxmem.BudgetError as e:
      add(f"fit({fraction})", None, None,
          error=f"BudgetError: smallest {e.smallest_bytes / MiB:.1f} MiB "
          f"({e.smallest_bytes / base:.2f})", fit_s=round(time.perf_counter() - t0, 1))
  return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
  out = ["# `nnx.scan` models under `jaxmem.fit` (`bench/nnx_scan.py`)", "",
         f"jax {meta['jax']}, commit `{meta['commit']}`, {meta['machine']}. CPU: "
         f"{SIZES['cpu']} (the `ffi` backend; fitted results compared with `jax.jit`'s). TPU: "
         f"{SIZES['tpu']} on a v5e compiled ahead of time (the `xla` backend). Peaks from the "
         "compiled executable; FLOPs from its `cost_analysis()`, relative to `jax.jit`'s.", "",
         "| model | where | method | compiled peak | of jit | FLOPs | notes |",
         "|---|---|---|---|---|---|---|"]
  for r in rows:
    peak = f"{r['peak_mib']:.1f} MiB" if "peak_mib" in r else "—"
    notes = "; ".join(str(r[k]) for k in ("error", "scans", "results") if r.get(k))
    if "fit_s" in r:
      notes += f"{'; ' if notes else ''}{r['fit_s']:.0f} s"
    out.append(f"| {r['model']} | {r['where']} | {r['method']} | {peak} | {r.get('of_jit', '')} | "
               f"{r.get('flops_x', '')} | {notes} |")
  return "\n".join(out) + "\n"


def main() -> None:
  if "--render" in sys.argv:   # the tables again from the results file
    doc = json.loads((RESULTS / "nnx_scan.json").read_text())
    meta, rows = doc["meta"], doc["rows"]
  else:
    rows = []
    for where in ("cpu", "tpu"):
      for model in ("nnx_mlp", "tanh_sgd"):
        rows += measure(model, where)
    meta = dict(jax=jax.__version__, commit=commit(),
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "nnx_scan.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  md = render(rows, meta)
  (RESULTS / "nnx_scan.md").write_text(md)
  write_excerpt("nnx_scan", "`python bench/nnx_scan.py` " + md.split("\n", 2)[2])
  print(md)


if __name__ == "__main__":
  main()
