"""Per-iteration recomputation of scan residuals: same outputs, smaller compiled peak."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
import models
from jaxmem._src.ir.scan_remat import ScanPair, recompute_scan_residuals, scan_pairs, traced_step


def _flat(step, args):
  leaves, tree = jax.tree_util.tree_flatten(args)

  def flat(*l):
    return jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(tree, l)))

  return jax.make_jaxpr(flat)(*leaves), leaves


def _run(closed):
  return jax.jit(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a))


def test_a_scanned_mlp_recomputes_its_residuals_bit_identically_in_less_memory():
  closed, leaves = _flat(*models.scanned_tanh_mlp())
  pairs = scan_pairs(closed.jaxpr)
  # One forward/backward pair; the three stacks (the incoming carry, tanh and
  # 1 - tanh of each layer) only the backward scan reads.
  assert [(len(p.residuals)) for p in pairs] == [3]
  rewritten = recompute_scan_residuals(closed)
  before, after = _run(closed), _run(rewritten)
  for a, b in zip(before(*leaves), after(*leaves)):
    np.testing.assert_array_equal(a, b)
  peak = lambda f: jaxmem.compiled_memory(f.lower(*leaves).compile()).peak_bytes
  # 12 layers of [1024, 128] f32 stacks three times (18 MiB) become one carry stack.
  assert peak(after) < 0.5 * peak(before)
  # The forward scan stacks one value per iteration instead of three.
  forward = rewritten.jaxpr.eqns[pairs[0].forward]
  assert forward.primitive.name == "scan" and len(forward.outvars) == 2


def test_an_empty_selection_leaves_the_program_as_it_was():
  closed, leaves = _flat(*models.scanned_tanh_mlp(layers=3, width=8, batch=4))
  pair = scan_pairs(closed.jaxpr)[0]
  assert recompute_scan_residuals(closed, [ScanPair(pair.forward, pair.backward, ())]) is closed
  # Recomputing only some residuals works too.
  some = recompute_scan_residuals(closed, [ScanPair(pair.forward, pair.backward, (1,))])
  for a, b in zip(_run(closed)(*leaves), _run(some)(*leaves)):
    np.testing.assert_array_equal(a, b)


def test_a_scan_may_be_in_one_pair_only():
  closed, _ = _flat(*models.scanned_tanh_mlp(layers=3, width=8, batch=4))
  pair = scan_pairs(closed.jaxpr)[0]
  with pytest.raises(ValueError, match="one pair only"):
    recompute_scan_residuals(closed, [pair, ScanPair(pair.forward, pair.backward, (0,))])


def test_an_nn_rnn_lstm_recomputes_bit_identically():
  import lstm
  closed, leaves = _flat(*lstm.build(batch_size=16, seq_len=8, vocab=32, embed=8, hidden=16,
                                     layers=1, scan=True))
  assert scan_pairs(closed.jaxpr)
  rewritten = recompute_scan_residuals(closed)
  for a, b in zip(_run(closed)(*leaves), _run(rewritten)(*leaves)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("save_dots, policy", [(False, "nothing_saveable"),
                                               (True, "dots_saveable")])
def test_a_scanned_gpt_computes_what_nn_remat_on_its_block_computes(save_dots, policy):
  # flax `nn.scan` over decoder blocks. The rewrite recomputes each block in
  # the backward scan (keeping its matmul outputs with `save_dots`), as
  # `nn.remat` on the scanned block with the matching policy does:
  # bit-identical gradients to it, in less memory than the step
  # without remat (from which both differ in last bits: XLA:CPU sums some
  # gradients of a recomputed block in another order).
  import optax
  import transformer
  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 32)

  def grad_of(remat_policy):
    model = transformer.GPT(32, 32, 2, 4, 32, remat_policy, True)

    def loss(params, tokens):
      logits = model.apply(params, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return model, jax.value_and_grad(loss)

  model, grad = grad_of(None)
  params = model.init(jax.random.PRNGKey(1), tokens[:1, :-1])
  closed, leaves = _flat(grad, (params, tokens))
  pairs = [p.saving_dots() if save_dots else p for p in scan_pairs(closed.jaxpr)]
  rewritten = _run(recompute_scan_residuals(closed, pairs))
  by_hand = jax.jit(grad_of(policy)[1])
  got = rewritten(*leaves)
  want = jax.tree_util.tree_leaves(by_hand(params, tokens))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  peak = lambda f: jaxmem.compiled_memory(f.lower(*leaves).compile()).peak_bytes
  assert peak(rewritten) < peak(_run(closed))


@pytest.mark.parametrize("save_dots", [False, True])
def test_offloaded_stacks_are_host_memory_on_xla_tpu_and_change_nothing_here(save_dots):
  """`ScanPair.offload`: what the recomputation reads is stacked in host memory, a slice per iteration."""
  from jaxmem._src.ir.scan_remat import with_scan_residuals_recomputed
  step, args = models.scanned_tanh_mlp()
  recompute = with_scan_residuals_recomputed(step, save_dots=save_dots)
  offload = with_scan_residuals_recomputed(step, save_dots=save_dots, offload=True)
  # Here (XLA:CPU ignores memory kinds): jit's results, bit for bit.
  for a, b in zip(jax.tree.leaves(jax.jit(offload)(*args)), jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_array_equal(a, b)
  # The forward scan's added stack is typed in host memory.
  text = str(jax.make_jaxpr(offload)(*args))
  assert "<host>" in text and "<host>" not in str(jax.make_jaxpr(recompute)(*args))
  # On a v5e (compiled ahead of time, at a size XLA:TPU does not keep on chip):
  # the stack is a host buffer and the device peak drops (measured without
  # matmul outputs: 663 -> 462 MiB; XLA:TPU still holds a few iterations'
  # carries on the device around the copies).
  target = jaxmem.get_target("tpu:v5e")
  big = target.place(jax.tree.map(
      lambda a: jax.ShapeDtypeStruct((a.shape[0], 1024, 1024) if a.ndim == 3 else (16384, 1024),
                                     a.dtype), args))
  peak = {}
  for name, f in (("recompute", recompute), ("offload", offload)):
    compiled = jax.jit(f).lower(*big).compile()
    peak[name] = jaxmem.compiled_memory(compiled)
  assert peak["offload"].host_temp_bytes >= 11 * 64 * 2 ** 20     # 12 iterations' [16384, 1024] f32
  assert peak["offload"].peak_bytes < peak["recompute"].peak_bytes - 2 * 64 * 2 ** 20


def _store_empty():
  return jaxmem.native.store_stats().live_entries == 0


@pytest.mark.parametrize("save_dots", [False, True])
def test_stacks_in_the_native_store_leave_xla_memory_bit_identically(save_dots):
  """`offload="native"`: one `offload` per forward iteration, one `fetch` per backward one."""
  from jaxmem._src.ir.scan_remat import with_scan_residuals_recomputed
  step, args = models.scanned_tanh_mlp()
  recompute = jax.jit(with_scan_residuals_recomputed(step, save_dots=save_dots))
  native = jax.jit(with_scan_residuals_recomputed(step, save_dots=save_dots, offload="native"))
  want = jax.jit(step)(*args)
  for _ in range(2):   # each run offloads and fetches its own slices
    np.testing.assert_array_equal(native(*args), want)
  assert _store_empty()
  peak = lambda f: jaxmem.compiled_memory(f.lower(*args).compile()).peak_bytes
  # The carries' stack ([12, 1024, 128] f32, 6 MiB) is handles now (and the
  # matmul outputs' with `save_dots`).
  assert peak(native) < peak(recompute) - 5.5 * 2 ** 20
  text = str(jax.make_jaxpr(native)(*args))
  assert "u32[12,2]" in text


@pytest.mark.parametrize("where", ["native", "memory_kind"])
def test_staged_residuals_are_copied_out_per_iteration_not_recomputed(where):
  from jaxmem._src.ir.scan_remat import with_scan_residuals_recomputed
  step, args = models.scanned_tanh_mlp()
  staged = with_scan_residuals_recomputed(step, offload=where, residuals="stage")
  np.testing.assert_array_equal(jax.jit(staged)(*args), jax.jit(step)(*args))
  assert _store_empty()
  flops = lambda f: jax.jit(f).lower(*args).compile().cost_analysis()["flops"]
  # Nothing is recomputed: the forward body runs once.
  assert flops(staged) == flops(step)
  peak = lambda f: jaxmem.compiled_memory(jax.jit(f).lower(*args).compile()).peak_bytes
  if where == "native":
    # Three [12, 1024, 128] f32 stacks (18 MiB) leave XLA's memory.
    assert peak(staged) <= peak(step) - 16 * 2 ** 20
  else:
    # XLA:CPU erases memory kinds: the stacks stay, typed in host memory.
    assert "<host>" in str(jax.make_jaxpr(staged)(*args))


def test_each_residual_may_be_kept_recomputed_or_staged():
  from jaxmem._src.ir.scan_remat import KEEP, RECOMPUTE, STAGE
  closed, leaves = _flat(*models.scanned_tanh_mlp(layers=4, width=32, batch=64))
  pair = scan_pairs(closed.jaxpr)[0]
  want = _run(closed)(*leaves)
  for choices in [(KEEP, RECOMPUTE, STAGE), (STAGE, KEEP, KEEP), (STAGE, STAGE, RECOMPUTE)]:
    rewritten = recompute_scan_residuals(
        closed, [pair.offloading("native").with_choices(choices)])
    for a, b in zip(_run(rewritten)(*leaves), want):
      np.testing.assert_array_equal(a, b)
  assert _store_empty()


def test_a_pair_says_what_is_wrong_with_its_choices():
  with pytest.raises(ValueError, match="one choice per residual"):
    ScanPair(0, 1, (0, 1), choices=("keep",))
  with pytest.raises(ValueError, match="unknown"):
    ScanPair(0, 1, (0,), choices=("drop",))
  with pytest.raises(ValueError, match="offload"):
    ScanPair(0, 1, (0,), choices=("stage",))
  with pytest.raises(ValueError, match="offload"):
    ScanPair(0, 1, (0,), offload="disk")


def _scan_step(kind):
  """An SGD step over 12 tanh layers, written as nested scans or with the user's remat."""
  def loss(ws, x):
    def layer(h, w):
      if kind == "nested":   # each outer iteration scans over 3 layers
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)
        return h, None
      return jnp.tanh(h @ w), None
    if kind in ("nothing_saveable", "dots_saveable"):
      layer = jax.checkpoint(layer, policy=getattr(jax.checkpoint_policies, kind))
    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.sum(h * h)

  def step(ws, x):
    return ws - 0.1 * jax.grad(loss)(ws, x)

  shape = (4, 3, 128, 128) if kind == "nested" else (12, 128, 128)
  return step, (jnp.full(shape, 0.01), jnp.ones((1024, 128)))


@pytest.mark.parametrize("kind", ["nested", "nothing_saveable", "dots_saveable"])
def test_nested_scans_and_the_users_remat_are_rewritten_bit_identically(kind):
  # Only the top-level pair is rewritten: an inner scan is part of the body
  # it recomputes, and a body the user remat-ed has as residuals what its
  # policy saves. Every rewrite computes what jax.jit computes.
  from jaxmem._src.ir.scan_remat import with_scan_residuals_recomputed
  step, args = _scan_step(kind)
  want = jax.jit(step)(*args)
  peak = lambda f: jaxmem.compiled_memory(jax.jit(f).lower(*args).compile()).peak_bytes
  for kw in [dict(), dict(save_dots=True), dict(offload="native"),
             dict(offload="native", residuals="stage")]:
    rewritten = with_scan_residuals_recomputed(step, **kw)
    np.testing.assert_array_equal(jax.jit(rewritten)(*args), want)
    assert peak(rewritten) <= peak(step)
  assert _store_empty()
  fitted = jaxmem.fit(0.5)(step)
  assert fitted.fit_result(*args).peak_bytes <= 0.5 * peak(step)
  np.testing.assert_array_equal(fitted(*args), want)


def test_a_pair_keeps_some_stacks_on_the_device_and_sends_the_others_out():
  """`ScanPair.on_device`: kept, staged and recomputed values in one rewrite, bit-identical."""
  from jaxmem._src.estimate.devices import device_profile
  from jaxmem._src.ir.scan_remat import traced_step, with_scan_residuals_recomputed
  from jaxmem._src.planners.scan_policy import scan_frontier
  step, args = models.scanned_tanh_mlp()
  closed, pairs, _ = traced_step(step, args)
  points = scan_frontier(closed.jaxpr, pairs, device_profile("h100-sxm"))
  pt = max(points, key=lambda p: sum(len(s) for s in p.stacks))
  (stacks,) = pt.stacks
  assert len(stacks) >= 2 and sum(b for _, b in stacks) == pt.stacked_bytes
  keep = next(sid for sid, _ in stacks if isinstance(sid, int))   # one body value stays

  def rewrite(**kw):
    return jax.jit(with_scan_residuals_recomputed(step, saved=pt.saved, **kw))

  on_device, all_out = rewrite(), rewrite(offload="native")
  mixed = rewrite(offload="native", on_device=[(keep,)])
  want = jax.jit(step)(*args)
  np.testing.assert_array_equal(mixed(*args), want)
  assert _store_empty()
  peak = lambda f: jaxmem.compiled_memory(f.lower(*args).compile()).peak_bytes
  assert peak(all_out) < peak(mixed) < peak(on_device)
  calls = lambda f: str(jax.make_jaxpr(f)(*args)).count("jaxmem_offload")
  assert 0 < calls(mixed) < calls(all_out)
  with pytest.raises(ValueError, match="neither equations of `saved`"):
    pairs[0].saving(pt.saved[0]).offloading("native").keeping_on_device([10 ** 6])


def test_partial_offloads_move_the_fewest_bytes_that_cover_the_excess():
  from jaxmem._src.api.fit import _partial_offloads
  from jaxmem._src.estimate.devices import device_profile
  from jaxmem._src.planners.scan_policy import ScanPolicyPoint
  pt = ScanPolicyPoint(((1, 2),), 190, 0.0, (((1, 100), (2, 60), (("carry", 0), 30)),))
  # 80 bytes over, a tenth to spare: 88. {60, 30} moves 90 bytes, {100} 100.
  ((_, k, keep),) = _partial_offloads([pt], 80, device_profile("h100-sxm"))
  assert k == 0 and keep == ((1,),)
  # Nothing to keep: all stacks out is the whole offload, not a partial one.
  assert _partial_offloads([pt], 170, device_profile("h100-sxm")) == []


def test_a_step_traced_once_is_rewritten_many_ways_without_tracing_it_again():
  """`fit` rewrites a step's scans several ways (policies, rewrites) from one trace of the
  user's step (`traced=`); arguments of other shapes trace it again."""
  from jaxmem._src.ir.scan_remat import traced_step, with_scan_residuals_recomputed

  step, args = models.scanned_tanh_mlp(layers=3, width=8, batch=4)
  calls = []

  def counted(*a):
    calls.append(1)
    return step(*a)

  traced = traced_step(counted, args)
  assert len(calls) == 1
  expected = jax.jit(step)(*args)
  for save_dots in (False, True):
    rewritten = with_scan_residuals_recomputed(counted, save_dots=save_dots, traced=traced)
    got = jax.jit(rewritten)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
      np.testing.assert_array_equal(a, b)
  assert len(calls) == 1
  _, other = models.scanned_tanh_mlp(layers=3, width=8, batch=2)
  with_scan_residuals_recomputed(counted, traced=traced)(*other)
  assert len(calls) == 2


def test_the_scans_of_a_pair_are_no_body_scans():
  # A differentiated scan's forward and backward scans are rewritten per
  # iteration (`scan_pairs`); only scans outside any pair are planned as
  # programs of their own (`ir/scan_bodies.py`).
  from jaxmem._src.ir.scan_bodies import body_scans

  def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return h.sum()

  def step(ws, x):
    total, _ = jax.lax.scan(lambda c, _: (c + 1.0, None), 0.0, None, length=3)
    return jax.grad(loss)(ws, x), total

  closed, pairs, _ = traced_step(step, (jnp.full((3, 4, 4), 0.1), jnp.ones((2, 4))))
  scans = [i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "scan"]
  assert len(pairs) == 1 and len(scans) == 3
  assert body_scans(closed.jaxpr, pairs) == [i for i in scans
                                              if i not in (pairs[0].forward, pairs[0].backward)]
