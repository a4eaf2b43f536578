"""The registry of primitive facts: one source for every module, consistent, with a default."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxmem._src.estimate import cost
from jaxmem._src.ir import primitives, sharding
from jaxmem._src.ir.primitives import Body, Fusion, Shape


def test_facts_are_consistent_across_the_registry():
  for name, f in primitives.registered().items():
    assert f.name == name and f.known
    if f.elementwise:    # the sharding rule of elementwise ops is to keep their operands' split
      assert sharding.rule_for(name) is not None, name
    if f.body is Body.BLOCK:
      assert f.fusion is Fusion.MATERIALIZED, name
    if f.matrix_unit:
      assert f.flops is not None and f.fusion is Fusion.MATERIALIZED, name
    if f.moves_data:
      assert f.fusion is Fusion.VIEW, name
  # Every inlined call of the flat program is known as one.
  from jaxmem._src import _compat
  assert all(primitives.facts(n).body is Body.INLINE for n in _compat.INLINE_BODIES)


def test_every_primitive_of_the_examples_is_known():
  import mlp
  import transformer
  for module, kw in ((mlp, dict(batch_size=8, width=8, depth=2)),
                     (transformer, dict(batch_size=2, seq_len=8, vocab=16, dim=8, heads=2,
                                        layers=1))):
    step, args = module.build(**kw)
    closed = jax.make_jaxpr(step)(*args)
    names = set()

    def walk(jaxpr):
      for e in jaxpr.eqns:
        names.add(e.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(e.params):
          walk(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    walk(closed.jaxpr)
    unknown = sorted(n for n in names if not primitives.is_known(n))
    assert not unknown, unknown


def test_an_unknown_primitive_gets_the_default_facts_and_one_warning():
  primitives._warn_unknown.cache_clear()
  with pytest.warns(UserWarning, match="`not_a_real_primitive`"):
    f = primitives.facts("not_a_real_primitive")
  assert (f.fusion, f.shape, f.body, f.known) == (Fusion.MATERIALIZED, Shape.OTHER, Body.NONE,
                                                  False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    primitives.facts("not_a_real_primitive")


def test_flops_rules_are_registered_per_primitive():
  mm = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((8, 16)), jnp.ones((16, 4))).eqns[0]
  assert primitives.facts("dot_general").flops(mm) == 2 * 8 * 4 * 16
  add = jax.make_jaxpr(lambda a: a + a)(jnp.ones((8, 16))).eqns[0]
  assert primitives.facts("add").flops is None
  assert cost.eqn_flops(add) == primitives.out_element_flops(add) == 8 * 16


def test_a_registered_fact_is_read_everywhere():
  # Registering a new primitive's facts is enough for the estimate, the cost model and
  # the sharding propagation to treat it alike (here: as an expensive elementwise op).
  name = "test_only_elementwise"
  assert not primitives.is_known(name)
  primitives.register(name, fusion=Fusion.EXPENSIVE, shape=Shape.ELEMENTWISE)
  try:
    f = primitives.facts(name)
    assert f.fuses_as_elementwise and f.elementwise
    assert sharding.rule_for(name) is sharding.rule_for("exp")
    assert name in primitives.names_where(lambda g: g.elementwise)
  finally:
    primitives._FACTS.pop(name)
