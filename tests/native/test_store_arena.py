"""The host store on its arenas: store_configure, $JAXMEM_HOST_ARENA, arena stats.

The offload/fetch custom calls keep their bytes in a host arena (Hayakawa et al. §4:
"best_fit" caching, "virtual" chunks; plus the original "heap" cache). Every
mode must give the same results as plain ``jax.jit`` and leave nothing behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import native
from jaxmem._src.lower.host_layout import host_layout
from jaxmem._src.native.extension import native_module

MODES = ("planned", "best_fit", "virtual", "heap")
KiB = 1 << 10
MiB = 1 << 20


# The configuration is process-wide: every test leaves it as it found it.
pytestmark = pytest.mark.usefixtures("restore_store_config")


def _assert_bit_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def _assert_empty():
  s = native.store_stats()
  assert s.live_entries == 0 and s.live_bytes == 0
  assert s.arena.live_allocations == 0 and s.arena.live_bytes == 0
  assert native.copy_stats().outstanding == 0


# ------------------------------------------------------------ fitted steps


@pytest.fixture(scope="module")
def fitted_small(mlp_small):
  """The small MLP fitted with offloads only, compiled for sync and async copies."""
  step, args = mlp_small

  def planner(program, budget, device):
    return jaxmem.get_planner("greedy")(program, budget, device, allow_remat=False)

  fitted = {copies: jaxmem.fit(0.7, planner=planner, copies=copies)(step)
            for copies in ("sync", "async")}
  for f in fitted.values():
    res = f.fit_result(*args)
    assert res.plan.num_offload > 0
  want = jax.jit(step)(*args)
  return args, fitted, want


@pytest.mark.parametrize("copies", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES)
def test_fitted_step_bit_identical_in_every_mode(fitted_small, mode, copies):
  args, fitted, want = fitted_small
  native.store_configure(mode, chunk_bytes=64 * KiB)
  before = native.store_stats()
  for _ in range(2):  # the second step reuses the arena's cached memory
    got = jax.block_until_ready(fitted[copies](*args))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      _assert_bit_equal(a, b)
    _assert_empty()
  s = native.store_stats()
  # (In "planned" mode the best-fit arena is made only for a buffer without a slot.)
  assert s.mode == mode and (mode == "planned" or s.arena.mode == mode)
  puts = s.total_puts - before.total_puts
  assert puts >= 2 and s.total_takes - before.total_takes == puts
  assert s.total_errors == before.total_errors
  if mode == "planned":
    # Every offloaded byte went to the plan's layout, at its max load.
    layout = host_layout(fitted[copies].fit_result(*args).plan.schedule())
    stats = native.store_plan_stats(layout.key)
    assert stats["planned"] == puts and stats["fallbacks"] == 0
    assert stats["footprint"] == layout.footprint == layout.max_load
    assert s.arena.allocs == 0
    return
  # The arena held the offloaded bytes and keeps its memory cached.
  assert s.arena.allocs == puts and s.arena.frees == s.arena.allocs
  assert s.peak_footprint_bytes >= s.arena.peak_requested_bytes > 0
  assert s.footprint_bytes > 0 and s.cached_bytes == s.footprint_bytes
  assert s.arena.allocs > s.arena.grows  # step 2 reused step 1's memory
  if mode == "virtual":
    assert s.footprint_bytes % (64 * KiB) == 0
    assert s.external_fragmentation == 0.0


def test_default_mode_is_planned_and_reuses_memory():
  if os.environ.get("JAXMEM_HOST_ARENA"):
    pytest.skip("$JAXMEM_HOST_ARENA overrides the default")
  cfg = native.store_config()
  if cfg["source"] == "default":
    assert cfg["mode"] == "planned"
  # Buffers without a planned slot go to best-fit.
  x = jnp.arange(64 * KiB, dtype=jnp.float32)
  f = jax.jit(lambda x: native.fetch(native.offload(x), x, shape=x.shape, dtype=x.dtype))
  for _ in range(3):
    _assert_bit_equal(f(x), x)
  s = native.store_stats()
  assert s.cache_misses >= 1 and s.cache_hits >= 2
  assert s.footprint_bytes >= x.nbytes


# -------------------------------------------------------- store_configure


def test_configure_while_non_empty_raises_and_changes_nothing():
  native.store_configure("best_fit")
  x = jnp.arange(1000, dtype=jnp.float32)
  h = native.offload(x)
  for mode in MODES:
    with pytest.raises(ValueError, match=r"store_configure: the host store is not empty"):
      native.store_configure(mode)
  assert native.store_config()["mode"] == "best_fit"
  assert native.store_stats().mode == "best_fit"
  _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)
  native.store_configure("virtual")  # empty again: allowed
  assert native.store_config() == {
      "mode": "virtual", "chunk_bytes": 2 * MiB, "segment_bytes": 2 * MiB,
      "capacity_bytes": 0, "source": "store_configure", "error": ""}


def test_configure_with_a_copy_in_flight_raises():
  x = jnp.arange(4096, dtype=jnp.float32)
  jax.block_until_ready(jax.jit(native.offload_start)(x))   # a ticket nobody finishes
  assert native.copy_stats().outstanding == 1
  assert native.store_stats().arena.live_allocations == 1
  with pytest.raises(ValueError, match="asynchronous copies"):
    native.store_configure("virtual")
  assert native.store_clear() >= x.nbytes
  native.store_configure("virtual")
  _assert_empty()


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="bump"), "unknown mode"),
    (dict(mode="virtual", chunk_bytes=1000), "store_configure: chunk_bytes must be a positive "
                                             "multiple of the page size"),
    (dict(mode="best_fit", segment_bytes=0), "store_configure: segment_bytes must be positive"),
    (dict(mode="virtual", capacity_bytes=3 * MiB), "store_configure: capacity_bytes"),
    (dict(mode="heap", capacity_bytes=-1), "store_configure: capacity_bytes"),
    (dict(mode="heap", chunk_bytes=1.5), "store_configure: chunk_bytes"),
])
def test_configure_bad_arguments(kwargs, match):
  before = native.store_config()
  with pytest.raises(ValueError, match=match):
    native.store_configure(**kwargs)
  assert native.store_config() == before


def test_clear_keeps_the_configuration_and_returns_memory():
  native.store_configure("virtual", chunk_bytes=128 * KiB)
  x = jnp.ones((100_000,), jnp.float32)
  h = native.offload(x)
  s = native.store_stats()
  assert s.footprint_bytes == 4 * 128 * KiB  # 400,000 bytes -> 4 chunks
  assert native.store_clear() == x.nbytes
  s = native.store_stats()
  assert s.footprint_bytes == 0 and s.cached_bytes == 0 and s.arena.chunk_bytes == 128 * KiB
  assert native.store_config()["mode"] == "virtual"
  with pytest.raises(jax.errors.JaxRuntimeError, match="already fetched or cleared"):
    jax.block_until_ready(native.fetch(h, x, shape=x.shape, dtype=x.dtype))


# ------------------------------------------------------------------ stats


def test_virtual_footprint_is_chunk_rounded():
  chunk = 64 * KiB
  native.store_configure("virtual", chunk_bytes=chunk)
  sizes = [1000, chunk, chunk + 4, 3 * chunk - 8]      # bytes (uint8 arrays)
  xs = [jnp.asarray(np.arange(n, dtype=np.uint8)) for n in sizes]
  hs = [native.offload(x) for x in xs]
  s = native.store_stats()
  chunks = [-(-n // chunk) for n in sizes]              # 1, 1, 2, 3
  assert s.arena.requested_live_bytes == sum(sizes) == s.live_bytes
  assert s.arena.live_bytes == sum(chunks) * chunk
  assert s.footprint_bytes == sum(chunks) * chunk == s.arena.pool_chunks * chunk
  assert s.internal_fragmentation == pytest.approx(1 - sum(sizes) / (sum(chunks) * chunk))
  assert s.external_fragmentation == 0.0
  for x, h in zip(xs, hs):
    _assert_bit_equal(native.fetch(h, x, shape=x.shape, dtype=x.dtype), x)
  s = native.store_stats()
  # Freed chunks stay in the pool (Hayakawa et al. §4) and serve any later size.
  assert s.footprint_bytes == sum(chunks) * chunk and s.cached_bytes == s.footprint_bytes
  y = jnp.zeros((sum(chunks) * chunk,), jnp.uint8)      # all chunks as one range
  _assert_bit_equal(native.fetch(native.offload(y), y, shape=y.shape, dtype=y.dtype), y)
  assert native.store_stats().footprint_bytes == sum(chunks) * chunk


def test_best_fit_and_heap_stats():
  for mode in ("best_fit", "heap"):
    native.store_clear()
    native.store_configure(mode, segment_bytes=4 * MiB)
    x = jnp.ones((1000,), jnp.float32)
    h = native.offload(x)
    s = native.store_stats()
    assert s.mode == mode and s.arena.live_allocations == 1
    assert s.arena.requested_live_bytes == x.nbytes <= s.arena.live_bytes
    assert s.footprint_bytes == (4 * MiB if mode == "best_fit" else 4 * KiB)
    assert s.peak_footprint_bytes == s.footprint_bytes
    native.fetch(h, x, shape=x.shape, dtype=x.dtype).block_until_ready()
    assert native.store_stats().cached_bytes == s.footprint_bytes


def test_capacity_is_enforced_with_a_clear_error():
  native.store_configure("best_fit", capacity_bytes=1 * MiB)
  x = jnp.ones((512 * KiB,), jnp.float32)   # 2 MiB
  with pytest.raises(jax.errors.JaxRuntimeError, match="out of host memory.*capacity"):
    jax.block_until_ready(native.offload(x))
  _assert_empty()
  small = jnp.ones((1000,), jnp.float32)     # still usable
  _assert_bit_equal(native.fetch(native.offload(small), small, shape=small.shape,
                                 dtype=small.dtype), small)


@pytest.mark.parametrize("mode", MODES)
def test_threads_share_the_arena(mode):
  """Direct put/take (GIL released) from several threads: no corruption, nothing left."""
  native.store_configure(mode, chunk_bytes=64 * KiB, segment_bytes=256 * KiB)
  errors: list[BaseException] = []

  def worker(seed):
    rng = np.random.default_rng(seed)
    try:
      for _ in range(100):
        n = int(rng.integers(0, 300 * KiB))
        data = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        h = native_module.store_put(data)
        assert native_module.store_take(h, n) == data
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  _assert_empty()
  assert native.store_stats().arena.errors == 0


# ---------------------------------------------------------- environment


def _run(env_value, code):
  env = dict(os.environ, JAXMEM_HOST_ARENA=env_value, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=300, check=False)


def test_env_var_is_read_at_first_use():
  code = (
      "import jax.numpy as jnp\n"
      "from jaxmem import native\n"
      "c = native.store_config()\n"
      "assert (c['mode'], c['chunk_bytes'], c['source']) == ('virtual', 65536, 'env'), c\n"
      "x = jnp.arange(5000, dtype=jnp.float32)\n"
      "h = native.offload(x)\n"
      "s = native.store_stats()\n"
      "assert s.mode == 'virtual' and s.footprint_bytes == 65536, s\n"
      "assert (native.fetch(h, x, shape=x.shape, dtype=x.dtype) == x).all()\n"
      "native.store_configure('heap')\n"
      "assert native.store_config()['source'] == 'store_configure'\n"
      "print('ok')\n")
  r = _run("virtual:chunk_bytes=64K", code)
  assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_bad_env_var_fails_offloads_clearly_until_configured():
  code = (
      "import jax, jax.numpy as jnp\n"
      "from jaxmem import native\n"
      "assert 'JAXMEM_HOST_ARENA' in native.store_config()['error']\n"
      "assert native.store_stats().mode == 'invalid'\n"
      "x = jnp.ones(8)\n"
      "try:\n"
      "  jax.block_until_ready(native.offload(x))\n"
      "  raise SystemExit('offload should fail')\n"
      "except jax.errors.JaxRuntimeError as e:\n"
      "  assert \"JAXMEM_HOST_ARENA='virtual:chunk=1'\" in str(e), e\n"
      "native.store_configure('best_fit')\n"
      "assert (native.fetch(native.offload(x), x, shape=x.shape, dtype=x.dtype) == x).all()\n"
      "print('ok')\n")
  r = _run("virtual:chunk=1", code)
  assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
