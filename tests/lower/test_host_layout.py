"""Planned host layouts (`lower/host_layout.py`, SmartPool §III) and the host store's planned mode."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import dsa, native
from jaxmem._src.lower.backend import jit_plan
from jaxmem._src.lower.host_layout import ALIGNMENT, compiled_lifetimes, host_layout


def _offload_only(program, budget, device):
  return jaxmem.get_planner("greedy")(program, budget, device, allow_remat=False)


@pytest.fixture(scope="module", params=["sync", "async"])
def planned(request, mlp_small):
  step, args = mlp_small
  plan = jaxmem.plan(step, *args, planner=_offload_only, budget=0.6)
  plan = plan.replace(copies=request.param)
  assert plan.num_offload > 0
  return step, args, plan


def test_the_layout_is_the_schedules_host_buffers_at_their_max_load(planned):
  _, _, plan = planned
  layout = host_layout(plan.schedule())
  assert host_layout(plan.schedule()) is layout   # solved and registered once
  assert len(layout.nbytes) == plan.num_offload == len(layout.slots)
  assert (layout.lower < layout.upper).all()
  assert (layout.offsets % ALIGNMENT == 0).all()
  aligned = -(-layout.nbytes // ALIGNMENT) * ALIGNMENT
  assert dsa.check(layout.lower, layout.upper, aligned, layout.offsets) == layout.footprint
  assert layout.footprint == layout.max_load == dsa.max_load(layout.lower, layout.upper, aligned)
  stats = native.store_plan_stats(layout.key)
  assert stats["footprint"] == layout.footprint and stats["slots"] == len(layout.nbytes)


def test_the_compiled_program_takes_the_slots_in_the_layouts_order(planned):
  _, args, plan = planned
  layout = host_layout(plan.schedule())
  text = jit_plan(plan).lower(*args).compile().as_text()
  lower, upper = compiled_lifetimes(layout, text)
  assert (upper < upper.max()).sum() >= len(upper) - 1   # every fetch found
  aligned = -(-layout.nbytes // ALIGNMENT) * ALIGNMENT
  # The schedule's offsets stay valid for the lifetimes of the compiled program.
  assert dsa.check(lower, upper, aligned, layout.offsets) <= layout.footprint
  assert compiled_lifetimes(layout, "HloModule m\n\nENTRY %e () -> () {\n}\n") is None


@pytest.mark.usefixtures("restore_store_config")
def test_a_planned_step_runs_in_its_slots_bit_identical(planned):
  step, args, plan = planned
  native.store_configure("planned")
  layout = host_layout(plan.schedule())
  want = jax.jit(step)(*args)
  before = native.store_plan_stats(layout.key)
  f = jit_plan(plan)
  for _ in range(3):
    got = jax.block_until_ready(f(*args))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  stats = native.store_plan_stats(layout.key)
  assert stats["planned"] - before["planned"] == 3 * plan.num_offload
  assert stats["fallbacks"] == before["fallbacks"]
  assert native.store_stats().arena.allocs == 0   # nothing went to best-fit


@pytest.mark.usefixtures("restore_store_config")
def test_other_modes_ignore_the_slots(planned):
  _, args, plan = planned
  native.store_configure("best_fit")
  layout = host_layout(plan.schedule())
  before = native.store_plan_stats(layout.key)
  jax.block_until_ready(jit_plan(plan)(*args))
  assert native.store_plan_stats(layout.key) == before
  assert native.store_stats().arena.allocs == plan.num_offload


@pytest.mark.usefixtures("restore_store_config")
def test_a_taken_slot_or_an_unknown_plan_falls_back_to_best_fit():
  native.store_configure("planned")
  native.store_register_plan(900, slots=[0], offsets=[0], sizes=[64], footprint=64)
  x = jnp.arange(16.0)
  first = native.offload(x, slot=(900, 0))
  second = native.offload(x + 1, slot=(900, 0))   # slot 0 is still live
  unknown = native.offload(x + 2, slot=(901, 0))
  stats = native.store_plan_stats(900)
  assert (stats["planned"], stats["fallbacks"]) == (1, 1)
  assert native.store_plan_stats(901) is None
  for h, k in ((second, 1), (first, 0), (unknown, 2)):
    assert native.fetch(h, h, shape=x.shape, dtype=x.dtype).tolist() == (x + k).tolist()
  native.store_unregister_plan(900)
  assert native.store_plan_stats(900) is None


def test_bad_layouts_and_arguments_raise():
  with pytest.raises(ValueError, match="store_register_plan"):
    native.store_register_plan(902, slots=[0], offsets=[3], sizes=[8], footprint=64)
  with pytest.raises(ValueError, match="store_register_plan"):
    native.store_register_plan(-1, slots=[0], offsets=[0], sizes=[8], footprint=64)
  with pytest.raises(ValueError, match="`dep` orders a planned copy"):
    native.offload(jnp.ones(4), dep=jnp.ones(1))
  with pytest.raises(ValueError, match=r"`slot` must be \(plan, slot\)"):
    native.offload(jnp.ones(4), slot=(1, -2))


def test_the_layout_goes_with_its_schedule(mlp_small):
  step, args = mlp_small
  plan = jaxmem.plan(step, *args, planner=_offload_only, budget=0.6)
  key = host_layout(plan.schedule()).key
  assert native.store_plan_stats(key) is not None
  del plan
  gc.collect()
  assert native.store_plan_stats(key) is None
