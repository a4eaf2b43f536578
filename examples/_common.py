"""Shared pieces of the example train steps: the optax steps, synthetic batches, and a CLI runner."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax


def remat_block(block: Any, remat_policy: str | Callable[..., Any] | None, **kw: Any) -> Any:
  """``block`` (a flax module class) under ``nn.remat`` with a JAX policy, or unchanged.

  The by-hand baseline users pick today: every block recomputed in the backward
  pass, saving what the policy allows (``"nothing_saveable"``,
  ``"dots_saveable"``, ``"offload_dot_with_no_batch_dims"``, ...). A callable
  is a policy itself, such as ``jaxmem.policy(plan).policy``, which decides
  the values the blocks tag with :func:`tag`.
  """
  if remat_policy is None:
    return block
  import flax.linen as nn
  if callable(remat_policy):
    return nn.remat(block, policy=remat_policy, **kw)
  policy = getattr(jax.checkpoint_policies, remat_policy)
  if remat_policy.startswith("offload"):
    policy = policy("device", "pinned_host")
  return nn.remat(block, policy=policy, **kw)


def tag(module: Any, x: jax.Array, what: str) -> jax.Array:
  """``x`` tagged ``"<module name>/<what>"`` with ``checkpoint_name`` (an identity).

  The names a ``jax.checkpoint`` policy decides by (``jaxmem.policy`` exports a
  plan over them). Blocks are given explicit names in the models (the names
  flax would pick), so a block keeps its tags and parameters under ``nn.remat``.
  """
  from jax.ad_checkpoint import checkpoint_name
  return checkpoint_name(x, f"{module.name}/{what}")


def optax_update(loss_fn: Callable[[Any], jax.Array], tx: Any, params: Any,
                 opt_state: Any) -> tuple[Any, Any, jax.Array]:
  """One optax step on ``loss_fn(params)``: ``(new_params, new_opt_state, loss)``."""
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy on integer labels (any label shape: per example or per pixel)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cross_entropy_step(apply: Callable[..., Any], tx: Any) -> Callable[..., Any]:
  """``step(params, opt_state, inputs, labels) -> (params, opt_state, loss)``.

  :func:`cross_entropy` of ``apply(params, inputs)``, updated by the optax
  transformation ``tx``.
  """
  def step(params, opt_state, inputs, labels):
    return optax_update(lambda p: cross_entropy(apply(p, inputs), labels), tx, params, opt_state)
  return step


def next_token_step(apply: Callable[..., Any], tx: Any) -> Callable[..., Any]:
  """``step(params, opt_state, tokens)``: :func:`cross_entropy` predicting ``tokens[:, 1:]``."""
  def step(params, opt_state, tokens):
    return optax_update(lambda p: cross_entropy(apply(p, tokens[:, :-1]), tokens[:, 1:]),
                        tx, params, opt_state)
  return step


def batchnorm_step(model: Any, tx: Any) -> Callable[..., Any]:
  """``step(params, batch_stats, opt_state, images, labels)`` for a model with BatchNorm.

  ``model.apply(..., train=True)`` updates the ``batch_stats`` collection; the
  step returns the new parameters, batch statistics, optimizer state and loss.
  """
  def step(params, batch_stats, opt_state, images, labels):
    def loss_fn(p):
      logits, updates = model.apply({"params": p, "batch_stats": batch_stats}, images,
                                    train=True, mutable=["batch_stats"])
      return cross_entropy(logits, labels), updates["batch_stats"]
    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, loss
  return step


def initial_state(init: Callable[[jax.Array], Any], key: jax.Array, abstract: bool) -> Any:
  """``init(key)`` compiled, or its shapes only (``abstract``: nothing allocated)."""
  return jax.eval_shape(init, key) if abstract else jax.jit(init)(key)


def image_batch(batch_size: int, image_size: int, label_shape: tuple[int, ...], classes: int,
                seed: int, abstract: bool) -> tuple[Any, Any]:
  """Synthetic NHWC float32 images and integer labels of ``label_shape`` below ``classes``.

  ``abstract``: ``jax.ShapeDtypeStruct`` placeholders instead.
  """
  img_shape = (batch_size, image_size, image_size, 3)
  if abstract:
    return (jax.ShapeDtypeStruct(img_shape, jnp.float32),
            jax.ShapeDtypeStruct(label_shape, jnp.int32))
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(kx, img_shape, jnp.float32),
          jax.random.randint(ky, label_shape, 0, classes))


def batchnorm_classifier(model: Any, tx: Any, batch_size: int, image_size: int, classes: int,
                         seed: int, abstract: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """:func:`batchnorm_step` and its arguments ``(params, batch_stats, opt_state, images, labels)``."""
  def init(key: jax.Array) -> tuple[Any, Any, Any]:
    variables = model.init(key, jnp.zeros((1, image_size, image_size, 3)), train=False)
    return variables["params"], variables["batch_stats"], tx.init(variables["params"])

  state = initial_state(init, jax.random.PRNGKey(seed), abstract)
  images, labels = image_batch(batch_size, image_size, (batch_size,), classes, seed, abstract)
  return batchnorm_step(model, tx), (*state, images, labels)


def image_task(model: Any, tx: Any, batch_size: int, image_size: int,
               label_shape: tuple[int, ...], classes: int, seed: int,
               abstract: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """:func:`cross_entropy_step` on images and its arguments ``(params, opt_state, images, labels)``."""
  def init(key: jax.Array) -> tuple[Any, Any]:
    params = model.init(key, jnp.zeros((1, image_size, image_size, 3)))
    return params, tx.init(params)

  state = initial_state(init, jax.random.PRNGKey(seed), abstract)
  images, labels = image_batch(batch_size, image_size, label_shape, classes, seed, abstract)
  return cross_entropy_step(model.apply, tx), (*state, images, labels)


def classifier_step(model: Any, inputs: jax.Array, labels: jax.Array, tx: Any,
                    seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """:func:`cross_entropy_step` of ``model`` and its arguments ``(params, opt_state, inputs, labels)``."""
  params = model.init(jax.random.PRNGKey(seed), inputs[:1])
  return cross_entropy_step(model.apply, tx), (params, tx.init(params), inputs, labels)


def fsdp_spec(leaf: Any, ways: int, axis: str = "data") -> jax.sharding.PartitionSpec:
  """FSDP: a parameter (or its optimizer state) split ``ways`` ways over ``axis``.

  Along its first dimension that divides evenly; vectors and leaves with no
  such dimension stay whole (replicated). The partitioner gathers each
  kernel for its use, as FSDP does.
  """
  P = jax.sharding.PartitionSpec
  dims = [d for d in range(leaf.ndim) if leaf.shape[d] % ways == 0] if leaf.ndim >= 2 else []
  return P(*[(axis if d == dims[0] else None) for d in range(leaf.ndim)]) if dims else P()


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
