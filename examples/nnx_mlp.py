"""An 8-layer flax nnx MLP trained with optax adam, fitted to half its compiled peak.

The same model as ``mlp.py``, written with ``flax.nnx``. The train step is a
pure function of arrays: the module is split once into its graph definition
(closed over) and its ``nnx.Param`` state (an argument), and merged back
inside the step (``nnx.split`` / ``nnx.merge``), so ``jaxmem.fit`` sees plain
pytrees of arrays. optax updates the ``nnx.State`` directly.

Run: ``python examples/nnx_mlp.py [--batch 8192] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from _common import run_example
from flax import nnx


def remat_call(fn: Callable[..., Any], remat_policy: str | None) -> Callable[..., Any]:
  """``fn`` (a function of nnx modules and arrays) under ``nnx.remat`` with a JAX policy.

  The nnx counterpart of ``_common.remat_block``: unchanged when
  ``remat_policy`` is None, else recomputed in the backward pass, saving what
  the ``jax.checkpoint_policies`` entry of that name allows.
  """
  if remat_policy is None:
    return fn
  policy = getattr(jax.checkpoint_policies, remat_policy)
  if remat_policy.startswith("offload"):
    policy = policy("device", "pinned_host")
  return nnx.remat(fn, policy=policy)


def _dense_relu(layer: nnx.Linear, x: jax.Array) -> jax.Array:
  return nnx.relu(layer(x))


class MLP(nnx.Module):
  """``depth`` Linear+ReLU layers of ``width`` and a linear classifier.

  With ``scan_layers`` the hidden layers are one stacked ``nnx.Linear``
  (created by ``nnx.vmap``) applied by ``nnx.scan``, as flax's
  ``scan_over_layers`` example writes deep models: traced and compiled once.
  """

  def __init__(self, width: int, depth: int, classes: int, *, rngs: nnx.Rngs,
               remat_policy: str | None = None, scan_layers: bool = False):
    if scan_layers:
      @nnx.vmap(in_axes=0, out_axes=0)
      def create(key: jax.Array) -> nnx.Linear:
        return nnx.Linear(width, width, rngs=nnx.Rngs(key))
      self.layers = create(jax.random.split(rngs.params(), depth))
    else:
      self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
    self.head = nnx.Linear(width, classes, rngs=rngs)
    self.remat_policy = remat_policy
    self.scan_layers = scan_layers

  def __call__(self, x: jax.Array) -> jax.Array:
    layer_fn = remat_call(_dense_relu, self.remat_policy)
    if self.scan_layers:
      x = nnx.scan(layer_fn, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.layers, x)
    else:
      for layer in self.layers:
        x = layer_fn(layer, x)
    return self.head(x)


def build(batch_size: int = 8192, width: int = 512, depth: int = 8, classes: int = 10,
          seed: int = 0, abstract: bool = False, remat_policy: Any = None,
          scan_layers: bool = False) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, opt_state, x, y)`` and its arguments.

  Args:
    batch_size: examples per step.
    width: input and hidden width.
    depth: hidden layers.
    classes: output classes.
    seed: seed of the parameters and the synthetic batch.
    abstract: return ``jax.ShapeDtypeStruct`` arguments (``nnx.eval_shape``:
      nothing allocated or initialised).
    remat_policy: recompute every layer with this ``jax.checkpoint_policies``
      name (``nnx.remat``, the by-hand baseline).
    scan_layers: the hidden layers as one ``nnx.scan`` over stacked parameters.

  Returns:
    ``(step, (params, opt_state, x, y))`` with ``params`` an ``nnx.State`` of
    the model's ``nnx.Param`` variables.
  """
  def make() -> MLP:
    return MLP(width, depth, classes, rngs=nnx.Rngs(seed), remat_policy=remat_policy,
               scan_layers=scan_layers)

  model = nnx.eval_shape(make) if abstract else make()
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(1e-3)

  def step(params, opt_state, x, y):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  if abstract:
    return step, (params, jax.eval_shape(tx.init, params),
                  jax.ShapeDtypeStruct((batch_size, width), jnp.float32),
                  jax.ShapeDtypeStruct((batch_size,), jnp.int32))
  kx, ky = jax.random.split(jax.random.PRNGKey(seed), 2)
  x = jax.random.normal(kx, (batch_size, width), jnp.float32)
  y = jax.random.randint(ky, (batch_size,), 0, classes)
  return step, (params, tx.init(params), x, y)


def main() -> None:
  run_example(build, default_batch=8192, doc=__doc__)


if __name__ == "__main__":
  main()
