"""A character-level LSTM language model (flax linen) trained with optax adam under a budget.

By default every layer is unrolled with a Python loop over the time steps, so
each step's gates and states are separate values in the program that jaxmem can
keep, recompute or offload one by one. ``scan=True`` runs each layer as
``nn.RNN`` (an ``nn.scan`` over time) instead: one ``scan`` block whose
residuals are stacked over time. The full-size step (vocabulary 128, 2 layers of
512, 128 characters, batch 64) is meant for ``jaxmem.analyze`` / planning /
simulation (``build(..., abstract=True)``); small sizes run on the CPU.

Run: ``python examples/lstm.py [--batch 64] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import initial_state, next_token_step, remat_block, run_example


class CharLSTM(nn.Module):
  vocab: int = 128
  embed: int = 64
  hidden: int = 512
  layers: int = 2
  scan: bool = False                # nn.RNN (nn.scan over time) instead of a Python loop
  remat_policy: str | None = None   # per-cell-step nn.remat with this JAX policy (a baseline)

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cell_cls = remat_block(nn.OptimizedLSTMCell, self.remat_policy)
    x = nn.Embed(self.vocab, self.embed)(tokens)          # [batch, time, embed]
    for layer in range(self.layers):
      cell = cell_cls(self.hidden, name=f"lstm_{layer}")
      if self.scan:
        x = nn.RNN(cell)(x)
        continue
      zeros = jnp.zeros((x.shape[0], self.hidden), x.dtype)
      carry, ys = (zeros, zeros), []
      for t in range(x.shape[1]):
        carry, y = cell(carry, x[:, t])
        ys.append(y)
      x = jnp.stack(ys, axis=1)
    return nn.Dense(self.vocab)(x)


def build(batch_size: int = 64, seq_len: int = 128, vocab: int = 128, embed: int = 64,
          hidden: int = 512, layers: int = 2, scan: bool = False, seed: int = 0,
          abstract: bool = False,
          remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, opt_state, tokens)`` (next-character loss).

  Args:
    batch_size: sequences per step.
    seq_len: characters predicted per sequence (``tokens`` has ``seq_len + 1``).
    vocab: character vocabulary (128: ASCII).
    embed: embedding width.
    hidden: LSTM state width of every layer.
    layers: stacked LSTM layers.
    scan: run each layer as ``nn.RNN`` (``nn.scan``) instead of unrolling it.
    seed: seed of the parameters and the synthetic tokens.
    abstract: return ``jax.ShapeDtypeStruct`` arguments (for ``jaxmem.analyze``
      and planning at full size without allocating or initialising anything).
    remat_policy: recompute every cell step with this ``jax.checkpoint_policies``
      name (the by-hand baseline).

  Returns:
    ``(step, (params, opt_state, tokens))``.
  """
  model = CharLSTM(vocab, embed, hidden, layers, scan, remat_policy)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(2e-3))
  tok_shape = (batch_size, seq_len + 1)

  def init(key: jax.Array) -> tuple[Any, Any]:
    params = model.init(key, jnp.zeros((1, seq_len), jnp.int32))
    return params, tx.init(params)

  step = next_token_step(model.apply, tx)
  params, opt_state = initial_state(init, jax.random.PRNGKey(seed + 1), abstract)
  if abstract:
    return step, (params, opt_state, jax.ShapeDtypeStruct(tok_shape, jnp.int32))
  tokens = jax.random.randint(jax.random.PRNGKey(seed), tok_shape, 0, vocab)
  return step, (params, opt_state, tokens)


def main() -> None:
  run_example(partial(build, seq_len=16, hidden=128, layers=2), default_batch=64, doc=__doc__)


if __name__ == "__main__":
  main()
