"""The largest batch that fits a fixed budget: plain ``jax.jit``, JAX's remat policies, jaxmem.

For every model (CPU-sized configurations of examples/*.py) and a fixed
per-model budget, :func:`jaxmem.max_batch` searches the largest batch size whose
*compiled* peak fits, for

* plain ``jax.jit`` (the reference: ratio 1),
* JAX's built-in policies, through the factories' ``remat_policy=`` keyword
  (every block under ``nn.remat`` with ``nothing_saveable`` / ``dots_saveable``),
* ``jaxmem.fit`` with the planners ``greedy``, ``segments`` and ``auto``.

It is the analogue of Hayakawa et al.'s Table 1 (ResNet-50: the largest batch trainable in
16 GB, with and without out-of-core scheduling) and of vDNN's VGG-16 result
(batch 256 needing 28 GB trained on a 12 GB K40).

Each factory builds the step once and re-batches its data arguments (the images
and labels, or tokens) by repeating examples: the examples' ``build`` would
re-initialise the parameters (seconds per call) for every batch size tried. The
re-batched arguments are checked against the shapes of ``build(batch_size=B)``
(traced with ``jax.eval_shape``). Searches after the first start next to an
earlier answer (see ``search_near``): the policies at jit's max batch, segments
at greedy's, auto at the larger of greedy's and segments'. Every search still
ends with a batch size that fits next to one that does not.

Run: ``python bench/max_batch.py [--quick] [--models mlp,cnn]``; writes
bench/results/max_batch.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import pathlib
import sys
import time
import traceback
from typing import Any

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from _results import write_excerpt  # noqa: E402
import jaxmem  # noqa: E402

POLICIES = ("nothing_saveable", "dots_saveable")
PLANNERS = ("greedy", "segments", "auto")
METHODS = ("jit", *POLICIES, *PLANNERS)


@dataclasses.dataclass(frozen=True)
class Model:
  module: str
  kwargs: dict[str, Any]
  budget: str        # fixed budget: the unplanned jax.jit max batch is moderate
  data: int          # trailing arguments that carry the batch (images+labels: 2, tokens: 1)
  lo: int = 1        # where the jax.jit search starts
  note: str = ""


MODELS = {
    "mlp": Model("mlp", dict(width=64, depth=4), "1MiB", 2, lo=64,
                 note="4x64 MLP, adam"),
    "cnn": Model("cnn", dict(image_size=16, channels=(16, 32)), "4MiB", 2, lo=8,
                 note="2 conv blocks 16/32 ch, 16x16 images, adam"),
    "transformer": Model("transformer", dict(seq_len=32, vocab=64, dim=32, heads=2, layers=2),
                         "4MiB", 1, lo=8, note="GPT, 2 layers, dim 32, 32 tokens, adamw"),
    "resnet": Model("resnet", dict(depth=18, image_size=16, width=8, classes=10), "5.5MiB", 2,
                    lo=8, note="ResNet-18 (BatchNorm), width 8, 16x16 images, SGD-momentum"),
    "vgg": Model("vgg", dict(image_size=32, width=1 / 16, head=256, classes=10), "4MiB", 2,
                 lo=8, note="VGG-16 (13 conv + 3 dense), width 1/16, 32x32 images, SGD-momentum"),
    "unet": Model("unet", dict(image_size=16, depth=2, width=8, classes=4), "2.5MiB", 2, lo=8,
                  note="UNet, 2 levels, width 8, 16x16 images, adam"),
    "densenet": Model("densenet", dict(image_size=16, blocks=(2, 2), growth=8, classes=10),
                      "7MiB", 2, lo=8, note="DenseNet-BC (2, 2), growth 8, 16x16 images, SGD-momentum"),
    "lstm": Model("lstm", dict(seq_len=4, vocab=64, embed=16, hidden=64, layers=1), "1MiB", 1,
                  lo=16, note="char-LSTM, 1 layer of 64, 4 steps unrolled, adam"),
}
# Batch sizes above a planner's answer that an earlier run found to fit (the searches here
# stop at a batch that fits next to one that does not): re-checked in full runs.
PROBES = {"unet": ("auto", 27), "lstm": ("auto", 103)}
QUICK = ("mlp", "vgg")
QUICK_METHODS = ("jit", "nothing_saveable", "greedy", "auto")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _shapes(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), tree)


class Rebatch:
  """``factory(batch) -> (step, args)``: ``build`` once, then the data args re-batched.

  The data arguments (the last ``model.data`` ones) are repeated along axis 0 to
  the batch size asked for; parameters and optimizer state are the built ones.
  """

  def __init__(self, model: Model, built_batch: int = 4):
    self.model = model
    self.step, args = importlib.import_module(model.module).build(batch_size=built_batch,
                                                                   **model.kwargs)
    self.state, data = tuple(args[:-model.data]), tuple(args[-model.data:])
    for leaf in jax.tree_util.tree_leaves(data):
      assert leaf.shape[0] == built_batch, (model.module, leaf.shape)
    self.data = jax.tree_util.tree_map(np.asarray, data)

  def with_policy(self, remat_policy: str) -> Rebatch:
    """The same model with ``build(remat_policy=...)``'s step.

    That build is traced abstractly (no parameters initialised): when every leaf of
    its state has a leaf of this factory's state at the same path (``nn.remat``
    renames ``Block_0`` to ``CheckpointBlock_0``) with the same shape and dtype,
    those arrays are reused (the compiled peak depends on them only through shapes
    and dtypes); otherwise it is built.
    """
    mod = importlib.import_module(self.model.module)
    box: dict[str, Any] = {}

    def abstract_build() -> Any:
      box["step"], args = mod.build(batch_size=4, remat_policy=remat_policy, **self.model.kwargs)
      return args[:-self.model.data]

    state = jax.eval_shape(abstract_build)
    # nn.remat renames a block `Stage_0` to `CheckpointStage_0`; its parameters are the same.
    name = lambda path: jax.tree_util.keystr(path).replace("Checkpoint", "")
    mine = {name(p): x for p, x in jax.tree_util.tree_flatten_with_path(self.state)[0]}
    paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [mine.get(name(p)) for p, _ in paths]
    if len(mine) != len(leaves) or any(
        x is None or _shapes(x) != _shapes(want) for x, (_, want) in zip(leaves, paths)):
      return Rebatch(dataclasses.replace(
          self.model, kwargs={**self.model.kwargs, "remat_policy": remat_policy}))
    other = object.__new__(Rebatch)
    other.__dict__.update(self.__dict__, step=box["step"],
                          state=tuple(jax.tree_util.tree_unflatten(treedef, leaves)))
    return other

  def __call__(self, batch: int) -> tuple[Any, tuple[Any, ...]]:
    data = jax.tree_util.tree_map(
        lambda x: jax.numpy.asarray(np.resize(x, (batch, *x.shape[1:]))), self.data)
    return self.step, (*self.state, *data)


def has_remat_policy(model: Model) -> bool:
  return "remat_policy" in inspect.signature(importlib.import_module(model.module).build).parameters


def jit_peak(step: Any, args: tuple[Any, ...]) -> int:
  return jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes


def search(factory: Rebatch, budget: str, planner: str | None, lo: int,
           fallback_lo: int | None = None) -> tuple[jaxmem.MaxBatchResult, list[str]]:
  """``jaxmem.max_batch`` from ``lo``; when ``lo`` does not fit, again from ``fallback_lo``."""
  notes = []
  try:
    return jaxmem.max_batch(factory, budget, planner, lo=lo, verbose=True), notes
  except jaxmem.BudgetError:
    if fallback_lo is None or fallback_lo >= lo:
      raise
    notes.append(f"batch {lo} did not fit; searched again from {fallback_lo}")
  res = jaxmem.max_batch(factory, budget, planner, lo=fallback_lo, hi=lo - 1, verbose=True)
  return res, notes


def search_near(factory: Rebatch, budget: str, planner: str | None, guess: int, lo: int
                ) -> tuple[jaxmem.MaxBatchResult, list[str]]:
  """The max batch when it is probably near ``guess``: ``guess`` and one neighbour first.

  ``guess`` fits: ``guess + 1`` is tried; when it does not fit, ``guess`` is the answer
  (two compiles), else the search goes on upwards from ``guess + 1``. ``guess`` does not
  fit: ``guess - 1`` is tried; when it fits it is the answer, else the search runs from
  ``lo`` up to ``guess - 2``. Either way the answer fits and the next batch size was
  compiled and does not. The result's ``tried`` and ``seconds`` cover every search.
  """
  t0 = time.perf_counter()
  before: list[tuple[int, int | None, bool]] = []   # failures ahead of the last search
  try:
    first = jaxmem.max_batch(factory, budget, planner, lo=guess, hi=guess + 1, verbose=True)
  except jaxmem.BudgetError:
    before.append((guess, None, False))
    if guess <= lo:
      raise
    try:
      res = jaxmem.max_batch(factory, budget, planner, lo=guess - 1, hi=guess - 1, verbose=True)
      notes = [f"batch {guess} did not fit; {guess - 1} did"]
    except jaxmem.BudgetError:
      before.append((guess - 1, None, False))
      if guess - 1 <= lo:
        raise
      res = jaxmem.max_batch(factory, budget, planner, lo=lo, hi=guess - 2, verbose=True)
      notes = [f"batches {guess} and {guess - 1} did not fit; searched {lo}..{guess - 2}"]
    return (dataclasses.replace(res, tried=(*before, *res.tried), capped=False,
                                seconds=time.perf_counter() - t0), notes)
  if not first.capped:
    return first, []
  res = jaxmem.max_batch(factory, budget, planner, lo=guess + 1, verbose=True)
  return (dataclasses.replace(res, tried=first.tried + res.tried[1:],
                              seconds=time.perf_counter() - t0),
          [f"batch {guess + 1} fit too; searched on from {guess + 1}"])


def row_of(name: str, model: Model, method: str, res: jaxmem.MaxBatchResult | None,
           base: int | None, seconds: float, status: str = "ok", notes: list[str] | None = None
           ) -> dict[str, Any]:
  row: dict[str, Any] = dict(model=name, method=method, budget=model.budget,
                             budget_bytes=jaxmem.parse_budget(model.budget).bytes,
                             status=status, seconds=round(seconds, 2), notes=notes or [])
  if res is not None:
    row.update(batch=res.batch, peak_bytes=res.peak_bytes,
               ratio=round(res.batch / base, 3) if base else None,
               next_failure=res.next_failure, capped=res.capped,
               tried=[list(t) for t in res.tried])
  return row


def same_shapes(model: Model, factory: Rebatch, batch: int) -> bool:
  """The re-batched arguments have the shapes and dtypes of ``build(batch_size=batch)``'s.

  ``build`` is traced abstractly (``jax.eval_shape``: nothing initialised or
  compiled); the step depends on the batch only through its arguments' shapes.
  """
  build = importlib.import_module(model.module).build
  want = jax.eval_shape(lambda: build(batch_size=batch, **model.kwargs)[1])
  got = factory(batch)[1]
  key = lambda tree: [(tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(tree)]
  return key(want) == key(got)


def run_model(name: str, model: Model, methods: tuple[str, ...], probe: bool = False
              ) -> list[dict[str, Any]]:
  rows: dict[str, dict[str, Any]] = {}
  base: int | None = None
  log(f"== {name}: {model.note}; budget {model.budget}")
  t = time.perf_counter()
  plain = Rebatch(model)
  log(f"   built in {time.perf_counter() - t:.1f} s")
  found: dict[str, int] = {}
  for method in methods:
    jax.clear_caches()
    t = time.perf_counter()
    notes: list[str] = []
    try:
      if method == "jit":
        res, notes = search(plain, model.budget, None, model.lo, 1)
        base = res.batch
        notes.append(f"re-batched arguments = build(batch_size={base})'s shapes: "
                     f"{'yes' if same_shapes(model, plain, base) else 'NO'}")
      elif method in POLICIES:
        if not has_remat_policy(model):
          rows[method] = row_of(name, model, method, None, base, 0.0, "skipped",
                                [f"{model.module}.build has no remat_policy keyword"])
          log(f"   {method}: skipped ({model.module}.build has no remat_policy)")
          continue
        # On XLA:CPU the policies rarely move the compiled peak: try jit's max batch first.
        res, notes = search_near(plain.with_policy(method), model.budget, None, base or 1, 1)
      else:
        # jaxmem.fit compiles plain jax.jit when the step fits, so jit's max batch fits; the
        # planners searched before give a first guess (auto runs greedy's and segments'
        # rounds when its own plans do not fit, so it fits what they fit).
        lo = base or 1
        guess = max([found[p] for p in PLANNERS if p in found and found[p] >= lo], default=None)
        if guess is None:
          res = jaxmem.max_batch(plain, model.budget, method, lo=lo, verbose=True)
        else:
          res, notes = search_near(plain, model.budget, method, guess, lo)
      found[method] = res.batch
      rows[method] = row_of(name, model, method, res, base, time.perf_counter() - t, notes=notes)
      log(f"   {method}: max batch {res.batch} ({time.perf_counter() - t:.1f} s)")
    except Exception as e:  # noqa: BLE001 (recorded in the table, not fatal)
      msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      log(f"   {method}: {msg}\n{traceback.format_exc()}")
      rows[method] = row_of(name, model, method, None, base, time.perf_counter() - t, "error",
                            notes + [msg])
  if probe and name in PROBES and PROBES[name][0] in found:
    method, batch = PROBES[name]
    if batch > found[method] and rows[method]["status"] == "ok":
      t = time.perf_counter()
      try:
        res = jaxmem.max_batch(plain, model.budget, method, lo=batch, hi=batch, verbose=True)
        note = (f"probe: batch {batch} fits too (compiled peak {mib(res.peak_bytes)} MiB), "
                f"though {found[method] + 1} does not: fitting is not monotone in the batch size")
      except jaxmem.BudgetError:
        note = f"probe: batch {batch} does not fit either"
      rows[method]["notes"].append(note)
      rows[method]["probe"] = dict(batch=batch, fits=note.startswith(f"probe: batch {batch} fits"),
                                   seconds=round(time.perf_counter() - t, 2))
      log(f"   {note}")
  return [rows[m] for m in methods if m in rows]


def mib(n: int | None) -> str:
  return "-" if n is None else f"{n / 2**20:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
  head = "| model | budget | method | max batch | ratio to jit | compiled peak MiB | seconds |"
  lines = [head, "|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["status"] == "ok":
      batch = str(r["batch"]) + (" (capped)" if r.get("capped") else "")
      ratio = f"{r['ratio']:.2f}" if r.get("ratio") else "-"
      lines.append(f"| {r['model']} | {r['budget']} | {r['method']} | {batch} | {ratio} | "
                   f"{mib(r['peak_bytes'])} | {r['seconds']:.1f} |")
    else:
      what = r["status"] + (f": {r['notes'][-1]}" if r["notes"] else "")
      lines.append(f"| {r['model']} | {r['budget']} | {r['method']} | {what} | - | - | "
                   f"{r['seconds']:.1f} |")
  return "\n".join(lines)


def pivot(rows: list[dict[str, Any]]) -> str:
  """One row per model: jit's largest batch, then each method's as a ratio to it."""
  models = list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
  methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
  lines = ["| model (budget) | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
  for model, budget in models:
    cells = []
    for m in methods:
      r = next((r for r in rows if (r["model"], r["budget"], r["method"]) == (model, budget, m)),
               None)
      if r is None or r["status"] != "ok":
        cells.append("-")
      elif m == "jit":
        cells.append(str(r["batch"]))
      else:
        cells.append(f"{r['ratio']:.2f}x" if r.get("ratio") else "-")
    lines.append(f"| {model} ({budget}) | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  models = list(dict.fromkeys(r["model"] for r in rows))
  methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
  width = 0.8 / max(1, len(methods))
  fig, ax = plt.subplots(figsize=(1.4 * len(models) + 3, 4.2))
  for i, m in enumerate(methods):
    xs, ys = [], []
    for j, model in enumerate(models):
      r = next((r for r in rows if r["model"] == model and r["method"] == m), None)
      x = j + (i - (len(methods) - 1) / 2) * width
      if r is not None and r["status"] == "ok" and r.get("ratio"):
        xs.append(x)
        ys.append(r["ratio"])
      elif r is not None:   # skipped (no remat_policy) or an error: say so where the bar would be
        ax.text(x, 0.05, r["status"], rotation=90, ha="center", va="bottom", fontsize=7)
    ax.bar(xs, ys, width, label=m)
  ax.axhline(1.0, color="black", lw=0.8)
  ax.set_xticks(range(len(models)), models)
  ax.set_ylabel("max batch / jax.jit max batch")
  ax.set_title("Largest batch within a fixed budget (compiled peaks, XLA:CPU)")
  ax.legend(fontsize=8, ncol=len(methods), loc="upper center", bbox_to_anchor=(0.5, -0.08))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(rows: list[dict[str, Any]], meta: dict[str, Any], models: dict[str, Model],
          out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "max_batch.json", "w", encoding="utf-8") as f:
    json.dump(dict(meta=meta, models={k: dataclasses.asdict(v) for k, v in models.items()},
                   rows=rows), f, indent=1, default=str)
  lines = [
      "# Largest batch within a fixed budget",
      "",
      "The analogue of Hayakawa et al.'s Table 1 (the largest ResNet-50 batch trainable in a 16 GB "
      "budget, with and without out-of-core scheduling) and of vDNN's VGG-16 result "
      "(batch 256, 28 GB, trained on a 12 GB K40), on CPU-sized models: for each model and a "
      "fixed budget, the largest batch size whose **compiled** peak (`memory_analysis()`: "
      "arguments + outputs + temp - aliased) fits, found by `jaxmem.max_batch` "
      "(doubling, then bisection; every batch size compiled).",
      "",
      f"{meta}",
      "",
      "Methods: `jit` is plain `jax.jit` (ratio 1); `nothing_saveable` / `dots_saveable` are "
      "the example's blocks under `nn.remat` with that JAX policy (the factories' "
      "`remat_policy=`), compiled with plain `jax.jit`; `greedy`, `segments`, `auto` are "
      "`jaxmem.fit(budget, planner=...)` (offloaded bytes live in host memory, outside the "
      "budget, as in Hayakawa et al. and vDNN).",
      "",
      "Models (each factory builds the step once and repeats the data examples to every batch "
      "size, rather than re-initialising the parameters per batch size; the step depends on "
      "the batch only through the arguments' shapes, checked against `build(batch_size=B)` "
      "traced abstractly):",
      "",
  ]
  for k, m in models.items():
    lines.append(f"* `{k}`: {m.note}; `{m.module}.build({', '.join(f'{a}={v!r}' for a, v in m.kwargs.items())})`,"
                 f" budget {m.budget}")
  lines += ["", table(rows), "",
            "Search order per model: jit from a small batch (doubling, then bisection); each "
            "policy tries jit's max batch B and B + 1 first; greedy searches from B; segments "
            "tries greedy's max batch (and the next) first, auto the larger of greedy's and "
            "segments' (`jaxmem.fit(planner=\"auto\")` also runs greedy's and segments' rounds "
            "when its own plans do not fit). Every answer fits and the next batch size was "
            "compiled and does not; `seconds` covers the whole search.", ""]
  notes = [f"* {r['model']} / {r['method']}: {n}" for r in rows for n in r["notes"]
           if r["status"] == "ok"]
  if notes:
    lines += ["Notes:", ""] + notes + [""]
  lines += [
      "With a planner, whether a batch size fits is not monotone in the batch size: a plan "
      "that fits batch B may not exist for B + 1 while one exists for a larger batch (the probes "
      "in the notes re-check such batch sizes, found by an earlier run whose searches took "
      "other paths). Bisection then stops at a batch that fits next to one that does not, "
      "which is what the table reports; it is a lower bound on the largest batch that fits.",
      "",
      "On XLA:CPU `jax.checkpoint` policies barely change the compiled peak (docs/design.md, 'Why native ops': "
      "the CPU pipeline drops `optimization_barrier` and CSE merges the recomputation back "
      "into the forward pass), so their ratio stays near 1 here (not measured on a GPU, where "
      "XLA keeps the recomputation). jaxmem's plans are enforced by its native fence/offload/fetch ops, so they "
      "hold on the CPU too.",
      "",
      "Run: `python bench/max_batch.py` (`--quick`: mlp and vgg, four methods; "
      "`--models a,b`).",
  ]
  (out / "max_batch.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
  plot(rows, out / "max_batch.png")
  excerpt = (f"`python bench/max_batch.py` ({meta.get('date', '')}; `bench/results/max_batch.md`, plot "
             "`bench/results/max_batch.png`): the largest batch whose *compiled* peak fits a fixed "
             "budget, CPU-sized models, as a ratio to `jax.jit`'s; each figure is a lower bound "
             "(a batch that fits next to one that does not). `jit`: its largest batch; the other "
             "columns: the ratio to it.\n\n" + pivot(rows))
  print(f"wrote {write_excerpt('max_batch', excerpt, out)}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true",
                 help=f"models {', '.join(QUICK)} and methods {', '.join(QUICK_METHODS)}")
  p.add_argument("--models", default=None, help=f"comma-separated subset of {', '.join(MODELS)}")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"),
                 help="directory for max_batch.{json,md,png}")
  a = p.parse_args()
  names = a.models.split(",") if a.models else list(QUICK if a.quick else MODELS)
  unknown = [n for n in names if n not in MODELS]
  if unknown:
    p.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
  methods = QUICK_METHODS if a.quick else METHODS
  t0 = time.perf_counter()
  rows: list[dict[str, Any]] = []
  for name in names:
    rows += run_model(name, MODELS[name], methods, probe=not a.quick)
  meta = dict(jax=jax.__version__, backend=jax.default_backend(),
              date=time.strftime("%Y-%m-%d %H:%M"), quick=a.quick,
              total_s=round(time.perf_counter() - t0, 1))
  print(table(rows))
  print(f"\ntotal {meta['total_s']} s")
  write(rows, meta, {n: MODELS[n] for n in names}, pathlib.Path(a.out))


if __name__ == "__main__":
  main()
