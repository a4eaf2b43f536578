"""ResNet-18/34/50/101 (flax linen, BatchNorm with batch statistics) trained with optax SGD momentum.

The papers measure themselves on ResNets (AutoSwap: ResNet50 4418 -> 2906 MB at
no overhead; Hayakawa et al.: ResNet-50 at batch 1440 on a 16 GB V100). The
full-size ImageNet step is meant for ``jaxmem.analyze`` / planning / simulation
(``build(..., abstract=True)`` gives shape-only arguments, nothing allocated);
small sizes run on the CPU.

Run: ``python examples/resnet.py [--batch 32] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import batchnorm_classifier, remat_block, run_example, tag

STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


class BasicBlock(nn.Module):
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = tag(self, nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x), "conv1")
    y = tag(self, nn.relu(norm()(y)), "relu1")
    y = tag(self, nn.Conv(self.filters, (3, 3), use_bias=False)(y), "conv2")
    y = norm(scale_init=nn.initializers.zeros)(y)
    if x.shape != y.shape:
      x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class Bottleneck(nn.Module):
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = tag(self, nn.Conv(self.filters, (1, 1), use_bias=False)(x), "conv1")
    y = tag(self, nn.relu(norm()(y)), "relu1")
    y = tag(self, nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(y), "conv2")
    y = tag(self, nn.relu(norm()(y)), "relu2")
    y = tag(self, nn.Conv(4 * self.filters, (1, 1), use_bias=False)(y), "conv3")
    y = norm(scale_init=nn.initializers.zeros)(y)
    if x.shape != y.shape:
      x = norm()(nn.Conv(4 * self.filters, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  depth: int = 50
  width: int = 64
  classes: int = 1000
  small_input: bool = False   # CIFAR-style stem (3x3 conv, no max_pool) for 32x32 images
  stages: tuple[int, ...] | None = None   # blocks per stage (default: STAGES[depth])
  remat_policy: Any = None   # per-block nn.remat: a JAX policy name (a baseline) or a policy

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    kind = Bottleneck if self.depth >= 50 else BasicBlock
    block = remat_block(kind, self.remat_policy, static_argnums=(2,))
    if self.small_input:
      x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
    else:
      x = nn.Conv(self.width, (7, 7), 2, padding=[(3, 3), (3, 3)], use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    if not self.small_input:
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    k = 0
    for i, n in enumerate(self.stages or STAGES[self.depth]):
      for j in range(n):
        x = block(self.width * 2 ** i, strides=2 if i > 0 and j == 0 else 1,
                  name=f"{kind.__name__}_{k}")(x, train)
        k += 1
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.classes)(x)


def build(batch_size: int = 8, depth: int = 50, image_size: int = 224, width: int = 64,
          classes: int = 1000, seed: int = 0, abstract: bool = False,
          stages: Sequence[int] | None = None,
          remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full SGD-momentum train step ``step(params, batch_stats, opt_state, images, labels)``.

  Args:
    batch_size, image_size, classes: the synthetic batch.
    depth: 18, 34, 50 or 101.
    width: channels of the first stage (64 in the paper's ResNets).
    abstract: return ``jax.ShapeDtypeStruct`` arguments (for ``jaxmem.analyze``
      and planning at full size without allocating or initialising anything).
    stages: override the blocks per stage (e.g. ``(1, 1, 1, 1)`` for a tiny test net).
    remat_policy: recompute every residual block with this ``jax.checkpoint_policies``
      name (the by-hand baseline).
  """
  model = ResNet(depth, width, classes, small_input=image_size <= 64,
                 stages=tuple(stages) if stages is not None else None, remat_policy=remat_policy)
  return batchnorm_classifier(model, optax.sgd(0.1, momentum=0.9), batch_size, image_size,
                              classes, seed, abstract)


def main() -> None:
  # Batch 32: at batch 8 the parameters, momentum and their updated copies are
  # most of the peak and half of it is out of reach (smallest compiled: 0.56).
  run_example(partial(build, image_size=64, depth=18, classes=10), default_batch=32, doc=__doc__)


if __name__ == "__main__":
  main()
