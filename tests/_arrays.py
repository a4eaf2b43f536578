"""Test arrays shared by the native-op tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def example_array(shape, dtype, seed=0):
  """A random array of ``dtype`` covering its whole value range (no NaNs for floats)."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return jnp.asarray(rng.random(shape) < 0.5)
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return jnp.asarray(rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype))
  # Random bit patterns would include NaNs; normal values are enough here.
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
