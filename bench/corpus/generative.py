"""Generative-model train steps (VAEs, a DCGAN) and flax nnx models.

The VAEs and the GAN are flax linen modules trained with ``jax.value_and_grad``
and optax; the nnx entries use the functional pattern (``nnx.split`` outside
the step, ``nnx.merge`` inside, ``nnx.value_and_grad``, the new state
returned).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus import Entry


# --------------------------------------------------------------------------
# vae: MLP and convolutional VAEs, Bernoulli likelihood, analytic KL.


class MLPEncoder(nn.Module):
  hidden: Sequence[int]
  latent: int

  @nn.compact
  def __call__(self, x):
    for h in self.hidden:
      x = nn.relu(nn.Dense(h)(x))
    mean = nn.Dense(self.latent, name="mean")(x)
    logvar = nn.Dense(self.latent, name="logvar")(x)
    return mean, logvar


class MLPDecoder(nn.Module):
  hidden: Sequence[int]
  out: int

  @nn.compact
  def __call__(self, z):
    for h in self.hidden:
      z = nn.relu(nn.Dense(h)(z))
    return nn.Dense(self.out)(z)


class ConvEncoder(nn.Module):
  features: Sequence[int]
  latent: int

  @nn.compact
  def __call__(self, x):
    for f in self.features:
      x = nn.Conv(f, (3, 3))(x)
      x = nn.relu(x)
      x = nn.Conv(f, (3, 3), strides=(2, 2))(x)
      x = nn.relu(x)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(self.latent)(x), nn.Dense(self.latent)(x)


class ConvDecoder(nn.Module):
  features: Sequence[int]  # from coarse to fine
  base_hw: int
  channels: int

  @nn.compact
  def __call__(self, z):
    f0 = self.features[0]
    x = nn.relu(nn.Dense(256)(z))
    x = nn.relu(nn.Dense(self.base_hw * self.base_hw * f0)(x))
    x = x.reshape((z.shape[0], self.base_hw, self.base_hw, f0))
    for f in self.features:
      x = nn.ConvTranspose(f, (3, 3), strides=(2, 2))(x)
      x = nn.relu(x)
      x = nn.Conv(f, (3, 3))(x)
      x = nn.relu(x)
    return nn.Conv(self.channels, (3, 3))(x)


class VAE(nn.Module):
  encoder: nn.Module
  decoder: nn.Module

  def __call__(self, x, key):
    mean, logvar = self.encoder(x)
    eps = jax.random.normal(key, mean.shape, mean.dtype)
    z = mean + jnp.exp(0.5 * logvar) * eps
    return self.decoder(z), mean, logvar


def _vae_step(model, tx):

  def step(params, opt_state, images, key):
    def loss_fn(p):
      logits, mean, logvar = model.apply({"params": p}, images, key)
      axes = tuple(range(1, images.ndim))
      rec = optax.sigmoid_binary_cross_entropy(logits, images).sum(axis=axes)
      kl = -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), axis=-1)
      return jnp.mean(rec + kl), (jnp.mean(rec), jnp.mean(kl))

    (loss, (rec, kl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "rec": rec, "kl": kl}

  return step


def _vae_mlp(hidden, latent, batch, seed=61):
  model = VAE(MLPEncoder(hidden, latent), MLPDecoder(tuple(reversed(hidden)), 28 * 28))
  tx = optax.adam(1e-3)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  images = jax.random.bernoulli(k1, 0.3, (batch, 28 * 28)).astype(jnp.float32)
  params = jax.jit(model.init)(k2, images[:1], k3)["params"]
  opt_state = tx.init(params)
  key = jax.random.PRNGKey(seed + 1)
  return _vae_step(model, tx), (params, opt_state, images, key)


def _vae_conv(features, latent, batch, hw, channels, seed=62):
  base = hw // 2 ** len(features)
  model = VAE(ConvEncoder(features, latent),
              ConvDecoder(tuple(reversed(features)), base, channels))
  tx = optax.adam(5e-4)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  images = jax.random.uniform(k1, (batch, hw, hw, channels), jnp.float32)
  params = jax.jit(model.init)(k2, images[:1], k3)["params"]
  opt_state = tx.init(params)
  key = jax.random.PRNGKey(seed + 1)
  return _vae_step(model, tx), (params, opt_state, images, key)


# --------------------------------------------------------------------------
# gan: DCGAN generator (BatchNorm) and discriminator, both updated per step.


class Generator(nn.Module):
  base_hw: int
  features: int
  channels: int

  @nn.compact
  def __call__(self, z, train: bool = True):
    f = self.features
    x = nn.Dense(self.base_hw * self.base_hw * 4 * f, use_bias=False)(z)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = x.reshape((z.shape[0], self.base_hw, self.base_hw, 4 * f))
    for mult in (2, 1):
      x = nn.ConvTranspose(mult * f, (4, 4), strides=(2, 2), use_bias=False)(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
    x = nn.Conv(self.channels, (3, 3))(x)
    return jnp.tanh(x)


class Discriminator(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x):
    f = self.features
    x = nn.leaky_relu(nn.Conv(f, (4, 4), strides=(2, 2))(x), 0.2)
    x = nn.Conv(2 * f, (4, 4), strides=(2, 2))(x)
    x = nn.LayerNorm()(x)
    x = nn.leaky_relu(x, 0.2)
    x = nn.Conv(4 * f, (3, 3))(x)
    x = nn.leaky_relu(x, 0.2)
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(1)(x)[:, 0]


def _gan(base_hw, g_features, d_features, channels, batch, latent, seed=71):
  hw = 4 * base_hw
  gen = Generator(base_hw, g_features, channels)
  disc = Discriminator(d_features)
  g_tx = optax.adam(2e-4, b1=0.5)
  d_tx = optax.adam(2e-4, b1=0.5)
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  real = jnp.tanh(jax.random.normal(k1, (batch, hw, hw, channels), jnp.float32))
  z = jax.random.normal(k2, (batch, latent), jnp.float32)
  g_vars = jax.jit(functools.partial(gen.init, train=False))(k3, z[:1])
  g_params, g_stats = g_vars["params"], g_vars["batch_stats"]
  d_params = jax.jit(disc.init)(k4, real[:1])["params"]
  g_opt, d_opt = g_tx.init(g_params), d_tx.init(d_params)

  def step(g_params, g_stats, d_params, g_opt, d_opt, real, z):
    # Discriminator: real -> 1, fake -> 0 (fakes from the current generator).
    fake, _ = gen.apply({"params": g_params, "batch_stats": g_stats}, z,
                        mutable=["batch_stats"])
    fake = jax.lax.stop_gradient(fake)

    def d_loss_fn(dp):
      real_logits = disc.apply({"params": dp}, real)
      fake_logits = disc.apply({"params": dp}, fake)
      return jnp.mean(jax.nn.softplus(-real_logits)) + jnp.mean(jax.nn.softplus(fake_logits))

    d_loss, d_grads = jax.value_and_grad(d_loss_fn)(d_params)
    d_updates, d_opt = d_tx.update(d_grads, d_opt, d_params)
    d_params = optax.apply_updates(d_params, d_updates)

    # Generator: non-saturating loss, gradients through the updated discriminator.
    def g_loss_fn(gp):
      fake, updates = gen.apply({"params": gp, "batch_stats": g_stats}, z,
                                mutable=["batch_stats"])
      logits = disc.apply({"params": d_params}, fake)
      return jnp.mean(jax.nn.softplus(-logits)), updates["batch_stats"]

    (g_loss, g_stats), g_grads = jax.value_and_grad(g_loss_fn, has_aux=True)(g_params)
    g_updates, g_opt = g_tx.update(g_grads, g_opt, g_params)
    g_params = optax.apply_updates(g_params, g_updates)
    return g_params, g_stats, d_params, g_opt, d_opt, {"d_loss": d_loss, "g_loss": g_loss}

  return step, (g_params, g_stats, d_params, g_opt, d_opt, real, z)


# --------------------------------------------------------------------------
# nnx: Conv/BatchNorm/Dropout/Linear modules, functional split/merge steps.


class NnxCNN(nnx.Module):

  def __init__(self, in_ch: int, features: Sequence[int], hw: int, hidden: int,
               num_classes: int, dropout: float, *, rngs: nnx.Rngs):
    self.convs = nnx.List()
    self.norms = nnx.List()
    c = in_ch
    for f in features:
      self.convs.append(nnx.Conv(c, f, (3, 3), use_bias=False, rngs=rngs))
      self.norms.append(nnx.BatchNorm(f, momentum=0.9, rngs=rngs))
      c = f
      hw //= 2
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.fc1 = nnx.Linear(c * hw * hw, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x):
    for conv, norm in zip(self.convs, self.norms):
      x = nnx.relu(norm(conv(x)))
      x = nnx.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = self.dropout(nnx.relu(self.fc1(x)))
    return self.fc2(x)


class NnxResBlock(nnx.Module):

  def __init__(self, c: int, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(c, rngs=rngs)
    self.conv2 = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(c, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    return nnx.relu(x + y)


class NnxResNet(nnx.Module):

  def __init__(self, in_ch: int, widths: Sequence[int], blocks: int, num_classes: int,
               *, rngs: nnx.Rngs):
    self.stem = nnx.Conv(in_ch, widths[0], (3, 3), rngs=rngs)
    self.stages = nnx.List()
    self.downs = nnx.List()
    c = widths[0]
    for i, w in enumerate(widths):
      self.downs.append(nnx.Conv(c, w, (3, 3), strides=(1, 1) if i == 0 else (2, 2),
                                 rngs=rngs))
      self.stages.append(nnx.List([NnxResBlock(w, rngs=rngs) for _ in range(blocks)]))
      c = w
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(c, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    for down, stage in zip(self.downs, self.stages):
      x = nnx.relu(down(x))
      for block in stage:
        x = block(x)
    x = jnp.mean(x, axis=(1, 2))
    return self.head(self.dropout(x))


def _nnx_data(seed, batch, hw, channels, num_classes):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (batch, hw, hw, channels), jnp.float32)
  y = jax.random.randint(k2, (batch,), 0, num_classes)
  return x, y


def _nnx_cnn(features, hw, channels, hidden, num_classes, batch, seed=81):
  """optax directly on the ``nnx.State`` of the params."""
  model = NnxCNN(channels, features, hw, hidden, num_classes, 0.3, rngs=nnx.Rngs(seed))
  tx = optax.adam(1e-3)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt_state = tx.init(params)
  x, y = _nnx_data(seed, batch, hw, channels, num_classes)

  def step(params, rest, opt_state, x, y):
    model = nnx.merge(graphdef, params, rest)

    def loss_fn(model):
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    _, _, rest = nnx.split(model, nnx.Param, ...)  # new batch stats, rng counts
    return params, rest, opt_state, loss

  return step, (params, rest, opt_state, x, y)


def _nnx_resnet(widths, blocks, hw, channels, num_classes, batch, seed=82):
  """``nnx.Optimizer`` carried through split/merge with the model."""
  model = NnxResNet(channels, widths, blocks, num_classes, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.05), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  x, y = _nnx_data(seed, batch, hw, channels, num_classes)

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      logits = model(x)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    _, state = nnx.split((model, optimizer))
    return state, {"loss": loss, "accuracy": accuracy}

  return step, (state, x, y)


# --------------------------------------------------------------------------


def entries() -> list[Entry]:
  p = functools.partial
  return [
      Entry("vae/mlp-s", "vae", p(_vae_mlp, (400,), 20, 100), (0, 1),
            "MLP VAE 784-400-20, reparameterized with a key arg, BCE + KL; adam"),
      Entry("vae/mlp-m", "vae", p(_vae_mlp, (1024, 512), 32, 250), (0, 1),
            "MLP VAE 784-1024-512-32, BCE + KL; adam"),
      Entry("vae/conv-m", "vae", p(_vae_conv, (32, 64), 24, 32, 36, 3), (0, 1),
            "conv VAE 36x36x3, strided convs / ConvTranspose decoder; adam"),
      Entry("gan/dcgan-s", "gan", p(_gan, 7, 24, 24, 1, 20, 64), (0, 1, 2, 3, 4),
            "DCGAN 28x28x1: D and G updated in one step, G grads through D; adam x2"),
      Entry("gan/dcgan-m", "gan", p(_gan, 9, 48, 48, 3, 28, 100), (0, 1, 2, 3, 4),
            "DCGAN 36x36x3: D and G updated in one step, G grads through D; adam x2"),
      Entry("nnx/cnn-s", "nnx", p(_nnx_cnn, (16, 32), 28, 1, 96, 10, 32), (0, 1, 2),
            "nnx Conv/BatchNorm/Dropout/Linear, split/merge, optax on nnx.State"),
      Entry("nnx/cnn-m", "nnx", p(_nnx_cnn, (32, 64, 96), 40, 3, 192, 21, 32), (0, 1, 2),
            "nnx Conv/BatchNorm/Dropout/Linear, split/merge, optax on nnx.State"),
      Entry("nnx/resnet-optimizer-m", "nnx", p(_nnx_resnet, (24, 48, 72), 2, 30, 3, 10, 32),
            (0,), "nnx residual convnet, nnx.Optimizer split/merged with the model; adamw"),
  ]
