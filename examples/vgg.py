"""VGG-16 (flax linen: 3x3 conv stacks, max-pool, 3 dense layers) trained with optax SGD momentum.

vDNN (Rhu et al.) measures itself on VGG-16: its convolutional feature maps are
most of the step's memory at ImageNet size, which is what the ``conv`` offload
policy targets. The full-size step (224 px, 1000 classes, batch 64) is meant for
``jaxmem.analyze`` / planning / simulation (``build(..., abstract=True)`` gives
shape-only arguments, nothing allocated); small sizes (``width`` < 1, small
images) run on the CPU.

Run: ``python examples/vgg.py [--batch 32] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import optax
from _common import image_task, remat_block, run_example

# (convolutions, channels) per stage: configuration "D" of Simonyan & Zisserman.
VGG16 = ((2, 64), (2, 128), (3, 256), (3, 512), (3, 512))


class Stage(nn.Module):
  """``convs`` 3x3 convolutions with ReLU, then a 2x2 max-pool."""
  convs: int
  channels: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for _ in range(self.convs):
      x = nn.relu(nn.Conv(self.channels, (3, 3))(x))
    return nn.max_pool(x, (2, 2), strides=(2, 2))


class VGG(nn.Module):
  stages: tuple[tuple[int, int], ...] = VGG16
  width: float = 1.0                # multiplier on every conv and dense width
  head: int = 4096                  # dense head width before ``width``
  classes: int = 1000
  remat_policy: str | None = None   # per-stage nn.remat with this JAX policy (a baseline)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    stage = remat_block(Stage, self.remat_policy)
    for convs, channels in self.stages:
      x = stage(convs, max(1, int(channels * self.width)))(x)
    x = x.reshape((x.shape[0], -1))
    hidden = max(1, int(self.head * self.width))
    x = nn.relu(nn.Dense(hidden)(x))
    x = nn.relu(nn.Dense(hidden)(x))
    return nn.Dense(self.classes)(x)


def build(batch_size: int = 64, image_size: int = 224, width: float = 1.0, classes: int = 1000,
          head: int = 4096, stages: Sequence[tuple[int, int]] = VGG16, seed: int = 0,
          abstract: bool = False,
          remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full SGD-momentum train step ``step(params, opt_state, images, labels)`` and its arguments.

  Args:
    batch_size: images per step.
    image_size: side of the square synthetic RGB images (224 for ImageNet; a
      multiple of ``2 ** len(stages)`` keeps every pool exact).
    width: multiplier on the channels of every stage and on the dense head
      (1.0 is VGG-16; 1/16 makes a CPU-sized net).
    classes: output classes.
    head: width of the two hidden dense layers before ``width`` is applied.
    stages: ``(convolutions, channels)`` per stage (default: VGG-16).
    seed: seed of the parameters and the synthetic batch.
    abstract: return ``jax.ShapeDtypeStruct`` arguments (for ``jaxmem.analyze``
      and planning at full size without allocating or initialising anything).
    remat_policy: recompute every conv stage with this ``jax.checkpoint_policies``
      name (the by-hand baseline).

  Returns:
    ``(step, (params, opt_state, images, labels))``.
  """
  model = VGG(tuple(tuple(s) for s in stages), width, head, classes, remat_policy)
  return image_task(model, optax.sgd(0.01, momentum=0.9), batch_size, image_size, (batch_size,),
                    classes, seed, abstract)


def main() -> None:
  run_example(partial(build, image_size=64, width=0.125, head=4096, classes=10),
              default_batch=32, doc=__doc__)


if __name__ == "__main__":
  main()
