"""Error codes of the native extension (``ffi/status.h``).

Every failure in ``ffi/`` is a ``jaxmem::Status``; the FFI handlers hand it to
XLA through ``ToFfiError`` (``ffi/handlers/common.h``), so the code names the
kind of failure in ``jax.errors.JaxRuntimeError``'s message:

* a stale, foreign or double-fetched handle or ticket, a ticket of the other
  kind, or a shape/dtype mismatch is ``INVALID_ARGUMENT``;
* out of host memory (the host arena's capacity, or the OS refusing memory)
  is ``RESOURCE_EXHAUSTED``;
* an unusable host arena configuration ($JAXMEM_HOST_ARENA) is
  ``FAILED_PRECONDITION``.

The Python bindings raise through ``RaisePyError`` (``ffi/bindings/bindings.h``)
and keep their exception types: ``HostArena`` raises ``ValueError`` for bad
handles and arguments, ``MemoryError`` when out of capacity, ``TypeError`` for
a call that does not apply to the mode; ``store_put``/``store_take``/
``store_configure`` raise ``ValueError``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import native
from jaxmem._src.native.extension import native_module as _native

KiB = 1 << 10
MiB = 1 << 20


# store_configure is process-wide: every test leaves it as it found it.
pytestmark = pytest.mark.usefixtures("restore_store_config")


def _runtime_error(fn, *args) -> str:
  """Runs ``fn(*args)`` to completion; returns the JaxRuntimeError's message."""
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    jax.block_until_ready(fn(*args))
  return str(info.value)


def _fetch(h, shape=(4,), dtype=jnp.float32):
  return native.fetch(h, h, shape=shape, dtype=dtype)


# ------------------------------------------------------ INVALID_ARGUMENT (sync)


def test_double_fetched_handle_is_invalid_argument():
  x = jnp.arange(4, dtype=jnp.float32)
  h = jax.jit(native.offload)(x)
  np.testing.assert_array_equal(jax.jit(_fetch)(h), x)
  msg = _runtime_error(jax.jit(_fetch), h)
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch: handle 0x"), msg
  assert "already fetched" in msg


def test_double_fetch_in_one_computation_is_invalid_argument():
  def f(x):
    h = native.offload(x)
    a = native.fetch(h, x, shape=x.shape, dtype=x.dtype)
    return native.fetch(h, a, shape=x.shape, dtype=x.dtype)

  msg = _runtime_error(jax.jit(f), jnp.ones(8))
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch: "), msg
  assert "already fetched" in msg


def test_stale_cleared_handle_is_invalid_argument():
  h = jax.jit(native.offload)(jnp.ones(4))
  jax.block_until_ready(h)
  native.store_clear()
  msg = _runtime_error(jax.jit(_fetch), h)
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch: "), msg
  assert "already fetched or cleared" in msg


def test_foreign_handle_is_invalid_argument():
  msg = _runtime_error(jax.jit(_fetch), jnp.array([12345, 678], jnp.uint32))
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch: "), msg
  assert "never issued" in msg


@pytest.mark.parametrize("shape,dtype", [((4,), jnp.int32), ((5,), jnp.float32)])
def test_shape_or_dtype_mismatch_is_invalid_argument(shape, dtype):
  x = jnp.arange(4, dtype=jnp.float32)
  h = jax.jit(native.offload)(x)
  msg = _runtime_error(jax.jit(lambda h: _fetch(h, shape, dtype)), h)
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch: "), msg
  assert "mismatch" in msg
  np.testing.assert_array_equal(jax.jit(_fetch)(h), x)  # the entry was kept


def test_unsupported_dtype_is_invalid_argument():
  msg = _runtime_error(jax.jit(native.offload), jnp.zeros((8,), jnp.int4))
  assert msg.startswith("INVALID_ARGUMENT: jaxmem offload: dtype "), msg


# ----------------------------------------------------- INVALID_ARGUMENT (async)


def test_stale_ticket_is_invalid_argument():
  def twice(x):
    t = native.offload_start(x)
    h1 = native.offload_done(x, t, None)
    return h1, native.offload_done(x, t, h1)

  msg = _runtime_error(jax.jit(twice), jnp.ones(4))
  assert msg.startswith("INVALID_ARGUMENT: jaxmem offload_done: copy ticket 0x"), msg
  assert "not outstanding" in msg


def test_foreign_ticket_is_invalid_argument():
  f = jax.jit(lambda x: native.offload_done(x, jnp.array([12345, 678], jnp.uint32)))
  msg = _runtime_error(f, jnp.ones(4))
  assert msg.startswith("INVALID_ARGUMENT: jaxmem offload_done: "), msg
  assert "never issued" in msg


def test_ticket_of_the_other_kind_is_invalid_argument():
  def f(x):
    t = native.offload_start(x)
    out = native.fetch_done(jnp.zeros_like(x), t, x)
    return out, native.offload_done(x, t, out)

  msg = _runtime_error(jax.jit(f), jnp.ones(4))
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch_done: "), msg
  assert "belongs to offload_start" in msg
  native.store_clear()  # the offload ticket the failed execution left


def test_fetch_start_of_a_double_fetched_handle_is_invalid_argument():
  x = jnp.arange(4, dtype=jnp.float32)
  h = jax.jit(native.offload)(x)
  np.testing.assert_array_equal(jax.jit(_fetch)(h), x)

  def f(h):
    buf, t = native.fetch_start(h, h, shape=(4,), dtype=jnp.float32)
    return native.fetch_done(buf, t)

  msg = _runtime_error(jax.jit(f), h)
  assert msg.startswith("INVALID_ARGUMENT: jaxmem fetch_start: handle 0x"), msg
  assert "already fetched" in msg


# ------------------------------------------------------------ RESOURCE_EXHAUSTED


# capacity_bytes (store_configure) caps the arena's footprint: a 2 MiB offload
# into a 1 MiB arena is out of host memory in every mode.
CAPPED = [
    dict(mode="best_fit", capacity_bytes=1 * MiB),
    dict(mode="virtual", chunk_bytes=64 * KiB, capacity_bytes=1 * MiB),
    dict(mode="heap", capacity_bytes=1 * MiB),
]


@pytest.mark.parametrize("config", CAPPED, ids=lambda c: c["mode"])
def test_offload_beyond_capacity_is_resource_exhausted(config):
  native.store_configure(**config)
  msg = _runtime_error(jax.jit(native.offload), jnp.ones((512 * KiB,), jnp.float32))
  assert msg.startswith("RESOURCE_EXHAUSTED: jaxmem offload: out of host memory"), msg
  assert "capacity" in msg
  assert native.store_stats().live_entries == 0


@pytest.mark.parametrize("config", CAPPED, ids=lambda c: c["mode"])
def test_offload_start_beyond_capacity_is_resource_exhausted(config):
  native.store_configure(**config)
  f = jax.jit(lambda x: native.offload_done(x, native.offload_start(x)))
  msg = _runtime_error(f, jnp.ones((512 * KiB,), jnp.float32))
  assert msg.startswith("RESOURCE_EXHAUSTED: jaxmem offload_start: out of host memory"), msg
  assert native.copy_stats().outstanding == 0


def test_store_still_works_after_resource_exhausted():
  native.store_configure("best_fit", capacity_bytes=1 * MiB)
  _runtime_error(jax.jit(native.offload), jnp.ones((512 * KiB,), jnp.float32))
  small = jnp.arange(1000, dtype=jnp.float32)
  got = jax.jit(lambda x: native.fetch(native.offload(x), x, shape=x.shape,
                                       dtype=x.dtype))(small)
  np.testing.assert_array_equal(got, small)


# ----------------------------------------------------------- FAILED_PRECONDITION


@pytest.mark.parametrize("env, match", [
    ("bump", "unknown host arena mode 'bump'"),
    ("virtual:chunk_bytes=1000", "chunk_bytes must be a positive multiple of the page size"),
])
def test_unusable_env_configuration_is_failed_precondition(env, match):
  """$JAXMEM_HOST_ARENA is read once per process: a fresh interpreter per case."""
  probe = (
      "import jax, jax.numpy as jnp\n"
      "from jaxmem import native\n"
      "try:\n"
      "  jax.block_until_ready(jax.jit(native.offload)(jnp.ones(4)))\n"
      "except jax.errors.JaxRuntimeError as e:\n"
      "  print(e)\n")
  env_vars = dict(os.environ, JAXMEM_HOST_ARENA=env, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", probe], env=env_vars, check=True,
                       capture_output=True, text=True).stdout
  assert out.startswith("FAILED_PRECONDITION: jaxmem offload: "), out
  assert match in out


# ------------------------------------------------- Python exception types


@pytest.mark.parametrize("mode", ["virtual", "best_fit"])
def test_host_arena_bad_handles_raise_value_error(mode):
  with jaxmem.HostArena(mode, chunk_bytes=64 * KiB) as arena:
    h = arena.allocate(100)
    arena.free(h)
    for call in (lambda: arena.free(h), lambda: arena.read(h),
                 lambda: arena.lookup(h), lambda: arena.free(h ^ (1 << 62))):
      with pytest.raises(ValueError) as info:
        call()
      assert type(info.value) is ValueError
    h = arena.allocate(8)
    with pytest.raises(ValueError, match="overruns"):
      arena.write(h, b"x" * 9)


@pytest.mark.parametrize("mode", ["virtual", "best_fit"])
def test_host_arena_out_of_capacity_raises_memory_error(mode):
  with jaxmem.HostArena(mode, chunk_bytes=64 * KiB, segment_bytes=64 * KiB,
                        capacity_bytes=256 * KiB) as arena:
    with pytest.raises(MemoryError, match="out of capacity") as info:
      arena.allocate(1 * MiB)
    assert not isinstance(info.value, ValueError)
    arena.allocate(64 * KiB)  # still usable


def test_host_arena_planned_state_errors_raise_value_error():
  with jaxmem.HostArena("planned", offsets={0: 0, 1: 0}, sizes={0: 4096, 1: 4096}) as arena:
    arena.allocate(0)
    with pytest.raises(ValueError, match="already live"):
      arena.allocate(0)
    with pytest.raises(ValueError, match="overlaps a live slot"):
      arena.allocate(1)
    with pytest.raises(ValueError, match="not in the plan"):
      arena.allocate(7)
    with pytest.raises(TypeError, match="virtual' or 'best_fit"):
      arena.stress(n_ops=10)
  with pytest.raises(ValueError, match="closed"):
    arena.allocate(0)


def test_store_bindings_raise_value_error():
  native.store_configure("best_fit", capacity_bytes=1 * MiB)
  # Out of host memory too: store_put's documented contract is ValueError.
  with pytest.raises(ValueError, match="out of host memory") as info:
    _native.store_put(b"x" * (2 * MiB))
  assert type(info.value) is ValueError
  i = _native.store_put(b"abcd")
  with pytest.raises(ValueError, match="not empty"):
    native.store_configure("virtual")
  with pytest.raises(ValueError, match="mismatch"):
    _native.store_take(i, 5)
  assert _native.store_take(i, 4) == b"abcd"
  with pytest.raises(ValueError, match="already fetched"):
    _native.store_take(i, 4)
  with pytest.raises(ValueError, match="CPU"):
    native.set_copy_cpus([99999])
