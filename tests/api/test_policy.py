"""``jaxmem.policy``: a plan exported as a ``jax.checkpoint`` policy, checked structurally.

The residuals JAX saves, offloads and recomputes under the exported policy
(read back from the ``jax.vjp`` jaxpr by ``jaxmem.residual_actions``) must be
exactly the plan's decisions, name by name: in the unrolled model the plan was
made for, and with the same policy inside a ``lax.scan`` body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxmem
from jaxmem._src.plan.decisions import Action

DEPTH, WIDTH, BATCH = 6, 128, 2048


def _loss(ws, x, name=lambda kind, i: f"{kind}{i}", policy=None):
  """Layers of two matmuls; the hidden value and the layer's output are tagged."""
  def forward(ws, x):
    for i, (w1, w2) in enumerate(ws):
      h = checkpoint_name(jnp.tanh(x @ w1), name("hidden", i))
      x = checkpoint_name(jnp.tanh(h @ w2), name("out", i))
    return jnp.sum(x * x)
  # The user's remat: one region over the whole forward pass, where the
  # policy decides every tagged value (a region's own output is always kept).
  return (forward if policy is None else jax.checkpoint(forward, policy=policy))(ws, x)


def _args():
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * DEPTH + 1)
  ws = [(0.1 * jax.random.normal(keys[2 * i], (WIDTH, WIDTH)),
         0.1 * jax.random.normal(keys[2 * i + 1], (WIDTH, WIDTH))) for i in range(DEPTH)]
  return ws, jax.random.normal(keys[-1], (BATCH, WIDTH))


def _step(ws, x):
  return jax.grad(_loss)(ws, x)


@pytest.mark.parametrize("planner,frac", [("greedy-remat", 0.6), ("greedy", 0.6),
                                          ("segments", 0.5), ("vdnn", 0.6), ("auto", 0.5)])
def test_exported_policy_makes_jax_save_exactly_what_the_plan_keeps(planner, frac):
  ws, x = _args()
  plan = jaxmem.plan(_step, ws, x, budget=frac, planner=planner, device="h100-pcie")
  export = jaxmem.policy(plan)
  assert {t.name for t in export.tagged} == {f"{k}{i}" for k in ("hidden", "out")
                                             for i in range(DEPTH)}
  assert not export.untagged, export.summary()
  # Every name's instances agree (one layer per name), so the policy can say it.
  assert not any(t.conflict for t in export.tagged)
  planned = {}
  for t in export.tagged:
    planned[t.name] = t.action
  assert set(planned.values()) != {"save"}
  realized = jaxmem.residual_actions(lambda ws, x: _loss(ws, x, policy=export.policy), ws, x)
  assert realized == planned, export.summary()
  # The same gradients as without any policy (on the CPU, bit for bit).
  got = jax.jit(jax.grad(lambda ws, x: _loss(ws, x, policy=export.policy)))(ws, x)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(jax.jit(_step)(ws, x))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_actions_follow_the_plan_s_decisions():
  ws, x = _args()
  plan = jaxmem.plan(_step, ws, x, budget=0.6, planner="greedy", device="h100-pcie")
  export = jaxmem.policy(plan)
  acted: dict[int, set[Action]] = {}
  for d in plan.decisions:
    acted.setdefault(d.var, set()).add(d.action)
  prog = plan.program
  for t in export.tagged:
    ops = [op for op in prog.ops if op.primitive == "name" and op.eqn.params["name"] == t.name]
    (op,) = ops
    tagged_vars = {op.outputs[0], *op.input_ids()}
    names = {Action.REMAT: "recompute", Action.OFFLOAD: "offload"}
    actions = {names[a] for v in tagged_vars for a in acted.get(v, ())}
    assert t.action in actions if actions else t.action == "save"


def _shared_names(kind, i):
  return kind


def test_one_name_for_every_layer_reports_the_conflict_and_covers_the_most_bytes():
  ws, x = _args()
  step = lambda ws, x: jax.grad(lambda ws, x: _loss(ws, x, name=_shared_names))(ws, x)  # noqa: E731
  plan = jaxmem.plan(step, ws, x, budget=0.75, planner="greedy-remat", device="h100-pcie")
  export = jaxmem.policy(plan)
  assert {t.name for t in export.tagged} == {"hidden", "out"}
  for t in export.tagged:
    assert t.instances == DEPTH and sum(t.planned.values()) == DEPTH
    # Equal bytes per instance: the majority decides.
    assert t.planned[t.action] == max(t.planned.values())
  conflicted = [t for t in export.tagged if t.conflict]
  assert conflicted, "budget 0.75 should recompute some layers and keep others"
  assert "conflict" in export.summary()


def test_policy_inside_a_scan_body_matches_the_plan():
  """The plan of the unrolled layers, applied by the user to a remat-ed ``lax.scan`` body.

  The body's carry is saved per iteration by ``scan`` itself; the policy
  decides the value inside the body (``hidden``).
  """
  ws, x = _args()
  step = lambda ws, x: jax.grad(lambda ws, x: _loss(ws, x, name=_shared_names))(ws, x)  # noqa: E731
  w1s, w2s = jnp.stack([w[0] for w in ws]), jnp.stack([w[1] for w in ws])
  seen = set()
  for planner, frac in (("greedy-remat", 0.3), ("greedy-remat", 1.0), ("greedy", 0.3)):
    plan = jaxmem.plan(step, ws, x, budget=frac, planner=planner, device="h100-pcie")
    export = jaxmem.policy(plan)

    def scanned(w1s, w2s, x):
      def body(x, w):
        h = checkpoint_name(jnp.tanh(x @ w[0]), "hidden")
        return jnp.tanh(h @ w[1]), None
      y, _ = jax.lax.scan(jax.checkpoint(body, policy=export.policy), x, (w1s, w2s))
      return jnp.sum(y * y)

    realized = jaxmem.residual_actions(scanned, w1s, w2s, x)
    assert realized == {"hidden": export.names["hidden"]}, export.summary()
    seen.add(realized["hidden"])
    got = jax.jit(jax.grad(scanned, argnums=(0, 1)))(w1s, w2s, x)
    want = jax.jit(_step)(ws, x)
    np.testing.assert_allclose(np.asarray(got[0]), np.stack([np.asarray(w[0]) for w in want]),
                               rtol=1e-4, atol=1e-6)
  assert len(seen) >= 2, "the plans should differ on `hidden`"


def test_untagged_decisions_are_listed_with_a_suggested_name():
  def loss(ws, x):
    for w1, w2 in ws:
      x = jnp.tanh(jnp.tanh(x @ w1) @ w2)
    return jnp.sum(x * x)
  ws, x = _args()
  plan = jaxmem.plan(jax.grad(loss), ws, x, budget=0.6, planner="greedy-remat",
                     device="h100-pcie")
  export = jaxmem.policy(plan)
  assert not export.tagged and export.untagged
  # Saving untagged values instead: the plan's recomputations are what is listed.
  assert {u.action for u in jaxmem.policy(plan, default="save").untagged} == {"recompute"}
  # The default recomputes untagged values: the residuals the plan keeps are listed.
  assert {u.action for u in export.untagged} == {"save"}
  assert all("test_policy.py" in u.source for u in export.untagged)
  assert "checkpoint_name(x, " in export.summary()


def test_policy_rejects_a_bad_default():
  ws, x = _args()
  plan = jaxmem.plan(_step, ws, x, budget=1.0, planner="greedy", device="h100-pcie")
  with pytest.raises(ValueError, match="`default`"):
    jaxmem.policy(plan, default="offload")  # type: ignore[arg-type]


def test_the_guide_s_flax_example():
  """docs/guide.md section 6: tag a flax block, plan, export, `nn.remat(Block, policy=...)`."""
  import flax.linen as nn
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = checkpoint_name(nn.gelu(nn.Dense(4 * x.shape[-1])(x)), "mlp_hidden")
      a = checkpoint_name(nn.MultiHeadDotProductAttention(num_heads=4)(x), "attention")
      return x + a + nn.Dense(x.shape[-1])(h)

  class Model(nn.Module):
    block: type = Block

    @nn.compact
    def __call__(self, x):
      for i in range(3):   # named: the remat-ed model has the same parameter tree
        x = self.block(name=f"block{i}")(x)
      return x

  x = jax.random.normal(jax.random.PRNGKey(0), (16, 64, 32))

  def make_step(model):
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
      loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss
    return step, tx

  step, tx = make_step(Model())
  params = Model().init(jax.random.PRNGKey(1), x)
  opt_state = tx.init(params)
  plan = jaxmem.plan(step, params, opt_state, x, budget=0.4, planner="greedy-remat",
                     device="h100-pcie")
  export = jaxmem.policy(plan)
  assert set(export.names) == {"mlp_hidden", "attention"}
  assert "recompute" in export.names.values()
  remat_model = Model(block=nn.remat(Block, policy=export.policy))
  realized = jaxmem.residual_actions(lambda p: jnp.mean(remat_model.apply(p, x) ** 2), params)
  assert realized == dict(export.names), export.summary()
  remat_step, _ = make_step(remat_model)
  got = jax.jit(remat_step)(params, opt_state, x)
  want = jax.jit(step)(params, opt_state, x)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
