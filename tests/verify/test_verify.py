"""Verification reads the compiled executable's own figures."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem._src.verify.compiled import CompiledMemory, compiled_memory


def test_the_peak_is_arguments_plus_outputs_plus_temp_minus_aliases():
  def f(x, y):
    return jnp.sin(x) @ y, x * 2.0
  x, y = jnp.ones((256, 128)), jnp.ones((128, 64))
  compiled = jax.jit(f, donate_argnums=0).lower(x, y).compile()
  stats = compiled.memory_analysis()
  mem = compiled_memory(compiled)
  assert mem.argument_bytes == stats.argument_size_in_bytes == x.nbytes + y.nbytes
  assert mem.output_bytes == stats.output_size_in_bytes
  assert mem.temp_bytes == stats.temp_size_in_bytes
  assert mem.alias_bytes == stats.alias_size_in_bytes
  assert mem.peak_bytes == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  assert str(mem).startswith(jaxmem.format_bytes(mem.peak_bytes))


def test_a_backend_without_memory_analysis_is_refused():
  class NoAnalysis:
    def memory_analysis(self):
      return None
  with pytest.raises(RuntimeError, match="memory_analysis"):
    compiled_memory(NoAnalysis())


def test_compiled_memory_is_a_frozen_record():
  mem = CompiledMemory(10, 20, 30, 5)
  assert mem.peak_bytes == 55 and mem.host_temp_bytes == 0
  with pytest.raises(dataclasses.FrozenInstanceError):
    mem.temp_bytes = 0
