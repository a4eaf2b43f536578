"""The held-out corpus: train steps written after jaxmem's estimate was last changed.

Measured by ``bench/corpus_bench.py --set heldout``: they say how the figures
of the main corpus generalise. Their first run is kept
(``bench/results/heldout_first.json``); one change to the estimate followed
it (XLA's code-duplication limit, from the state-space model's under-estimate),
so the state-space entries are no longer held out; the others still are.
Families the main corpus does not have: a ViT, a ConvNeXt (depthwise 7x7
convolutions, LayerNorm, layer scale), an encoder-decoder transformer with
cross-attention, a neural ODE integrated with unrolled RK4, PointNet (shared
MLP, max over points, dropout), a diagonal state-space model over
``lax.associative_scan``, skip-gram with negative sampling (gathers and
scatter-add gradients) and an nnx transformer language model with
``nnx.Optimizer``.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from corpus import Entry
from corpus import train_step as _train_step


def _labels(rng: np.random.Generator, n: int, classes: int) -> jax.Array:
  return jnp.asarray(rng.integers(0, classes, size=n), jnp.int32)


def _image_classifier(model: nn.Module, classes: int, batch: int, image: int, seed: int,
                      tx: optax.GradientTransformation, loss: str):
  """``make()`` of a linen image classifier on random NHWC images and labels.

  ``loss``: ``"smoothed"`` (cross-entropy against labels smoothed by 0.1) or
  ``"integer"`` (cross-entropy with integer labels).
  """
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, image, image, 3)), jnp.float32)
    y = _labels(rng, batch, classes)
    params = model.init(jax.random.PRNGKey(seed), x)

    def loss_fn(params, x, y):
      logits = model.apply(params, x)
      if loss == "smoothed":
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(
            jax.nn.one_hot(y, classes), 0.1)).mean()
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), x, y)
  return make


# --------------------------------------------------------------------- ViT


class EncoderBlock(nn.Module):
  width: int
  heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
    x = x + y
    y = nn.LayerNorm()(x)
    y = nn.Dense(self.width * self.mlp_ratio)(y)
    y = nn.gelu(y)
    y = nn.Dense(self.width)(y)
    return x + y


class ViT(nn.Module):
  patch: int
  width: int
  depth: int
  heads: int
  classes: int

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(self.width, (self.patch, self.patch), strides=self.patch, padding="VALID",
                name="embed")(images)
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
    x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), x], axis=1)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, h * w + 1, c))
    for _ in range(self.depth):
      x = EncoderBlock(self.width, self.heads)(x)
    x = nn.LayerNorm()(x[:, 0])
    return nn.Dense(self.classes)(x)


def _vit(model: ViT, batch: int, image: int, seed: int):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.05))
  return _image_classifier(model, model.classes, batch, image, seed, tx, "smoothed")


# ---------------------------------------------------------------- ConvNeXt


class ConvNeXtBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.width, (7, 7), feature_group_count=self.width, padding="SAME")(x)
    y = nn.LayerNorm(epsilon=1e-6)(y)
    y = nn.Dense(4 * self.width)(y)
    y = nn.gelu(y)
    y = nn.Dense(self.width)(y)
    gamma = self.param("gamma", nn.initializers.constant(1e-6), (self.width,))
    return x + gamma * y


class ConvNeXt(nn.Module):
  widths: Sequence[int]
  depths: Sequence[int]
  classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.widths[0], (4, 4), strides=4, padding="VALID", name="stem")(x)
    x = nn.LayerNorm(epsilon=1e-6)(x)
    for i, (w, d) in enumerate(zip(self.widths, self.depths)):
      if i:
        x = nn.LayerNorm(epsilon=1e-6)(x)
        x = nn.Conv(w, (2, 2), strides=2, padding="VALID")(x)
      for _ in range(d):
        x = ConvNeXtBlock(w)(x)
    x = nn.LayerNorm(epsilon=1e-6)(x.mean(axis=(1, 2)))
    return nn.Dense(self.classes)(x)


def _convnext(model: ConvNeXt, batch: int, image: int, seed: int):
  return _image_classifier(model, model.classes, batch, image, seed,
                           optax.sgd(0.05, momentum=0.9, nesterov=True), "integer")


# ------------------------------------------------- encoder-decoder (plain JAX)


def _init_seq2seq(key, vocab, d, layers, heads):
  def dense(key, m, n):
    return jax.random.normal(key, (m, n), jnp.float32) / np.sqrt(m)

  keys = iter(jax.random.split(key, 4 + 16 * layers))

  def attn():
    return {"q": dense(next(keys), d, d), "k": dense(next(keys), d, d),
            "v": dense(next(keys), d, d), "o": dense(next(keys), d, d)}

  def ffn():
    return {"w1": dense(next(keys), d, 4 * d), "w2": dense(next(keys), 4 * d, d)}

  return {
      "src_embed": dense(next(keys), vocab, d) * np.sqrt(d) * 0.02,
      "tgt_embed": dense(next(keys), vocab, d) * np.sqrt(d) * 0.02,
      "enc": [{"self": attn(), "ffn": ffn(), "ln": jnp.ones((2, d))} for _ in range(layers)],
      "dec": [{"self": attn(), "cross": attn(), "ffn": ffn(), "ln": jnp.ones((3, d))}
              for _ in range(layers)],
      "out": dense(next(keys), d, vocab),
  }


def _layer_norm(x, scale):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale


def _attention(p, x, ctx, heads, mask=None):
  b, t, d = x.shape
  split = lambda y: y.reshape(b, -1, heads, d // heads)  # noqa: E731
  q, k, v = split(x @ p["q"]), split(ctx @ p["k"]), split(ctx @ p["v"])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
  if mask is not None:
    logits = jnp.where(mask, logits, -1e9)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
  return out.reshape(b, t, d) @ p["o"]


def _seq2seq_loss(params, src, tgt_in, tgt_out, heads):
  x = params["src_embed"][src]
  for layer in params["enc"]:
    x = x + _attention(layer["self"], _layer_norm(x, layer["ln"][0]),
                       _layer_norm(x, layer["ln"][0]), heads)
    x = x + jax.nn.relu(_layer_norm(x, layer["ln"][1]) @ layer["ffn"]["w1"]) @ layer["ffn"]["w2"]
  y = params["tgt_embed"][tgt_in]
  t = tgt_in.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  for layer in params["dec"]:
    h = _layer_norm(y, layer["ln"][0])
    y = y + _attention(layer["self"], h, h, heads, causal)
    y = y + _attention(layer["cross"], _layer_norm(y, layer["ln"][1]), x, heads)
    y = y + jax.nn.relu(_layer_norm(y, layer["ln"][2]) @ layer["ffn"]["w1"]) @ layer["ffn"]["w2"]
  logits = y @ params["out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out).mean()


def _seq2seq(batch, src_len, tgt_len, vocab, d, layers, heads, seed):
  def make():
    rng = np.random.default_rng(seed)
    src = jnp.asarray(rng.integers(0, vocab, size=(batch, src_len)), jnp.int32)
    tgt = jnp.asarray(rng.integers(0, vocab, size=(batch, tgt_len + 1)), jnp.int32)
    params = _init_seq2seq(jax.random.PRNGKey(seed), vocab, d, layers, heads)
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000))

    def loss_fn(params, src, tgt):
      return _seq2seq_loss(params, src, tgt[:, :-1], tgt[:, 1:], heads)

    return _train_step(tx, loss_fn), (params, tx.init(params), src, tgt)
  return make


# ---------------------------------------------------- neural ODE (unrolled RK4)


def _ode(batch, dim, hidden, steps, seed):
  def make():
    rng = np.random.default_rng(seed)
    x0 = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {"w1": jax.random.normal(k1, (dim + 1, hidden)) / np.sqrt(dim + 1),
              "w2": jax.random.normal(k2, (hidden, hidden)) / np.sqrt(hidden),
              "w3": jax.random.normal(k3, (hidden, dim)) / np.sqrt(hidden) * 0.1,
              "b1": jnp.zeros(hidden), "b2": jnp.zeros(hidden)}
    tx = optax.adabelief(1e-3)

    def field(p, t, x):
      h = jnp.tanh(jnp.concatenate([x, jnp.full((x.shape[0], 1), t)], -1) @ p["w1"] + p["b1"])
      h = jnp.tanh(h @ p["w2"] + p["b2"])
      return h @ p["w3"]

    def loss_fn(p, x0, target):
      dt = 1.0 / steps
      x = x0
      for i in range(steps):
        t = i * dt
        a = field(p, t, x)
        b = field(p, t + dt / 2, x + dt / 2 * a)
        c = field(p, t + dt / 2, x + dt / 2 * b)
        d = field(p, t + dt, x + dt * c)
        x = x + dt / 6 * (a + 2 * b + 2 * c + d)
      return jnp.mean((x - target) ** 2)

    return _train_step(tx, loss_fn), (params, tx.init(params), x0, target)
  return make


# ---------------------------------------------------------------- PointNet


class PointNet(nn.Module):
  widths: Sequence[int]
  head: Sequence[int]
  classes: int

  @nn.compact
  def __call__(self, points, *, train: bool):
    x = points
    for w in self.widths:              # the shared MLP: one Dense over every point
      x = nn.relu(nn.LayerNorm()(nn.Dense(w)(x)))
    x = x.max(axis=1)                  # symmetric over the points
    for w in self.head:
      x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(w)(x)))
    return nn.Dense(self.classes)(x)


def _pointnet(model: PointNet, batch: int, points: int, seed: int):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, points, 3)), jnp.float32)
    y = _labels(rng, batch, model.classes)
    params = model.init(jax.random.PRNGKey(seed), x, train=False)
    tx = optax.adam(1e-3)

    def step(params, opt_state, key, x, y):
      key, drop = jax.random.split(key)

      def loss_fn(params):
        logits = model.apply(params, x, train=True, rngs={"dropout": drop})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, key, loss

    return step, (params, tx.init(params), jax.random.PRNGKey(seed + 1), x, y)
  return make


# ------------------------------------------- diagonal SSM (associative_scan)


def _ssm(batch, length, d, state, layers, classes, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, length, d)), jnp.float32)
    y = _labels(rng, batch, classes)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 * layers + 1))
    params = {"layers": [{"log_a": jnp.log(jnp.linspace(0.5, 0.99, state)),
                          "b": jax.random.normal(next(keys), (d, state)) / np.sqrt(d),
                          "c": jax.random.normal(next(keys), (state, d)) / np.sqrt(state),
                          "gate": jax.random.normal(next(keys), (d, d)) / np.sqrt(d),
                          "ln": jnp.ones(d)} for _ in range(layers)],
              "head": jax.random.normal(next(keys), (d, classes)) / np.sqrt(d)}
    tx = optax.lion(1e-4)

    def layer(p, u):
      a = jnp.exp(p["log_a"])                                    # (state,)
      bu = _layer_norm(u, p["ln"]) @ p["b"]                      # (batch, length, state)
      a_t = jnp.broadcast_to(a, bu.shape)

      def combine(left, right):
        (a1, b1), (a2, b2) = left, right
        return a1 * a2, a2 * b1 + b2

      _, h = jax.lax.associative_scan(combine, (a_t, bu), axis=1)
      return u + (h @ p["c"]) * jax.nn.sigmoid(u @ p["gate"])

    def loss_fn(params, x, y):
      u = x
      for p in params["layers"]:
        u = layer(p, u)
      logits = u.mean(axis=1) @ params["head"]
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), x, y)
  return make


# ---------------------------------------- skip-gram with negative sampling


def _skipgram(vocab, dim, batch, negatives, seed):
  def make():
    rng = np.random.default_rng(seed)
    center = jnp.asarray(rng.integers(0, vocab, size=batch), jnp.int32)
    context = jnp.asarray(rng.integers(0, vocab, size=batch), jnp.int32)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {"in": jax.random.uniform(k1, (vocab, dim), minval=-0.5 / dim, maxval=0.5 / dim),
              "out": jnp.zeros((vocab, dim))}
    tx = optax.sgd(0.025)

    def step(params, opt_state, key, center, context):
      key, sample = jax.random.split(key)
      negs = jax.random.randint(sample, (center.shape[0], negatives), 0, vocab)

      def loss_fn(params):
        c = params["in"][center]                                  # (batch, dim)
        pos = jnp.sum(c * params["out"][context], -1)
        neg = jnp.einsum("bd,bkd->bk", c, params["out"][negs])
        return -(jax.nn.log_sigmoid(pos).mean() + jax.nn.log_sigmoid(-neg).sum(-1).mean())

      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, key, loss

    return step, (params, tx.init(params), jax.random.PRNGKey(seed + 1), center, context)
  return make


# ------------------------------------------------- nnx transformer language model


class NnxBlock(nnx.Module):

  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.RMSNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
    self.ln2 = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    gate, value = jnp.split(self.up(self.ln2(x)), 2, axis=-1)
    return x + self.down(nnx.silu(gate) * value)                  # SwiGLU


class NnxLM(nnx.Module):

  def __init__(self, vocab: int, d: int, heads: int, depth: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(d, heads, rngs=rngs) for _ in range(depth)])
    self.norm = nnx.RMSNorm(d, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(self.norm(x))                          # tied embeddings


def _nnx_lm(vocab, d, heads, depth, batch, length, seed):
  def make():
    model = NnxLM(vocab, d, heads, depth, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4, b2=0.95), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, length + 1)), jnp.int32)

    def step(state, tokens):
      model, optimizer = nnx.merge(graphdef, state)

      def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      _, state = nnx.split((model, optimizer))
      return state, loss

    return step, (state, tokens)
  return make


def entries() -> list[Entry]:
  donate = (0, 1)
  return [
      Entry("vit/vit-s", "vit", _vit(ViT(patch=4, width=96, depth=4, heads=3, classes=10),
                                     batch=16, image=32, seed=200),
            donate, "patch conv, CLS token, pre-LN MHA blocks, label smoothing, clipped adamw"),
      Entry("vit/vit-m", "vit", _vit(ViT(patch=4, width=128, depth=6, heads=4, classes=100),
                                     batch=8, image=48, seed=201),
            donate, "patch conv, CLS token, pre-LN MHA blocks, label smoothing, clipped adamw"),
      Entry("convnext/convnext-s", "convnext",
            _convnext(ConvNeXt(widths=(32, 64), depths=(2, 2), classes=10), batch=16, image=64,
                      seed=202),
            donate, "depthwise 7x7 conv, LayerNorm, inverted MLP, layer scale, nesterov"),
      Entry("convnext/convnext-m", "convnext",
            _convnext(ConvNeXt(widths=(48, 96, 192), depths=(2, 2, 4), classes=100), batch=16,
                      image=96, seed=203),
            donate, "depthwise 7x7 conv, LayerNorm, inverted MLP, layer scale, nesterov"),
      Entry("seq2seq/enc-dec-s", "seq2seq",
            _seq2seq(batch=16, src_len=48, tgt_len=40, vocab=4001, d=128, layers=2, heads=4,
                     seed=204),
            donate, "plain-JAX encoder-decoder: causal self-attention, cross-attention"),
      Entry("seq2seq/enc-dec-m", "seq2seq",
            _seq2seq(batch=6, src_len=64, tgt_len=64, vocab=8009, d=192, layers=3, heads=6,
                     seed=205),
            donate, "plain-JAX encoder-decoder: causal self-attention, cross-attention"),
      Entry("ode/rk4-s", "ode", _ode(batch=2048, dim=32, hidden=256, steps=8, seed=206),
            donate, "neural ODE, 8 unrolled RK4 steps of a tanh MLP field, adabelief"),
      Entry("ode/rk4-m", "ode", _ode(batch=1536, dim=64, hidden=256, steps=12, seed=207),
            donate, "neural ODE, 12 unrolled RK4 steps of a tanh MLP field, adabelief"),
      Entry("pointnet/pointnet-s", "pointnet",
            _pointnet(PointNet(widths=(64, 128, 512), head=(256, 128), classes=16), batch=8,
                      points=512, seed=208),
            (0, 1, 2), "shared per-point MLP, max over points, dropout from a carried key"),
      Entry("pointnet/pointnet-m", "pointnet",
            _pointnet(PointNet(widths=(64, 128, 1024), head=(512, 256), classes=40), batch=8,
                      points=640, seed=209),
            (0, 1, 2), "shared per-point MLP, max over points, dropout from a carried key"),
      Entry("ssm/diag-scan-s", "ssm",
            _ssm(batch=16, length=256, d=64, state=64, layers=2, classes=10, seed=210),
            donate, "diagonal linear recurrence by lax.associative_scan, gated, lion"),
      Entry("ssm/diag-scan-m", "ssm",
            _ssm(batch=16, length=512, d=96, state=128, layers=3, classes=10, seed=211),
            donate, "diagonal linear recurrence by lax.associative_scan, gated, lion"),
      Entry("skipgram/negsample-s", "skipgram",
            _skipgram(vocab=50_000, dim=128, batch=4096, negatives=5, seed=212),
            (0, 1, 2), "embedding gathers, scatter-add gradients, sampled negatives"),
      Entry("skipgram/negsample-m", "skipgram",
            _skipgram(vocab=40_009, dim=128, batch=8192, negatives=8, seed=213),
            (0, 1, 2), "embedding gathers, scatter-add gradients, sampled negatives"),
      Entry("nnx/lm-s", "nnx-lm", _nnx_lm(vocab=2048, d=128, heads=4, depth=3, batch=8,
                                          length=128, seed=214),
            (0,), "nnx: RMSNorm, MHA with causal mask, SwiGLU, tied embeddings, nnx.Optimizer"),
      Entry("nnx/lm-m", "nnx-lm", _nnx_lm(vocab=5000, d=192, heads=6, depth=4, batch=4,
                                          length=192, seed=215),
            (0,), "nnx: RMSNorm, MHA with causal mask, SwiGLU, tied embeddings, nnx.Optimizer"),
  ]
