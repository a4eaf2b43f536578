"""DenseNet-BC (flax linen, BatchNorm with batch statistics) trained with optax SGD momentum.

Every dense layer reads the concatenation of all earlier feature maps of its
block, so a naive step stores a quadratic number of bytes per block: the
concatenations and their BatchNorm/ReLU outputs are cheap to recompute and
expensive to keep (Pleiss et al., "Memory-efficient implementation of
DenseNets"). The default configuration is DenseNet-121 (blocks (6, 12, 24, 16),
growth rate k=32, bottleneck 4k, compression 0.5); the full-size ImageNet step
is meant for ``jaxmem.analyze`` / planning / simulation (``build(...,
abstract=True)`` gives shape-only arguments, nothing allocated); small sizes run
on the CPU.

Run: ``python examples/densenet.py [--batch 16] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import batchnorm_classifier, remat_block, run_example

DENSENET_121 = (6, 12, 24, 16)


class DenseLayer(nn.Module):
  """BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k): the ``k`` new feature maps of one dense layer."""
  growth: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = nn.Conv(4 * self.growth, (1, 1), use_bias=False)(nn.relu(norm()(x)))
    return nn.Conv(self.growth, (3, 3), use_bias=False)(nn.relu(norm()(y)))


class Transition(nn.Module):
  """BN-ReLU-Conv1x1 to ``channels``, then a 2x2 average pool."""
  channels: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.Conv(self.channels, (1, 1), use_bias=False)(x)
    return nn.avg_pool(x, (2, 2), strides=(2, 2))


class DenseNet(nn.Module):
  blocks: tuple[int, ...] = DENSENET_121   # dense layers per block
  growth: int = 32                         # k: feature maps each dense layer adds
  compression: float = 0.5                 # channel reduction of every transition
  classes: int = 1000
  small_input: bool = False   # CIFAR-style stem (3x3 conv, no max_pool) for small images
  remat_policy: str | None = None          # per-dense-layer nn.remat with this JAX policy

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    layer = remat_block(DenseLayer, self.remat_policy, static_argnums=(2,))
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    if self.small_input:
      x = nn.Conv(2 * self.growth, (3, 3), use_bias=False)(x)
    else:
      x = nn.Conv(2 * self.growth, (7, 7), 2, padding=[(3, 3), (3, 3)], use_bias=False)(x)
      x = nn.relu(norm()(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, n in enumerate(self.blocks):
      for _ in range(n):
        x = jnp.concatenate([x, layer(self.growth)(x, train)], axis=-1)
      if i < len(self.blocks) - 1:
        x = Transition(int(x.shape[-1] * self.compression))(x, train)
    x = nn.relu(norm()(x))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.classes)(x)


def build(batch_size: int = 64, image_size: int = 224, blocks: Sequence[int] = DENSENET_121,
          growth: int = 32, compression: float = 0.5, classes: int = 1000, seed: int = 0,
          abstract: bool = False,
          remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full SGD-momentum train step ``step(params, batch_stats, opt_state, images, labels)``.

  Args:
    batch_size: images per step.
    image_size: side of the square synthetic RGB images; 64 or less selects
      the CIFAR-style stem.
    blocks: dense layers per block (DenseNet-121: ``(6, 12, 24, 16)``; e.g.
      ``(2, 2)`` for a tiny test net).
    growth: the growth rate k (channels each dense layer adds; the bottleneck
      1x1 convolution has 4k).
    compression: channel fraction kept by every transition (0.5 in DenseNet-BC).
    classes: output classes.
    seed: seed of the parameters and the synthetic batch.
    abstract: return ``jax.ShapeDtypeStruct`` arguments (for ``jaxmem.analyze``
      and planning at full size without allocating or initialising anything).
    remat_policy: recompute every dense layer with this ``jax.checkpoint_policies``
      name (the by-hand baseline).

  Returns:
    ``(step, (params, batch_stats, opt_state, images, labels))``; the step
    returns the updated parameters, batch statistics and optimizer state, and
    the loss.
  """
  model = DenseNet(tuple(blocks), growth, compression, classes, small_input=image_size <= 64,
                   remat_policy=remat_policy)
  return batchnorm_classifier(model, optax.sgd(0.1, momentum=0.9, nesterov=True), batch_size,
                              image_size, classes, seed, abstract)


def main() -> None:
  run_example(partial(build, image_size=32, blocks=(4, 4, 4), growth=12, classes=10),
              default_batch=16, doc=__doc__)


if __name__ == "__main__":
  main()
