"""`jaxmem.cost`: device profiles, the roofline per op, the measured CPU profile."""

from __future__ import annotations

import pytest

import jaxmem


def test_device_profiles_cite_figures_and_price_ops():
  from jaxmem._src import cost

  for name in ("h100-sxm", "h100-pcie", "a100-40g", "v100", "gtx-1080ti", "k40"):
    prof = jaxmem.device_profile(name)
    assert prof.source and prof.memory_bytes and prof.memory_bytes_per_s and prof.host_bytes_per_s
  assert jaxmem.device_profile("k40").memory_bytes_per_s == 288e9       # paper 004's figure
  with pytest.raises(ValueError, match="a100-40g"):
    jaxmem.device_profile("a100")
  # Roofline: a big matmul is compute-bound, an elementwise add memory-bound.
  import jax
  import jax.numpy as jnp
  mm = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((4096, 4096))).eqns[0]
  add = jax.make_jaxpr(lambda a: a + a)(jnp.ones((4096, 4096))).eqns[0]
  h100 = jaxmem.device_profile("h100-sxm")
  assert cost.eqn_flops(mm) == 2 * 4096 ** 3
  assert cost.eqn_seconds(mm, h100) == pytest.approx(2 * 4096 ** 3 / 494.7e12 + 4e-6)
  assert cost.eqn_seconds(add, h100) == pytest.approx(3 * 4096 * 4096 * 4 / 3.35e12 + 4e-6)
  assert cost.eqn_seconds(add, h100, fused=True) < cost.eqn_seconds(add, h100)


def test_cpu_profile_is_measured_on_request(monkeypatch, tmp_path):
  from jaxmem._src import cost

  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  measured = cost.calibrate_cpu(repeats=2)
  assert measured.flops_per_s > 1e8 and measured.host_bytes_per_s > 1e7
  assert measured.memory_bytes_per_s > 1e8 and "measured" in measured.source
  assert cost.calibrate_cpu() == measured          # cached per machine: reproducible plans
  monkeypatch.setenv("JAXMEM_CPU_PROFILE", "measured")
  monkeypatch.setattr(cost, "_CALIBRATED", None)
  assert jaxmem.device_profile("cpu") == measured
  monkeypatch.delenv("JAXMEM_CPU_PROFILE")
  assert jaxmem.device_profile("cpu") is cost.STATIC_CPU
