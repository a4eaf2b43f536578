"""An 8-layer flax MLP trained with optax adam, fitted to half its compiled peak.

Run: ``python examples/mlp.py [--batch 8192] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import classifier_step, remat_block, run_example


class Layer(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.relu(nn.Dense(self.width)(x))


class MLP(nn.Module):
  width: int = 512
  depth: int = 8
  classes: int = 10
  remat_policy: str | None = None   # per-layer nn.remat with this JAX policy (a baseline)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.remat_policy is None:
      for _ in range(self.depth):
        x = nn.relu(nn.Dense(self.width)(x))
    else:
      layer = remat_block(Layer, self.remat_policy)
      for _ in range(self.depth):
        x = layer(self.width)(x)
    return nn.Dense(self.classes)(x)


def build(batch_size: int = 8192, width: int = 512, depth: int = 8, classes: int = 10,
          seed: int = 0, remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, opt_state, x, y)`` and its arguments.

  ``remat_policy``: recompute every layer with this ``jax.checkpoint_policies``
  name (the by-hand baseline).
  """
  model = MLP(width, depth, classes, remat_policy)
  kx, ky = jax.random.split(jax.random.PRNGKey(seed), 2)
  x = jax.random.normal(kx, (batch_size, width), jnp.float32)
  y = jax.random.randint(ky, (batch_size,), 0, classes)
  return classifier_step(model, x, y, optax.adam(1e-3), seed)


def main() -> None:
  run_example(build, default_batch=8192, doc=__doc__)


if __name__ == "__main__":
  main()
