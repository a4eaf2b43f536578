"""Shared pieces of the example train steps: a classifier step with optax, and a CLI runner."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import optax


def remat_block(block: Any, remat_policy: str | None, **kw: Any) -> Any:
  """``block`` (a flax module class) under ``nn.remat`` with a JAX policy, or unchanged.

  The by-hand baseline users pick today: every block recomputed in the backward
  pass, saving what the policy allows (``"nothing_saveable"``,
  ``"dots_saveable"``, ``"offload_dot_with_no_batch_dims"``, ...).
  """
  if remat_policy is None:
    return block
  import flax.linen as nn
  policy = getattr(jax.checkpoint_policies, remat_policy)
  if remat_policy.startswith("offload"):
    policy = policy("device", "pinned_host")
  return nn.remat(block, policy=policy, **kw)


def classifier_step(model: Any, inputs: jax.Array, labels: jax.Array, tx: Any,
                    seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full train step ``step(params, opt_state, inputs, labels)`` and its arguments.

  Softmax cross-entropy on integer labels, gradient by ``jax.value_and_grad``,
  update by the optax transformation ``tx``.
  """
  apply = model.apply
  params = model.init(jax.random.PRNGKey(seed), inputs[:1])
  opt_state = tx.init(params)

  def step(params, opt_state, inputs, labels):
    def loss_fn(p):
      logits = apply(p, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, inputs, labels)


def run_example(build: Callable[..., Any], default_batch: int, doc: str | None) -> None:
  """``--batch --steps --budget``: train a few steps under ``jaxmem.fit`` and print the result."""
  import jaxmem
  p = argparse.ArgumentParser(description=doc)
  p.add_argument("--batch", type=int, default=default_batch)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--budget", default="0.5", help="bytes, '800MiB', or a fraction such as 0.5")
  a = p.parse_args()
  budget = float(a.budget) if a.budget.replace(".", "", 1).isdigit() and "." in a.budget else (
      int(a.budget) if a.budget.isdigit() else a.budget)
  step, args = build(batch_size=a.batch)
  fitted = jaxmem.fit(budget, verbose=True)(step)
  for i in range(a.steps):
    # The step returns its updated state (params, optimizer state, ...) then the loss;
    # the state replaces the leading arguments, the batch stays.
    *state, loss = fitted(*args)
    args = (*state, *args[len(state):])
    print(f"step {i}: loss {float(loss):.4f}")
  result = fitted.fit_result(*args)
  print(result.plan.summary())
  print(result.summary())
