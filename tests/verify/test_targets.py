"""Targets compiled ahead of time: XLA:TPU's own compiled program, on a machine without a TPU.

libtpu comes with the test extras (``jax[tpu]``); these tests compile for TPU
chips through ``jax.experimental.topologies`` and never run anything on one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.estimate.targets import CHIPS, get_target
from jaxmem._src.native.extension import TARGET_PREFIX
from jaxmem._src.plan.decisions import Action
from jaxmem._src.verify.compiled import compiled_cost, compiled_memory

pytest.importorskip("libtpu", reason="TPU targets need libtpu: pip install 'jax[tpu]'")


def test_get_target_parses_chips_and_topologies():
  assert get_target(None).is_local and get_target("local").platform == jax.default_backend()
  t = get_target("TPU:v6e")
  assert (t.name, t.platform, t.topology, t.profile) == ("tpu:v6e", "tpu", "v6e:1x1", "tpu-v6e")
  assert get_target("tpu:v5e:2x2").topology == "v5e:2x2"
  assert get_target(t) is t
  with pytest.raises(ValueError, match="'tpu:<chip>'"):
    get_target("tpu:v7x")
  with pytest.raises(ValueError, match="not a known target"):
    get_target("gpu:rtx9999")
  assert get_target("GPU:h100").name == "gpu:h100"   # parsed without the CUDA plugin
  with pytest.raises(TypeError, match="`target`"):
    get_target(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("chip", sorted(CHIPS))
def test_every_chip_compiles_here(chip):
  t = get_target(f"tpu:{chip}")
  assert t.devices[0].device_kind == CHIPS[chip].device_kind
  x = t.place((jax.ShapeDtypeStruct((1024, 1024), jnp.float32),))
  compiled = jax.jit(lambda a: jnp.tanh(a @ a).sum()).lower(*x).compile()
  assert compiled_memory(compiled).argument_bytes == 4 * 1024 * 1024
  assert "tpu" in compiled.as_text().lower() or compiled.memory_analysis() is not None


def test_place_keeps_target_shardings_and_moves_the_rest():
  t = get_target("tpu:v5e:2x2")
  assert len(t.devices) == 4
  mesh = jax.sharding.Mesh(np.array(t.devices), ("data",))
  sharded = jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                 sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  placed = t.place({"a": sharded, "b": jnp.zeros((3,)), "c": "static"})
  assert placed["a"].sharding == sharded.sharding
  assert placed["b"].sharding.device_set == {t.devices[0]}
  assert placed["c"] == "static"


def _tanh_mlp(depth: int = 8, width: int = 256, batch: int = 16384):
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x * x)

  def step(ws, x):
    grads = jax.grad(loss)(ws, x)
    return [w - 0.1 * g for w, g in zip(ws, grads)]

  shapes = ([jax.ShapeDtypeStruct((width, width), jnp.float32)] * depth,
            jax.ShapeDtypeStruct((batch, width), jnp.float32))
  return step, shapes


def test_analyze_for_a_target_models_its_compiler():
  step, shapes = _tanh_mlp()
  prog = jaxmem.analyze(step, *shapes, target="tpu:v5e")
  assert (prog.backend, prog.target) == ("tpu", "tpu:v5e")
  assert prog.peak_bytes > 0


def test_the_tpu_estimate_counts_tiles_and_on_chip_memory():
  # 8 layers of 256, batch 16384 (16 MiB activations): XLA:TPU v5e keeps up to
  # its 112 MiB of VMEM of temporaries off the HBM peak. The estimate with
  # the chip's tiles and on-chip memory is within 15% of the compiled peak
  # (measured 52.0 against 52.3 MiB; the CPU's model of the same step: 164 MiB).
  step, shapes = _tanh_mlp()
  prog = jaxmem.analyze(step, *shapes, target="tpu:v5e")
  tpu = compiled_memory(jax.jit(step).lower(*get_target("tpu:v5e").place(shapes)).compile())
  assert abs(prog.peak_bytes / tpu.peak_bytes - 1) <= 0.15
  cpu = jaxmem.analyze(step, *shapes)
  assert cpu.peak_bytes > 2 * prog.peak_bytes
  # A 10x10 array takes a whole tile of 8x128 words, rounded up to 16 rows.
  small = jaxmem.analyze(lambda x: jnp.tanh(x).sum(), jax.ShapeDtypeStruct((10, 10), jnp.float32),
                         target="tpu:v5e")
  assert small.vars[small.invars[0]].nbytes == 16 * 128 * 4


@functools.cache
def _fitted_on_v5e():
  step, shapes = _tanh_mlp()
  fitted = jaxmem.fit(0.6, target="tpu:v5e")(step)
  return step, shapes, fitted, fitted.fit_result(*shapes)


def test_fit_for_a_tpu_target_is_verified_on_xla_tpu():
  step, shapes, fitted, res = _fitted_on_v5e()
  assert (res.backend, res.target, res.platform) == ("xla", "tpu:v5e", "tpu")
  assert res.peak_bytes <= res.budget_bytes < res.unplanned_peak_bytes
  # The fraction is of XLA:TPU's unplanned peak, not of the CPU's or of the estimate.
  unplanned = compiled_memory(jax.jit(step).lower(*get_target("tpu:v5e").place(shapes)).compile())
  assert res.unplanned_peak_bytes == unplanned.peak_bytes
  assert res.budget_bytes == int(0.6 * unplanned.peak_bytes)
  assert res.plan.decisions
  # Compiled with XLA:TPU's scheduler limited to the budget's share for temporaries.
  assert res.compiler_options.keys() == {"xla_tpu_max_hbm_size_mib",
                                         "xla_tpu_scheduler_percent_shared_memory_limit"}
  compiled = fitted.lower(*shapes).compile()
  assert compiled_memory(compiled).peak_bytes == res.peak_bytes
  # Every planned offload is a host buffer in XLA:TPU's program.
  if res.plan.num_offload:
    assert compiled_memory(compiled).host_temp_bytes > 0 and "S(5)" in compiled.as_text()
  # No custom call of ours on a TPU (they have no TPU implementation).
  assert f'custom_call_target="{TARGET_PREFIX}' not in compiled.as_text()
  assert "verified on:     tpu:v5e (tpu)" in res.summary()
  # Its price is XLA:TPU's own count of what the fitted program computes and moves.
  assert res.cost == compiled_cost(compiled)
  assert res.unplanned_cost == compiled_cost(
      jax.jit(step).lower(*get_target("tpu:v5e").place(shapes)).compile())
  assert res.cost.flops > 0 and res.cost.bytes_accessed > 0
  assert "compiled cost:   FLOPs" in res.summary()


def test_fit_for_a_tpu_target_keeps_the_cheapest_fitting_plan_in_the_compiled_program():
  # Whole segments and selective recomputation both fit this MLP at 0.6 of
  # its v5e peak: both are compiled, and the plan kept costs least in
  # XLA:TPU's own FLOPs and bytes, priced on the target's profile.
  step, shapes, _, res = _fitted_on_v5e()
  planners = [name for name, _, _ in res.compared]
  assert len(planners) == 2 and res.plan.planner in planners
  assert all(peak <= res.budget_bytes for _, peak, _ in res.compared)
  kept = next(price for name, _, price in res.compared if name == res.plan.planner)
  assert kept == min(price for _, _, price in res.compared)
  profile = jaxmem.device_profile("tpu-v5e")
  assert kept == pytest.approx(res.cost.seconds(profile, res.memory.host_temp_bytes))


def test_on_a_gpu_target_autos_plans_compete_with_whole_segments_by_compiled_cost():
  # XLA:GPU's compiled kernels rank `auto`'s plans otherwise than the
  # simulated time does (bench/results/gpu_cost.md); building `fit` for a GPU
  # target needs no CUDA plugin (tests/verify/test_gpu_targets.py compiles).
  from jaxmem._src.planners.segments import segments
  fitted = jaxmem.fit(0.5, target="gpu:h100")(lambda x: x)
  assert fitted.backend == "xla" and fitted._prices_compiled
  assert fitted._planner_groups()[0] == (None, segments)
  assert not jaxmem.fit(0.5)(lambda x: x)._prices_compiled          # the CPU: simulated


def test_the_smallest_peak_reported_for_a_tpu_target_is_reached_when_asked_for():
  # A 12-layer MLP whose rounds at 0.2 of its v5e peak reach a smaller peak
  # (124 MiB, selective recomputation's floor) than `auto`'s floor (171 MiB):
  # every planner's floor is made by a search that fails before it, so
  # `fit` reports it without a search to check it, and asking for it is met.
  step, shapes = _tanh_mlp(depth=12, width=512, batch=16384)
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.2, target="tpu:v5e")(step).fit_result(*shapes)
  err = info.value
  unplanned = compiled_memory(jax.jit(step).lower(*get_target("tpu:v5e").place(shapes)).compile())
  assert err.budget_bytes < err.smallest_bytes < unplanned.peak_bytes
  res = jaxmem.fit(err.smallest_bytes, target="tpu:v5e")(step).fit_result(*shapes)
  assert res.peak_bytes <= err.smallest_bytes


def test_a_step_fitted_for_a_tpu_runs_here_with_jit_s_results():
  step, shapes, fitted, _ = _fitted_on_v5e()
  keys = jax.random.split(jax.random.PRNGKey(0), len(shapes[0]) + 1)
  ws = [0.05 * jax.random.normal(k, s.shape) for k, s in zip(keys, shapes[0])]
  x = jax.random.normal(keys[-1], shapes[1].shape)
  got, expected = fitted(ws, x), jax.jit(step)(ws, x)
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_memory_limit_options_hit_the_limit_and_leave_xla_s_remat_alone():
  t = get_target("tpu:v5e")
  mib = 2 ** 20
  for limit, ref in [(100 * mib, 400 * mib), (3 * 2**30, 2**30), (7 * mib, 5 * 2**30)]:
    opts = t.memory_limit_options(limit, ref)
    hbm, pct = opts["xla_tpu_max_hbm_size_mib"], opts["xla_tpu_scheduler_percent_shared_memory_limit"]
    assert 1 <= pct <= 100 and isinstance(pct, int)
    assert hbm * mib >= 2 * ref                       # XLA's own remat never triggers
    if limit >= 0.02 * hbm * mib:
      assert abs(hbm * mib * pct / 100 - limit) <= 0.01 * limit
  assert get_target("local").memory_limit_options(100 * mib, 400 * mib) == {}
  assert t.memory_limit_options(0, 400 * mib) == {}
  # Probe compiles (`fit`'s compiles that only read memory) are measured on XLA:CPU only.
  assert t.probe_options == {}


def test_planned_offloads_free_memory_on_xla_tpu_only_under_the_scheduler_limit():
  # The fact the TPU offload plans stand on (libtpu 0.0.42.1): with HBM to
  # spare, XLA:TPU fetches every offloaded value back right after its copy
  # out, so the plan raises the peak; told to keep its temporaries within a
  # limit, it holds the copies back and the offloads free what they should.
  # Activations of 32 MiB: XLA:TPU keeps smaller steps' temporaries on chip.
  step, shapes = _tanh_mlp(depth=8, width=1024, batch=8192)
  t = get_target("tpu:v5e")
  placed = t.place(shapes)
  unplanned = compiled_memory(jax.jit(step).lower(*placed).compile())
  plan = jaxmem.plan(step, *shapes, budget=0.5, planner="vdnn-all", target=t)
  assert plan.num_offload >= 6
  from jaxmem._src.lower.backend import jit_plan
  loose = compiled_memory(jit_plan(plan, backend="xla").lower(*placed).compile())
  temp_share = unplanned.peak_bytes // 2 - (unplanned.peak_bytes - unplanned.temp_bytes)
  opts = t.memory_limit_options(temp_share, unplanned.peak_bytes)
  tight = compiled_memory(jit_plan(plan, backend="xla", compiler_options=opts)
                          .lower(*placed).compile())
  assert loose.peak_bytes > unplanned.peak_bytes
  assert tight.peak_bytes < 0.75 * unplanned.peak_bytes
  assert tight.host_temp_bytes >= 6 * 8192 * 1024 * 4


def test_ffi_backend_is_refused_for_a_tpu_target():
  with pytest.raises(ValueError, match="backend='xla'"):
    jaxmem.fit(0.5, target="tpu:v5e", backend="ffi")


def test_compare_and_max_batch_for_a_tpu_target():
  step, shapes = _tanh_mlp(depth=2, width=256, batch=16384)
  cmp = jaxmem.compare(step, *shapes, verbose=False, target="tpu:v5e")
  tpu = compiled_memory(jax.jit(step).lower(*get_target("tpu:v5e").place(shapes)).compile())
  assert cmp.compiled.peak_bytes == tpu.peak_bytes

  def factory(batch):
    return step, (shapes[0], jax.ShapeDtypeStruct((batch, 256), jnp.float32))
  res = jaxmem.max_batch(factory, tpu.peak_bytes, planner=None, lo=8192, hi=16384,
                         target="tpu:v5e")
  assert res.batch == 16384 and res.peak_bytes == tpu.peak_bytes
