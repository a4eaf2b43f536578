"""jaxmem's estimate on train steps computed in 16-bit floats, against XLA:CPU's compiled peak.

XLA:CPU has no 16-bit float matmul: a ``bfloat16`` or ``float16`` dot reads
float32 copies of its operands and writes a float32 result
(``jaxmem/_src/estimate/xla_model.py``: ``dot_layout_copies``,
``stored_var_bytes``). The rule was found on one corpus step (the novel set's
``bf16/lm-dropout-s``); these steps were written to check it, not to tune
it: MLPs computed in ``bfloat16`` from float32 parameters (flax's ``dtype``)
with and without biases, in ``float16`` from float32 parameters, with
``float16`` and ``bfloat16`` parameters throughout, self-attention with
``bfloat16`` parameters, and a ``bfloat16`` CNN (convolutions and max
pooling, which the rule does not cover).

Run: ``python bench/half_precision.py`` (a minute on 2 CPUs); writes
``bench/results/half_precision.{json,md}``. ``--before REF`` also measures
the package of commit ``REF`` (a temporary git worktree, imported from there
in a fresh process) and puts it beside this checkout.
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

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MiB = 2 ** 20


def cases() -> dict:
  """``{name: (step, args)}``: adam or SGD steps of small flax models in 16 bits."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  bf = jnp.bfloat16

  def train(model, x, y, params_dtype=jnp.float32, tx=None):
    tx = tx or optax.adam(1e-3)
    params = jax.tree.map(lambda p: p.astype(params_dtype),
                          model.init(jax.random.PRNGKey(0), x))

    def loss_fn(p, x, y):
      out = model.apply(p, x).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    def step(p, s, x, y):
      loss, g = jax.value_and_grad(loss_fn)(p, x, y)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss
    return step, (params, tx.init(params), x, y)

  class MLP(nn.Module):
    dtype: object
    width: int = 1024
    depth: int = 6
    bias: bool = True

    @nn.compact
    def __call__(self, x):
      for _ in range(self.depth):
        x = nn.relu(nn.Dense(self.width, dtype=self.dtype, use_bias=self.bias)(x))
      return nn.Dense(10, dtype=self.dtype)(x)

  class CNN(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x):
      for w in (32, 64, 64):
        x = nn.max_pool(nn.relu(nn.Conv(w, (3, 3), dtype=self.dtype)(x)), (2, 2), (2, 2))
      return nn.Dense(10, dtype=self.dtype)(x.reshape(x.shape[0], -1))

  class Attention(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x):
      x = nn.Embed(1000, 256, dtype=self.dtype)(x)
      for _ in range(2):
        x = x + nn.SelfAttention(4, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        h = nn.gelu(nn.Dense(1024, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)))
        x = x + nn.Dense(256, dtype=self.dtype)(h)
      return nn.Dense(1000, dtype=self.dtype)(x)

  rng = np.random.default_rng(0)
  x = lambda *shape, dtype=jnp.float32: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
  labels = lambda n: jnp.zeros(n, jnp.int32)  # noqa: E731
  return {
      "mlp, bfloat16 compute": train(MLP(bf), x(2048, 512), labels(2048)),
      "mlp, bfloat16 compute, no biases": train(MLP(bf, bias=False), x(2048, 512), labels(2048)),
      "mlp, float16 compute": train(MLP(jnp.float16, width=768, depth=5), x(1024, 512),
                                    labels(1024)),
      "mlp, bfloat16 throughout": train(MLP(bf, width=768), x(2048, 512, dtype=bf), labels(2048),
                                        bf, optax.sgd(1e-2)),
      "mlp, float16 throughout": train(MLP(jnp.float16), x(2048, 512, dtype=jnp.float16),
                                       labels(2048), jnp.float16, optax.sgd(1e-2)),
      "attention, bfloat16 throughout": train(
          Attention(bf), jnp.asarray(rng.integers(0, 1000, size=(8, 256)), jnp.int32),
          jnp.zeros((8, 256), jnp.int32), bf, optax.sgd(1e-2)),
      "cnn, bfloat16 compute": train(CNN(bf), x(64, 32, 32, 3), labels(64)),
  }


def measure() -> list[dict]:
  """Each case's compiled peak and estimate, in this process."""
  import jax

  import jaxmem
  rows = []
  for name, (step, args) in cases().items():
    est = jaxmem.analyze(step, *args, donate_argnums=(0, 1)).peak_bytes
    compiled = jaxmem.compiled_memory(
        jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()).peak_bytes
    rows.append(dict(name=name, compiled_mib=round(compiled / MiB, 2),
                     estimate_mib=round(est / MiB, 2), error=round(est / compiled - 1, 4)))
    print(json.dumps(rows[-1]), flush=True)
  return rows


def _measured_at(ref: str) -> list[dict]:
  """:func:`measure` with the package of commit ``ref``, in a fresh process."""
  with tempfile.TemporaryDirectory() as tmp:
    tree = pathlib.Path(tmp) / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                   check=True, capture_output=True)
    try:
      code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import half_precision, json; "
              "print('ROWS' + json.dumps(half_precision.measure()))")
      out = subprocess.run([sys.executable, "-c", code], cwd=tree, check=True,
                           capture_output=True, text=True).stdout
    finally:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                     check=False, capture_output=True)
  return json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROWS")))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--before", default=None, help="a commit to measure beside this checkout")
  opts = parser.parse_args()
  import jax
  sys.path.insert(0, str(HERE))
  from _results import commit
  rows = measure()
  before = _measured_at(opts.before) if opts.before else None
  meta = dict(jax=jax.__version__, commit=commit(), before=opts.before,
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "half_precision.json").write_text(json.dumps(dict(meta=meta, rows=rows,
                                                               before=before), indent=1))
  head = ["| step | compiled peak (MiB) | estimate (MiB) | error |"
          + (f" at `{opts.before}` |" if before else ""),
          "|---|---|---|---|" + ("---|" if before else "")]
  for i, r in enumerate(rows):
    line = (f"| {r['name']} | {r['compiled_mib']:.1f} | {r['estimate_mib']:.1f} | "
            f"{100 * r['error']:+.1f}% |")
    if before:
      line += f" {100 * before[i]['error']:+.1f}% |"
    head.append(line)
  text = ("# jaxmem's estimate in 16-bit floats (`bench/half_precision.py`)\n\n"
          f"`python bench/half_precision.py{' --before ' + opts.before if before else ''}` jax "
          f"{meta['jax']}, commit `{meta['commit']}`, {meta['machine']}: `jaxmem.analyze`'s peak "
          "against XLA:CPU's compiled peak of plain `jax.jit` on steps written to check the "
          "16-bit matmul rule (none of them in the corpus).\n\n" + "\n".join(head) + "\n")
  (RESULTS / "half_precision.md").write_text(text)
  print(text)


if __name__ == "__main__":
  main()
