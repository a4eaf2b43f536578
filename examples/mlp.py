"""An 8-layer flax MLP trained with optax adam, fitted to half its compiled peak.

Run: ``python examples/mlp.py [--batch 8192] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (batch_size, width), jnp.float32)
  y = jax.random.randint(ky, (batch_size,), 0, classes)
  params = model.init(kp, x[:1])
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)

  def step(params, opt_state, x, y):
    def loss_fn(p):
      logits = model.apply(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, x, y)


def main() -> None:
  import jaxmem
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--batch", type=int, default=8192)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--budget", default="0.5")
  a = p.parse_args()
  budget = float(a.budget) if a.budget.replace(".", "", 1).isdigit() else a.budget
  step, (params, opt_state, x, y) = build(a.batch)
  fitted = jaxmem.fit(budget, verbose=True)(step)
  for i in range(a.steps):
    params, opt_state, loss = fitted(params, opt_state, x, y)
    print(f"step {i}: loss {float(loss):.4f}")
  print(fitted.fit_result(params, opt_state, x, y).summary())


if __name__ == "__main__":
  main()
