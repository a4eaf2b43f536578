"""An 8-layer flax MLP trained with optax adam, fitted to half its compiled peak.

Run: ``python examples/mlp.py [--batch 8192] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import classifier_step, run_example


class MLP(nn.Module):
  width: int = 512
  depth: int = 8
  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(self.classes)(x)


def build(batch_size: int = 8192, width: int = 512, depth: int = 8, classes: int = 10,
          seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, opt_state, x, y)`` and its arguments."""
  model = MLP(width, depth, classes)
  kx, ky = jax.random.split(jax.random.PRNGKey(seed), 2)
  x = jax.random.normal(kx, (batch_size, width), jnp.float32)
  y = jax.random.randint(ky, (batch_size,), 0, classes)
  return classifier_step(model, x, y, optax.adam(1e-3), seed)


def main() -> None:
  run_example(build, default_batch=8192, doc=__doc__)


if __name__ == "__main__":
  main()
