"""Asynchronous copies: the start/done custom calls, the copy engine, window placement, fit."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _arrays import example_array

import jaxmem
import models
from jaxmem import native
from jaxmem._src.lower.ffi import schedule_function
from jaxmem._src.plan.schedule import StepKind, async_copies, build_schedule

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.int32, jnp.bool_]
ASYNC_KINDS = {StepKind.OFFLOAD_START, StepKind.OFFLOAD_DONE, StepKind.FETCH_START,
               StepKind.FETCH_DONE}


_example = example_array


def _assert_bit_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def _assert_clean():
  assert native.store_stats().live_entries == 0
  assert native.copy_stats().outstanding == 0


def _async_roundtrip(x, work):
  """Offload x while ``work`` runs, fetch it back while ``work`` runs again."""
  t = native.offload_start(x)
  y = work(x)
  h = native.offload_done(x, t, y)
  buf, t2 = native.fetch_start(h, y, shape=x.shape, dtype=x.dtype)
  z = work(y)
  return native.fetch_done(buf, t2, z), z


@pytest.fixture(autouse=True)
def _engine_defaults():
  yield
  native.set_copy_threads(1)
  native.store_clear()


# ---------------------------------------------------------------- custom calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (5, 3), (64, 33)])
def test_roundtrip_bit_identical(shape, dtype):
  x = _example(shape, dtype, seed=len(shape))
  got, _ = jax.jit(lambda x: _async_roundtrip(x, lambda v: v))(x)
  _assert_bit_equal(got, x)
  _assert_clean()


def test_roundtrip_with_compute_in_the_window():
  x = _example((512, 256), jnp.int32) // 1024          # integers: exact arithmetic
  work = lambda v: jnp.cumsum(v, axis=0) % 7 + v       # noqa: E731
  got, z = jax.jit(lambda x: _async_roundtrip(x, work))(x)
  _assert_bit_equal(got, x)
  _assert_bit_equal(z, work(work(x)))
  stats = native.copy_stats()
  assert stats.outstanding == 0 and stats.in_flight == 0
  assert stats.bytes_copied >= 2 * x.nbytes


def test_preserves_nan_and_signed_zero_bits():
  x = jnp.asarray(np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45], np.float32))
  got, _ = jax.jit(lambda x: _async_roundtrip(x, lambda v: v * 1))(x)
  _assert_bit_equal(got, x)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_worker_thread_counts(threads):
  native.set_copy_threads(threads)
  assert native.copy_stats().threads == threads
  xs = [_example((128, 64), jnp.float32, seed=s) for s in range(4)]

  @jax.jit
  def f(*xs):
    ts = [native.offload_start(x) for x in xs]
    hs = [native.offload_done(x, t, None) for x, t in zip(xs, ts)]
    pending = [native.fetch_start(h, xs[-1], shape=x.shape, dtype=x.dtype)
               for h, x in zip(hs, xs)]
    return [native.fetch_done(b, t) for b, t in pending]

  for got, x in zip(f(*xs), xs):
    _assert_bit_equal(got, x)
  _assert_clean()


def test_ops_are_side_effecting_and_ordered():
  def f(x, y):
    t = native.offload_start(x)
    h = native.offload_done(x, t, y)
    return native.fetch_done(*native.fetch_start(h, y, shape=x.shape, dtype=x.dtype), y)

  hlo = jax.jit(f).lower(jnp.ones(8), jnp.ones(3)).compile().as_text()
  for name in ("offload_start", "offload_done", "fetch_start", "fetch_done"):
    assert f'custom_call_target="jaxmem_{name}"' in hlo
  assert hlo.count("custom_call_has_side_effect=true") >= 4


def test_done_reads_the_source_no_copy():
  """The done keeping ``x`` alive is a read: XLA inserts no copy of the source."""
  def f(x):
    y = jnp.sin(x)
    t = native.offload_start(y)
    z = jnp.cos(y) * 2        # another reader of y, not ordered before the start
    h = native.offload_done(y, t, z)
    return h, z

  hlo = jax.jit(f).lower(jnp.ones((256, 256))).compile().as_text()
  assert " copy(" not in hlo.split("ENTRY")[1]


def test_subbyte_dtype_is_refused():
  x = jnp.zeros((8,), jnp.int4)
  with pytest.raises(Exception, match="not supported"):
    jax.block_until_ready(jax.jit(lambda x: native.offload_done(x, native.offload_start(x)))(x))


# ------------------------------------------------------------------- errors


def _expect_error(fn, *args, match):
  errors_before = native.copy_stats().total_errors
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(fn(*args))
  assert native.copy_stats().total_errors > errors_before or "host store" in match
  native.store_clear()
  # The engine still works afterwards.
  x = _example((16, 4), jnp.float32)
  got, _ = jax.jit(lambda x: _async_roundtrip(x, lambda v: v + 1))(x)
  _assert_bit_equal(got, x)


def test_stale_ticket_raises():
  def twice(x):
    t = native.offload_start(x)
    h1 = native.offload_done(x, t, None)
    h2 = native.offload_done(x, t, h1)
    return h1, h2

  _expect_error(jax.jit(twice), jnp.ones(4), match="not outstanding")


def test_made_up_ticket_raises():
  f = jax.jit(lambda x: native.offload_done(x, jnp.array([12345, 678], jnp.uint32)))
  _expect_error(f, jnp.ones(4), match="never issued")


def test_ticket_of_the_other_kind_raises():
  def f(x):
    t = native.offload_start(x)
    out = native.fetch_done(jnp.zeros_like(x), t, x)   # an offload ticket
    return out, native.offload_done(x, t, out)

  _expect_error(jax.jit(f), jnp.ones(4), match="belongs to offload_start")


def test_fetch_start_of_unknown_handle_raises():
  def f(x):
    buf, t = native.fetch_start(jnp.array([1, 2], jnp.uint32), x, shape=(4,), dtype=jnp.float32)
    return native.fetch_done(buf, t, x)

  _expect_error(jax.jit(f), jnp.ones(4), match="host store")


def test_fetch_start_mismatch_raises_and_keeps_entry():
  x = _example((4, 3), jnp.float32)
  h = native.offload(x)

  def f(h):
    buf, t = native.fetch_start(h, h, shape=(4, 4), dtype=jnp.float32)
    return native.fetch_done(buf, t)

  with pytest.raises(Exception, match="mismatch"):
    jax.block_until_ready(jax.jit(f)(h))
  # The entry is still there: a correct fetch works.
  _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)
  _assert_clean()


def test_start_and_done_in_different_computations_are_refused():
  """A fetch buffer handed out of its computation may be copied by XLA: refused, not torn."""
  x = _example((32, 8), jnp.float32)
  h = native.offload(x)
  buf, t = jax.jit(lambda h: native.fetch_start(h, h, shape=x.shape, dtype=x.dtype))(h)
  with pytest.raises(Exception, match="moved between the start and the done"):
    jax.block_until_ready(jax.jit(native.fetch_done)(buf, t))
  _assert_clean()


def test_orphaned_tickets_are_counted_and_cleared():
  """A start whose done never runs leaves a ticket; store_clear frees it."""
  x = _example((64, 64), jnp.float32)
  t = jax.jit(native.offload_start)(x)
  native.copy_drain()
  stats = native.copy_stats()
  assert stats.outstanding == 1 and stats.in_flight == 0
  assert native.store_clear() >= x.nbytes
  assert native.copy_stats().outstanding == 0
  with pytest.raises(Exception, match="not outstanding"):
    jax.block_until_ready(jax.jit(native.offload_done)(x, t))


def test_bad_ticket_shape_is_a_type_error():
  with pytest.raises(TypeError, match="ticket"):
    native.offload_done(jnp.ones(3), jnp.zeros((3,), jnp.uint32))
  with pytest.raises(TypeError, match="handle"):
    native.fetch_start(jnp.zeros((2,), jnp.int32), 0.0, shape=(1,), dtype=jnp.float32)


def test_vmap_is_not_supported():
  with pytest.raises(Exception):
    jax.vmap(native.offload_start)(jnp.ones((3, 4)))


def test_copy_cpus():
  native.set_copy_cpus([0])
  assert native.copy_stats().cpus == (0,)
  x = _example((32, 32), jnp.float32)
  got, _ = jax.jit(lambda x: _async_roundtrip(x, lambda v: v * 2))(x)
  _assert_bit_equal(got, x)
  native.set_copy_cpus([])
  assert native.copy_stats().cpus == ()
  with pytest.raises(ValueError, match="CPU"):
    native.set_copy_cpus([100000 - 1])


# --------------------------------------------------------- window placement


@pytest.fixture(scope="module")
def mlp_plan():
  step, args = models.mlp(1024, 128, 6)
  prog = models.mlp_program(1024, 128, 6)
  plan = jaxmem.get_planner("greedy")(prog, int(prog.peak_bytes * 0.5), "cpu",
                                      allow_remat=False)
  assert plan.num_offload >= 3
  return step, args, prog, plan


def _check_well_formed(sched, prog):
  defined = set(prog.invars) | set(prog.consts)
  for st in sched.steps:
    for x in st.inputs:
      if isinstance(x, int):
        assert x in defined, st
    defined.update(st.outputs)


def test_window_zero_is_the_synchronous_schedule(mlp_plan):
  _, _, prog, plan = mlp_plan
  sync = build_schedule(prog, plan.decisions, plan.pinned)
  zero = build_schedule(prog, plan.decisions, plan.pinned, copies="async", window=0)
  assert [s.kind for s in zero.steps] == [s.kind for s in sync.steps]
  assert zero.profile().peak_bytes == sync.profile().peak_bytes


def test_windows_follow_paper_001(mlp_plan):
  _, _, prog, plan = mlp_plan
  sync = build_schedule(prog, plan.decisions, plan.pinned)
  sched = async_copies(sync, window=1.0, budget=None)
  _check_well_formed(sched, prog)
  assert sched.copies == "async" and len(sched.windows) == plan.num_offload
  kinds = [s.kind for s in sched.steps]
  split = 0
  for w in sched.windows:
    assert w.offload_start <= w.offload_done < w.fetch_start <= w.fetch_done
    if w.offload_done > w.offload_start:
      split += 1
      assert kinds[w.offload_start] is StepKind.OFFLOAD_START
      assert kinds[w.offload_done] is StepKind.OFFLOAD_DONE
      # As late as the window allows, unless the peak bound pulled it in.
      assert w.offload_cover_bytes >= w.window_bytes or w.offload_budget_bound
      assert w.offload_cover_bytes > 0
    if w.fetch_done > w.fetch_start:
      assert kinds[w.fetch_start] is StepKind.FETCH_START
      assert kinds[w.fetch_done] is StepKind.FETCH_DONE
      assert w.fetch_cover_bytes >= w.window_bytes or w.fetch_budget_bound
  assert split > 0
  # Windows fill valleys: the schedule's estimated peak does not grow.
  assert sched.profile().peak_bytes <= sync.profile().peak_bytes


def test_profile_counts_source_until_done_and_destination_from_start(mlp_plan):
  _, _, prog, plan = mlp_plan
  sched = build_schedule(prog, plan.decisions, plan.pinned, copies="async", window=2.0,
                         budget=None)
  prof = sched.profile()
  for w in sched.windows:
    st = sched.steps[w.offload_start]
    if w.offload_done > w.offload_start:
      src = st.inputs[0]
      assert prof.intervals[src][1] >= w.offload_done
    if w.fetch_done > w.fetch_start:
      buf = sched.steps[w.fetch_start].outputs[0]
      assert prof.intervals[buf][0] == w.fetch_start
      assert prof.intervals[buf][1] >= w.fetch_done
      # The aliased result takes the buffer over after the done: not counted twice.
      out = sched.steps[w.fetch_done].outputs[0]
      assert prof.intervals[out][0] == w.fetch_done + 1


def test_larger_windows_reach_further(mlp_plan):
  _, _, prog, plan = mlp_plan
  sync = build_schedule(prog, plan.decisions, plan.pinned)
  small = async_copies(sync, window=0.25, budget=None).windows
  large = async_copies(sync, window=8.0, budget=None).windows
  # The first window sees only the plan's own headroom; later ones share what
  # earlier windows left (placed in offload order), so only totals compare.
  a, b = small[0], large[0]
  assert b.offload_cover_bytes >= a.offload_cover_bytes
  assert b.fetch_cover_bytes >= a.fetch_cover_bytes
  total = lambda ws: sum(w.offload_cover_bytes + w.fetch_cover_bytes for w in ws)  # noqa: E731
  assert total(large) > total(small)
  # An absolute window in bytes (Hayakawa et al.'s schedule-window) works too.
  nbytes = large[0].nbytes
  absolute = async_copies(sync, window=int(nbytes), budget=None).windows
  assert all(w.window_bytes == nbytes for w in absolute)


def test_budget_bounds_the_windows(mlp_plan):
  _, _, prog, plan = mlp_plan
  sync = build_schedule(prog, plan.decisions, plan.pinned)
  live = sync.profile().live_bytes
  tight = int(np.max(live))          # no headroom anywhere near the peak
  loose = async_copies(sync, window=8.0, budget=None)
  bound = async_copies(sync, window=8.0, budget=int(np.min(live)))
  assert sum(w.offload_done - w.offload_start for w in bound.windows) <= sum(
      w.offload_done - w.offload_start for w in loose.windows)
  assert async_copies(sync, window=8.0, budget=tight).profile().peak_bytes <= tight
  assert all(w.offload_done == w.offload_start and w.fetch_done == w.fetch_start
             for w in bound.windows)


def test_bad_arguments():
  with pytest.raises(ValueError, match="copies"):
    jaxmem.fit(0.5, copies="overlapped")
  with pytest.raises(ValueError, match="window"):
    jaxmem.fit(0.5, copies="async", window=-1)
  with pytest.raises(ValueError, match="window"):
    jaxmem.fit(0.5, copies="async", window="1MiB")


def test_async_schedule_runs_bit_identical(mlp_plan):
  step, args, prog, plan = mlp_plan
  want = jax.jit(step)(*args)
  leaves = jax.tree_util.tree_leaves(args)
  for window in (0.5, 2.0, 64 * 1024):
    sched = dataclasses.replace(plan, copies="async", window=window).schedule()
    assert any(s.kind in ASYNC_KINDS for s in sched.steps)
    got = jax.jit(schedule_function(sched))(*leaves)
    for a, b in zip(jax.tree_util.tree_leaves(want), got):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_clean()


# --------------------------------------------------------------------- fit


@pytest.fixture(scope="module")
def fitted_async():
  step, args = models.mlp(8192, 512, 8)
  fitted = jaxmem.fit(0.5, copies="async")(step)
  return step, args, fitted


def test_fit_async_within_budget_and_bit_identical(fitted_async):
  step, args, fitted = fitted_async
  res = fitted.fit_result(*args)
  mem = jaxmem.compiled_memory(fitted.lower(*args).compile())
  assert mem.peak_bytes == res.peak_bytes <= res.budget_bytes
  assert res.plan.copies == "async" and res.plan.num_offload > 0
  sched = res.plan.schedule()
  assert any(w.offload_done > w.offload_start for w in sched.windows)
  assert "jaxmem_offload_start" in fitted.lower(*args).compile().as_text()
  assert "async copies" in res.plan.summary()
  params, opt_state, *data = args
  got = want = (params, opt_state)
  plain = jax.jit(step)
  for _ in range(2):
    got = jax.block_until_ready(fitted(*got[:2], *data))
    want = plain(*want[:2], *data)
    _assert_clean()
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_executions_at_once(fitted_async):
  """The same fitted step called from two Python threads: correct, and nothing left over."""
  step, args, fitted = fitted_async
  want = jax.jit(step)(*args)
  fitted(*args)   # compile once, outside the threads
  errors: list[BaseException] = []
  barrier = threading.Barrier(2)

  def worker():
    try:
      barrier.wait()
      for _ in range(3):
        got = fitted(*args)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  native.copy_drain()
  _assert_clean()


def test_custom_planner_gets_async_copies(mlp_small):
  step, args = mlp_small
  seen = []

  def planner(program, budget, device):      # knows nothing of copies
    seen.append(budget)
    return jaxmem.get_planner("greedy")(program, budget, device, allow_remat=False)

  fitted = jaxmem.fit(0.7, planner=planner, copies="async", window=2.0)(step)
  res = fitted.fit_result(*args)
  assert seen and res.plan.copies == "async" and res.plan.window == 2.0
  assert res.peak_bytes <= res.budget_bytes
  for a, b in zip(jax.tree_util.tree_leaves(fitted(*args)),
                  jax.tree_util.tree_leaves(jax.jit(step)(*args))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------ host memory


def test_host_buffers_are_reused():
  """Freed host buffers are cached: a loop offloading the same sizes reuses warm memory."""
  x = _example((256, 256), jnp.float32)
  f = jax.jit(lambda x: _async_roundtrip(x, lambda v: v + 1)[0])
  jax.block_until_ready(f(x))
  before = native.store_stats()
  for _ in range(3):
    _assert_bit_equal(f(x), x)
  after = native.store_stats()
  assert after.cache_hits - before.cache_hits >= 3
  assert after.cached_bytes >= x.nbytes
  native.store_clear()
  assert native.store_stats().cached_bytes == 0
