"""Sequence models: recurrent nets, transformers, mixture-of-experts.

Written the way flax linen users write them: a module, ``model.init``, an
optax optimizer, and a train step closing over both that takes
``(params, opt_state, *batch)`` and returns ``(params, opt_state, loss)``.
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


def _tokens(seed, shape, vocab):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32))


def _lm_loss(logits, tokens):
  """Next-token cross-entropy: logits at t predict tokens at t + 1."""
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def _clipped_adam(lr=3e-3):
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))


def _adamw_warmup_cosine(peak=6e-4, warmup=200, total=10_000):
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=total, end_value=peak * 0.1)
  return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1)


# --------------------------------------------------------------------- rnn


class CharLSTM(nn.Module):
  """A character LSTM LM, unrolled with a Python loop over time."""
  vocab: int
  embed: int
  hidden: int
  layers: int = 1

  @nn.compact
  def __call__(self, tokens):
    batch, steps = tokens.shape
    x = nn.Embed(self.vocab, self.embed)(tokens)
    for layer in range(self.layers):
      cell = nn.OptimizedLSTMCell(self.hidden, name=f"lstm_{layer}")
      carry = cell.initialize_carry(jax.random.PRNGKey(0), (batch, x.shape[-1]))
      outs = []
      for t in range(steps):
        carry, y = cell(carry, x[:, t])
        outs.append(y)
      x = jnp.stack(outs, axis=1)
    return nn.Dense(self.vocab, name="head")(x)


class GRULM(nn.Module):
  """A GRU LM over ``jax.lax.scan`` (``nn.RNN``), with a projection."""
  vocab: int
  embed: int
  hidden: int
  layers: int = 1

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.embed)(tokens)
    for layer in range(self.layers):
      x = nn.RNN(nn.GRUCell(self.hidden), name=f"gru_{layer}")(x)
    x = nn.tanh(nn.Dense(self.embed, name="proj")(x))
    return nn.Dense(self.vocab, name="head")(x)


def _rnn(model, batch, steps, seed):
  def make():
    tokens = _tokens(seed, (batch, steps), model.vocab)
    params = model.init(jax.random.PRNGKey(seed), tokens[:2])
    tx = _clipped_adam()
    opt_state = tx.init(params)

    def loss_fn(params, tokens):
      return _lm_loss(model.apply(params, tokens), tokens)

    return _train_step(tx, loss_fn), (params, opt_state, tokens)

  return make


# --------------------------------------------------------------- attention


class MLP(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    return nn.Dense(d)(nn.gelu(nn.Dense(self.hidden)(x)))


class PostLNBlock(nn.Module):
  heads: int
  mlp: int
  dropout: float

  @nn.compact
  def __call__(self, x, mask, deterministic):
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.heads, dropout_rate=self.dropout, deterministic=deterministic)(x, x, mask=mask)
    x = nn.LayerNorm()(x + nn.Dropout(self.dropout)(y, deterministic=deterministic))
    y = MLP(self.mlp)(x)
    return nn.LayerNorm()(x + nn.Dropout(self.dropout)(y, deterministic=deterministic))


class PostLNGPT(nn.Module):
  """GPT-1 style: learned positions, post-LN blocks, GELU MLP, dropout."""
  vocab: int
  d: int
  heads: int
  layers: int
  max_len: int
  dropout: float = 0.1

  @nn.compact
  def __call__(self, tokens, deterministic=True):
    t = tokens.shape[1]
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.d))
    x = nn.Embed(self.vocab, self.d)(tokens) + pos[None, :t]
    x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = PostLNBlock(self.heads, 4 * self.d, self.dropout)(x, mask, deterministic)
    return nn.Dense(self.vocab, use_bias=False)(x)


def _rope(x, positions, base=10000.0):
  """Rotary embeddings on the last axis of ``x`` (``[..., t, (h,) dh]``)."""
  dh = x.shape[-1]
  freqs = 1.0 / (base ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [t, dh/2]
  if x.ndim == 4:  # [b, t, h, dh]
    angles = angles[:, None, :]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = x[..., 0::2], x[..., 1::2]
  rot = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return rot.reshape(x.shape)


class MultiQueryAttention(nn.Module):
  heads: int
  head_dim: int

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    q = nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name="q")(x)
    k = nn.Dense(self.head_dim, use_bias=False, name="k")(x)  # one shared K head
    v = nn.Dense(self.head_dim, use_bias=False, name="v")(x)  # one shared V head
    pos = jnp.arange(t)
    q, k = _rope(q, pos), _rope(k, pos)
    scores = jnp.einsum("bthd,bsd->bhts", q, k) / math.sqrt(self.head_dim)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bsd->bthd", probs, v)
    return nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="o")(out)


class SwiGLU(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    gate = nn.Dense(self.hidden, use_bias=False)(x)
    up = nn.Dense(self.hidden, use_bias=False)(x)
    return nn.Dense(x.shape[-1], use_bias=False)(nn.silu(gate) * up)


class MQARopeLM(nn.Module):
  """Pre-LN decoder with multi-query attention, rotary positions, SwiGLU."""
  vocab: int
  d: int
  heads: int
  layers: int
  mlp: int

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.d)
    x = embed(tokens)
    for i in range(self.layers):
      x = x + MultiQueryAttention(self.heads, self.d // self.heads, name=f"attn_{i}")(
          nn.RMSNorm(name=f"norm_attn_{i}")(x))
      x = x + SwiGLU(self.mlp, name=f"mlp_{i}")(nn.RMSNorm(name=f"norm_mlp_{i}")(x))
    x = nn.RMSNorm(name="norm_out")(x)
    return embed.attend(x)  # tied output embedding


def _sinusoid(t, d):
  pos = np.arange(t)[:, None]
  i = np.arange(d // 2)[None, :]
  angle = pos / (10000 ** (2 * i / d))
  return jnp.asarray(np.concatenate([np.sin(angle), np.cos(angle)], axis=-1), jnp.float32)


class PreLNEncoderBlock(nn.Module):
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, x, mask):
    x = x + nn.SelfAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    return x + MLP(self.mlp)(nn.LayerNorm()(x))


class EncoderClassifier(nn.Module):
  """A BERT-ish encoder over padded sequences, masked mean pooling, classes."""
  vocab: int
  d: int
  heads: int
  layers: int
  classes: int

  @nn.compact
  def __call__(self, tokens):
    valid = tokens != 0  # id 0 is padding
    x = nn.Embed(self.vocab, self.d)(tokens) + _sinusoid(tokens.shape[1], self.d)[None]
    mask = nn.make_attention_mask(valid, valid)
    for _ in range(self.layers):
      x = PreLNEncoderBlock(self.heads, 4 * self.d)(x, mask)
    x = nn.LayerNorm()(x)
    w = valid[..., None].astype(x.dtype)
    pooled = (x * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
    h = nn.tanh(nn.Dense(self.d, name="pooler")(pooled))
    return nn.Dense(self.classes, name="classifier")(h)


class ScanBlock(nn.Module):
  """One pre-LN decoder block, carried through ``nn.scan``."""
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, x, _):
    t = x.shape[1]
    mask = nn.make_causal_mask(jnp.ones((x.shape[0], t)))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    x = x + MLP(self.mlp)(nn.LayerNorm()(x))
    return x, None


class ScannedDecoder(nn.Module):
  vocab: int
  d: int
  heads: int
  layers: int
  max_len: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    x = x + self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.d))[None, :tokens.shape[1]]
    blocks = nn.scan(
        ScanBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=self.layers,
    )(self.heads, 4 * self.d, name="blocks")
    x, _ = blocks(x, None)
    x = nn.LayerNorm()(x)
    return nn.Dense(self.vocab, name="head")(x)


def _lm(model, batch, steps, seed, tx_fn=_adamw_warmup_cosine):
  def make():
    tokens = _tokens(seed, (batch, steps), model.vocab)
    params = model.init(jax.random.PRNGKey(seed), tokens[:2])
    tx = tx_fn()
    opt_state = tx.init(params)

    def loss_fn(params, tokens):
      return _lm_loss(model.apply(params, tokens), tokens)

    return _train_step(tx, loss_fn), (params, opt_state, tokens)

  return make


def _gpt_dropout(model, batch, steps, seed):
  def make():
    tokens = _tokens(seed, (batch, steps), model.vocab)
    params = model.init(jax.random.PRNGKey(seed), tokens[:2])
    tx = _adamw_warmup_cosine()
    opt_state = tx.init(params)

    def step(params, opt_state, tokens, rng):
      rng, drop = jax.random.split(rng)

      def loss_fn(params):
        logits = model.apply(params, tokens, deterministic=False, rngs={"dropout": drop})
        return _lm_loss(logits, tokens)

      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, rng, loss

    return step, (params, opt_state, tokens, jax.random.PRNGKey(seed + 1))

  return make


def _classifier(model, batch, steps, seed):
  def make():
    rng = np.random.default_rng(seed)
    lengths = rng.integers(steps // 4, steps + 1, size=batch)
    ids = rng.integers(1, model.vocab, size=(batch, steps))
    ids = np.where(np.arange(steps)[None, :] < lengths[:, None], ids, 0)
    tokens = jnp.asarray(ids, jnp.int32)
    labels = jnp.asarray(rng.integers(0, model.classes, size=batch), jnp.int32)
    params = model.init(jax.random.PRNGKey(seed), tokens[:2])
    tx = _adamw_warmup_cosine(peak=1e-4)
    opt_state = tx.init(params)

    def loss_fn(params, tokens, labels):
      logits = model.apply(params, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return _train_step(tx, loss_fn), (params, opt_state, tokens, labels)

  return make


# --------------------------------------------------------------------- moe


class Top2MoE(nn.Module):
  """GShard-style top-2 MoE MLP: one-hot dispatch/combine, capacity factor.

  Returns the output and the load-balancing auxiliary loss.
  """
  experts: int
  hidden: int
  group_size: int
  capacity_factor: float = 1.25

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    e = self.experts
    tokens = x.reshape(-1, self.group_size, d)  # [g, s, d]
    g, s, _ = tokens.shape
    capacity = int(math.ceil(self.capacity_factor * 2 * s / e))

    logits = nn.Dense(e, use_bias=False, name="router")(tokens)
    probs = jax.nn.softmax(logits, axis=-1)  # [g, s, e]
    gates, index = jax.lax.top_k(probs, 2)  # [g, s, 2]
    gates = gates / gates.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(index, e, dtype=x.dtype)  # [g, s, 2, e]

    # Load balancing (Switch/GShard): fraction routed (top-1) x mean router prob.
    density = choice[:, :, 0].mean(axis=1)
    density_proxy = probs.mean(axis=1)
    aux = (density * density_proxy).mean() * e * e

    # Position of each token in its expert's buffer; first choices go first.
    ordered = jnp.swapaxes(choice, 1, 2).reshape(g, 2 * s, e)
    position = (jnp.cumsum(ordered, axis=1) - 1.0) * ordered
    position = jnp.swapaxes(position.reshape(g, 2, s, e), 1, 2)  # [g, s, 2, e]
    keep = choice * (position < capacity)
    slot = jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=x.dtype)  # [g, s, 2, e, c]
    dispatch = jnp.einsum("gske,gskec->gsec", keep, slot)
    combine = jnp.einsum("gsk,gske,gskec->gsec", gates, keep, slot)

    w_in = self.param("w_in", nn.initializers.lecun_normal(), (e, d, self.hidden))
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (e, self.hidden, d))
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, tokens)
    h = nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, w_in))
    expert_out = jnp.einsum("egcf,efd->egcd", h, w_out)
    out = jnp.einsum("gsec,egcd->gsd", combine, expert_out)
    return out.reshape(b, t, d), aux


class MoELM(nn.Module):
  vocab: int
  d: int
  heads: int
  layers: int
  experts: int
  group_size: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    x = x + self.param("pos_embed", nn.initializers.normal(0.02), (tokens.shape[1], self.d))[None]
    mask = nn.make_causal_mask(tokens)
    aux_total = 0.0
    for i in range(self.layers):
      x = x + nn.SelfAttention(num_heads=self.heads, name=f"attn_{i}")(nn.LayerNorm()(x), mask=mask)
      y, aux = Top2MoE(self.experts, 2 * self.d, self.group_size, name=f"moe_{i}")(nn.LayerNorm()(x))
      x = x + y
      aux_total = aux_total + aux
    x = nn.LayerNorm()(x)
    return nn.Dense(self.vocab, name="head")(x), aux_total / self.layers


def _moe(model, batch, steps, seed):
  def make():
    tokens = _tokens(seed, (batch, steps), model.vocab)
    params = model.init(jax.random.PRNGKey(seed), tokens[:1, :])
    tx = _clipped_adam(1e-3)
    opt_state = tx.init(params)

    def loss_fn(params, tokens):
      logits, aux = model.apply(params, tokens)
      return _lm_loss(logits, tokens) + 0.01 * aux

    return _train_step(tx, loss_fn), (params, opt_state, tokens)

  return make


# ----------------------------------------------------------------- entries


def entries() -> list[Entry]:
  donate = (0, 1)
  return [
      # rnn
      Entry("rnn/lstm-unrolled-s", "rnn",
            _rnn(CharLSTM(vocab=97, embed=48, hidden=192), batch=16, steps=24, seed=0),
            donate, "char LSTM, Python loop over 24 steps, clipped adam"),
      Entry("rnn/lstm-unrolled-m", "rnn",
            _rnn(CharLSTM(vocab=97, embed=64, hidden=320, layers=2), batch=24, steps=16, seed=1),
            donate, "2-layer char LSTM, Python loop over 16 steps, clipped adam"),
      Entry("rnn/gru-scan-s", "rnn",
            _rnn(GRULM(vocab=97, embed=64, hidden=320), batch=24, steps=48, seed=2),
            donate, "GRU over lax.scan (nn.RNN), clipped adam"),
      Entry("rnn/gru-scan-m", "rnn",
            _rnn(GRULM(vocab=211, embed=128, hidden=416, layers=2), batch=24, steps=64, seed=3),
            donate, "2-layer GRU over lax.scan (nn.RNN), clipped adam"),
      # attention
      Entry("attention/gpt-postln-s", "attention",
            _gpt_dropout(PostLNGPT(vocab=1013, d=96, heads=4, layers=2, max_len=64), batch=8, steps=48, seed=10),
            donate, "post-LN decoder, learned positions, GELU, dropout, adamw warmup-cosine"),
      Entry("attention/gpt-postln-m", "attention",
            _gpt_dropout(PostLNGPT(vocab=1999, d=160, heads=5, layers=4, max_len=96), batch=8, steps=64, seed=11),
            donate, "post-LN decoder, learned positions, GELU, dropout, adamw warmup-cosine"),
      Entry("attention/mqa-rope-s", "attention",
            _lm(MQARopeLM(vocab=1201, d=128, heads=4, layers=2, mlp=344), batch=6, steps=56, seed=12),
            donate, "pre-LN (RMSNorm) decoder, multi-query attention, rotary, SwiGLU, tied head"),
      Entry("attention/mqa-rope-m", "attention",
            _lm(MQARopeLM(vocab=3001, d=224, heads=7, layers=3, mlp=608), batch=6, steps=80, seed=13),
            donate, "pre-LN (RMSNorm) decoder, multi-query attention, rotary, SwiGLU, tied head"),
      Entry("attention/encoder-cls-s", "attention",
            _classifier(EncoderClassifier(vocab=3001, d=96, heads=4, layers=2, classes=10), batch=12, steps=60, seed=14),
            donate, "pre-LN encoder, padding mask, masked mean pooling, 10 classes"),
      Entry("attention/scan-decoder-m", "attention",
            _lm(ScannedDecoder(vocab=1037, d=128, heads=4, layers=6, max_len=96), batch=8, steps=72, seed=15),
            donate, "6-layer pre-LN decoder as nn.scan over one block"),
      # moe
      Entry("moe/top2-s", "moe",
            _moe(MoELM(vocab=383, d=96, heads=4, layers=2, experts=6, group_size=64), batch=6, steps=64, seed=20),
            donate, "top-2 MoE MLP, one-hot dispatch/combine, capacity 1.25, aux loss"),
      Entry("moe/top2-m", "moe",
            _moe(MoELM(vocab=1999, d=160, heads=5, layers=2, experts=8, group_size=96), batch=10, steps=96, seed=21),
            donate, "top-2 MoE MLP, one-hot dispatch/combine, capacity 1.25, aux loss"),
  ]
