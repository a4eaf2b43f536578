"""UNet (flax linen: conv encoder, decoder with skip connections): segmentation with optax adam.

A segmentation step keeps every encoder level's feature map alive until the
decoder level that concatenates it, so the skips span almost the whole step:
the long-lived, large buffers that offloading (rather than recomputation) is
for. The full-size step (256 px, width 64, 4 levels) is meant for
``jaxmem.analyze`` / planning / simulation (``build(..., abstract=True)`` gives
shape-only arguments, nothing allocated); small sizes run on the CPU.

Run: ``python examples/unet.py [--batch 16] [--steps 3] [--budget 0.5]``
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import image_task, remat_block, run_example, tag


class DoubleConv(nn.Module):
  """Two 3x3 convolutions with ReLU: one UNet level."""
  channels: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = tag(self, nn.relu(tag(self, nn.Conv(self.channels, (3, 3))(x), "conv1")), "relu1")
    return nn.relu(tag(self, nn.Conv(self.channels, (3, 3))(x), "conv2"))


class Up(nn.Module):
  """Doubles the spatial size: a stride-2 transposed convolution, or a resize and a 3x3 conv."""
  channels: int
  mode: str = "transpose"   # "transpose" or a ``jax.image.resize`` method ("nearest", "bilinear")

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.mode == "transpose":
      return nn.ConvTranspose(self.channels, (2, 2), strides=(2, 2))(x)
    b, h, w, c = x.shape
    x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method=self.mode)
    return nn.Conv(self.channels, (3, 3))(x)


class UNet(nn.Module):
  depth: int = 4                    # down-sampling levels
  width: int = 64                   # channels of the first level (doubled per level)
  classes: int = 21
  upsample: str = "transpose"
  remat_policy: Any = None          # per-level nn.remat: a JAX policy name or a policy

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    level = remat_block(DoubleConv, self.remat_policy)
    names = (f"DoubleConv_{k}" for k in range(2 * self.depth + 1))
    skips = []
    for i in range(self.depth):
      x = level(self.width * 2 ** i, name=next(names))(x)
      skips.append(x)
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = level(self.width * 2 ** self.depth, name=next(names))(x)
    for i in reversed(range(self.depth)):
      x = Up(self.width * 2 ** i, self.upsample)(x)
      x = level(self.width * 2 ** i, name=next(names))(jnp.concatenate([skips[i], x], axis=-1))
    return nn.Conv(self.classes, (1, 1))(x)


def build(batch_size: int = 8, image_size: int = 256, depth: int = 4, width: int = 64,
          classes: int = 21, upsample: str = "transpose", seed: int = 0, abstract: bool = False,
          remat_policy: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A full adam train step ``step(params, opt_state, images, masks)`` and its arguments.

  The loss is the softmax cross-entropy of every pixel's logits against its
  integer class in ``masks`` (``int32[batch, image_size, image_size]``), averaged.

  Args:
    batch_size: images per step.
    image_size: side of the square synthetic RGB images (a multiple of
      ``2 ** depth``).
    depth: down-sampling levels (4 in the original UNet).
    width: channels of the first level, doubled at every level below it.
    classes: segmentation classes.
    upsample: ``"transpose"`` (stride-2 transposed convolution) or a
      ``jax.image.resize`` method followed by a 3x3 convolution.
    seed: seed of the parameters and the synthetic batch.
    abstract: return ``jax.ShapeDtypeStruct`` arguments (for ``jaxmem.analyze``
      and planning at full size without allocating or initialising anything).
    remat_policy: recompute every level's two convolutions with this
      ``jax.checkpoint_policies`` name (the by-hand baseline).

  Returns:
    ``(step, (params, opt_state, images, masks))``.
  """
  if image_size % 2 ** depth:
    raise ValueError(f"image_size {image_size} is not a multiple of 2 ** depth = {2 ** depth}.")
  model = UNet(depth, width, classes, upsample, remat_policy)
  return image_task(model, optax.adam(1e-3), batch_size, image_size,
                    (batch_size, image_size, image_size), classes, seed, abstract)


def main() -> None:
  run_example(partial(build, image_size=64, depth=3, width=8, classes=4), default_batch=16,
              doc=__doc__)


if __name__ == "__main__":
  main()
