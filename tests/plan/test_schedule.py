"""The schedule, unit by unit: where restores, fences, pins and copies go, and what they cost.

Programs are tiny hand-written steps; decisions are made by hand, so each test
states the placement rule it checks (``jaxmem/_src/plan/schedule.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxmem
import models
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.schedule import (Schedule, StepKind, build_schedule, choose_dep,
                                       fence_points, stored_source, window_bytes)


@pytest.fixture(scope="module")
def program():
  grad, args = models.tanh_mlp(depth=4, width=64, batch=512)
  return jaxmem.analyze(grad, *args)


def _residual(program):
  """A forward tanh output read again by the backward pass, and its gap."""
  for v in program.vars:
    if v.role.value == "activation" and program.ops[v.defined_by].primitive == "tanh":
      fwd = [u for u in v.uses if program.ops[u].phase.value == "forward"]
      bwd = [u for u in v.uses if program.ops[u].phase.value == "backward"]
      if fwd and bwd:
        return v, max(fwd), min(bwd)
  raise AssertionError("no residual")


def test_no_decision_is_the_program_itself(program):
  sched = build_schedule(program, ())
  assert [st.kind for st in sched.steps] == [StepKind.COMPUTE] * program.num_ops
  assert [st.op for st in sched.steps] == list(range(program.num_ops))
  assert sched.value_var == tuple(range(len(program.vars)))
  # Priced like the program: the same peak.
  assert sched.profile().peak_bytes == program.peak_bytes


def test_an_offload_goes_after_the_last_use_and_its_fetch_before_the_next(program):
  v, a, b = _residual(program)
  sched = build_schedule(program, [Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)])
  kinds = [st.kind for st in sched.steps]
  off = kinds.index(StepKind.OFFLOAD)
  fetch = kinds.index(StepKind.FETCH)
  assert sched.steps[off - 1].op == a and sched.steps[off].anchor == a + 0.5
  assert sched.steps[fetch + 1].op == b and sched.steps[fetch].anchor == b - 0.5
  handle = sched.steps[off].outputs[0]
  assert sched.steps[fetch].inputs[0] == handle and sched.value_var[handle] is None
  # The use after the gap reads the fetched version, not the original.
  fetched = sched.steps[fetch].outputs[0]
  assert sched.value_var[fetched] == v.id
  assert fetched in sched.steps[fetch + 1].inputs and v.id not in sched.steps[fetch + 1].inputs
  # The fetch waits for the use's other input (its `dep`), chosen by choose_dep.
  assert sched.steps[fetch].inputs[1] == choose_dep(program, b, {v.id})


def test_a_remat_recomputes_its_chain_behind_fences_before_the_use(program):
  v, a, b = _residual(program)
  chain = (v.defined_by,)
  sched = build_schedule(program, [Decision(v.id, Action.REMAT, a, b, chain, v.nbytes)])
  recomputed = [i for i, st in enumerate(sched.steps) if st.recompute]
  assert [sched.steps[i].op for i in recomputed] == list(chain)
  i = recomputed[0]
  fences = [st for st in sched.steps[:i] if st.kind is StepKind.FENCE and st.anchor == b - 0.5]
  assert [st.var for st in fences] == fence_points(program, chain)
  assert sched.steps[i + 1].op == b
  new = sched.steps[i].outputs[0]
  assert sched.value_var[new] == v.id and new in sched.steps[i + 1].inputs


def test_pins_fence_a_value_right_after_its_definition(program):
  v, _, _ = _residual(program)
  sched = build_schedule(program, (), pinned=(v.id,))
  (k,) = [i for i, st in enumerate(sched.steps) if st.kind is StepKind.PIN]
  assert sched.steps[k - 1].op == v.defined_by and sched.steps[k].anchor == v.defined_by + 0.25
  pinned = sched.steps[k].outputs[0]
  later = [st for st in sched.steps[k + 1:] if st.kind is StepKind.COMPUTE]
  assert all(v.id not in st.inputs for st in later)
  assert any(pinned in st.inputs for st in later)


def test_offloading_a_residual_frees_its_bytes_over_its_gap():
  # h = x @ w is read by the next matmul and by the backward weight gradient: matmuls
  # read stored operands, so nothing keeps h on the device over its gap. (A tanh
  # output would not do: its fused derivative `1 - t * t` reads it in place.)
  def loss(w, x):
    h = x @ w
    return jnp.sum(jnp.sin(h @ w) @ w)
  program = jaxmem.analyze(jax.grad(loss), jnp.ones((64, 64)), jnp.ones((2048, 64)))
  (mm,) = [op for op in program.ops if op.primitive == "dot_general" and op.index == 0]
  v = program.vars[mm.outputs[0]]
  a = max(u for u in v.uses if program.ops[u].phase.value == "forward")
  b = min(u for u in v.uses if program.ops[u].phase.value == "backward")
  assert b - a > 2
  plain = build_schedule(program, ()).profile()
  sched = build_schedule(program, [Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)])
  prof = sched.profile()
  mid = [i for i, st in enumerate(sched.steps) if st.op is not None and a < st.op < b]
  assert mid
  for i in mid:   # v's bytes are off the device for the whole gap (an 8-byte handle stays)
    assert prof.live_bytes[i] == plain.live_bytes[sched.steps[i].op] - v.nbytes + 8


def test_async_copies_split_into_starts_and_dones_inside_the_budget(program):
  v, a, b = _residual(program)
  d = Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)
  sync = build_schedule(program, [d])
  sched = build_schedule(program, [d], copies="async", window=4.0,
                         budget=sync.profile().peak_bytes)
  assert sched.copies == "async" and len(sched.windows) == 1
  w = sched.windows[0]
  assert w.offload_start <= w.offload_done < w.fetch_start <= w.fetch_done
  assert sched.profile().peak_bytes <= sync.profile().peak_bytes


def test_window_bytes_reads_ints_as_bytes_and_floats_as_multiples():
  assert window_bytes(1000, 64) == 1000
  assert window_bytes(2.0, 64) == 128
  assert window_bytes(None, 64) == 64
  with pytest.raises(ValueError, match="window"):
    window_bytes(-1, 64)
  with pytest.raises(ValueError, match="window"):
    window_bytes(True, 64)


def test_a_bad_copy_mode_is_refused(program):
  with pytest.raises(ValueError, match="copies"):
    build_schedule(program, (), copies="eventually")


def test_schedules_are_immutable(program):
  sched = build_schedule(program, ())
  assert isinstance(sched, Schedule)
  with pytest.raises(dataclasses.FrozenInstanceError):
    sched.copies = "async"
  assert isinstance(sched.steps, tuple)


def test_a_schedule_runs_to_the_same_values(program):
  # The ffi backend executes exactly the step list: offload + remat give jit's values.
  from jaxmem._src.lower.ffi import schedule_function
  grad, args = models.tanh_mlp(depth=4, width=64, batch=512)
  v, a, b = _residual(program)
  sched = build_schedule(program, [Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)])
  got = jax.jit(schedule_function(sched))(*jax.tree_util.tree_leaves(args))
  want = jax.tree_util.tree_leaves(jax.jit(grad)(*args))
  for g, w in zip(got, want):
    assert jnp.array_equal(g, w)


def _masked_loss(w, x):
  n = x.shape[0]
  # A causal mask computed from constants only, as flax's `make_causal_mask`.
  mask = (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]).astype(jnp.float32)
  h = jnp.tanh(x @ w)
  scores = (h @ h.T) * mask
  return jnp.sum(jnp.tanh(scores) @ h)


def test_fences_skip_values_computed_from_constants():
  """A fence on a causal mask would make XLA store it; XLA recomputes it in its consumers instead."""
  w = jax.random.normal(jax.random.PRNGKey(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.PRNGKey(1), (256, 64))
  prog = jaxmem.analyze(jax.grad(_masked_loss), w, x)
  mask = next(v for v in prog.vars if prog.constant_like[v.id] and v.shape == (256, 256)
              and v.aval.dtype == jnp.float32)
  product = next(k for k in mask.uses if prog.ops[k].primitive == "mul")
  # Recomputing the product from the mask and the (kept) scores' inputs: the
  # chain's op reads the mask and an activation; only the activation is fenced.
  chain = (product,)
  fenced = fence_points(prog, chain)
  assert fenced and mask.id not in fenced
  assert all(not prog.constant_like[x] for x in fenced)
  # An op reading only values computed from constants gets no fence at all.
  assert fence_points(prog, (mask.defined_by,)) == []


def test_copies_wait_for_the_value_a_view_views_not_the_view():
  """A copy ordered after a slice XLA fuses away would make XLA write the slice as a copy."""
  from jaxmem._src.ir import primitives

  def loss(w, x):
    a, b = jnp.split(x @ w, 2, axis=1)
    return jnp.sum(jnp.tanh(a) * jax.nn.sigmoid(b))

  prog = jaxmem.analyze(jax.grad(loss), jnp.ones((64, 128)), jnp.ones((256, 64)))
  virtual = prog.profile.virtual
  is_view = lambda x: primitives.facts(prog.ops[prog.vars[x].defined_by].primitive).relayout
  replaced = 0
  for op in prog.ops:
    ins = [x for x in op.input_ids() if not prog.vars[x].is_input and not prog.constant_like[x]]
    latest = max(ins, key=lambda x: prog.vars[x].defined_by) if ins else None
    dep = choose_dep(prog, op.index, set())
    if latest is not None and virtual[latest] and is_view(latest):
      replaced += 1      # a fused slice: the matmul output it slices orders the copy
      assert dep == stored_source(prog, latest) != latest and not virtual[dep]
    if dep is not None:
      assert not (virtual[dep] and is_view(dep))
  assert replaced


def test_a_fenced_argument_is_copied_at_the_program_start_on_the_cpu():
  """XLA:CPU schedules the copy a fence on an argument needs near the start, not at the fence."""
  def loss(w, x):
    w2 = jnp.concatenate([w, w], axis=1)       # computed from the argument alone
    h = jnp.tanh(x @ w2)
    return jnp.sum(jnp.tanh(h @ w2.T))

  prog = jaxmem.analyze(jax.grad(loss), jnp.ones((64, 64)), jnp.ones((256, 64)))
  (cat,) = [op for op in prog.ops if op.primitive == "concatenate" and op.phase.value == "forward"]
  v = prog.vars[cat.outputs[0]]
  a, b = min(v.uses), max(v.uses)     # recomputed for its last use
  assert b - a >= 2
  sched = build_schedule(prog, [Decision(v.id, Action.REMAT, a, b, (cat.index,), v.nbytes)])
  (fence,) = [st for st in sched.steps if st.kind is StepKind.FENCE]
  assert prog.vars[fence.inputs[0]].is_input
  prof = sched.profile()
  assert prof.intervals[fence.outputs[0]][0] == 0
  # Live bytes at the start include the copy.
  assert prof.live_bytes[0] >= build_schedule(prog, ()).profile().live_bytes[0] + 64 * 64 * 4


def test_schedules_of_one_program_share_only_the_steps_no_decision_renames():
  """`build_schedule` reuses an op's compute step across plans of one program
  (planners build dozens of schedules per program) only where the plan renamed
  none of its inputs, and forgets the program with it."""
  import gc

  from jaxmem._src.plan import schedule as schedule_mod
  grad, args = models.tanh_mlp(depth=3, width=32, batch=64)
  prog = jaxmem.analyze(grad, *args)
  v, a, b = _residual(prog)
  planned = build_schedule(prog, [Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)],
                           pinned=(v.id,))
  plain = build_schedule(prog, ())
  again = build_schedule(prog, [Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)],
                         pinned=(v.id,))
  assert again.steps == planned.steps
  for st in plain.steps:       # no version of a planned schedule leaks into the plain one
    assert st.inputs == tuple(prog.ops[st.op].inputs)
  renamed = [st for st in planned.steps if st.kind is StepKind.COMPUTE
             and st.inputs != tuple(prog.ops[st.op].inputs)]
  assert renamed and all(v.id not in st.inputs for st in renamed)
  shared = sum(x is y for x, y in zip(plain.steps, (st for st in planned.steps
                                                    if st.kind is StepKind.COMPUTE)))
  assert shared >= prog.num_ops - len(renamed) - 1
  cached = len(schedule_mod._ORIGINAL_STEPS)
  del prog, planned, plain, again, v
  gc.collect()
  assert len(schedule_mod._ORIGINAL_STEPS) < cached


def test_a_schedule_built_again_is_the_one_built_before():
  """Planners build the same plan more than once: `build_schedule` returns the
  schedule (and its estimate) it built before for the same arguments, and a
  new one when anything it is built from differs (for asynchronous copies,
  the budget bounding their windows too)."""
  grad, args = models.tanh_mlp(depth=3, width=32, batch=64)
  prog = jaxmem.analyze(grad, *args)
  v, a, b = _residual(prog)
  offload = [Decision(v.id, Action.OFFLOAD, a, b, (), v.nbytes)]
  first = build_schedule(prog, offload, copies="async", budget=prog.peak_bytes)
  peak = first.profile().peak_bytes
  again = build_schedule(prog, tuple(offload), copies="async", budget=prog.peak_bytes)
  assert again is first and again.profile().peak_bytes == peak
  assert build_schedule(prog, offload, copies="async", budget=prog.peak_bytes // 2) is not first
  assert build_schedule(prog, offload) is not first                 # synchronous copies
  assert build_schedule(prog, offload, (v.id,), copies="async",
                        budget=prog.peak_bytes) is not first        # a pin
  # Without a round trip the asynchronous schedule has the synchronous one's
  # steps, and shares its estimate.
  plain = build_schedule(prog, ())
  assert build_schedule(prog, (), copies="async").profile() is plain.profile()
  with pytest.raises(ValueError, match="window"):
    build_schedule(prog, offload, copies="async", window=[1])
