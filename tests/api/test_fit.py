"""`jaxmem.fit`: compiled peak within budget, identical training, clear errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
import models


def assert_trees_equal(a, b, rtol=1e-6):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)


def train(step, args, n):
  params, opt_state, *data = args
  for _ in range(n):
    params, opt_state, loss = step(params, opt_state, *data)
  return params, opt_state, loss


def check_fit_half(step, args):
  fitted = jaxmem.fit(0.5)(step)
  compiled = fitted.lower(*args).compile()
  mem = jaxmem.compiled_memory(compiled)
  res = fitted.fit_result(*args)
  base = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile())
  assert res.unplanned_peak_bytes == base.peak_bytes
  assert res.budget_bytes == math.floor(0.5 * base.peak_bytes)
  assert res.peak_bytes == mem.peak_bytes
  assert mem.peak_bytes <= res.budget_bytes, (str(mem), res.budget_bytes)
  assert res.rounds >= 1
  got = train(fitted, args, 3)
  want = train(jax.jit(step), args, 3)
  assert_trees_equal(got, want)
  # As with jax.jit, the compiled step is called with the step's own arguments.
  assert_trees_equal(compiled(*args), jax.jit(step)(*args))
  return res, got, want


def test_mlp_8_layers_batch_8192_fits_half_its_peak():
  step, args = models.mlp(8192, 512, 8)
  res, got, want = check_fit_half(step, args)
  # The rewrite re-binds the same primitives: bit-identical, not merely close.
  for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert res.plan.decisions
  assert "offload" in res.plan.summary() or "remat" in res.plan.summary()


def test_cnn_fits_half_its_peak():
  import cnn
  step, args = cnn.build()
  res, got, want = check_fit_half(step, args)
  # The three max_pool gradients are computed by the argmax/select substitution,
  # which is what removes XLA:CPU's hoisted select_and_scatter index arrays.
  assert res.plan.substituted_ops == 3
  assert "3 lowering substitutions" in res.plan.summary()


def test_probe_compiles_read_the_memory_of_the_compiles_that_run(mlp_small):
  """`fit` reads each candidate plan's memory from a probe compile (XLA:CPU without LLVM's
  optimizations, `Target.probe_options`) and compiles the plan it keeps again as it runs: the
  two compiles' `memory_analysis()` agree, unplanned and planned (every corpus step:
  bench/results/probe_compiles.md), and the fitted step is the compile as it runs."""
  from jaxmem._src.estimate.targets import get_target
  from jaxmem._src.lower.backend import jit_plan

  probe = get_target(None).probe_options
  assert probe == {"xla_backend_optimization_level": 0}
  step, args = mlp_small
  plan = jaxmem.plan(step, *args, budget=0.5, planner="greedy")
  assert plan.decisions
  for jitted in (jax.jit(step), jit_plan(plan)):
    lowered = jitted.lower(*args)
    assert jaxmem.compiled_memory(lowered.compile(probe)) == jaxmem.compiled_memory(
        lowered.compile())
  fitted = jaxmem.fit(0.75)(step)
  res = fitted.fit_result(*args)
  assert res.rounds >= 1
  assert res.peak_bytes == jaxmem.compiled_memory(fitted.lower(*args).compile()).peak_bytes
  assert res.compiler_options == {}


def test_plan_summary_says_when_a_plan_misses_its_target(mlp_small):
  step, args = mlp_small
  reachable = jaxmem.plan(step, *args, budget=0.9, planner="greedy")
  assert reachable.estimated_peak_bytes <= reachable.target_bytes
  assert "MISSES" not in reachable.summary()
  tiny = jaxmem.plan(step, *args, budget=0.01, planner="greedy")
  assert tiny.estimated_peak_bytes > tiny.target_bytes
  assert "MISSES the target by" in tiny.summary().splitlines()[1]


def test_already_fits_means_no_plan(mlp_small):
  step, args = mlp_small
  fitted = jaxmem.fit(1.0)(step)
  res = fitted.fit_result(*args)
  assert res.rounds == 0 and not res.plan.decisions
  assert res.peak_bytes == res.unplanned_peak_bytes <= res.budget_bytes
  assert_trees_equal(fitted(*args), jax.jit(step)(*args))


def test_absolute_budget_and_summary(mlp_small):
  step, args = mlp_small
  base = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes
  fitted = jaxmem.fit(int(base * 0.8))(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes == int(base * 0.8)
  text = res.summary()
  assert "fitted peak" in text and "within budget" in text
  assert_trees_equal(fitted(*args), jax.jit(step)(*args))


def test_budget_below_anything_reachable(mlp_small):
  step, args = mlp_small
  fitted = jaxmem.fit("1KiB")(step)
  with pytest.raises(jaxmem.BudgetError) as info:
    fitted(*args)
  err = info.value
  assert err.budget_bytes == 1024
  assert err.smallest_bytes > 1024
  assert err.holders and all(isinstance(b, int) and b > 0 for _, b in err.holders)
  msg = str(err)
  assert "smallest peak reachable" in msg and "largest holders" in msg and "`jaxmem.fit`" in msg
  # The smallest budget it reports is one that works.
  ok = jaxmem.fit(err.smallest_bytes)(step)
  assert ok.fit_result(*args).peak_bytes <= err.smallest_bytes
  # What holds that floor, by kind: at least the compiled floor in all (the
  # estimate, plus what the compiled peak holds beyond it), and advice.
  kinds = dict(err.floor)
  assert sum(b for b in kinds.values() if b > 0) >= err.smallest_bytes
  assert "parameters" in kinds or "step inputs (batch, labels, keys)" in kinds
  assert "what holds that peak, by kind" in msg and "lower the floor" in err.advice
  assert err.advice in msg


def test_a_floor_of_arguments_is_named_with_what_would_lower_it():
  """An optimizer step whose parameters and Adam state are most of its memory:
  the error says the arguments hold the floor, and (not donated) that
  donating the state lets XLA write the update in place."""
  import optax
  tx = optax.adam(1e-3)
  params = [jnp.ones((512, 512)), jnp.ones((512,))]
  opt_state = tx.init(params)
  x = jnp.ones((8, 512))

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p[0] + p[1]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.3)(step)(params, opt_state, x)
  err = info.value
  kinds = [k for k, _ in err.floor]
  assert kinds[0] in ("optimizer state", "parameters", "outputs (new state, loss)")
  assert "the step's arguments hold" in err.advice and "donate the state" in err.advice
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.3, donate_argnums=(0, 1))(step)(params, opt_state, x)
  assert "donate the state" not in info.value.advice
  assert "the step's arguments hold" in info.value.advice


def test_smallest_reachable_includes_the_unplanned_program():
  # A 2-layer tanh MLP whose every plan compiles above plain `jax.jit` on
  # XLA:CPU (fences store what XLA fused): the floor is the unplanned peak,
  # and asking for it is answered with no plan at all.
  grad, args = models.tanh_mlp(depth=2, width=256, batch=256)

  def step(ws, x):
    return [w - 0.1 * g for w, g in zip(ws, grad(ws, x))]

  base = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(1)(step)(*args)
  assert info.value.smallest_bytes <= base
  ok = jaxmem.fit(info.value.smallest_bytes)(step).fit_result(*args)
  assert ok.peak_bytes <= info.value.smallest_bytes


def test_non_array_argument_is_explained():
  fitted = jaxmem.fit(0.5)(lambda x, tag: x * 2)
  with pytest.raises(TypeError, match=r"argument 1 is a str.*static_argnums=\(1,\)"):
    fitted(jnp.ones(3), "hello")
  with pytest.raises(TypeError, match=r"argument 0\['a'\] is a object"):
    fitted({"a": object()}, 1.0)


def test_static_argnums_pass_through():
  calls = []

  def step(x, mode):
    calls.append(mode)
    return jnp.tanh(x) if mode == "tanh" else jnp.sin(x)

  fitted = jaxmem.fit(1.0, static_argnums=1)(step)
  x = jnp.linspace(-1, 1, 16)
  np.testing.assert_array_equal(fitted(x, "tanh"), jnp.tanh(x))
  np.testing.assert_array_equal(fitted(x, "sin"), jnp.sin(x))
  n = len(calls)
  fitted(x, "tanh")
  assert len(calls) == n  # cached per static value and shape
  with pytest.raises(TypeError, match="hashable"):
    fitted(x, ["unhashable"])


def test_kwargs_pass_through():
  fitted = jaxmem.fit(1.0)(lambda x, *, scale: x * scale)
  np.testing.assert_array_equal(fitted(jnp.ones(3), scale=2.0), jnp.full(3, 2.0))


def test_donate_argnums_pass_through(mlp_small):
  step, args = mlp_small
  want = jax.jit(step)(*args)
  fitted = jaxmem.fit(0.8, donate_argnums=(0, 1))(step)
  copies = jax.tree_util.tree_map(jnp.copy, args)
  mem = jaxmem.compiled_memory(fitted.lower(*copies).compile())
  assert mem.alias_bytes > 0
  got = fitted(*copies)
  assert_trees_equal(got, want)
  with pytest.raises(ValueError, match="both static and donated"):
    jaxmem.fit(0.5, static_argnums=0, donate_argnums=0)(step)


def test_plans_once_per_signature(mlp_small):
  step, args = mlp_small
  seen = []

  def counting(program, budget, device):
    seen.append(program.num_ops)
    return jaxmem.get_planner("greedy")(program, budget, device)

  fitted = jaxmem.fit(0.9, planner=counting)(step)
  fitted(*args)
  n = len(seen)
  assert n >= 1
  fitted(*args)
  fitted.fit_result(*args)
  fitted.lower(*args)
  assert len(seen) == n
  smaller = (args[0], args[1], args[2][:128], args[3][:128])
  jax.block_until_ready(fitted(*smaller))
  assert len(seen) > n


def test_out_of_range_argnums():
  fitted = jaxmem.fit(1.0, static_argnums=3)(lambda x: x)
  with pytest.raises(ValueError, match="out of range"):
    fitted(jnp.ones(2))


def test_transformations_of_a_fitted_step_are_explained():
  fitted = jaxmem.fit(1.0)(lambda x: jnp.sin(x).sum())
  with pytest.raises(TypeError, match="put `jax.grad` inside the step"):
    jax.jit(fitted)(jnp.ones(3))
  with pytest.raises(TypeError, match="not inside `jax.jit`, `jax.grad`"):
    jax.grad(fitted)(jnp.ones(3))


def test_a_failing_fit_compiles_each_plan_once(mlp_small, monkeypatch):
  # 0.6 of this MLP's peak is out of reach (parameters, adam state and their
  # updated copies are most of it), but near enough `auto`'s first plan
  # (`FLOOR_REACH`) for the fallbacks to be tried. `auto`'s fallbacks (greedy,
  # segments) and tighter targets return plans already compiled: each is
  # compiled once.
  from jaxmem._src.api import fit as fit_lib
  step, args = mlp_small
  compiled = []
  jit_plan = fit_lib.jit_plan

  def counting(plan, **kwargs):
    compiled.append((fit_lib._plan_key(plan), repr(sorted((kwargs["compiler_options"] or {}).items()))))
    return jit_plan(plan, **kwargs)

  monkeypatch.setattr(fit_lib, "jit_plan", counting)
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.fit(0.6)(step)(*args)
  assert len(compiled) >= 2 and len(set(compiled)) == len(compiled)


def test_a_search_out_of_reach_stops_at_autos_floor(mlp_small, monkeypatch):
  # At half this MLP's peak `auto`'s first plan is also its most aggressive,
  # and it compiles 1.35x the budget (more than `FLOOR_REACH` leaves room
  # for): the fallback planners' rounds (greedy's compiled to the same peak)
  # are not compiled, only their plans for a budget just under the floor, and
  # the smallest peak the error reports is still reached when asked for.
  from jaxmem._src.api import fit as fit_lib
  step, args = mlp_small
  compiled = []
  jit_plan = fit_lib.jit_plan

  def counting(plan, **kwargs):
    compiled.append(plan.planner)
    return jit_plan(plan, **kwargs)

  monkeypatch.setattr(fit_lib, "jit_plan", counting)
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.5)(step)(*args)
  # The search compiles `auto`'s first plan only; then each planner's plan for a
  # budget just under the floor is compiled once, unless a round made it already,
  # and `auto`'s plans for the rungs around that budget (`UNDER_FLOOR_RUNGS`).
  assert compiled[0].startswith("auto"), compiled
  probes = compiled[1:]
  rungs = len(fit_lib.UNDER_FLOOR_RUNGS)
  assert len(probes) <= 1 + rungs + len(fit_lib.Fitted._fallback_planners(jaxmem.fit(0.5)(step)))
  assert sum(p.startswith("auto") for p in probes) <= 1 + rungs, compiled
  assert info.value.smallest_bytes > (1 - fit_lib.FLOOR_REACH) ** -1 * info.value.budget_bytes
  ok = jaxmem.fit(info.value.smallest_bytes)(step).fit_result(*args)
  assert ok.peak_bytes <= info.value.smallest_bytes


def test_plans_estimated_far_above_are_not_compiled_under_the_floor(monkeypatch, capsys):
  # A small unrolled char LSTM at 0.3 of its peak fails; under its floor, a
  # plan whose estimate, scaled as every attempt so far compiled, is far above
  # the lowest of them is not compiled (`UNDER_FLOOR_MARGIN`). Probing every
  # plan (a margin of 1.0) compiles more and reports the same floor.
  import pathlib
  import sys
  from jaxmem._src.api import fit as fit_lib
  bench = pathlib.Path(__file__).resolve().parents[2] / "bench"
  if str(bench) not in sys.path:
    sys.path.insert(0, str(bench))
  from corpus.sequences import CharLSTM, _rnn
  step, args = _rnn(CharLSTM(vocab=31, embed=16, hidden=64), batch=8, steps=6, seed=0)()
  jit_plan = fit_lib.jit_plan
  default = fit_lib.UNDER_FLOOR_MARGIN
  floors, compiles = {}, {}
  for margin in (default, 1.0):
    compiled = []

    def counting(plan, **kwargs):
      compiled.append(plan.planner)
      return jit_plan(plan, **kwargs)

    monkeypatch.setattr(fit_lib, "jit_plan", counting)
    monkeypatch.setattr(fit_lib, "UNDER_FLOOR_MARGIN", margin)
    with pytest.raises(jaxmem.BudgetError) as info:
      jaxmem.fit(0.3, donate_argnums=(0, 1), verbose=True)(step).fit_result(*args)
    floors[margin], compiles[margin] = info.value.smallest_bytes, len(compiled)
    skipped = "above every attempt's smallest compiled peak" in capsys.readouterr().err
    assert skipped == (margin < 1.0)
  assert compiles[default] < compiles[1.0], compiles
  assert floors[default] == floors[1.0]


def test_relax_keeps_a_looser_plan_only_when_it_fits_and_is_faster():
  # This CNN at 0.6 of its peak: the first plan (one decision) compiles 11% under
  # the budget, so `relax` plans for a target raised by the unused bytes, and
  # again while a looser plan fits and simulates faster (here down to pins and
  # lowering substitutions only): each such plan is kept.
  import cnn
  from jaxmem._src.plan.simulate import simulate
  step, args = cnn.build(batch_size=32, image_size=8, channels=(8, 8))
  tight = jaxmem.fit(0.6, relax=False)(step).fit_result(*args)
  loose = jaxmem.fit(0.6)(step).fit_result(*args)
  assert tight.budget_bytes - tight.peak_bytes >= 0.1 * tight.budget_bytes
  assert loose.peak_bytes <= loose.budget_bytes == tight.budget_bytes
  assert loose.rounds >= tight.rounds + 1
  assert len(loose.plan.decisions) < len(tight.plan.decisions)
  assert simulate(loose.plan).step_time_s < simulate(tight.plan).step_time_s
  # Same values as the first plan's step (both are bit-identical to jax.jit here).
  out_tight = jaxmem.fit(0.6, relax=False)(step)(*args)
  out_loose = jaxmem.fit(0.6)(step)(*args)
  for a, b in zip(jax.tree.leaves(out_tight), jax.tree.leaves(out_loose)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fit_recomputes_a_scans_residuals_per_iteration():
  # The stacked residuals of a scanned MLP are one value each to the planners:
  # no plan of the step as written goes below its peak. `fit` then plans the
  # step rewritten to recompute them in the backward scan (ir/scan_remat.py).
  step, args = models.scanned_tanh_mlp()
  fitted = jaxmem.fit(0.5)(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes < res.unplanned_peak_bytes
  assert res.scans.startswith("recomputed") and "per iteration" in res.summary()
  forward = next(op for op in res.plan.program.ops if op.primitive == "scan")
  assert len(forward.outputs) == 2   # the carry, and its per-iteration stack only
  # The same arithmetic on the same values: bit-identical to jax.jit.
  np.testing.assert_array_equal(fitted(*args), jax.jit(step)(*args))


def test_budget_error_names_the_scan_that_stacks_the_holders():
  step, args = models.scanned_tanh_mlp()
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit("1KiB")(step)(*args)
  msg = str(info.value)
  assert "stacked over 12 iterations by the `scan` at" in msg and "models.py" in msg


def test_fit_recomputes_the_residuals_of_an_nnx_scan():
  # flax nnx: layers made with `nnx.vmap` and applied with `nnx.scan`, the
  # step a functional SGD update over `nnx.split` state.
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
      self.linear = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.linear(x))

  class Scanned(nnx.Module):
    def __init__(self, layers: int, width: int, rngs: nnx.Rngs):
      @nnx.vmap(in_axes=0, out_axes=0)
      def create(key):
        return Block(width, nnx.Rngs(key))
      self.blocks = create(jax.random.split(rngs.params(), layers))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def layer(x, block):
        return block(x)
      return layer(x, self.blocks)

  graphdef, params = nnx.split(Scanned(8, 128, nnx.Rngs(0)))

  def step(params, x):
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

  x = jnp.ones((1024, 128))
  fitted = jaxmem.fit(0.5)(step)
  res = fitted.fit_result(params, x)
  assert res.peak_bytes <= res.budget_bytes and res.scans.startswith("recomputed")
  for a, b in zip(jax.tree.leaves(fitted(params, x)), jax.tree.leaves(jax.jit(step)(params, x))):
    np.testing.assert_array_equal(a, b)


def test_fit_stacks_an_nnx_scans_carries_in_the_native_store():
  # The examples' nnx MLP with `nnx.scan` (Linear + ReLU, adam): recomputing
  # its residuals still stacks each layer's input (0.89 of the peak, as
  # `nnx.remat(nothing_saveable)` by hand). The `ffi` backend then keeps that
  # stack in jaxmem's host store, one slice per iteration.
  import nnx_mlp
  step, args = nnx_mlp.build(batch_size=2048, width=256, depth=12, scan_layers=True)
  fitted = jaxmem.fit(0.5)(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes
  assert "jaxmem's host store" in res.scans
  # Reports still name the user's scan, not the rewrite.
  scan = next(op for op in res.plan.program.ops if op.primitive == "scan")
  assert "nnx_mlp.py" in scan.source
  for a, b in zip(jax.tree.leaves(fitted(*args)), jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_array_equal(a, b)
  assert jaxmem.native.store_stats().live_entries == 0


def test_floor_advice_follows_the_largest_kinds():
  from jaxmem._src.api.fit import UNMODELLED, floor_advice
  mib = 2 ** 20
  args = floor_advice([("parameters", 60 * mib), ("optimizer state", 30 * mib),
                       ("activations kept for the backward pass", 10 * mib)], 100 * mib,
                      donated=True, cpu=True, fallback=False)
  assert "arguments hold 90%" in args and "100.00 MiB" in args
  assert "activations" not in args and "donate" not in args
  acts = floor_advice([("activations kept for the backward pass", 70 * mib),
                       ("outputs (new state, loss)", 20 * mib), (UNMODELLED, 10 * mib)],
                      100 * mib, donated=False, cpu=True, fallback=False)
  assert "activations and temporaries hold 70%" in acts
  assert "donate the state" in acts and "XLA's own buffers hold 10%" in acts
  assert "compiler_fallback" in acts
  assert "compiler_fallback" not in floor_advice([(UNMODELLED, mib)], mib, donated=True,
                                                 cpu=False, fallback=False)
  scans = floor_advice([("values stacked by scans", 50 * mib), ("parameters", 50 * mib)],
                       100 * mib, donated=True, cpu=False, fallback=False)
  assert "`jax.checkpoint` on the scan body" in scans
  # XLA:CPU's memory scheduler, where activations or XLA's buffers hold the
  # floor and the process has not turned the breadth-first default off.
  scheduler = "xla_cpu_enable_concurrency_optimized_scheduler=false"
  floor = [("activations kept for the backward pass", 70 * mib), ("parameters", 30 * mib)]
  assert scheduler in floor_advice(floor, 100 * mib, donated=True, cpu=True, fallback=False,
                                   breadth_first=True)
  assert scheduler not in floor_advice(floor, 100 * mib, donated=True, cpu=True, fallback=False,
                                       breadth_first=False)
  assert scheduler not in floor_advice(floor, 100 * mib, donated=True, cpu=False, fallback=False,
                                       breadth_first=True)
  assert scheduler not in floor_advice([("parameters", 100 * mib)], 100 * mib, donated=True,
                                       cpu=True, fallback=False, breadth_first=True)


def test_floor_advice_names_the_instruction_whose_working_set_is_the_floor():
  from jaxmem._src.api.fit import floor_advice
  from jaxmem._src.verify.working_set import WorkingSet
  mib = 2 ** 20
  floor = [("activations kept for the backward pass", 70 * mib), ("parameters", 30 * mib)]
  ws = WorkingSet("fusion.7", "transpose(jvp(Net))/add_any", 35 * mib, 35 * mib)
  text = floor_advice(floor, 100 * mib, donated=True, cpu=True, fallback=False,
                      breadth_first=True, working_set=ws)
  assert "`fusion.7` (`transpose(jvp(Net))/add_any`) reads 35.00 MiB and writes 35.00 MiB" in text
  assert "splits one instruction" in text
  # The generic lines it replaces: no plan and no scheduler orders one instruction.
  assert "activations and temporaries hold" not in text
  assert "xla_cpu_enable_concurrency_optimized_scheduler" not in text


def test_a_floor_of_one_instructions_working_set_is_named_by_the_budget_error():
  # A hypernetwork's per-example tanh and its gradient, read and written by
  # one fusion, are the floor with the arguments: the error says so.
  step, args = models.hypernetwork()
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.5, donate_argnums=(0,))(step).fit_result(*args)
  if jax.default_backend() == "cpu":
    assert "one instruction holds it" in info.value.advice
    assert "reads 2.0" in info.value.advice and "writes 2.00 MiB" in info.value.advice
    # The compiled floor program's own temporaries at its peak, named by the
    # model line XLA recorded: they are within the floor.
    held = info.value.compiled_holders
    assert held and all(b > 0 for _, b in held)
    assert sum(b for _, b in held) <= info.value.smallest_bytes
    assert "in the compiled program" in str(info.value)


def test_the_cpu_scheduler_is_breadth_first_unless_xla_flags_turn_it_off(monkeypatch):
  from jaxmem._src.api.fit import cpu_schedules_breadth_first
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert cpu_schedules_breadth_first()
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x "
                     "--xla_cpu_enable_concurrency_optimized_scheduler=false")
  assert not cpu_schedules_breadth_first()
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
  assert cpu_schedules_breadth_first()


def _accumulating_step():
  """An 8-layer tanh MLP's SGD step over two micro-batches, its gradients summed in a `scan`."""
  ws = [jnp.full((256, 256), 0.01)] * 8
  xs = jnp.ones((2, 1024, 256))

  def step(ws, xs):
    def loss(ws, x):
      for w in ws:
        x = jnp.tanh(x @ w)
      return jnp.sum(x ** 2)

    def body(acc, x):
      return jax.tree.map(jnp.add, acc, jax.grad(loss)(ws, x)), None
    grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, ws), xs)
    return [w - 0.1 * g for w, g in zip(ws, grads)]
  return step, (ws, xs)


def test_fit_plans_the_body_of_a_gradient_accumulation_scan():
  """Gradient accumulation: a `scan` over micro-batches whose body is a whole
  forward and backward pass, with no backward scan to rewrite. Its body is
  planned as a step of its own (`ir/scan_bodies.py`); per-value remat and
  offload re-bind the same primitives: bit-identical."""
  step, args = _accumulating_step()
  fitted = jaxmem.fit(0.8)(step)
  res = fitted.fit_result(*args)
  assert res.peak_bytes <= res.budget_bytes < res.unplanned_peak_bytes
  assert res.scans.startswith("body of the `scan` at ") and "test_fit.py" in res.scans
  for a, b in zip(fitted(*args), jax.jit(step)(*args)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_floor_held_by_a_loop_body_names_that_body_and_is_reached_when_asked():
  """Below what its body's plans reach, the error names the body (the scan's
  working set is charged to it as one op's), not XLA, says what lowers it,
  and reports a floor that `fit` reaches when asked for it."""
  step, args = _accumulating_step()
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.4)(step)(*args)
  err = info.value
  body = [k for k, _ in err.floor if k.startswith("inside the body of the `scan` at ")]
  assert body and "test_fit.py" in body[0]
  assert "working set of a loop body holds" in err.advice
  unplanned = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes
  assert err.smallest_bytes < unplanned
  again = jaxmem.fit(int(err.smallest_bytes))(step).fit_result(*args)
  assert again.peak_bytes <= err.smallest_bytes
