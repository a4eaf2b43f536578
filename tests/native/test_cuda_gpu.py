"""The CUDA handlers and both backends, run on a GPU.

Everything here is skipped without a GPU (CI has none; ``tests/native/test_cuda_handlers.py``
checks what can be checked without one). On a machine with a GPU and jax's CUDA
plugin, after ``pip install .`` (the CUDA handlers are built by default on Linux,
with no nvcc), run::

    pytest -q tests/native/test_cuda_gpu.py

What it shows: the CUDA runtime of jax's CUDA wheels loaded and every CUDA handler
was handed to XLA; the synchronous and asynchronous copies round-trip every
byte-sized dtype bit for bit through pinned host memory; a stale handle or ticket
fails the execution with a ``JaxRuntimeError`` and the process goes on; and
``jaxmem.fit`` with ``backend="ffi"`` and ``backend="xla"`` meets half of the
unplanned GPU peak on a small MLP step, the compiled program of this GPU verifying
it, with the outputs of plain ``jax.jit``.

Last runs on a GPU (an H100 at 501d656, ``bench/results/gpu_h100.md``; an H200 at
28f3769, ``bench/results/gpu.md``; jax 0.11.2 on both): 29 of 31 passed with the test
file of ``tests/native/``; the ``xla`` fit of the MLP below stopped at 0.64 of its peak
(``BudgetError``), and so did the test that plans with it. Those two are the open GPU
planning problem, not a test to loosen.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import native
from jaxmem._src.lower.backend import jit_plan
from jaxmem._src.native.extension import native_module

from test_cuda_handlers import HANDLERS   # this folder's sibling test module

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU (jax.default_backend() == 'gpu')")

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.int32, jnp.bool_)


def _values(dtype: jnp.dtype, shape: tuple[int, ...] = (257, 33)) -> jax.Array:
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 50
  return (x > 0) if dtype == jnp.bool_ else x.astype(dtype)


def test_cuda_runtime_loaded_and_every_handler_registered():
  assert native.WITH_CUDA, "the extension was built with JAXMEM_CUDA=OFF"
  assert native.CUDA_STATUS.startswith("loaded: "), native.CUDA_STATUS
  assert set(native_module.cuda_registrations()) == HANDLERS


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_sync_copies_round_trip_on_the_gpu(dtype):
  x = _values(dtype)
  f = jax.jit(lambda x: native.fetch(native.offload(x), x, shape=x.shape, dtype=x.dtype))
  y = f(x)
  assert y.devices() == x.devices() and next(iter(y.devices())).platform == "gpu"
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_async_copies_round_trip_on_the_gpu(dtype):
  x = _values(dtype, (1024, 513))

  def f(x):
    ticket = native.offload_start(x)
    busy = jnp.tanh(jnp.ones((512, 512)) @ jnp.ones((512, 512)))   # work the copy overlaps
    handle = native.offload_done(x, ticket, busy)
    buf, t2 = native.fetch_start(handle, busy, shape=x.shape, dtype=x.dtype)
    return native.fetch_done(buf, t2, busy), busy

  y, _ = jax.jit(f)(x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_planned_copies_round_trip_on_the_gpu():
  x = _values(jnp.float32, (300, 7))

  def f(x):
    h = native.offload(x, slot=(12345, 0), dep=x)
    t = native.offload_start(x * 2, slot=(12345, 1), dep=x)
    h2 = native.offload_done(x * 2, t, x)
    return (native.fetch(h, x, shape=x.shape, dtype=x.dtype),
            native.fetch(h2, x, shape=x.shape, dtype=x.dtype))

  a, b = jax.jit(f)(x)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(b), np.asarray(x * 2))


def test_a_stale_handle_fails_the_execution_not_the_process():
  x = _values(jnp.float32, (64,))
  handle = jax.jit(native.offload)(x)
  fetch = jax.jit(lambda h: native.fetch(h, h, shape=x.shape, dtype=x.dtype))
  np.testing.assert_array_equal(np.asarray(fetch(handle)), np.asarray(x))
  with pytest.raises(jax.errors.JaxRuntimeError, match="host store"):
    np.asarray(fetch(handle))
  # The process and the GPU go on: the next copies run, and once they have,
  # jax's effects barrier (which waits for the last side-effecting execution)
  # passes again.
  round_trip = jax.jit(lambda v: native.fetch(native.offload(v), v, shape=v.shape,
                                              dtype=v.dtype))
  np.testing.assert_array_equal(np.asarray(round_trip(x + 1)), np.asarray(x + 1))
  jax.effects_barrier()


def _mlp_step():
  sys.path.insert(0, str(ROOT / "examples"))
  import mlp  # noqa: PLC0415 (examples/ is not a package)
  # Large enough that activations dominate: at batch 2048, width 512 the
  # GPU's smallest compiled peak was 0.8 of the unplanned one (parameters,
  # adam state and XLA:GPU's workspaces).
  return mlp.build(batch_size=16384, width=1024, depth=6)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_fit_meets_half_the_gpu_peak_with_jit_outputs(backend):
  step, args = _mlp_step()
  fitted = jaxmem.fit(0.5, backend=backend)(step)
  res = fitted.fit_result(*args)
  assert res.platform == "gpu" and res.backend == backend
  assert res.peak_bytes <= res.budget_bytes < res.unplanned_peak_bytes
  assert res.plan.decisions, "a plan was needed and made"
  got = jax.tree_util.tree_leaves(fitted(*args))
  want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=2e-5, atol=2e-6)


def test_one_plan_through_both_backends_on_the_gpu():
  step, args = _mlp_step()
  res = jaxmem.fit(0.5, backend="xla")(step).fit_result(*args)
  want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
  for backend in ("ffi", "xla"):
    planned = jit_plan(res.plan, backend=backend)
    compiled = planned.lower(*args).compile()
    assert jaxmem.compiled_memory(compiled).peak_bytes < res.unplanned_peak_bytes
    got = jax.tree_util.tree_leaves(compiled(*args))
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 rtol=2e-5, atol=2e-6)
