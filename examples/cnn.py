"""A small flax CNN (conv-relu-pool blocks, dense head) trained with optax adam under a budget.

Run: ``python examples/cnn.py [--batch 64] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import classifier_step, run_example


class CNN(nn.Module):
  channels: tuple[int, ...] = (32, 64, 64)
  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for c in self.channels:
      x = nn.relu(nn.Conv(c, (3, 3))(x))
      x = nn.relu(nn.Conv(c, (3, 3))(x))
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(self.classes)(x)


def build(batch_size: int = 64, image_size: int = 32, channels: tuple[int, ...] = (32, 64, 64),
          classes: int = 10, seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, opt_state, images, labels)`` and its arguments."""
  model = CNN(channels, classes)
  kx, ky = jax.random.split(jax.random.PRNGKey(seed), 2)
  images = jax.random.normal(kx, (batch_size, image_size, image_size, 3), jnp.float32)
  labels = jax.random.randint(ky, (batch_size,), 0, classes)
  return classifier_step(model, images, labels, optax.adam(1e-3), seed)


def main() -> None:
  run_example(build, default_batch=64, doc=__doc__)


if __name__ == "__main__":
  main()
