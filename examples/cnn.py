"""A small flax CNN (conv-relu-pool blocks, dense head) trained with optax adam under a budget.

Run: ``python examples/cnn.py [--batch 64] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
  images = jax.random.normal(kx, (batch_size, image_size, image_size, 3), jnp.float32)
  labels = jax.random.randint(ky, (batch_size,), 0, classes)
  params = model.init(kp, images[:1])
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)

  def step(params, opt_state, images, labels):
    def loss_fn(p):
      logits = model.apply(p, images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, images, labels)


def main() -> None:
  import jaxmem
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--budget", default="0.5")
  a = p.parse_args()
  budget = float(a.budget) if a.budget.replace(".", "", 1).isdigit() else a.budget
  step, (params, opt_state, images, labels) = build(a.batch)
  fitted = jaxmem.fit(budget, verbose=True)(step)
  for i in range(a.steps):
    params, opt_state, loss = fitted(params, opt_state, images, labels)
    print(f"step {i}: loss {float(loss):.4f}")
  print(fitted.fit_result(params, opt_state, images, labels).summary())


if __name__ == "__main__":
  main()
