"""The novel set: train steps written after the unseen set had served to diagnose the estimate.

The unseen set (``unseen.py``) was measured as it came (``unseen_first.json``)
and then served to diagnose the estimate (its capsule and Sinkhorn steps led
to three estimate rules), so it no longer says how jaxmem does on code it has
never seen. These steps were written on 2026-12-01, before any change to
jaxmem in that session, and are measured as they come
(``bench/corpus_bench.py --set novel``, ``bench/corpus_estimates.py``):
nothing in jaxmem is to be changed because of them without keeping that
first run (``bench/results/novel_first.json``) beside the later ones.

Families and program patterns no other set has: a Fourier neural operator
(``rfft2``/``irfft2``, complex arithmetic), differentially private SGD
(per-example gradients by ``vmap`` of ``grad``, clipped one by one), MAML
(gradients through three unrolled inner SGD steps, ``vmap`` over tasks), a
decoder LM computed in ``bfloat16`` with dropout, a Conformer block (depthwise
1-D convolution, GLU, BatchNorm over time, attention), gradient accumulation
(``grad`` inside a ``lax.scan`` over micro-batches), EfficientNet's MBConv
blocks (squeeze-excite, stochastic depth) and a listwise ranking loss (a sort
and a gather by ``argsort``).
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus import Entry
from corpus import train_step as _train_step

# ------------------------------------------------- Fourier neural operator


class _SpectralConv(nn.Module):
  width: int
  modes: int

  @nn.compact
  def __call__(self, x):
    b, h, w, c = x.shape
    init = nn.initializers.normal(1.0 / (c * self.width))
    wr = self.param("w_real", init, (2, self.modes, self.modes, c, self.width))
    wi = self.param("w_imag", init, (2, self.modes, self.modes, c, self.width))
    weights = wr + 1j * wi
    xf = jnp.fft.rfft2(x, axes=(1, 2))
    m = self.modes
    low = jnp.einsum("bxyc,xyco->bxyo", xf[:, :m, :m], weights[0])
    high = jnp.einsum("bxyc,xyco->bxyo", xf[:, -m:, :m], weights[1])
    out = jnp.zeros((b, h, w // 2 + 1, self.width), xf.dtype)
    out = out.at[:, :m, :m].set(low).at[:, -m:, :m].set(high)
    return jnp.fft.irfft2(out, s=(h, w), axes=(1, 2))


class _FNO(nn.Module):
  width: int
  modes: int
  layers: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    for _ in range(self.layers):
      x = nn.gelu(_SpectralConv(self.width, self.modes)(x) + nn.Dense(self.width)(x))
    return nn.Dense(1)(nn.gelu(nn.Dense(4 * self.width)(x)))


def _fno(batch, grid, width, modes, layers, seed):
  def make():
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(size=(batch, grid, grid, 3)), jnp.float32)
    u = jnp.asarray(rng.normal(size=(batch, grid, grid, 1)), jnp.float32)
    model = _FNO(width, modes, layers)
    params = model.init(jax.random.PRNGKey(seed), a)
    tx = optax.adam(1e-3)

    def loss_fn(params, a, u):
      pred = model.apply(params, a)
      return jnp.mean(jnp.linalg.norm((pred - u).reshape(batch, -1), axis=-1)
                      / jnp.linalg.norm(u.reshape(batch, -1), axis=-1))

    return _train_step(tx, loss_fn), (params, tx.init(params), a, u)
  return make


# ---------------------------------------------------------------- DP-SGD


class _Classifier(nn.Module):
  width: int
  classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.width)(x))
    x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(self.classes)(x)


def _dpsgd(batch, features, width, classes, clip, sigma, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, features)), jnp.float32)
    y = jnp.asarray(rng.integers(0, classes, size=batch), jnp.int32)
    model = _Classifier(width, classes)
    params = model.init(jax.random.PRNGKey(seed), x[:1])
    tx = optax.sgd(0.05, momentum=0.9)

    def example_loss(params, xi, yi):
      logits = model.apply(params, xi[None])
      return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None]).sum()

    def step(params, opt_state, key, x, y):
      grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, x, y)
      norms = jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1)
                           for g in jax.tree.leaves(grads)))
      scale = jnp.minimum(1.0, clip / (norms + 1e-6))
      summed = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads)
      leaves, tree = jax.tree.flatten(summed)
      keys = jax.random.split(key, len(leaves) + 1)
      noisy = [(g + sigma * clip * jax.random.normal(k, g.shape)) / batch
               for g, k in zip(leaves, keys[1:])]
      updates, opt_state = tx.update(jax.tree.unflatten(tree, noisy), opt_state, params)
      return optax.apply_updates(params, updates), opt_state, keys[0]

    return step, (params, tx.init(params), jax.random.PRNGKey(seed + 1), x, y)
  return make


# ------------------------------------------------------------------ MAML


def _maml(tasks, shots, features, width, classes, inner_steps, seed):
  def make():
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.normal(size=(tasks, shots, features)), jnp.float32)
    ys = jnp.asarray(rng.integers(0, classes, size=(tasks, shots)), jnp.int32)
    xq = jnp.asarray(rng.normal(size=(tasks, shots, features)), jnp.float32)
    yq = jnp.asarray(rng.integers(0, classes, size=(tasks, shots)), jnp.int32)
    model = _Classifier(width, classes)
    params = model.init(jax.random.PRNGKey(seed), xs[0])
    tx = optax.adam(1e-3)

    def task_loss(params, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    def adapted_loss(params, xs, ys, xq, yq):
      fast = params
      for _ in range(inner_steps):
        grads = jax.grad(task_loss)(fast, xs, ys)
        fast = jax.tree.map(lambda p, g: p - 0.1 * g, fast, grads)
      return task_loss(fast, xq, yq)

    def loss_fn(params, xs, ys, xq, yq):
      return jax.vmap(adapted_loss, in_axes=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).mean()

    return _train_step(tx, loss_fn), (params, tx.init(params), xs, ys, xq, yq)
  return make


# ------------------------------------------------ bfloat16 LM with dropout


class _DecoderBlock(nn.Module):
  dim: int
  heads: int
  rate: float

  @nn.compact
  def __call__(self, x, mask):
    bf16 = jnp.bfloat16
    y = nn.LayerNorm(dtype=bf16)(x)
    y = nn.MultiHeadDotProductAttention(self.heads, dtype=bf16, dropout_rate=self.rate,
                                        deterministic=False)(y, y, mask=mask)
    x = x + nn.Dropout(self.rate, deterministic=False)(y)
    y = nn.LayerNorm(dtype=bf16)(x)
    y = nn.Dense(self.dim, dtype=bf16)(nn.gelu(nn.Dense(4 * self.dim, dtype=bf16)(y)))
    return x + nn.Dropout(self.rate, deterministic=False)(y)


class _BF16LM(nn.Module):
  vocab: int
  dim: int
  heads: int
  layers: int
  rate: float

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.dim, dtype=jnp.bfloat16)
    x = embed(tokens)
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = _DecoderBlock(self.dim, self.heads, self.rate)(x, mask)
    x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
    return embed.attend(x).astype(jnp.float32)


def _bf16_lm(batch, seq, vocab, dim, heads, layers, seed):
  def make():
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, seq + 1)), jnp.int32)
    model = _BF16LM(vocab, dim, heads, layers, 0.1)
    params = model.init({"params": jax.random.PRNGKey(seed),
                         "dropout": jax.random.PRNGKey(seed + 1)}, tokens[:, :-1])
    tx = optax.adamw(3e-4, weight_decay=0.1)

    def loss_fn(params, key, tokens):
      logits = model.apply(params, tokens[:, :-1], rngs={"dropout": key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, key, tokens):
      key, sub = jax.random.split(key)
      loss, grads = jax.value_and_grad(loss_fn)(params, sub, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, key, loss

    return step, (params, tx.init(params), jax.random.PRNGKey(seed + 2), tokens)
  return make


# --------------------------------------------------------------- Conformer


class _ConvModule(nn.Module):
  dim: int
  kernel: int

  @nn.compact
  def __call__(self, x, train):
    y = nn.LayerNorm()(x)
    y = nn.glu(nn.Dense(2 * self.dim)(y))
    y = nn.Conv(self.dim, (self.kernel,), feature_group_count=self.dim, padding="SAME")(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    return nn.Dense(self.dim)(nn.swish(y))


class _ConformerBlock(nn.Module):
  dim: int
  heads: int
  kernel: int

  @nn.compact
  def __call__(self, x, train):
    ffn = lambda: nn.Sequential([nn.LayerNorm(), nn.Dense(4 * self.dim), nn.swish,  # noqa: E731
                                 nn.Dense(self.dim)])
    x = x + 0.5 * ffn()(x)
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads)(y, y)
    x = x + _ConvModule(self.dim, self.kernel)(x, train)
    x = x + 0.5 * ffn()(x)
    return nn.LayerNorm()(x)


class _Conformer(nn.Module):
  dim: int
  heads: int
  kernel: int
  blocks: int
  vocab: int

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(self.dim)(x)
    for _ in range(self.blocks):
      x = _ConformerBlock(self.dim, self.heads, self.kernel)(x, train)
    return nn.Dense(self.vocab)(x)


def _conformer(batch, frames, features, dim, heads, kernel, blocks, vocab, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, frames, features)), jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, size=(batch, frames)), jnp.int32)
    model = _Conformer(dim, heads, kernel, blocks, vocab)
    variables = model.init(jax.random.PRNGKey(seed), x)
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, stats, x, y):
      def loss_fn(params):
        logits, new = model.apply({"params": params, "batch_stats": stats}, x,
                                  mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, new["batch_stats"]
      (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, stats, loss

    return step, (params, tx.init(params), stats, x, y)
  return make


# ------------------------------------------ gradient accumulation in a scan


class _ConvNet(nn.Module):
  widths: tuple[int, ...]
  classes: int

  @nn.compact
  def __call__(self, x):
    for w in self.widths:
      x = nn.relu(nn.Conv(w, (3, 3))(x))
      x = nn.relu(nn.Conv(w, (3, 3))(x))
      x = nn.avg_pool(x, (2, 2), (2, 2))
    return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def _accum(micro, batch, image, widths, classes, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(micro, batch, image, image, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, classes, size=(micro, batch)), jnp.int32)
    model = _ConvNet(widths, classes)
    params = model.init(jax.random.PRNGKey(seed), x[0])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def loss_fn(params, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    def step(params, opt_state, x, y):
      def body(acc, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree.map(jnp.add, acc, (loss, grads)), None
      zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = jax.lax.scan(body, zeros, (x, y))
      grads = jax.tree.map(lambda g: g / micro, grads)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss / micro

    return step, (params, tx.init(params), x, y)
  return make


# ------------------------------------------------- EfficientNet-style MBConv


class _MBConv(nn.Module):
  out: int
  expand: int
  stride: int
  drop: float

  @nn.compact
  def __call__(self, x, key):
    c = x.shape[-1]
    y = nn.swish(nn.BatchNorm(use_running_average=False)(nn.Conv(c * self.expand, (1, 1))(x)))
    y = nn.Conv(c * self.expand, (3, 3), strides=self.stride, feature_group_count=c * self.expand)(y)
    y = nn.swish(nn.BatchNorm(use_running_average=False)(y))
    s = y.mean(axis=(1, 2), keepdims=True)
    s = nn.sigmoid(nn.Dense(c * self.expand)(nn.swish(nn.Dense(max(1, c // 4))(s))))
    y = nn.BatchNorm(use_running_average=False)(nn.Conv(self.out, (1, 1))(y * s))
    if self.stride == 1 and self.out == c:
      keep = jax.random.bernoulli(key, 1.0 - self.drop, (x.shape[0], 1, 1, 1))
      y = x + y * keep / (1.0 - self.drop)
    return y


class _EfficientNet(nn.Module):
  stages: tuple[tuple[int, int, int], ...]   # (channels, blocks, stride)
  classes: int

  @nn.compact
  def __call__(self, x, key):
    x = nn.swish(nn.BatchNorm(use_running_average=False)(nn.Conv(16, (3, 3), strides=2)(x)))
    keys = iter(jax.random.split(key, sum(n for _, n, _ in self.stages)))
    for out, blocks, stride in self.stages:
      for i in range(blocks):
        x = _MBConv(out, 4, stride if i == 0 else 1, 0.2)(x, next(keys))
    return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def _efficientnet(batch, image, stages, classes, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, image, image, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, classes, size=batch), jnp.int32)
    model = _EfficientNet(stages, classes)
    variables = model.init(jax.random.PRNGKey(seed), x, jax.random.PRNGKey(0))
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.rmsprop(1e-3, decay=0.9, momentum=0.9)

    def step(params, opt_state, stats, key, x, y):
      key, sub = jax.random.split(key)

      def loss_fn(params):
        logits, new = model.apply({"params": params, "batch_stats": stats}, x, sub,
                                  mutable=["batch_stats"])
        smooth = optax.smooth_labels(jax.nn.one_hot(y, classes), 0.1)
        return optax.softmax_cross_entropy(logits, smooth).mean(), new["batch_stats"]
      (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, stats, key, loss

    return step, (params, tx.init(params), stats, jax.random.PRNGKey(seed + 1), x, y)
  return make


# ------------------------------------------------------ listwise ranking


class _Scorer(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.relu(nn.LayerNorm()(nn.Dense(self.width)(x)))
    return nn.Dense(1)(x)[..., 0]


def _ranking(queries, docs, features, width, seed):
  def make():
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(queries, docs, features)), jnp.float32)
    rel = jnp.asarray(rng.integers(0, 5, size=(queries, docs)), jnp.float32)
    model = _Scorer(width)
    params = model.init(jax.random.PRNGKey(seed), x[:1])
    tx = optax.lamb(1e-3)

    def loss_fn(params, x, rel):
      scores = model.apply(params, x)
      listnet = optax.softmax_cross_entropy(scores, jax.nn.softmax(rel))
      # Approximate NDCG: a smooth rank of every document, gains sorted for the ideal DCG.
      diff = scores[:, :, None] - scores[:, None, :]
      ranks = 1.0 + jnp.sum(jax.nn.sigmoid(-diff / 0.1), axis=-1) - 0.5
      gains = 2.0 ** rel - 1.0
      dcg = jnp.sum(gains / jnp.log2(1.0 + ranks), axis=-1)
      ideal = jnp.sort(gains, axis=-1)[:, ::-1]
      idcg = jnp.sum(ideal / jnp.log2(2.0 + jnp.arange(docs)), axis=-1)
      order = jnp.argsort(-scores, axis=-1)
      top = jnp.take_along_axis(rel, order[:, :10], axis=-1)
      precision = jnp.mean(top > 2.0)
      return jnp.mean(listnet) - jnp.mean(dcg / (idcg + 1e-6)) + 0.0 * precision

    return _train_step(tx, loss_fn), (params, tx.init(params), x, rel)
  return make


def entries() -> list[Entry]:
  return [
      Entry("fno/spectral-s", "fno", _fno(batch=8, grid=64, width=32, modes=12, layers=4,
                                          seed=501),
            (0, 1), "rfft2/irfft2, complex einsums on the low modes, GELU"),
      Entry("dpsgd/per-example-s", "dpsgd", _dpsgd(batch=64, features=784, width=256,
                                                   classes=10, clip=1.0, sigma=1.1, seed=502),
            (0, 1, 2), "per-example gradients (vmap of grad), clipped, noised, momentum SGD"),
      Entry("maml/inner-loop-s", "maml", _maml(tasks=16, shots=100, features=64, width=256,
                                               classes=5, inner_steps=3, seed=503),
            (0, 1), "gradients through three unrolled inner SGD steps, vmap over tasks"),
      Entry("bf16/lm-dropout-s", "bf16", _bf16_lm(batch=8, seq=128, vocab=2048, dim=256,
                                                  heads=4, layers=3, seed=504),
            (0, 1, 2), "bfloat16 compute, float32 parameters, attention and residual dropout"),
      Entry("conformer/block-s", "conformer", _conformer(batch=8, frames=256, features=80,
                                                         dim=144, heads=4, kernel=15, blocks=2,
                                                         vocab=64, seed=505),
            (0, 1, 2), "depthwise 1-D convolution, GLU, BatchNorm over time, self-attention"),
      Entry("accum/microbatch-scan-s", "accum", _accum(micro=4, batch=16, image=32,
                                                       widths=(32, 64), classes=10, seed=506),
            (0, 1), "grad inside a lax.scan over 4 micro-batches, clipped adamw"),
      Entry("efficientnet/mbconv-se-s", "efficientnet",
            _efficientnet(batch=16, image=48, stages=((24, 1, 1), (40, 2, 2)),
                          classes=100, seed=507),
            (0, 1, 2, 3), "MBConv (depthwise 3x3), squeeze-excite, stochastic depth, RMSProp"),
      Entry("ranking/listwise-s", "ranking", _ranking(queries=64, docs=128, features=136,
                                                      width=256, seed=508),
            (0, 1), "ListNet and approximate NDCG (pairwise sigmoids), a sort, argsort gathers"),
  ]
