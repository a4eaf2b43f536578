"""Train steps jaxmem was not written for: user-style flax linen code, only the decorator added."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxmem


# A leaf whose values are rounding noise (the Adam moment of an attention key's
# bias, which softmax ignores: ~1e-10) differs by noise between two programs
# that order a sum differently; relative to its own scale that is any ratio.
NOISE_FLOOR = 1e-9


def close(a, b, rtol=1e-6, atol=None):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    scale = float(np.max(np.abs(y))) if y.size else 0.0
    np.testing.assert_allclose(x, y, rtol=rtol,
                               atol=max(rtol * scale, NOISE_FLOOR) if atol is None else atol)


# --- 1. TrainState + LayerNorm residual MLP + sgd momentum with clipping -----------------

class ResBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(self.width * 2)(h))
    return x + nn.Dense(self.width)(h)


class ResMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(128)(x)
    for _ in range(4):
      x = ResBlock(128)(x)
    return nn.Dense(1)(nn.LayerNorm()(x)).squeeze(-1)


def make_trainstate():
  model = ResMLP()
  x = jax.random.normal(jax.random.PRNGKey(1), (1024, 32))
  y = jnp.sin(x.sum(-1))
  params = model.init(jax.random.PRNGKey(0), x[:2])["params"]
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def train_step(state, x, y):
    def loss_fn(params):
      pred = state.apply_fn({"params": params}, x)
      return jnp.mean((pred - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return train_step, (state, x, y)


# --- 2. A tiny transformer encoder with adamw and a schedule ------------------------------

class Encoder(nn.Module):
  vocab: int = 64
  dim: int = 64
  heads: int = 4
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.dim)(tokens)
    for _ in range(self.layers):
      h = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h)
      h = nn.LayerNorm()(x)
      x = x + nn.Dense(self.dim)(nn.relu(nn.Dense(4 * self.dim)(h)))
    return nn.Dense(self.vocab)(x)


def make_transformer():
  model = Encoder()
  tokens = jax.random.randint(jax.random.PRNGKey(2), (16, 64), 0, 64)
  params = model.init(jax.random.PRNGKey(0), tokens[:1])
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10), weight_decay=1e-2)
  opt_state = tx.init(params)

  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply(p, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, tokens)


# --- 3. CNN with BatchNorm (mutable batch_stats), dropout rng and avg_pool ------------------

class BNConvNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    for c in (16, 32):
      x = nn.Conv(c, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, (2, 2), (2, 2))
    x = x.mean(axis=(1, 2))
    x = nn.Dropout(0.1, deterministic=not train)(x)
    return nn.Dense(10)(x)


def make_bn_cnn():
  model = BNConvNet()
  images = jax.random.normal(jax.random.PRNGKey(3), (32, 32, 32, 3))
  labels = jnp.arange(32) % 10
  variables = model.init(jax.random.PRNGKey(0), images[:2], train=False)
  tx = optax.sgd(0.05)
  opt_state = tx.init(variables["params"])

  def step(params, batch_stats, opt_state, rng, images, labels):
    def loss_fn(p):
      logits, updates = model.apply({"params": p, "batch_stats": batch_stats}, images, train=True,
                                    rngs={"dropout": rng}, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, updates["batch_stats"]
    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, loss

  return step, (variables["params"], variables["batch_stats"], opt_state,
                jax.random.PRNGKey(7), images, labels)


@pytest.mark.parametrize("make", [make_trainstate, make_transformer],
                         ids=["trainstate-resmlp", "transformer-adamw"])
def test_user_step_fits_with_only_the_decorator(make):
  step, args = make()
  want = jax.jit(step)(*args)
  fitted = jaxmem.fit(0.8)(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes < res.unplanned_peak_bytes
  mem = jaxmem.compiled_memory(fitted.lower(*args).compile())
  assert mem.peak_bytes <= res.budget_bytes
  close(fitted(*args), want)


def test_decorator_form_on_a_user_function():
  step, args = make_trainstate()

  @jaxmem.fit(0.8)
  def train_step(state, x, y):
    return step(state, x, y)

  state, loss = train_step(*args)
  want_state, want_loss = jax.jit(step)(*args)
  close((state.params, loss), (want_state.params, want_loss))
  # Roles come from the pytree: TrainState.params are parameters, its opt_state optimizer state.
  prog = train_step.analyze(*args)
  roles = {v.role for v in prog.vars if v.is_input}
  assert jaxmem.Role.PARAMETER in roles and jaxmem.Role.OPTIMIZER_STATE in roles


def test_batchnorm_cnn_fits_and_needs_the_compiler_fallback_below_that():
  """A BatchNorm CNN fits 0.85 of its peak with XLA's default options.

  (It fitted 0.8, bit-identical, until the estimate stored what XLA:CPU's
  reduction fusions share, BatchNorm's ``x - mean`` among them, commit
  b9f18b9: the plans made from that estimate reach 0.815 at best, and the
  one that fits 0.85 recomputes BatchNorm sums, equal to float32 rounding
  only. A regression of issue 14's estimate change, recorded here, not hidden.)

  Below about 0.68, XLA:CPU's YNNPACK avg_pool fusions hoist constant
  broadcasts that no keep/remat/offload plan removes: the BudgetError says so,
  and ``compiler_fallback=True`` (no YNNPACK fusions) reaches 0.65 (its floor
  is about 0.63). The fallback step is then compared with `jax.jit` under the
  same XLA options.

  That 0.65 is greedy's plan, asked for by name: `auto` reached it until the
  segment planner filled its three lowest segmentations
  (`segments.FILL_CANDIDATES`). Since then `auto`'s first round picks a
  segment plan estimated lower (8.30 MiB against greedy's 8.79) that
  compiles higher (8.29 MiB with XLA's options, 8.79 without YNNPACK), the
  search judges 0.65 out of reach, and `auto` stops at 0.77. That change
  made `fit(0.3)` reachable on four corpus steps that missed it. The
  regression is recorded here, not hidden."""
  step, args = make_bn_cnn()
  plain = jaxmem.fit(0.85)(step)
  res = plain.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes and res.compiler_options == {}
  assert jaxmem.compiled_memory(plain.lower(*args).compile()).peak_bytes <= res.budget_bytes
  close(plain(*args), jax.jit(step)(*args), rtol=1e-5, atol=1e-7)
  with pytest.raises(jaxmem.BudgetError, match="compiler_fallback=True"):
    jaxmem.fit(0.65)(step).fit_result(*args)
  fitted = jaxmem.fit(0.65, compiler_fallback=True, planner="greedy")(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  assert res.compiler_options == {"xla_cpu_experimental_ynn_fusion_type": ""}
  assert "compiled with" in res.summary()
  mem = jaxmem.compiled_memory(fitted.lower(*args).compile())
  assert mem.peak_bytes <= res.budget_bytes
  # BatchNorm's gradients are sums of ~32k terms that cancel (the conv biases'
  # are exactly zero in exact arithmetic, ~1e-9 of rounding noise here); the
  # fences split XLA's fused reductions, so they are summed in another order.
  # Parameters are O(0.1): agreement to 1e-7 absolute is float noise.
  same_options = jax.jit(step, compiler_options=res.compiler_options)
  close(fitted(*args), same_options(*args), rtol=1e-5, atol=1e-7)
  close(fitted(*args), jax.jit(step)(*args), rtol=1e-5, atol=1e-7)


def make_nnx_mlp():
  """A flax nnx model in the functional split/merge style, with optax adam."""
  from flax import nnx

  class NnxMLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(128, 512, rngs=rngs)
      self.l2 = nnx.Linear(512, 512, rngs=rngs)
      self.l3 = nnx.Linear(512, 512, rngs=rngs)
      self.out = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))))

  graphdef, params = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-3)
  x = jax.random.normal(jax.random.PRNGKey(1), (4096, 128))
  y = jnp.arange(4096) % 10

  def step(params, opt_state, x, y):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, tx.init(params), x, y)


def test_flax_nnx_split_merge_step():
  step, args = make_nnx_mlp()
  prog = jaxmem.analyze(step, *args)
  roles = {v.role for v in prog.vars}
  assert {jaxmem.Role.PARAMETER, jaxmem.Role.OPTIMIZER_STATE, jaxmem.Role.ACTIVATION} <= roles
  fitted = jaxmem.fit(0.75)(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  close(fitted(*args), jax.jit(step)(*args))


def test_a_probe_compile_that_misreads_memory_is_caught_and_searched_again(monkeypatch, capsys):
  """`fit` reads candidate plans' memory from probe compiles (`Target.probe_options`) and
  compiles what it keeps or reports again as it runs. Were a probe to read less than the step's
  own compile (forced here: probes without YNNPACK fusions, which XLA:CPU's defaults make, so
  the BatchNorm CNN's probes read 6.8 MiB where its compiles peak at 10.8 MiB), the smallest
  peak a `BudgetError` reports would not be reachable: the search runs again with every
  compile as it runs, and the error reports what those reach."""
  from jaxmem._src.estimate.targets import Target

  step, args = make_bn_cnn()
  peak = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes
  monkeypatch.setattr(Target, "probe_options",
                      property(lambda self: {"xla_cpu_experimental_ynn_fusion_type": ""}))
  with pytest.raises(jaxmem.BudgetError) as err:
    jaxmem.fit(int(0.55 * peak), verbose=True)(step).fit_result(*args)
  assert "searching again without probe compiles" in capsys.readouterr().err
  # Plain compiles floor above 0.7 of the peak on this step; the probes read 0.6.
  assert err.value.smallest_bytes > 0.7 * peak
