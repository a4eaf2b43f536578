"""The fresh set: train steps written after every estimate change of issue 14.

The held-out set (``heldout.py``) has served to diagnose the estimate since its
first run (its skip-gram, state-space and softmax steps each led to a change),
so it no longer says how jaxmem does on code it has never seen. These steps
were written on 2026-11-28 at commit ``79397b4``, after the last change to the
estimate, and are measured as they come (``bench/corpus_bench.py --set
fresh``): nothing in jaxmem is to be changed because of them without keeping
that first run (``bench/results/fresh_first.json``) beside the later ones.

Families neither other set has: a RealNVP normalizing flow (affine couplings,
log-determinants), a VQ-VAE (nearest-codebook lookup, straight-through
estimator), a soft actor-critic update (two critics, target networks, a
reparametrized tanh-Gaussian policy), a graph attention network (edge softmax
by ``segment_max``/``segment_sum``), a Perceiver (cross-attention from latents
to a long input), a PixelCNN (masked convolutions, a 256-way softmax per
pixel), a decoder whose user wrote ``jax.checkpoint`` inside ``lax.scan``
over its layers, and a mixture density network.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus import Entry
from corpus import train_step as _train_step

# ------------------------------------------------------------ RealNVP flow


class _Coupling(nn.Module):
  dim: int
  hidden: int
  parity: int

  @nn.compact
  def __call__(self, x):
    mask = (jnp.arange(self.dim) % 2 == self.parity).astype(x.dtype)
    h = x * mask
    h = nn.relu(nn.Dense(self.hidden)(h))
    h = nn.relu(nn.Dense(self.hidden)(h))
    s = jnp.tanh(nn.Dense(self.dim)(h)) * (1 - mask)
    t = nn.Dense(self.dim)(h) * (1 - mask)
    y = x * mask + (1 - mask) * (x * jnp.exp(s) + t)
    return y, jnp.sum(s, axis=-1)


class _RealNVP(nn.Module):
  dim: int
  hidden: int
  layers: int

  @nn.compact
  def __call__(self, x):
    logdet = jnp.zeros(x.shape[0])
    for i in range(self.layers):
      x, ld = _Coupling(self.dim, self.hidden, i % 2)(x)
      logdet = logdet + ld
    return x, logdet


def _realnvp(dim, hidden, layers, batch, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_t(4, size=(batch, dim)), jnp.float32)
    model = _RealNVP(dim, hidden, layers)
    params = model.init(jax.random.PRNGKey(seed), x)
    tx = optax.adam(1e-3)

    def loss_fn(params, x):
      z, logdet = model.apply(params, x)
      log_pz = -0.5 * jnp.sum(z * z, axis=-1) - 0.5 * dim * jnp.log(2 * jnp.pi)
      return -jnp.mean(log_pz + logdet)

    return _train_step(tx, loss_fn), (params, tx.init(params), x)
  return make


# ----------------------------------------------------------------- VQ-VAE


class _VQVAE(nn.Module):
  codes: int
  code_dim: int
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(self.width, (4, 4), strides=(2, 2))(x))
    h = nn.relu(nn.Conv(self.width, (4, 4), strides=(2, 2))(h))
    z = nn.Conv(self.code_dim, (1, 1))(h)
    codebook = self.param("codebook", nn.initializers.uniform(1.0 / self.codes),
                          (self.codes, self.code_dim))
    flat = z.reshape(-1, self.code_dim)
    d = (jnp.sum(flat ** 2, 1, keepdims=True) - 2 * flat @ codebook.T
         + jnp.sum(codebook ** 2, 1)[None, :])
    idx = jnp.argmin(d, axis=1)
    q = codebook[idx].reshape(z.shape)
    commit = jnp.mean((z - jax.lax.stop_gradient(q)) ** 2)
    book = jnp.mean((jax.lax.stop_gradient(z) - q) ** 2)
    q = z + jax.lax.stop_gradient(q - z)               # straight-through
    h = nn.relu(nn.ConvTranspose(self.width, (4, 4), strides=(2, 2))(q))
    h = nn.relu(nn.ConvTranspose(self.width, (4, 4), strides=(2, 2))(h))
    return nn.Conv(x.shape[-1], (3, 3))(h), commit, book


def _vqvae(codes, code_dim, width, batch, image, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(size=(batch, image, image, 3)), jnp.float32)
    model = _VQVAE(codes, code_dim, width)
    params = model.init(jax.random.PRNGKey(seed), x)
    tx = optax.adam(2e-4)

    def loss_fn(params, x):
      recon, commit, book = model.apply(params, x)
      return jnp.mean((recon - x) ** 2) + book + 0.25 * commit

    return _train_step(tx, loss_fn), (params, tx.init(params), x)
  return make


# ------------------------------------------------------- soft actor-critic


class _MLP(nn.Module):
  hidden: int
  out: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.out)(x)


def _sac(obs_dim, act_dim, hidden, batch, seed):
  def make():
    rng = np.random.default_rng(seed)
    obs = jnp.asarray(rng.normal(size=(batch, obs_dim)), jnp.float32)
    act = jnp.asarray(rng.uniform(-1, 1, size=(batch, act_dim)), jnp.float32)
    rew = jnp.asarray(rng.normal(size=(batch,)), jnp.float32)
    nxt = jnp.asarray(rng.normal(size=(batch, obs_dim)), jnp.float32)
    done = jnp.asarray(rng.uniform(size=(batch,)) < 0.05, jnp.float32)
    actor, critic = _MLP(hidden, 2 * act_dim), _MLP(hidden, 1)
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    sa = jnp.concatenate([obs, act], -1)
    params = {"actor": actor.init(k[0], obs), "q1": critic.init(k[1], sa),
              "q2": critic.init(k[2], sa), "log_alpha": jnp.zeros(())}
    target = {"q1": params["q1"], "q2": params["q2"]}
    tx = optax.adam(3e-4)
    gamma, tau = 0.99, 0.005

    def policy(p, o, key):
      mean, log_std = jnp.split(actor.apply(p, o), 2, axis=-1)
      log_std = jnp.clip(log_std, -5, 2)
      eps = jax.random.normal(key, mean.shape)
      u = mean + jnp.exp(log_std) * eps
      a = jnp.tanh(u)
      logp = jnp.sum(-0.5 * eps ** 2 - log_std - 0.5 * jnp.log(2 * jnp.pi)
                     - jnp.log(1 - a ** 2 + 1e-6), -1)
      return a, logp

    def loss_fn(p, target, key):
      k1, k2 = jax.random.split(key)
      alpha = jnp.exp(p["log_alpha"])
      a2, logp2 = policy(p["actor"], nxt, k1)
      sa2 = jnp.concatenate([nxt, a2], -1)
      q_next = jnp.minimum(critic.apply(target["q1"], sa2), critic.apply(target["q2"], sa2))[:, 0]
      y = jax.lax.stop_gradient(rew + gamma * (1 - done) * (q_next - alpha * logp2))
      q_loss = sum(jnp.mean((critic.apply(p[q], sa)[:, 0] - y) ** 2) for q in ("q1", "q2"))
      a, logp = policy(p["actor"], obs, k2)
      sa_pi = jnp.concatenate([obs, a], -1)
      frozen = jax.lax.stop_gradient({"q1": p["q1"], "q2": p["q2"]})
      q_pi = jnp.minimum(critic.apply(frozen["q1"], sa_pi), critic.apply(frozen["q2"], sa_pi))
      actor_loss = jnp.mean(jax.lax.stop_gradient(alpha) * logp - q_pi[:, 0])
      alpha_loss = -jnp.mean(p["log_alpha"] * jax.lax.stop_gradient(logp - act_dim))
      return q_loss + actor_loss + alpha_loss

    def step(params, opt_state, target, key):
      key, sub = jax.random.split(key)
      loss, grads = jax.value_and_grad(loss_fn)(params, target, sub)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      target = jax.tree.map(lambda t, s: (1 - tau) * t + tau * s, target,
                            {"q1": params["q1"], "q2": params["q2"]})
      return params, opt_state, target, key, loss

    return step, (params, tx.init(params), target, jax.random.PRNGKey(seed + 1))
  return make


# ------------------------------------------------- graph attention network


class _GATLayer(nn.Module):
  features: int
  heads: int

  @nn.compact
  def __call__(self, x, senders, receivers):
    n = x.shape[0]
    h = nn.Dense(self.features * self.heads, use_bias=False)(x).reshape(n, self.heads, -1)
    a_src = self.param("a_src", nn.initializers.lecun_normal(), (self.heads, self.features))
    a_dst = self.param("a_dst", nn.initializers.lecun_normal(), (self.heads, self.features))
    e = nn.leaky_relu(jnp.sum(h[senders] * a_src, -1) + jnp.sum(h[receivers] * a_dst, -1), 0.2)
    e = e - jax.ops.segment_max(e, receivers, n)[receivers]
    w = jnp.exp(e)
    w = w / (jax.ops.segment_sum(w, receivers, n)[receivers] + 1e-9)
    out = jax.ops.segment_sum(w[..., None] * h[senders], receivers, n)
    return nn.elu(out.reshape(n, -1))


class _GAT(nn.Module):
  features: int
  heads: int
  classes: int

  @nn.compact
  def __call__(self, x, senders, receivers):
    x = _GATLayer(self.features, self.heads)(x, senders, receivers)
    x = _GATLayer(self.features, self.heads)(x, senders, receivers)
    return nn.Dense(self.classes)(x)


def _gat(nodes, edges, in_dim, features, heads, classes, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(nodes, in_dim)), jnp.float32)
    senders = jnp.asarray(rng.integers(0, nodes, size=edges), jnp.int32)
    receivers = jnp.asarray(rng.integers(0, nodes, size=edges), jnp.int32)
    y = jnp.asarray(rng.integers(0, classes, size=nodes), jnp.int32)
    model = _GAT(features, heads, classes)
    params = model.init(jax.random.PRNGKey(seed), x, senders, receivers)
    tx = optax.adamw(5e-3, weight_decay=5e-4)

    def loss_fn(params, x, senders, receivers, y):
      logits = model.apply(params, x, senders, receivers)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), x, senders, receivers, y)
  return make


# ---------------------------------------------------------------- Perceiver


class _Perceiver(nn.Module):
  latents: int
  width: int
  heads: int
  self_blocks: int
  classes: int

  @nn.compact
  def __call__(self, x):
    lat = self.param("latents", nn.initializers.normal(0.02), (self.latents, self.width))
    lat = jnp.broadcast_to(lat, (x.shape[0],) + lat.shape)
    kv = nn.Dense(self.width)(nn.LayerNorm()(x))
    lat = lat + nn.MultiHeadDotProductAttention(num_heads=1)(nn.LayerNorm()(lat), kv)
    lat = lat + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(lat))))
    for _ in range(self.self_blocks):
      h = nn.LayerNorm()(lat)
      lat = lat + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h)
      lat = lat + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(lat))))
    return nn.Dense(self.classes)(jnp.mean(lat, axis=1))


def _perceiver(batch, tokens, in_dim, latents, width, heads, blocks, classes, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, tokens, in_dim)), jnp.float32)
    y = jnp.asarray(rng.integers(0, classes, size=batch), jnp.int32)
    model = _Perceiver(latents, width, heads, blocks, classes)
    params = model.init(jax.random.PRNGKey(seed), x)
    tx = optax.lamb(1e-3)

    def loss_fn(params, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), x, y)
  return make


# ----------------------------------------------------------------- PixelCNN


class _MaskedConv(nn.Module):
  features: int
  size: int
  kind: str            # "A": the centre pixel masked too, "B": not

  @nn.compact
  def __call__(self, x):
    k = self.size
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (k, k, x.shape[-1], self.features))
    mask = np.ones((k, k, 1, 1), np.float32)
    mask[k // 2, k // 2 + (self.kind == "B"):] = 0
    mask[k // 2 + 1:] = 0
    y = jax.lax.conv_general_dilated(x, kernel * mask, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + self.param("bias", nn.initializers.zeros, (self.features,))


class _PixelCNN(nn.Module):
  width: int
  layers: int

  @nn.compact
  def __call__(self, x):
    h = nn.relu(_MaskedConv(self.width, 7, "A")(x))
    for _ in range(self.layers):
      h = h + _MaskedConv(self.width, 3, "B")(nn.relu(h))
    h = nn.relu(_MaskedConv(self.width, 1, "B")(nn.relu(h)))
    return _MaskedConv(256, 1, "B")(h)


def _pixelcnn(batch, image, width, layers, seed):
  def make():
    rng = np.random.default_rng(seed)
    levels = jnp.asarray(rng.integers(0, 256, size=(batch, image, image)), jnp.int32)
    x = (levels[..., None].astype(jnp.float32) / 127.5) - 1.0
    model = _PixelCNN(width, layers)
    params = model.init(jax.random.PRNGKey(seed), x)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))

    def loss_fn(params, x, levels):
      logits = model.apply(params, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, levels).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), x, levels)
  return make


# ---------------------------------------- decoder with jax.checkpoint in lax.scan


def _remat_scan_decoder(vocab, width, heads, layers, batch, length, seed):
  def make():
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, length + 1)), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    s = 0.02

    def stacked(key, shape):
      return s * jax.random.normal(key, (layers,) + shape)
    params = {"embed": s * jax.random.normal(keys[0], (vocab, width)),
              "pos": s * jax.random.normal(keys[1], (length, width)),
              "blocks": {"qkv": stacked(keys[2], (width, 3 * width)),
                         "out": stacked(keys[3], (width, width)),
                         "up": stacked(keys[4], (width, 4 * width)),
                         "down": stacked(keys[5], (4 * width, width)),
                         "ln1": jnp.ones((layers, width)), "ln2": jnp.ones((layers, width))}}
    tx = optax.adamw(3e-4, weight_decay=0.1)
    causal = jnp.tril(jnp.ones((length, length), bool))

    def rms(x, g):
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    @jax.checkpoint
    def block(x, p):
      h = rms(x, p["ln1"])
      q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
      split = lambda t: t.reshape(batch, length, heads, -1)  # noqa: E731
      a = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(width // heads)
      a = jax.nn.softmax(jnp.where(causal, a, -1e9), axis=-1)
      x = x + jnp.einsum("bhqk,bkhd->bqhd", a, split(v)).reshape(x.shape) @ p["out"]
      return x + jax.nn.gelu(rms(x, p["ln2"]) @ p["up"]) @ p["down"]

    def loss_fn(params, tokens):
      x = params["embed"][tokens[:, :-1]] + params["pos"]
      x, _ = jax.lax.scan(lambda c, p: (block(c, p), None), x, params["blocks"])
      logits = x @ params["embed"].T
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), tokens)
  return make


# -------------------------------------------------- mixture density network


def _mdn(in_dim, out_dim, mixtures, hidden, batch, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, in_dim)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(batch, out_dim)), jnp.float32)
    model = _MLP(hidden, mixtures * (1 + 2 * out_dim))
    params = model.init(jax.random.PRNGKey(seed), x)
    tx = optax.rmsprop(1e-3)

    def loss_fn(params, x, y):
      out = model.apply(params, x)
      logit_pi = out[:, :mixtures]
      mu, log_sigma = jnp.split(out[:, mixtures:].reshape(batch, mixtures, 2 * out_dim), 2, -1)
      log_sigma = jnp.clip(log_sigma, -7, 7)
      z = (y[:, None, :] - mu) * jnp.exp(-log_sigma)
      comp = -0.5 * jnp.sum(z * z, -1) - jnp.sum(log_sigma, -1) - 0.5 * out_dim * np.log(2 * np.pi)
      return -jnp.mean(jax.nn.logsumexp(jax.nn.log_softmax(logit_pi) + comp, -1))

    return _train_step(tx, loss_fn), (params, tx.init(params), x, y)
  return make


def entries() -> list[Entry]:
  return [
      Entry("flow/realnvp-s", "flow", _realnvp(dim=64, hidden=512, layers=8, batch=1024, seed=301),
            (0, 1), "affine coupling layers, log-determinants, Student-t data"),
      Entry("vqvae/conv-s", "vqvae", _vqvae(codes=512, code_dim=64, width=64, batch=16, image=64,
                                            seed=302),
            (0, 1), "strided convs, nearest codebook entry, straight-through estimator"),
      Entry("rl/sac-s", "rl", _sac(obs_dim=64, act_dim=8, hidden=512, batch=2048, seed=303),
            (0, 1, 2), "two critics, target networks, tanh-Gaussian policy, entropy temperature"),
      Entry("gat/gat-s", "gat", _gat(nodes=4096, edges=32768, in_dim=64, features=32, heads=4,
                                     classes=16, seed=304),
            (0, 1), "edge softmax with segment_max/segment_sum, multi-head aggregation"),
      Entry("perceiver/latent-s", "perceiver",
            _perceiver(batch=8, tokens=2048, in_dim=64, latents=128, width=128, heads=4,
                       blocks=3, classes=32, seed=305),
            (0, 1), "cross-attention from latents to a long input, LAMB"),
      Entry("pixelcnn/masked-s", "pixelcnn", _pixelcnn(batch=16, image=28, width=64, layers=5,
                                                       seed=306),
            (0, 1), "masked 7x7 and 3x3 convolutions, 256-way softmax per pixel"),
      Entry("remat-scan/decoder-s", "remat-scan",
            _remat_scan_decoder(vocab=2048, width=192, heads=6, layers=6, batch=8, length=256,
                                seed=307),
            (0, 1), "a user's jax.checkpoint around the block inside lax.scan over layers"),
      Entry("mdn/mixture-s", "mdn", _mdn(in_dim=32, out_dim=8, mixtures=32, hidden=1024,
                                         batch=4096, seed=308),
            (0, 1), "mixture density network: logsumexp over components, rmsprop"),
  ]
