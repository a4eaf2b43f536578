"""Structured-data models: graph nets, K-means, two-tower contrastive,
MLP-Mixer, a DLRM-style recommender.

Written the way flax linen / plain JAX users write them: a module,
``model.init``, an optax optimizer, and a train step closing over both.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus import Entry
from corpus import train_step as _train_step


# ------------------------------------------------------------------- graph


class MLP(nn.Module):
  features: tuple[int, ...]
  layer_norm: bool = True

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = nn.Dense(f)(x)
      if i < len(self.features) - 1:
        x = nn.relu(x)
    if self.layer_norm:
      x = nn.LayerNorm()(x)
    return x


class GraphNet(nn.Module):
  """Encode-process-decode message passing (edge MLP, sum aggregation, node MLP)."""
  hidden: int
  classes: int
  rounds: int = 3

  @nn.compact
  def __call__(self, nodes, edges, senders, receivers):
    n = nodes.shape[0]
    h = MLP((self.hidden, self.hidden), name="node_encoder")(nodes)
    e = MLP((self.hidden, self.hidden), name="edge_encoder")(edges)
    for r in range(self.rounds):
      msg_in = jnp.concatenate([e, h[senders], h[receivers]], axis=-1)
      e = e + MLP((self.hidden, self.hidden), name=f"edge_mlp_{r}")(msg_in)
      agg = jax.ops.segment_sum(e, receivers, num_segments=n)
      degree = jax.ops.segment_sum(jnp.ones_like(receivers, jnp.float32), receivers, num_segments=n)
      agg = agg / jnp.maximum(degree, 1.0)[:, None]
      h = h + MLP((self.hidden, self.hidden), name=f"node_mlp_{r}")(jnp.concatenate([h, agg], axis=-1))
    return MLP((self.hidden, self.classes), layer_norm=False, name="decoder")(h)


def _graph(nodes, edges, node_feats, edge_feats, hidden, classes, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(nodes, node_feats)), jnp.float32)
    ef = jnp.asarray(rng.normal(size=(edges, edge_feats)), jnp.float32)
    senders = jnp.asarray(rng.integers(0, nodes, size=edges), jnp.int32)
    receivers = jnp.asarray(rng.integers(0, nodes, size=edges), jnp.int32)
    labels = jnp.asarray(rng.integers(0, classes, size=nodes), jnp.int32)
    train_mask = jnp.asarray(rng.random(nodes) < 0.6)
    model = GraphNet(hidden, classes)
    params = model.init(jax.random.PRNGKey(seed), x, ef, senders, receivers)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def loss_fn(params, x, ef, senders, receivers, labels, train_mask):
      logits = model.apply(params, x, ef, senders, receivers)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      w = train_mask.astype(losses.dtype)
      return (losses * w).sum() / w.sum()

    return _train_step(tx, loss_fn), (params, opt_state, x, ef, senders, receivers, labels, train_mask)

  return make


# ------------------------------------------------------------------ kmeans


def _sq_distances(points, centroids):
  return (jnp.sum(points * points, axis=1, keepdims=True)
          - 2.0 * points @ centroids.T
          + jnp.sum(centroids * centroids, axis=1)[None, :])


def lloyd_step(points, centroids):
  """One Lloyd iteration; new centroids by segment_sum; empty clusters stay put."""
  k = centroids.shape[0]
  d2 = _sq_distances(points, centroids)
  assign = jnp.argmin(d2, axis=1)
  inertia = jnp.sum(jnp.maximum(jnp.min(d2, axis=1), 0.0))
  sums = jax.ops.segment_sum(points, assign, num_segments=k)
  counts = jax.ops.segment_sum(jnp.ones(points.shape[0], points.dtype), assign, num_segments=k)
  new = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], centroids)
  return new, inertia


def lloyd_fori(points, centroids, iters=5):
  """Several Lloyd iterations in a fori_loop; centroids by a one-hot matmul."""
  k = centroids.shape[0]

  def body(_, carry):
    c, _ = carry
    d2 = _sq_distances(points, c)
    onehot = jax.nn.one_hot(jnp.argmin(d2, axis=1), k, dtype=points.dtype)
    inertia = jnp.sum(jnp.maximum(jnp.min(d2, axis=1), 0.0))
    counts = onehot.sum(axis=0)
    sums = onehot.T @ points
    c = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], c)
    return c, inertia

  return jax.lax.fori_loop(0, iters, body, (centroids, jnp.zeros((), points.dtype)))


def _kmeans(step, n, d, k, clusters, seed):
  def make():
    rng = np.random.default_rng(seed)
    means = rng.normal(scale=4.0, size=(clusters, d))
    points = means[rng.integers(0, clusters, size=n)] + rng.normal(size=(n, d))
    points = jnp.asarray(points, jnp.float32)
    centroids = points[jnp.asarray(rng.choice(n, size=k, replace=False))]
    return step, (points, centroids)

  return make


# ------------------------------------------------------------- contrastive


class ImageTower(nn.Module):
  hidden: int
  embed: int

  @nn.compact
  def __call__(self, images):
    x = images.reshape(images.shape[0], -1)
    x = nn.gelu(nn.Dense(self.hidden)(x))
    x = nn.LayerNorm()(nn.gelu(nn.Dense(self.hidden)(x)))
    return nn.Dense(self.embed, use_bias=False, name="proj")(x)


class TextTower(nn.Module):
  """An embedding bag: masked mean of token embeddings, then an MLP."""
  vocab: int
  width: int
  embed: int

  @nn.compact
  def __call__(self, tokens):
    valid = (tokens != 0).astype(jnp.float32)[..., None]
    x = nn.Embed(self.vocab, self.width)(tokens)
    x = (x * valid).sum(1) / jnp.maximum(valid.sum(1), 1.0)
    x = nn.LayerNorm()(nn.gelu(nn.Dense(self.width)(x)))
    return nn.Dense(self.embed, use_bias=False, name="proj")(x)


class CLIP(nn.Module):
  image_hidden: int
  vocab: int
  text_width: int
  embed: int

  def setup(self):
    self.image = ImageTower(self.image_hidden, self.embed)
    self.text = TextTower(self.vocab, self.text_width, self.embed)
    self.logit_scale = self.param("logit_scale", nn.initializers.constant(math.log(1 / 0.07)), ())

  def __call__(self, images, tokens):
    img = self.image(images)
    txt = self.text(tokens)
    img = img / jnp.linalg.norm(img, axis=-1, keepdims=True)
    txt = txt / jnp.linalg.norm(txt, axis=-1, keepdims=True)
    scale = jnp.exp(jnp.minimum(self.logit_scale, math.log(100.0)))
    return scale * img @ txt.T


def _clip(batch, image_shape, seq, model, seed):
  def make():
    rng = np.random.default_rng(seed)
    images = jnp.asarray(rng.random(size=(batch, *image_shape)), jnp.float32)
    lengths = rng.integers(3, seq + 1, size=batch)
    ids = rng.integers(1, model.vocab, size=(batch, seq))
    tokens = jnp.asarray(np.where(np.arange(seq)[None] < lengths[:, None], ids, 0), jnp.int32)
    params = model.init(jax.random.PRNGKey(seed), images[:2], tokens[:2])
    tx = optax.adam(5e-4)
    opt_state = tx.init(params)

    def loss_fn(params, images, tokens):
      logits = model.apply(params, images, tokens)
      labels = jnp.arange(logits.shape[0])
      return 0.5 * (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                    + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean())

    return _train_step(tx, loss_fn), (params, opt_state, images, tokens)

  return make


# ------------------------------------------------------------------- mixer


class MlpBlock(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    y = nn.gelu(nn.Dense(self.hidden)(x))
    return nn.Dense(x.shape[-1])(y)


class MixerBlock(nn.Module):
  tokens_hidden: int
  channels_hidden: int

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    y = jnp.swapaxes(y, 1, 2)
    y = MlpBlock(self.tokens_hidden, name="token_mixing")(y)
    x = x + jnp.swapaxes(y, 1, 2)
    y = nn.LayerNorm()(x)
    return x + MlpBlock(self.channels_hidden, name="channel_mixing")(y)


class MlpMixer(nn.Module):
  patch: int
  channels: int
  tokens_hidden: int
  channels_hidden: int
  blocks: int
  classes: int

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(self.channels, (self.patch, self.patch), strides=(self.patch, self.patch), name="stem")(images)
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    for i in range(self.blocks):
      x = MixerBlock(self.tokens_hidden, self.channels_hidden, name=f"block_{i}")(x)
    x = nn.LayerNorm(name="pre_head_norm")(x)
    return nn.Dense(self.classes, name="head", kernel_init=nn.initializers.zeros)(x.mean(axis=1))


def _mixer(model, batch, image, seed):
  def make():
    rng = np.random.default_rng(seed)
    images = jnp.asarray(rng.normal(size=(batch, image, image, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, model.classes, size=batch), jnp.int32)
    params = model.init(jax.random.PRNGKey(seed), images[:1])
    tx = optax.sgd(0.05, momentum=0.9, nesterov=True)
    opt_state = tx.init(params)

    def loss_fn(params, images, labels):
      logits = model.apply(params, images)
      return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, model.classes)).mean()

    return _train_step(tx, loss_fn), (params, opt_state, images, labels)

  return make


# ------------------------------------------------------------------ recsys


class DLRM(nn.Module):
  """Bottom MLP on dense features, one embedding table per sparse feature,
  pairwise dot-product interactions, top MLP to one logit."""
  table_sizes: tuple[int, ...]
  embed: int
  bottom: tuple[int, ...]
  top: tuple[int, ...]

  @nn.compact
  def __call__(self, dense, sparse):
    x = dense
    for i, f in enumerate(self.bottom):
      x = nn.relu(nn.Dense(f, name=f"bottom_{i}")(x))
    x = nn.Dense(self.embed, name="bottom_out")(x)
    embs = [nn.Embed(n, self.embed, name=f"table_{t}")(sparse[:, t]) for t, n in enumerate(self.table_sizes)]
    feats = jnp.stack([x] + embs, axis=1)  # [b, f, d]
    z = jnp.einsum("bfd,bgd->bfg", feats, feats)
    i, j = np.triu_indices(feats.shape[1], k=1)
    y = jnp.concatenate([x, z[:, i, j]], axis=-1)
    for k, f in enumerate(self.top):
      y = nn.relu(nn.Dense(f, name=f"top_{k}")(y))
    return nn.Dense(1, name="logit")(y)[:, 0]


def _dlrm(model, batch, dense_features, seed):
  def make():
    rng = np.random.default_rng(seed)
    dense = jnp.asarray(np.log1p(rng.exponential(size=(batch, dense_features))), jnp.float32)
    # Popular ids are looked up far more often than the tail (Zipf-like).
    sparse = np.stack([(rng.zipf(1.2, size=batch) - 1) % n for n in model.table_sizes], axis=1)
    sparse = jnp.asarray(sparse, jnp.int32)
    clicks = jnp.asarray(rng.random(batch) < 0.25, jnp.float32)
    params = model.init(jax.random.PRNGKey(seed), dense[:2], sparse[:2])
    tx = optax.adagrad(0.02)
    opt_state = tx.init(params)

    def loss_fn(params, dense, sparse, clicks):
      logits = model.apply(params, dense, sparse)
      return optax.sigmoid_binary_cross_entropy(logits, clicks).mean()

    return _train_step(tx, loss_fn), (params, opt_state, dense, sparse, clicks)

  return make


# ----------------------------------------------------------------- entries


def entries() -> list[Entry]:
  donate = (0, 1)
  return [
      # graph
      Entry("graph/mpnn-s", "graph",
            _graph(nodes=750, edges=3000, node_feats=37, edge_feats=5, hidden=48, classes=7, seed=30),
            donate, "message passing: gather, segment_sum, edge/node MLPs, 3 rounds"),
      Entry("graph/mpnn-m", "graph",
            _graph(nodes=2200, edges=9000, node_feats=61, edge_feats=8, hidden=64, classes=12, seed=31),
            donate, "message passing: gather, segment_sum, edge/node MLPs, 3 rounds"),
      # kmeans
      Entry("kmeans/lloyd-s", "kmeans",
            _kmeans(lloyd_step, n=24_000, d=24, k=61, clusters=40, seed=32),
            (1,), "one Lloyd step, argmin, segment_sum centroids, no grad"),
      Entry("kmeans/lloyd-fori-m", "kmeans",
            _kmeans(lloyd_fori, n=90_000, d=40, k=120, clusters=90, seed=33),
            (1,), "5 Lloyd steps in fori_loop, one-hot matmul centroids, no grad"),
      # contrastive
      Entry("contrastive/clip-mlp-s", "contrastive",
            _clip(64, (16, 16, 3), 20, CLIP(image_hidden=320, vocab=2003, text_width=96, embed=96), seed=34),
            donate, "two towers, normalized embeddings, symmetric InfoNCE, learned temperature"),
      Entry("contrastive/clip-mlp-m", "contrastive",
            _clip(256, (32, 32, 3), 32, CLIP(image_hidden=768, vocab=6007, text_width=192, embed=256), seed=35),
            donate, "two towers, normalized embeddings, symmetric InfoNCE, learned temperature"),
      # mixer
      Entry("mixer/mixer-s", "mixer",
            _mixer(MlpMixer(patch=4, channels=96, tokens_hidden=48, channels_hidden=384, blocks=4, classes=10),
                   batch=8, image=32, seed=36),
            donate, "MLP-Mixer, 64 patches, sgd nesterov"),
      Entry("mixer/mixer-m", "mixer",
            _mixer(MlpMixer(patch=4, channels=192, tokens_hidden=96, channels_hidden=768, blocks=6, classes=100),
                   batch=8, image=36, seed=37),
            donate, "MLP-Mixer, 81 patches, sgd nesterov"),
      # recsys
      Entry("recsys/dlrm-s", "recsys",
            _dlrm(DLRM(table_sizes=(12011, 8003, 20011, 5003, 977, 3001, 7919, 1009), embed=16,
                       bottom=(64, 32), top=(128, 64)), batch=512, dense_features=13, seed=38),
            donate, "8 embedding tables (gather), dot interactions, adagrad"),
      Entry("recsys/dlrm-m", "recsys",
            _dlrm(DLRM(table_sizes=(90001, 50021, 40009, 25013, 10007, 5003, 2003, 997, 60013, 20011), embed=16,
                       bottom=(128, 64), top=(256, 128)), batch=2048, dense_features=13, seed=39),
            donate, "10 embedding tables (gather), dot interactions, adagrad"),
  ]
