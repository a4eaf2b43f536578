"""A small flax nnx CNN (conv-BatchNorm-relu blocks, max-pool, dense head) trained with optax adam.

The ``cnn.py`` model written with ``flax.nnx``, plus BatchNorm. The train step
is a pure function of arrays: the module is split once into its graph
definition (closed over), its ``nnx.Param`` state and its ``nnx.BatchStat``
state, and merged back inside the step; the updated batch statistics are read
back with ``nnx.state`` and returned, as ``resnet.py`` threads ``batch_stats``.

Run: ``python examples/nnx_cnn.py [--batch 64] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from _common import run_example
from flax import nnx
from nnx_mlp import remat_call


class ConvBlock(nnx.Module):
  """Two 3x3 conv-BatchNorm-ReLU layers, then a 2x2 max-pool."""

  def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(cout, cout, (3, 3), use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(self.bn2(self.conv2(x)))
    return nnx.max_pool(x, (2, 2), strides=(2, 2))


def _apply(block: ConvBlock, x: jax.Array) -> jax.Array:
  return block(x)


class CNN(nnx.Module):
  """Conv blocks of ``channels``, a 128-wide hidden dense layer and a classifier."""

  def __init__(self, image_size: int, channels: Sequence[int], classes: int, *, rngs: nnx.Rngs,
               remat_policy: str | None = None):
    cins = (3, *channels[:-1])
    self.blocks = nnx.List([ConvBlock(a, b, rngs=rngs) for a, b in zip(cins, channels)])
    side = image_size // 2 ** len(channels)
    self.hidden = nnx.Linear(side * side * channels[-1], 128, rngs=rngs)
    self.head = nnx.Linear(128, classes, rngs=rngs)
    self.remat_policy = remat_policy

  def __call__(self, x: jax.Array) -> jax.Array:
    block_fn = remat_call(_apply, self.remat_policy)
    for block in self.blocks:
      x = block_fn(block, x)
    x = x.reshape((x.shape[0], -1))
    return self.head(nnx.relu(self.hidden(x)))


def build(batch_size: int = 64, image_size: int = 32, channels: Sequence[int] = (32, 64, 64),
          classes: int = 10, seed: int = 0, abstract: bool = False,
          remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, batch_stats, opt_state, images, labels)``.

  Args:
    batch_size: images per step.
    image_size: side of the square synthetic RGB images (a multiple of
      ``2 ** len(channels)``).
    channels: output channels of every conv block.
    classes: output classes.
    seed: seed of the parameters and the synthetic batch.
    abstract: return ``jax.ShapeDtypeStruct`` arguments (``nnx.eval_shape``:
      nothing allocated or initialised).
    remat_policy: recompute every conv block with this ``jax.checkpoint_policies``
      name (``nnx.remat``, the by-hand baseline).

  Returns:
    ``(step, (params, batch_stats, opt_state, images, labels))``; the step
    returns the updated parameters, batch statistics and optimizer state, and
    the loss.
  """
  def make() -> CNN:
    return CNN(image_size, tuple(channels), classes, rngs=nnx.Rngs(seed),
               remat_policy=remat_policy)

  model = nnx.eval_shape(make) if abstract else make()
  graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  tx = optax.adam(1e-3)

  def step(params, batch_stats, opt_state, images, labels):
    def loss_fn(p):
      # copy=True: fresh Variables inside this trace. Without it nnx.merge reuses the
      # argument's BatchStat objects, which BatchNorm then mutates from inside
      # jax.grad (a TraceContextError) and, run eagerly, in the caller's state.
      net = nnx.merge(graphdef, p, batch_stats, copy=True)
      logits = net(images)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, nnx.state(net, nnx.BatchStat)
    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, loss

  img_shape = (batch_size, image_size, image_size, 3)
  if abstract:
    return step, (params, batch_stats, jax.eval_shape(tx.init, params),
                  jax.ShapeDtypeStruct(img_shape, jnp.float32),
                  jax.ShapeDtypeStruct((batch_size,), jnp.int32))
  kx, ky = jax.random.split(jax.random.PRNGKey(seed), 2)
  images = jax.random.normal(kx, img_shape, jnp.float32)
  labels = jax.random.randint(ky, (batch_size,), 0, classes)
  return step, (params, batch_stats, tx.init(params), images, labels)


def main() -> None:
  run_example(build, default_batch=64, doc=__doc__)


if __name__ == "__main__":
  main()
