"""The cost model: device profiles, the roofline per op, the measured CPU profile."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem._src import _compat
from jaxmem._src.estimate import cost, devices


def test_device_profiles_cite_their_figures():
  for name in ("h100-sxm", "h100-pcie", "h200", "a100-40g", "v100", "gtx-1080ti", "k40"):
    prof = jaxmem.device_profile(name)
    assert prof.name == name and prof.source
    assert prof.memory_bytes and prof.memory_bytes_per_s and prof.host_bytes_per_s
    # A matmul unit is at least as fast in half precision, elementwise work slower.
    assert prof.matmul_rate("bfloat16") >= prof.matmul_rate("float32") >= prof.vector_rate
  with pytest.raises(ValueError, match="a100-40g"):
    jaxmem.device_profile("a100")


def test_roofline_prices_compute_and_memory_bound_ops():
  mm = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((4096, 4096))).eqns[0]
  add = jax.make_jaxpr(lambda a: a + a)(jnp.ones((4096, 4096))).eqns[0]
  h100 = jaxmem.device_profile("h100-sxm")
  eff = h100.efficiency
  assert cost.eqn_flops(mm) == 2 * 4096 ** 3
  # A big matmul is compute-bound, an elementwise add memory-bound; each at
  # what its class achieves of the datasheet's rate.
  assert cost.eqn_seconds(mm, h100) == pytest.approx(
      cost.eqn_flops(mm) / (h100.flops_per_s * eff.matmul) + h100.op_overhead_s)
  assert cost.eqn_seconds(add, h100) == pytest.approx(
      3 * 4096 * 4096 * 4 / (h100.memory_bytes_per_s * eff.memory) + h100.op_overhead_s)
  assert cost.eqn_seconds(add, h100, fused=True) < cost.eqn_seconds(add, h100)


def test_every_op_class_is_derated_by_its_own_efficiency():
  import dataclasses
  x = jnp.ones((2048, 2048))
  eqns = {name: jax.make_jaxpr(f)(x).eqns[0] for name, f in
          (("matmul", lambda a: a @ a), ("memory", lambda a: a + a),
           ("reduction", lambda a: a.sum(0)))}
  ideal = jaxmem.DeviceProfile("ideal", 1e14, 1e10, None, 1e13, 1e12)
  assert ideal.efficiency == jaxmem.Efficiency()       # user rates are achieved rates
  for field in ("matmul", "memory", "reduction"):
    half = dataclasses.replace(ideal, efficiency=jaxmem.Efficiency(**{field: 0.5}))
    for name, eqn in eqns.items():
      ratio = cost.eqn_seconds(eqn, half) / cost.eqn_seconds(eqn, ideal)
      assert ratio == pytest.approx(2.0 if name == field else 1.0), (field, name)
  slow = dataclasses.replace(ideal, efficiency=jaxmem.Efficiency(copy=0.5, copy_latency_s=1e-5))
  assert slow.copy_seconds(1e9) == pytest.approx(1e-5 + 2 * ideal.copy_seconds(1e9))
  # Built-in profiles give the link's rate and derate copies like compute.
  h100 = jaxmem.device_profile("h100-sxm")
  assert h100.host_bytes_per_s == 64e9 and h100.copy_bytes_per_s == pytest.approx(0.8 * 64e9)
  assert h100.efficiency.matmul < 1 and h100.efficiency.memory < 1


def test_efficiency_checks_its_fractions():
  with pytest.raises(ValueError, match=r"`Efficiency.matmul`=1.5"):
    jaxmem.Efficiency(matmul=1.5)
  with pytest.raises(ValueError, match="copy_latency_s"):
    jaxmem.Efficiency(copy_latency_s=-1.0)
  with pytest.raises(TypeError, match="`DeviceProfile.efficiency`"):
    jaxmem.DeviceProfile("x", 1e12, 1e9, efficiency=0.5)


def test_vectorized_op_costs_equal_the_per_equation_roofline():
  def step(w, x):
    h = jnp.tanh(x @ w)
    return jax.lax.scan(lambda c, r: (c + r, None), h[0], h)[0].sum() + (h @ w.T).sum()
  args = (jnp.ones((64, 64), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16))
  eqns = jax.make_jaxpr(jax.grad(step))(*args).eqns
  costs = cost.op_costs([(e, bool(_compat.sub_jaxprs(e))) for e in eqns])
  assert costs.bodies   # the scan is priced through its body
  for name in ("h100-pcie", "k40", "cpu"):
    prof = jaxmem.device_profile(name)
    for fused in (False, True):
      got = costs.seconds(prof, fused=fused)
      want = [cost.eqn_seconds(e, prof, fused=fused) for e in eqns]
      assert got.tolist() == want   # the same float operations: equal, not close


def test_cpu_profile_is_measured_on_request(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  measured = devices.calibrate_cpu(repeats=2)
  assert measured.flops_per_s > 1e8 and measured.host_bytes_per_s > 1e7
  assert measured.memory_bytes_per_s > 1e8 and "measured" in measured.source
  assert devices.calibrate_cpu() == measured          # cached per machine: reproducible plans
  monkeypatch.setenv("JAXMEM_CPU_PROFILE", "measured")
  devices._measured_cpu.cache_clear()
  try:
    assert jaxmem.device_profile("cpu") == measured
  finally:
    devices._measured_cpu.cache_clear()
  monkeypatch.delenv("JAXMEM_CPU_PROFILE")
  assert jaxmem.device_profile("cpu") is devices.STATIC_CPU



def _checkpoint_eqn(f, *args):
  """The ``checkpoint`` equation of ``jax.checkpoint(f)`` traced at ``args``."""
  closed = jax.make_jaxpr(jax.checkpoint(f))(*args)
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]
  return eqn


def test_a_body_moves_the_bytes_of_its_stored_values_only():
  """Inside a body an elementwise value read only there is fused; the body's results are stored.

  Bytes and time are priced by the same rule (`eqn_accessed`, `eqn_seconds`).
  """
  dev = devices.device_profile("h100-sxm")
  x = jnp.ones((1024, 1024))
  eqn = _checkpoint_eqn(lambda x: jnp.tanh(jnp.sin(x)), x)
  nbytes = x.size * 4
  # sin is fused into tanh; tanh, the result, reads x and writes its buffer.
  assert cost.eqn_accessed(eqn) == 2 * nbytes
  assert cost.eqn_accessed(eqn, fused=True) == 2 * nbytes     # a body is never fused away
  assert cost.eqn_seconds(eqn, dev) == pytest.approx(
      2 * nbytes / dev.stream_bytes_per_s + dev.op_overhead_s, rel=0.05)
  # A scan body is priced per iteration, times its trip count.
  def scanned(c):
    return jax.lax.scan(lambda c, _: (jnp.tanh(jnp.sin(c)), None), c, None, length=3)[0]
  (scan,) = [e for e in jax.make_jaxpr(scanned)(x).eqns if e.primitive.name == "scan"]
  assert cost.eqn_accessed(scan) == 3 * 2 * nbytes


def test_what_a_convolution_reads_in_a_body_is_stored_unless_the_compiler_fuses_it():
  """A ReLU feeding a convolution inside a checkpoint body: XLA:GPU's cuDNN call
  reads it from memory, XLA:TPU computes it inside its convolution fusion."""
  img, k = jnp.ones((8, 64, 64, 32)), jnp.ones((3, 3, 32, 32))

  def block(img):
    return jax.lax.conv_general_dilated(jnp.maximum(img * 2.0, 0.0), k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
  eqn = _checkpoint_eqn(block, img)
  gpu = devices.device_profile("h100-sxm")
  assert not gpu.fuses_into_convolutions and devices.device_profile("tpu-v5e").fuses_into_convolutions
  fused = dataclasses.replace(gpu, fuses_into_convolutions=True)
  # The ReLU's result is written and read once more when it is stored.
  extra = 2 * img.size * 4 / gpu.stream_bytes_per_s
  assert cost.eqn_seconds(eqn, gpu) - cost.eqn_seconds(eqn, fused) == pytest.approx(
      extra + gpu.op_overhead_s, rel=0.05)
  # Bytes accessed stay XLA:TPU's count (what `bench/compiled_traffic.py` compares with).
  assert cost.eqn_accessed(eqn) == cost.eqn_accessed(eqn, fused=False)


def test_a_convolution_epilogue_is_fused_but_a_batchnorm_between_convolutions_is_stored():
  """conv -> + bias -> ReLU -> conv: the ReLU is computed in the first convolution's
  cuDNN call (priced fused); conv -> BatchNorm -> ReLU -> conv: the normalisation
  reads a reduction of the convolution's output, so it is a kernel of its own."""
  img, k = jnp.ones((8, 32, 32, 16)), jnp.ones((3, 3, 16, 16))
  bias = jnp.ones((16,))

  def conv(x):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def with_bias(x):
    return conv(jnp.maximum(conv(x) + bias, 0.0))

  def with_norm(x):
    y = conv(x)
    return conv(jnp.maximum((y - y.mean((0, 1, 2))) * bias, 0.0))
  gpu = devices.device_profile("h100-sxm")
  fused = dataclasses.replace(gpu, fuses_into_convolutions=True)
  for f, extra_kernels in ((with_bias, 0), (with_norm, 1)):
    eqn = _checkpoint_eqn(f, img)
    gap = cost.eqn_seconds(eqn, gpu) - cost.eqn_seconds(eqn, fused)
    assert gap == pytest.approx(extra_kernels * (2 * img.size * 4 / gpu.stream_bytes_per_s
                                                 + gpu.op_overhead_s), rel=0.05, abs=1e-9)
