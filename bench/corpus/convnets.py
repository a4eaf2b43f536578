"""Convolutional train steps: plain CNNs, UNets, DenseNets, MobileNets, WaveNets.

Written the way flax linen users write them: ``nn.Module`` classes with
``@nn.compact``, BatchNorm in train mode with mutable ``batch_stats``, a loss,
``jax.value_and_grad`` and an optax update; the step returns the new params,
optimizer state (and batch statistics) and the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus import Entry


# --------------------------------------------------------------------------
# Shared helpers.


def _images(seed: int, batch: int, hw: int, channels: int, num_classes: int):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (batch, hw, hw, channels), jnp.float32)
  y = jax.random.randint(k2, (batch,), 0, num_classes)
  return x, y


def _bn_step(model: nn.Module, tx: optax.GradientTransformation):
  """A classifier step for a model with BatchNorm (``train`` keyword)."""

  def step(params, batch_stats, opt_state, images, labels):
    def loss_fn(p):
      logits, updates = model.apply(
          {"params": p, "batch_stats": batch_stats}, images, train=True,
          mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, updates["batch_stats"]

    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, new_stats, opt_state, loss

  return step


def _make_bn_classifier(model, tx, *, seed, batch, hw, channels, num_classes):
  images, labels = _images(seed, batch, hw, channels, num_classes)
  init = jax.jit(functools.partial(model.init, train=False))
  variables = init(jax.random.PRNGKey(seed + 1), images[:1])
  params, batch_stats = variables["params"], variables["batch_stats"]
  opt_state = tx.init(params)
  return _bn_step(model, tx), (params, batch_stats, opt_state, images, labels)


# --------------------------------------------------------------------------
# cnn: conv + BatchNorm + ReLU, max-pooled or strided + average-pooled.


class ConvBlock(nn.Module):
  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.relu(x)


class PoolCNN(nn.Module):
  """VGG-ish: two conv blocks per stage, then a 2x2 max pool."""
  stages: Sequence[int]
  num_classes: int
  hidden: int = 128

  @nn.compact
  def __call__(self, x, train: bool = True):
    for f in self.stages:
      x = ConvBlock(f)(x, train)
      x = ConvBlock(f)(x, train)
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(self.hidden)(x)
    x = nn.relu(x)
    return nn.Dense(self.num_classes)(x)


class StridedCNN(nn.Module):
  """All-convolutional: downsampling by stride-2 convs, global average pool."""
  stages: Sequence[int]
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = ConvBlock(self.stages[0])(x, train)
    for i, f in enumerate(self.stages):
      x = ConvBlock(f, strides=1 if i == 0 else 2)(x, train)
      x = ConvBlock(f)(x, train)
    x = nn.avg_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def _cnn_maxpool(stages, batch, hw, channels, num_classes):
  model = PoolCNN(stages=stages, num_classes=num_classes)
  tx = optax.sgd(0.05, momentum=0.9)
  return _make_bn_classifier(model, tx, seed=11, batch=batch, hw=hw,
                             channels=channels, num_classes=num_classes)


def _cnn_strided(stages, batch, hw, channels, num_classes):
  model = StridedCNN(stages=stages, num_classes=num_classes)
  tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
  return _make_bn_classifier(model, tx, seed=12, batch=batch, hw=hw,
                             channels=channels, num_classes=num_classes)


# --------------------------------------------------------------------------
# unet: three levels, concatenated skips, per-pixel softmax cross-entropy.


class DoubleConv(nn.Module):
  features: int
  groups: int = 0

  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = nn.Conv(self.features, (3, 3))(x)
      if self.groups:
        x = nn.GroupNorm(num_groups=self.groups)(x)
      x = nn.relu(x)
    return x


class UNet(nn.Module):
  base: int
  num_classes: int
  upsample: str = "transpose"  # or "resize"
  groups: int = 0

  def _up(self, x, features):
    if self.upsample == "transpose":
      return nn.ConvTranspose(features, (2, 2), strides=(2, 2))(x)
    b, h, w, c = x.shape
    x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method="nearest")
    return nn.Conv(features, (3, 3))(x)

  @nn.compact
  def __call__(self, x):
    f = self.base
    e1 = DoubleConv(f, self.groups)(x)
    e2 = DoubleConv(2 * f, self.groups)(nn.max_pool(e1, (2, 2), strides=(2, 2)))
    mid = DoubleConv(4 * f, self.groups)(nn.max_pool(e2, (2, 2), strides=(2, 2)))
    d2 = self._up(mid, 2 * f)
    d2 = DoubleConv(2 * f, self.groups)(jnp.concatenate([d2, e2], axis=-1))
    d1 = self._up(d2, f)
    d1 = DoubleConv(f, self.groups)(jnp.concatenate([d1, e1], axis=-1))
    return nn.Conv(self.num_classes, (1, 1))(d1)


def _unet(base, batch, hw, channels, num_classes, upsample, groups=0, seed=21):
  model = UNet(base=base, num_classes=num_classes, upsample=upsample, groups=groups)
  tx = optax.adam(1e-3)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  images = jax.random.uniform(k1, (batch, hw, hw, channels), jnp.float32)
  masks = jax.random.randint(k2, (batch, hw, hw), 0, num_classes)
  params = jax.jit(model.init)(k3, images[:1])["params"]
  opt_state = tx.init(params)

  def step(params, opt_state, images, masks):
    def loss_fn(p):
      logits = model.apply({"params": p}, images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, masks).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, images, masks)


# --------------------------------------------------------------------------
# densenet: DenseNet-BC (bottleneck layers, compressed transitions).


class DenseLayer(nn.Module):
  growth: int
  bn_size: int = 4

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.BatchNorm(use_running_average=not train)(x)
    y = nn.relu(y)
    y = nn.Conv(self.bn_size * self.growth, (1, 1), use_bias=False)(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    y = nn.relu(y)
    y = nn.Conv(self.growth, (3, 3), use_bias=False)(y)
    return jnp.concatenate([x, y], axis=-1)


class Transition(nn.Module):
  compression: float = 0.5

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Conv(int(x.shape[-1] * self.compression), (1, 1), use_bias=False)(x)
    return nn.avg_pool(x, (2, 2), strides=(2, 2))


class DenseNet(nn.Module):
  growth: int
  block_layers: Sequence[int]
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(2 * self.growth, (3, 3), use_bias=False)(x)
    for i, n in enumerate(self.block_layers):
      for _ in range(n):
        x = DenseLayer(self.growth)(x, train)
      if i != len(self.block_layers) - 1:
        x = Transition()(x, train)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def _densenet(growth, block_layers, batch, hw, num_classes):
  model = DenseNet(growth=growth, block_layers=block_layers, num_classes=num_classes)
  tx = optax.adamw(1e-3, weight_decay=1e-4)
  return _make_bn_classifier(model, tx, seed=31, batch=batch, hw=hw, channels=3,
                             num_classes=num_classes)


# --------------------------------------------------------------------------
# mobilenet: MobileNetV2-style inverted residuals with depthwise convs.


class InvertedResidual(nn.Module):
  out: int
  strides: int
  expand: int

  @nn.compact
  def __call__(self, x, train: bool):
    inp = x.shape[-1]
    hidden = inp * self.expand
    y = x
    if self.expand != 1:
      y = nn.Conv(hidden, (1, 1), use_bias=False)(y)
      y = nn.BatchNorm(use_running_average=not train)(y)
      y = nn.relu6(y)
    y = nn.Conv(hidden, (3, 3), strides=self.strides, feature_group_count=hidden,
                use_bias=False)(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    y = nn.relu6(y)
    y = nn.Conv(self.out, (1, 1), use_bias=False)(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    if self.strides == 1 and inp == self.out:
      y = x + y
    return y


class MobileNet(nn.Module):
  # (expand, out channels, repeats, first stride)
  config: Sequence[tuple[int, int, int, int]]
  stem: int
  head: int
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.stem, (3, 3), strides=2, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu6(x)
    # A depthwise-separable block (no expansion) as in MobileNetV1.
    x = nn.Conv(self.stem, (3, 3), feature_group_count=self.stem, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu6(x)
    for t, c, n, s in self.config:
      for i in range(n):
        x = InvertedResidual(c, s if i == 0 else 1, t)(x, train)
    x = nn.Conv(self.head, (1, 1), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu6(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def _mobilenet(config, stem, head, batch, hw, num_classes):
  model = MobileNet(config=config, stem=stem, head=head, num_classes=num_classes)
  tx = optax.rmsprop(0.01, decay=0.9, eps=1e-3, momentum=0.9)
  return _make_bn_classifier(model, tx, seed=41, batch=batch, hw=hw, channels=3,
                             num_classes=num_classes)


# --------------------------------------------------------------------------
# conv1d: WaveNet (dilated causal convs, gated activations, residual + skip).


class CausalConv(nn.Module):
  features: int
  kernel: int = 2
  dilation: int = 1

  @nn.compact
  def __call__(self, x):
    pad = (self.kernel - 1) * self.dilation
    return nn.Conv(self.features, (self.kernel,), kernel_dilation=(self.dilation,),
                   padding=((pad, 0),))(x)


class WaveNetLayer(nn.Module):
  channels: int
  skip: int
  dilation: int

  @nn.compact
  def __call__(self, x):
    h = CausalConv(2 * self.channels, kernel=2, dilation=self.dilation)(x)
    filt, gate = jnp.split(h, 2, axis=-1)
    z = jnp.tanh(filt) * jax.nn.sigmoid(gate)
    skip = nn.Conv(self.skip, (1,))(z)
    res = nn.Conv(self.channels, (1,))(z)
    return x + res, skip


class WaveNet(nn.Module):
  channels: int
  skip: int
  dilations: Sequence[int]
  quant: int = 256

  @nn.compact
  def __call__(self, audio):
    x = CausalConv(self.channels, kernel=2)(audio)
    skips = 0.0
    for d in self.dilations:
      x, s = WaveNetLayer(self.channels, self.skip, d)(x)
      skips = skips + s
    y = nn.relu(skips)
    y = nn.relu(nn.Conv(self.skip, (1,))(y))
    return nn.Conv(self.quant, (1,))(y)


def _mu_law(x, mu=255):
  y = jnp.sign(x) * jnp.log1p(mu * jnp.abs(x)) / jnp.log1p(mu)
  return jnp.clip(((y + 1) / 2 * mu + 0.5).astype(jnp.int32), 0, mu)


def _wavenet(channels, skip, stacks, layers, batch, length, seed=51):
  dilations = tuple(2 ** i for i in range(layers)) * stacks
  model = WaveNet(channels=channels, skip=skip, dilations=dilations)
  tx = optax.adam(3e-4)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  t = jnp.arange(length + 1, dtype=jnp.float32)
  freqs = jax.random.uniform(k1, (batch, 1), minval=0.01, maxval=0.2)
  wave = 0.6 * jnp.sin(freqs * t) + 0.05 * jax.random.normal(k2, (batch, length + 1))
  audio = wave[:, :-1, None].astype(jnp.float32)
  targets = _mu_law(wave[:, 1:])
  params = jax.jit(model.init)(k3, audio[:1, :64])["params"]
  opt_state = tx.init(params)

  def step(params, opt_state, audio, targets):
    def loss_fn(p):
      logits = model.apply({"params": p}, audio)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, audio, targets)


# --------------------------------------------------------------------------


def entries() -> list[Entry]:
  p = functools.partial
  bn_donate = (0, 1, 2)
  return [
      Entry("cnn/bn-maxpool-s", "cnn",
            p(_cnn_maxpool, (16, 32), 24, 28, 1, 10), bn_donate,
            "conv+BN+ReLU, max pool, dense head; sgd momentum; 28x28x1"),
      Entry("cnn/bn-maxpool-m", "cnn",
            p(_cnn_maxpool, (32, 64, 96), 32, 36, 3, 21), bn_donate,
            "conv+BN+ReLU, max pool, dense head; sgd momentum; 36x36x3"),
      Entry("cnn/bn-strided-s", "cnn",
            p(_cnn_strided, (24, 48), 16, 28, 1, 10), bn_donate,
            "strided convs + BN, avg pool, global mean; sgd nesterov"),
      Entry("cnn/bn-strided-m", "cnn",
            p(_cnn_strided, (32, 64, 128), 40, 36, 3, 21), bn_donate,
            "strided convs + BN, avg pool, global mean; sgd nesterov"),
      Entry("unet/convT-s", "unet",
            p(_unet, 12, 8, 36, 3, 5, "transpose"), (0, 1),
            "3-level UNet, ConvTranspose up, concat skips, pixel CE; adam"),
      Entry("unet/convT-m", "unet",
            p(_unet, 24, 12, 60, 3, 21, "transpose"), (0, 1),
            "3-level UNet, ConvTranspose up, concat skips, pixel CE; adam"),
      Entry("unet/resize-gn-m", "unet",
            p(_unet, 20, 10, 52, 1, 7, "resize", 4), (0, 1),
            "3-level UNet, nearest resize + conv up, GroupNorm; adam"),
      Entry("densenet/bc-s", "densenet",
            p(_densenet, 8, (3, 3, 3), 8, 30, 10), bn_donate,
            "DenseNet-BC, bottleneck 1x1, transition avg pool; adamw"),
      Entry("densenet/bc-m", "densenet",
            p(_densenet, 12, (4, 6, 4), 14, 30, 10), bn_donate,
            "DenseNet-BC, bottleneck 1x1, transition avg pool; adamw"),
      Entry("mobilenet/v2-s", "mobilenet",
            p(_mobilenet, ((1, 16, 1, 1), (4, 24, 2, 2), (4, 40, 2, 2)),
              16, 128, 16, 40, 10), bn_donate,
            "inverted residuals, depthwise convs, BN, relu6; rmsprop"),
      Entry("mobilenet/v2-m", "mobilenet",
            p(_mobilenet, ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2),
                           (6, 64, 2, 2), (6, 96, 1, 1)),
              32, 320, 16, 64, 21), bn_donate,
            "inverted residuals, depthwise convs, BN, relu6; rmsprop"),
      Entry("conv1d/wavenet-s", "conv1d",
            p(_wavenet, 24, 48, 1, 7, 4, 720), (0, 1),
            "dilated causal convs, tanh*sigmoid gates, residual+skip; adam"),
      Entry("conv1d/wavenet-m", "conv1d",
            p(_wavenet, 32, 64, 2, 8, 4, 1600), (0, 1),
            "dilated causal convs, tanh*sigmoid gates, residual+skip; adam"),
  ]
