"""A small GPT-style causal language model (flax linen) trained with optax adamw under a budget.

Run: ``python examples/transformer.py [--batch 16] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import next_token_step, remat_block, run_example, tag


class DecoderBlock(nn.Module):
  dim: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = tag(self, nn.LayerNorm()(x), "ln1")
    x = x + tag(self, nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask),
                "attention")
    h = tag(self, nn.LayerNorm()(x), "ln2")
    hidden = tag(self, nn.Dense(4 * self.dim)(h), "mlp_in")
    return x + nn.Dense(self.dim)(tag(self, nn.gelu(hidden), "mlp_hidden"))


class ScannedBlock(nn.Module):
  """One decoder block as the body of ``nn.scan``: ``(x, None) -> (x, None)``."""
  dim: int
  heads: int
  remat_policy: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    block = remat_block(DecoderBlock, self.remat_policy)
    return block(self.dim, self.heads, name="DecoderBlock")(x), None


class GPT(nn.Module):
  vocab: int = 256
  dim: int = 128
  heads: int = 4
  layers: int = 4
  max_len: int = 128
  # Per-block nn.remat with this JAX policy (a by-hand baseline), or a policy
  # function such as jaxmem.policy(plan).policy over the blocks' tags.
  remat_policy: Any = None
  # The blocks as one `nn.scan` over stacked parameters (how large models are
  # written: the layer is traced and compiled once) instead of unrolled.
  scan_layers: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    pos = jnp.arange(tokens.shape[1])
    x = nn.Embed(self.vocab, self.dim)(tokens) + nn.Embed(self.max_len, self.dim)(pos)
    if self.scan_layers:
      blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=self.layers)
      x, _ = blocks(self.dim, self.heads, self.remat_policy, name="DecoderBlocks")(x, None)
    else:
      block = remat_block(DecoderBlock, self.remat_policy)
      for i in range(self.layers):
        x = block(self.dim, self.heads, name=f"DecoderBlock_{i}")(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def tensor_parallel_spec(path: Any, leaf: Any, axis: str = "model") -> jax.sharding.PartitionSpec:
  """Megatron-style tensor parallelism of one GPT parameter (or optimizer state) leaf.

  query/key/value and the MLP's first kernel split by output (heads,
  columns) over ``axis``, the attention output projection and the MLP's
  second kernel by input; the rest whole. Leaves of ``scan_layers=True``
  models have a leading layer dimension, left whole. Use with
  ``jax.tree_util.tree_map_with_path``.
  """
  P = jax.sharding.PartitionSpec
  k = jax.tree_util.keystr(path)
  stacked = "DecoderBlocks" in k
  ndim = leaf.ndim - stacked
  spec = P()
  if any(f"['{n}']" in k for n in ("query", "key", "value")):
    spec = P(None, axis, None) if ndim == 3 else P(axis, None)
  elif "['out']" in k and ndim == 3:
    spec = P(axis, None, None)
  elif "Dense_0" in k and "Block" in k:
    spec = P(None, axis) if ndim == 2 else P(axis)
  elif "Dense_1" in k and "Block" in k and ndim == 2:
    spec = P(axis, None)
  return P(None, *spec) if stacked and spec != P() else spec


def build(batch_size: int = 16, seq_len: int = 128, vocab: int = 256, dim: int = 128,
          heads: int = 4, layers: int = 4, seed: int = 0,
          remat_policy: Any = None, scan_layers: bool = False,
          ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adamw train step ``step(params, opt_state, tokens)`` (next-token loss) and its arguments.

  ``remat_policy``: recompute every decoder block with this ``jax.checkpoint_policies``
  name (the by-hand baseline). ``scan_layers``: the blocks as one ``nn.scan``.
  """
  model = GPT(vocab, dim, heads, layers, seq_len, remat_policy, scan_layers)
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch_size, seq_len + 1), 0, vocab)
  params = model.init(jax.random.PRNGKey(seed + 1), tokens[:1, :-1])
  tx = optax.adamw(1e-3, weight_decay=1e-2)
  opt_state = tx.init(params)

  return next_token_step(model.apply, tx), (params, opt_state, tokens)


def main() -> None:
  run_example(build, default_batch=16, doc=__doc__)


if __name__ == "__main__":
  main()
