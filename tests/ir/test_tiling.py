"""XLA:TPU's tiled layouts in the bytes a program's values take (`jaxmem._src.ir.tiling`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem._src.ir import trace as trace_mod
from jaxmem._src.ir.tiling import tiled_nbytes

MiB = 2 ** 20


@pytest.mark.parametrize("shape,itemsize,mib", [
    # Sizes read from XLA:TPU v5e's buffer assignment of the UNet example
    # (batch 8, 128x128, width 16), libtpu 0.0.42.1.
    ((8, 128, 128, 16), 4, 64),     # {3,0,2,1:T(8,128)}: 16 channels on 128 lanes
    ((8, 128, 128, 16), 2, 32),     # bf16 packs 16 rows
    ((8, 64, 64, 32), 4, 16),
    ((8, 32, 32, 64), 4, 4),
])
def test_measured_tpu_buffers(shape, itemsize, mib):
  assert tiled_nbytes(shape, itemsize, "tpu") == mib * MiB


def test_other_platforms_are_dense():
  assert tiled_nbytes((8, 128, 128, 16), 4, "cpu") == 8 * 128 * 128 * 16 * 4
  assert tiled_nbytes((8, 128, 128, 16), 4, "gpu") == 8 * 128 * 128 * 16 * 4


def test_small_arrays_take_a_whole_tile_row():
  assert tiled_nbytes((), 4, "tpu") == 512
  assert tiled_nbytes((16,), 4, "tpu") == 512
  assert tiled_nbytes((3, 5), 4, "tpu") == 8 * 128 * 4


def test_a_narrow_last_dimension_is_not_kept_minor():
  # An image with 3 channels: XLA lays out the width minor-most.
  assert tiled_nbytes((8, 128, 128, 3), 4, "tpu") < tiled_nbytes((8, 128, 128, 16), 4, "tpu")


def test_empty_arrays_take_nothing():
  assert tiled_nbytes((0, 128), 4, "tpu") == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=4), st.sampled_from([1, 2, 4]))
def test_tiles_never_shrink_an_array_and_are_whole(shape, itemsize):
  dense = math.prod(shape) * itemsize
  tiled = tiled_nbytes(shape, itemsize, "tpu")
  assert tiled >= dense
  # Whole tiles of 8 rows of 128 32-bit lanes (one row of 128 for rank < 2).
  assert tiled % (128 * itemsize) == 0
  if len(shape) >= 2:
    assert tiled % 4096 == 0


def test_a_tpu_trace_counts_padded_bytes():
  def f(x):
    return jnp.tanh(x).sum()
  x = jax.ShapeDtypeStruct((10, 10), jnp.float32)
  cpu = trace_mod.trace(f, (x,), backend="cpu")
  tpu = trace_mod.trace(f, (x,), backend="tpu")
  x_cpu, x_tpu = cpu.vars[cpu.invars[0]], tpu.vars[tpu.invars[0]]
  assert x_cpu.nbytes == 10 * 10 * 4
  assert x_tpu.nbytes == 16 * 128 * 4     # one tile: 10 rows of 8, 10 lanes of 128
  assert x_tpu.global_nbytes == 10 * 10 * 4


def test_only_a_convolution_keeps_its_features_minor():
  def conv(x, k):
    y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.tanh(y).sum()
  x = jax.ShapeDtypeStruct((8, 32, 32, 16), jnp.float32)
  k = jax.ShapeDtypeStruct((3, 3, 16, 16), jnp.float32)
  prog = trace_mod.trace(conv, (x, k), backend="tpu")
  # The image and the convolution's result: 16 channels on 128 lanes (batch 8
  # minor-most would pad 16 times); the elementwise tanh shares their layout.
  assert prog.vars[prog.invars[0]].nbytes == 8 * 32 * 32 * 128 * 4
  out = [v for v in prog.vars if v.aval.shape == (8, 32, 32, 16) and not v.is_input]
  assert out and all(v.nbytes == 8 * 32 * 32 * 128 * 4 for v in out)
  # The same shape elsewhere takes the layout that pads least: 32 on 128 lanes.
  plain = trace_mod.trace(lambda x: jnp.tanh(x).sum(), (x,), backend="tpu")
  assert plain.vars[plain.invars[0]].nbytes == 8 * 32 * 16 * 128 * 4
