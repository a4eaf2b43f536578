"""Estimate vs compiled peak on the example models and user-style steps (target: within ±15%).

For each model: jaxmem's estimate (before compiling), the jaxpr-only estimate
(every jaxpr value stored), the compiled peak of plain ``jax.jit``
(``memory_analysis()``), and the relative error. Writes
bench/results/estimate_accuracy.{json,md}.

Run: ``python bench/estimate_accuracy.py``
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jaxmem  # noqa: E402
from _results import write_excerpt  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "api"))

# (label, module, factory, kwargs): the examples, then the user-style steps of
# tests/api/test_user_models.py (written without jaxmem in mind).
MODELS = [
    ("mlp 8x512, batch 8192", "mlp", "build", dict(batch_size=8192)),
    ("mlp 8x512, batch 2048", "mlp", "build", dict(batch_size=2048)),
    ("cnn max_pool, batch 64", "cnn", "build", dict(batch_size=64)),
    ("cnn max_pool, batch 128", "cnn", "build", dict(batch_size=128)),
    ("gpt 4x128, batch 16, seq 128", "transformer", "build", dict(batch_size=16)),
    ("gpt 4x128, batch 32, seq 128", "transformer", "build", dict(batch_size=32)),
    ("resnet-18, 64x64, batch 16", "resnet", "build",
     dict(batch_size=16, depth=18, image_size=64, classes=10)),
    ("resnet-50, 96x96, batch 8", "resnet", "build",
     dict(batch_size=8, depth=50, image_size=96, classes=10)),
    ("user: TrainState ResMLP", "test_user_models", "make_trainstate", {}),
    ("user: transformer encoder, adamw", "test_user_models", "make_transformer", {}),
    ("user: BatchNorm CNN, avg_pool", "test_user_models", "make_bn_cnn", {}),
    ("user: flax nnx MLP", "test_user_models", "make_nnx_mlp", {}),
]


def main() -> None:
  rows = []
  for label, module, factory, kw in MODELS:
    print(f"[{label}] ...", file=sys.stderr, flush=True)
    step, args = getattr(__import__(module), factory)(**kw)
    t = time.perf_counter()
    cmp = jaxmem.compare(step, *args, verbose=False)
    rows.append(dict(model=label, estimate=cmp.estimated_peak_bytes, jaxpr_only=cmp.jaxpr_peak_bytes,
                     compiled=cmp.compiled.peak_bytes, error=cmp.relative_error,
                     jaxpr_only_error=cmp.jaxpr_peak_bytes / cmp.compiled.peak_bytes - 1,
                     within=abs(cmp.relative_error) <= 0.15, seconds=time.perf_counter() - t,
                     notes=list(cmp.notes)))
  head = "| model | estimate MiB | compiled MiB | error | within ±15% | jaxpr-only MiB (error) |"
  lines = [head, "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['estimate'] / 2**20:.1f} | {r['compiled'] / 2**20:.1f} | "
                 f"{r['error']:+.1%} | {'yes' if r['within'] else 'NO'} | "
                 f"{r['jaxpr_only'] / 2**20:.1f} ({r['jaxpr_only_error']:+.1%}) |")
  table = "\n".join(lines)
  print(table)
  out = ROOT / "bench" / "results"
  out.mkdir(parents=True, exist_ok=True)
  meta = dict(jax=jax.__version__, backend=jax.default_backend(), date=time.strftime("%Y-%m-%d %H:%M"))
  (out / "estimate_accuracy.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "estimate_accuracy.md").write_text(
      f"# Estimate vs compiled peak\n\n`python bench/estimate_accuracy.py` — {meta}\n\n{table}\n")
  print(f"within ±15%: {sum(r['within'] for r in rows)}/{len(rows)}")
  excerpt = (f"`python bench/estimate_accuracy.py` (jax {meta['jax']}, {meta['backend']}, "
             f"{meta['date']}; `bench/results/estimate_accuracy.md`): **{sum(r['within'] for r in rows)}"
             f" of {len(rows)} within ±15%** of the compiled peak, before anything is compiled.\n\n"
             + table)
  print(f"wrote {write_excerpt('estimate_accuracy', excerpt)}")


if __name__ == "__main__":
  main()
