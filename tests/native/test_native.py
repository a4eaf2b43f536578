"""Tests of the native extension: fence / offload / fetch and the host store."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _arrays import example_array
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem import native

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8,
          jnp.int32, jnp.bool_]


_example = example_array


def _bits(x):
  """Bit pattern of an array, for bit-exact comparisons (NaN-safe)."""
  a = np.asarray(x)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(
      f"u{a.dtype.itemsize}")


def _assert_bit_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype,
                                                     b.shape, b.dtype)
  np.testing.assert_array_equal(_bits(a), _bits(b))


def _roundtrip(x):
  h = native.offload(x)
  return native.fetch(h, x, shape=x.shape, dtype=x.dtype)


@pytest.fixture(autouse=True)
def _empty_store():
  native.store_clear()
  yield
  native.store_clear()


# ------------------------------------------------------------------- fence


def test_registration_is_idempotent():
  native.register()
  native.register()
  x = jnp.arange(4.0)
  _assert_bit_equal(native.fence(x, x), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fence_is_identity(dtype):
  x = _example((3, 5), dtype)
  dep = jnp.ones((7,), jnp.int32)
  _assert_bit_equal(native.fence(x, dep), x)


@pytest.mark.parametrize("shape", [(), (0,), (4, 0, 2), (1,)])
def test_fence_scalar_and_empty(shape):
  x = _example(shape, jnp.float32)
  _assert_bit_equal(native.fence(x, jnp.float32(1)), x)
  _assert_bit_equal(jax.jit(native.fence)(x, x), x)


def test_fence_survives_jit():
  def f(a, b):
    y = jnp.sin(a)
    return native.fence(y, b) * 2.0

  a = jnp.linspace(0.0, 1.0, 16, dtype=jnp.float32)
  b = jnp.ones((3,), jnp.float32)
  jf = jax.jit(f)
  lowered = jf.lower(a, b)
  assert "jaxmem_fence" in lowered.as_text()
  hlo = lowered.compile().as_text()
  assert "jaxmem_fence" in hlo
  assert "custom_call_has_side_effect=true" in hlo
  _assert_bit_equal(jf(a, b), jnp.sin(a) * 2.0)


def test_fence_of_jit_argument_is_not_clobbered():
  # The argument is not donated, so XLA must copy before the aliasing call.
  x = jnp.arange(8, dtype=jnp.float32)
  out = jax.jit(native.fence)(x, x)
  _assert_bit_equal(out, np.arange(8, dtype=np.float32))
  _assert_bit_equal(x, np.arange(8, dtype=np.float32))


def test_fence_not_cse_d():
  def f(a):
    return native.fence(a, a) + native.fence(a, a)

  hlo = jax.jit(f).lower(jnp.ones(4)).compile().as_text()
  assert hlo.count('custom_call_target="jaxmem_fence"') == 2


# ---------------------------------------------------------- offload / fetch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (5, 3), (2, 3, 4)])
def test_roundtrip_eager(shape, dtype):
  x = _example(shape, dtype)
  h = native.offload(x)
  assert h.shape == native.HANDLE_SHAPE and h.dtype == native.HANDLE_DTYPE
  _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)
  s = native.store_stats()
  assert s.live_entries == 0 and s.live_bytes == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8,
                                   jnp.bool_])
@pytest.mark.parametrize("shape", [(), (0,), (33, 7)])
def test_roundtrip_jit(shape, dtype):
  x = _example(shape, dtype, seed=1)
  _assert_bit_equal(jax.jit(_roundtrip)(x), x)


def test_offload_and_fetch_in_separate_jits():
  x = _example((64, 32), jnp.bfloat16)
  h = jax.jit(native.offload)(x)
  assert native.store_stats().live_bytes == x.nbytes
  fetch = jax.jit(native.fetch, static_argnames=("shape", "dtype"))
  y = fetch(h, jnp.zeros(()), shape=x.shape, dtype=x.dtype)
  _assert_bit_equal(y, x)
  assert native.store_stats().live_bytes == 0


def test_offloads_are_not_cse_d():
  def f(a):
    return native.offload(a), native.offload(a)

  x = jnp.ones((4,), jnp.float32)
  h1, h2 = jax.jit(f)(x)
  assert native.handle_id(h1) != native.handle_id(h2)
  assert native.store_stats().live_entries == 2


def test_preserves_nan_and_signed_zero_bits():
  x = jnp.asarray(np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45],
                           dtype=np.float32))
  _assert_bit_equal(jax.jit(_roundtrip)(x), x)


def test_fetch_after_dep():
  def f(x):
    h = native.offload(x)
    g = jnp.cumsum(x) * 3
    y = native.fetch(h, g, shape=x.shape, dtype=x.dtype)
    return y + g

  x = _example((128,), jnp.int32) // 1024  # integers: exact arithmetic
  np.testing.assert_array_equal(jax.jit(f)(x), x + jnp.cumsum(x) * 3)


def test_vmap():
  x = _example((3, 4), jnp.float32)
  _assert_bit_equal(jax.vmap(native.fence, in_axes=(0, None))(x, 1.0), x)
  hs = jax.vmap(native.offload)(x)
  assert hs.shape == (3, 2)
  ys = jax.jit(jax.vmap(
      lambda h: native.fetch(h, 0.0, shape=(4,), dtype=jnp.float32)))(hs)
  _assert_bit_equal(ys, x)
  assert native.store_stats().live_entries == 0


# ------------------------------------------------------------------ errors


def test_double_fetch_raises():
  x = _example((4, 4), jnp.float32)
  h = native.offload(x)
  _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)
  with pytest.raises(Exception, match="host store") as info:
    native.fetch(h, x, shape=x.shape, dtype=x.dtype).block_until_ready()
  assert "already fetched" in str(info.value)
  # Still usable afterwards.
  _assert_bit_equal(_roundtrip(x), x)


def test_double_fetch_in_jit_raises():
  def f(x):
    h = native.offload(x)
    a = native.fetch(h, x, shape=x.shape, dtype=x.dtype)
    b = native.fetch(h, a, shape=x.shape, dtype=x.dtype)
    return a + b

  with pytest.raises(Exception, match="host store"):
    jax.jit(f)(jnp.ones((8,))).block_until_ready()


def test_made_up_handle_raises():
  h = jnp.array([12345, 678], jnp.uint32)
  with pytest.raises(Exception, match="host store") as info:
    native.fetch(h, h, shape=(3,), dtype=jnp.float32).block_until_ready()
  assert "never issued" in str(info.value)
  assert native.store_stats().total_errors >= 1


def test_cleared_handle_raises():
  x = _example((10,), jnp.int8)
  h = native.offload(x)
  assert native.store_clear() == x.nbytes
  with pytest.raises(Exception, match="host store"):
    native.fetch(h, x, shape=x.shape, dtype=x.dtype).block_until_ready()


@pytest.mark.parametrize("shape,dtype", [
    ((4, 3), jnp.int32),     # same bytes, wrong dtype
    ((4, 4), jnp.float32),   # wrong size
    ((2, 3), jnp.bfloat16),  # wrong size and dtype
])
def test_mismatch_raises_and_keeps_entry(shape, dtype):
  x = _example((4, 3), jnp.float32)
  h = native.offload(x)
  with pytest.raises(Exception, match="mismatch"):
    native.fetch(h, x, shape=shape, dtype=dtype).block_until_ready()
  # A corrected fetch still works.
  _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)


def test_bad_handle_type_raises():
  with pytest.raises(TypeError):
    native.fetch(jnp.zeros((3,), jnp.uint32), 0.0, shape=(1,),
                 dtype=jnp.float32)
  with pytest.raises(TypeError):
    native.fetch(jnp.zeros((2,), jnp.int32), 0.0, shape=(1,),
                 dtype=jnp.float32)


# ------------------------------------------------------------------- stats


def test_stats_count_puts_and_takes():
  before = native.store_stats()
  xs = [_example((n, 8), jnp.float32, seed=n) for n in (1, 2, 3)]
  hs = [native.offload(x) for x in xs]
  mid = native.store_stats()
  total = sum(x.nbytes for x in xs)
  assert mid.live_entries == 3
  assert mid.live_bytes == total
  assert mid.peak_bytes >= total
  assert mid.total_puts - before.total_puts == 3
  for h, x in zip(hs, xs):
    _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)
  after = native.store_stats()
  assert after.live_entries == 0 and after.live_bytes == 0
  assert after.total_takes - before.total_takes == 3
  assert after.total_errors == before.total_errors
  assert isinstance(after, native.StoreStats)


def test_store_clear_returns_bytes():
  native.offload(jnp.ones((10,), jnp.float32)).block_until_ready()
  native.offload(jnp.ones((3,), jnp.int8)).block_until_ready()
  assert native.store_clear() == 43
  assert native.store_clear() == 0
  assert native.store_stats().live_entries == 0


# -------------------------------------------------------------- direct API


def test_store_put_take_direct():
  from jaxmem import _native
  data = bytes(range(256)) * 3
  i = _native.store_put(data)
  assert isinstance(i, int) and i != 0
  assert _native.store_take(i, len(data)) == data
  with pytest.raises(ValueError, match="already fetched"):
    _native.store_take(i, len(data))
  with pytest.raises(ValueError, match="never issued"):
    _native.store_take(1, 4)
  j = _native.store_put(b"abcd")
  with pytest.raises(ValueError, match="mismatch"):
    _native.store_take(j, 5)
  with pytest.raises(ValueError, match="mismatch"):
    _native.store_take(j, 4, dtype_code=11)
  assert _native.store_take(j, 4) == b"abcd"
  k = _native.store_put(b"")
  assert _native.store_take(k, 0) == b""


def test_handle_id_matches_direct_api():
  from jaxmem import _native
  x = jnp.arange(5, dtype=jnp.uint8)
  h = native.offload(x)
  assert _native.store_take(native.handle_id(h), 5) == bytes(range(5))
  with pytest.raises(Exception, match="host store"):
    native.fetch(h, x, shape=x.shape, dtype=x.dtype).block_until_ready()


# -------------------------------------------------------------- property


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(shape, dtype, seed):
  x = _example(shape, dtype, seed=seed)
  _assert_bit_equal(_roundtrip(x), x)
  assert native.store_stats().live_entries == 0


# ------------------------------------------------------------- concurrency


def test_two_threads():
  @jax.jit
  def step(x):
    h = native.offload(x)
    y = x * 2 + 1
    return native.fetch(h, y, shape=x.shape, dtype=x.dtype) - y

  errors = []

  def worker(seed):
    try:
      for i in range(50):
        x = _example((64, 16), jnp.float32, seed=seed * 1000 + i)
        np.testing.assert_array_equal(step(x), x - (x * 2 + 1))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert native.store_stats().live_entries == 0


# ---------------------------------------------- docs/design.md "Why native ops"


def _mlp_params(depth=8, width=256):
  keys = jax.random.split(jax.random.key(0), depth)
  return [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width)
          for k in keys]


def _mlp_grads(params, x, *, offload):
  """Manual forward + backward of a ReLU MLP with loss sum(h_L).

  Saved activations h_1..h_L; with ``offload`` each is staged to the host
  after the forward and fetched (after the incoming gradient) right before the
  backward step that needs it.
  """
  hs = [x]
  for w in params:
    hs.append(jax.nn.relu(hs[-1] @ w))
  loss = jnp.sum(hs[-1])

  saved = hs[1:]
  if offload:
    saved = [native.offload(h) for h in saved]

  def get(i, dep):  # activation h_{i+1}, i.e. the output of layer i
    if not offload:
      return saved[i]
    return native.fetch(saved[i], dep, shape=x.shape, dtype=x.dtype)

  g = jnp.ones_like(hs[-1])  # d loss / d h_L
  grads = [None] * len(params)
  out = get(len(params) - 1, g)
  for i in reversed(range(len(params))):
    inp = x if i == 0 else get(i - 1, g)
    gz = jnp.where(out > 0, g, 0.0)
    grads[i] = inp.T @ gz
    g = gz @ params[i].T
    out = inp
  return loss, grads


def test_offload_cuts_compiled_temp_with_identical_grads():
  params = _mlp_params()
  x = jax.random.normal(jax.random.key(1), (2048, 256), jnp.float32)

  plain = jax.jit(lambda p, a: _mlp_grads(p, a, offload=False))
  staged = jax.jit(lambda p, a: _mlp_grads(p, a, offload=True))
  c_plain = plain.lower(params, x).compile()
  c_staged = staged.lower(params, x).compile()
  m_plain = c_plain.memory_analysis()
  m_staged = c_staged.memory_analysis()
  assert "jaxmem_offload" in c_staged.as_text()

  def total(m):  # docs/design.md, "Verify": outputs may share the temp arena.
    return (m.argument_size_in_bytes + m.output_size_in_bytes +
            m.temp_size_in_bytes - m.alias_size_in_bytes)

  act = x.nbytes
  assert m_staged.temp_size_in_bytes < m_plain.temp_size_in_bytes
  assert total(m_staged) <= total(m_plain) - 3 * act, (total(m_plain),
                                                       total(m_staged))

  loss_p, grads_p = c_plain(params, x)
  loss_s, grads_s = c_staged(params, x)
  _assert_bit_equal(loss_p, loss_s)
  for gp, gs in zip(grads_p, grads_s):
    _assert_bit_equal(gp, gs)
  # And equal to autodiff (up to float reassociation).
  ref = jax.grad(lambda p: jnp.sum(_mlp_forward(p, x)))(params)
  for gr, gp in zip(ref, grads_p):
    np.testing.assert_allclose(gr, gp, rtol=2e-3, atol=2e-3)
  assert native.store_stats().live_entries == 0


def _mlp_forward(params, x):
  for w in params:
    x = jax.nn.relu(x @ w)
  return x
