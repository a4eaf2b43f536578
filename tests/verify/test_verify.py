"""Verification reads the compiled executable's own figures."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem._src.verify.compiled import CompiledCost, CompiledMemory, compiled_cost, compiled_memory


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


def test_the_compiled_cost_is_xla_s_own_count_of_flops_and_bytes():
  def f(x, y):
    return jnp.tanh(x @ y)
  x, y = jnp.ones((256, 128)), jnp.ones((128, 64))
  compiled = jax.jit(f).lower(x, y).compile()
  cost = compiled_cost(compiled)
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  assert cost == CompiledCost(float(analysis["flops"]), float(analysis["bytes accessed"]))
  assert cost.flops >= 2 * 256 * 128 * 64        # the matmul's multiply-adds at least
  assert cost.bytes_accessed >= x.nbytes + y.nbytes


def test_the_compiled_cost_prices_flops_bytes_and_host_copies_on_a_profile():
  profile = jaxmem.DeviceProfile("p", flops_per_s=1e12, host_bytes_per_s=1e9,
                                 memory_bytes_per_s=1e11)
  cost = CompiledCost(flops=2e12, bytes_accessed=3e11)
  assert cost.seconds(profile) == pytest.approx(2.0 + 3.0)
  # Host bytes go out and come back.
  assert cost.seconds(profile, host_bytes=10**9) == pytest.approx(
      5.0 + 2 * profile.copy_seconds(10**9))
  assert CompiledCost(1.1e9, 0.9e9).relative_to(CompiledCost(1e9, 1e9)) == (
      "FLOPs +10.0%, bytes accessed -10.0%")


def test_a_backend_without_cost_analysis_has_no_compiled_cost():
  class NoCost:
    def cost_analysis(self):
      raise NotImplementedError("no cost analysis here")
  assert compiled_cost(NoCost()) is None


def test_without_a_cost_analysis_the_compiled_cost_is_read_from_the_hlo():
  compiled = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(jnp.ones((64, 32)),
                                                          jnp.ones((32, 16))).compile()

  class NoCost:
    def cost_analysis(self):
      return None

    def as_text(self):
      return compiled.as_text()
  cost = compiled_cost(NoCost())
  assert cost is not None and cost.kernels and cost.flops >= 2 * 64 * 32 * 16
  assert compiled_cost(NoCost(), from_hlo=False) is None
  profile = jaxmem.device_profile("h100-sxm")
  assert cost.seconds(profile) == pytest.approx(sum(k.seconds(profile) for k in cost.kernels))


def test_the_compiled_cost_docstring_example_runs():
  import doctest
  from jaxmem._src.verify import compiled
  result = doctest.testmod(compiled, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 5 and result.failed == 0
