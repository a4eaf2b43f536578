"""``jaxmem.policy`` on the examples: the plan of the tagged step, as the policy of the user's own ``nn.remat``.

The GPT, ResNet and UNet examples tag their blocks' values (``_common.tag``,
one name per block and value). Each tiny step is planned, the plan exported,
and the model rebuilt with ``nn.remat(Block, policy=export.policy)``: what JAX
then saves, offloads and recomputes (``jaxmem.residual_actions``) must be the
export name for name, every tagged decision of the plan must be in it (one
name per block: no conflicts), and the gradients must be jit's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from test_examples import build


def _transformer(remat_policy=None):
  import transformer
  kw = dict(batch_size=8, seq_len=32, vocab=32, dim=32, heads=2, layers=2)
  step, args = build("transformer", **kw)
  model = transformer.GPT(kw["vocab"], kw["dim"], kw["heads"], kw["layers"], kw["seq_len"],
                          remat_policy)
  from _common import cross_entropy
  tokens = args[2]
  return step, args, args[0], lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:])


def _resnet(remat_policy=None):
  import resnet
  kw = dict(batch_size=8, depth=18, image_size=16, width=8, classes=10, stages=(1, 1))
  step, args = build("resnet", **kw)
  model = resnet.ResNet(18, 8, 10, small_input=True, stages=(1, 1), remat_policy=remat_policy)
  from _common import cross_entropy
  params, stats, _, images, labels = args

  def loss(p):
    logits, _ = model.apply({"params": p, "batch_stats": stats}, images, train=True,
                            mutable=["batch_stats"])
    return cross_entropy(logits, labels)
  return step, args, params, loss


def _unet(remat_policy=None):
  import unet
  kw = dict(batch_size=8, image_size=16, depth=1, width=8, classes=4)
  step, args = build("unet", **kw)
  model = unet.UNet(1, 8, 4, "transpose", remat_policy)
  from _common import cross_entropy
  params, _, images, masks = args
  return step, args, params, lambda p: cross_entropy(model.apply(p, images), masks)


MODELS = {"transformer": _transformer, "resnet": _resnet, "unet": _unet}
PLANS = [("greedy-remat", 0.6), ("greedy", 0.5), ("segments", 0.6)]


@functools.cache
def _export(name: str, planner: str, frac: float):
  step, args, _, _ = MODELS[name]()
  plan = jaxmem.plan(step, *args, budget=frac, planner=planner, device="h100-pcie")
  return plan, jaxmem.policy(plan)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("planner,frac", PLANS)
def test_exported_policy_matches_the_plan_on_the_example(name, planner, frac):
  plan, export = _export(name, planner, frac)
  assert export.tagged, export.summary()
  # One name per block and value: every tagged value got the plan's own decision.
  assert not any(t.conflict for t in export.tagged), export.summary()
  _, _, params, loss = MODELS[name](export.policy)
  realized = jaxmem.residual_actions(loss, params)
  assert realized == dict(export.names), export.summary()
  _, _, _, plain = MODELS[name]()
  got, want = jax.jit(jax.grad(loss))(params), jax.jit(jax.grad(plain))(params)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_some_plan_recomputes_or_offloads_tagged_values(name):
  """The check above is not vacuous: the plans do decide tagged values."""
  actions = {a for planner, frac in PLANS for a in _export(name, planner, frac)[1].names.values()}
  assert actions - {"save"}, actions
