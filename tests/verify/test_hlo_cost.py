"""The compiled program's cost read kernel by kernel from its HLO text.

XLA:CPU's own ``cost_analysis()`` is the reference where it counts the same
thing (no loops); where it counts a loop body once, the count here is the
trip count times the body's. XLA:GPU's text (cuDNN convolutions, Triton GEMM
fusions) is checked on a module written out below, since CI has no CUDA
plugin to compile one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem._src.estimate.devices import device_profile
from jaxmem._src.verify.compiled import compiled_cost
from jaxmem._src.verify.hlo_cost import hlo_kernels, parse_hlo


def _totals(compiled):
  kernels = hlo_kernels(compiled.as_text())
  flops = sum((k.matrix_flops + k.vector_flops) * k.count for k in kernels)
  return flops, sum(k.bytes_accessed * k.count for k in kernels), kernels


def _conv(k, img):
  return jax.lax.conv_general_dilated(img, k, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.mark.parametrize("name", ["matmul", "mlp_grad", "conv_grad"])
def test_counts_agree_with_xla_cpus_cost_analysis_on_loop_free_programs(name):
  x, w = jnp.ones((512, 256)), jnp.ones((256, 128))
  img, k = jnp.ones((8, 32, 32, 16)), jnp.ones((3, 3, 16, 32))
  f, args = {
      "matmul": (lambda x, w: jnp.tanh(x @ w).sum(), (x, w)),
      "mlp_grad": (jax.grad(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w.T).sum()), (w, x)),
      "conv_grad": (jax.grad(lambda k, img: jax.nn.relu(_conv(k, img)).sum()), (k, img)),
  }[name]
  compiled = jax.jit(f).lower(*args).compile()
  xla = compiled.cost_analysis()
  flops, nbytes, kernels = _totals(compiled)
  assert kernels
  assert nbytes == pytest.approx(xla["bytes accessed"], rel=1e-6)
  # XLA counts a padded convolution's edges as not computed (SAME padding): a few percent.
  assert flops == pytest.approx(xla["flops"], rel=0.05)


def test_a_loop_body_counts_its_trip_count_times():
  def f(w, x):
    def body(c, _):
      return jnp.tanh(c @ w), c.sum()
    return jax.lax.scan(body, x, None, length=7)[1].sum()
  w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
  compiled = jax.jit(f).lower(w, x).compile()
  _, _, kernels = _totals(compiled)
  matmul = 2 * 64 * 256 * 256
  assert sum(k.matrix_flops * k.count for k in kernels) == pytest.approx(7 * matmul)
  # XLA:CPU's own analysis counts the body once; `from_hlo` is what a ranking needs.
  assert compiled.cost_analysis()["flops"] < 2 * matmul
  assert compiled_cost(compiled, from_hlo=True).flops >= 7 * matmul


def test_a_scan_reads_one_slice_of_its_stacked_input_per_iteration():
  def f(xs):
    return jax.lax.scan(lambda c, x: (c + jnp.tanh(x), None), jnp.zeros(4096), xs)[0]
  xs = jnp.ones((64, 4096))
  compiled = jax.jit(f).lower(xs).compile()
  _, nbytes, _ = _totals(compiled)
  # Each of the 64 iterations reads its row, not the whole stack (64 x 1 MiB).
  assert nbytes < 8 * xs.nbytes


# A module of XLA:GPU's compiled text (jax 0.10.2, `gpu:h100` ahead of time), cut to
# one cuDNN convolution each way, a Triton GEMM fusion, and a host offload.
_GPU_HLO = """HloModule jit_step, is_scheduled=true

%gemm_fusion_dot (parameter_0: bf16[128,64], parameter_1: bf16[64,32]) -> bf16[128,32] {
  %parameter_0 = bf16[128,64]{1,0} parameter(0)
  %parameter_1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[128,32]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_relu (param_0: f32[8,16,16,32]) -> f32[8,16,16,32] {
  %param_0 = f32[8,16,16,32]{3,2,1,0} parameter(0)
  %constant_1 = f32[] constant(0)
  %broadcast.1 = f32[8,16,16,32]{3,2,1,0} broadcast(%constant_1), dimensions={}
  ROOT %maximum.1 = f32[8,16,16,32]{3,2,1,0} maximum(%param_0, %broadcast.1)
}

ENTRY %main (x: f32[8,16,16,16], k: f32[32,3,3,16], a: bf16[128,64], b: bf16[64,32]) -> (f32[8,16,16,32], f32[32,3,3,16], bf16[128,32], f32[8,16,16,32]) {
  %x = f32[8,16,16,16]{3,2,1,0} parameter(0)
  %k = f32[32,3,3,16]{3,2,1,0} parameter(1)
  %a = bf16[128,64]{1,0} parameter(2)
  %b = bf16[64,32]{1,0} parameter(3)
  %cudnn-conv.1 = (f32[8,16,16,32]{3,2,1,0}, u8[0]{0}) custom-call(%x, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %get-tuple-element.1 = f32[8,16,16,32]{3,2,1,0} get-tuple-element(%cudnn-conv.1), index=0
  %loop_maximum_fusion = f32[8,16,16,32]{3,2,1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_relu
  %cudnn-conv-bw-filter.1 = (f32[32,3,3,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %loop_maximum_fusion), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
  %get-tuple-element.2 = f32[32,3,3,16]{3,2,1,0} get-tuple-element(%cudnn-conv-bw-filter.1), index=0
  %gemm_fusion = bf16[128,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot
  %copy-start = (f32[8,16,16,32]{3,2,1,0}, f32[8,16,16,32]{3,2,1,0:S(5)}, u32[]) copy-start(%loop_maximum_fusion)
  %copy-done = f32[8,16,16,32]{3,2,1,0:S(5)} copy-done(%copy-start)
  ROOT %tuple = (f32[8,16,16,32]{3,2,1,0}, f32[32,3,3,16]{3,2,1,0}, bf16[128,32]{1,0}, f32[8,16,16,32]{3,2,1,0:S(5)}) tuple(%loop_maximum_fusion, %get-tuple-element.2, %gemm_fusion, %copy-done)
}
"""


def test_xla_gpu_kernels_convolutions_gemms_and_host_copies():
  comps, entry = parse_hlo(_GPU_HLO)
  assert entry == "main" and set(comps) == {"gemm_fusion_dot", "fused_relu", "main"}
  kernels = {k.name: k for k in hlo_kernels(_GPU_HLO)}
  assert set(kernels) == {"cudnn-conv.1", "loop_maximum_fusion", "cudnn-conv-bw-filter.1",
                          "gemm_fusion", "copy-start"}
  conv = 2 * (8 * 16 * 16 * 32) * (3 * 3 * 16)        # 2 per multiply-add of the forward conv
  assert kernels["cudnn-conv.1"].matrix_flops == conv
  assert kernels["cudnn-conv-bw-filter.1"].matrix_flops == conv
  # The workspace (u8[0]) is not counted; the input and kernel are read, the output written.
  assert kernels["cudnn-conv.1"].bytes_accessed == 4 * (8 * 16 * 16 * 16 + 32 * 9 * 16
                                                        + 8 * 16 * 16 * 32)
  gemm = kernels["gemm_fusion"]
  assert gemm.matrix_flops == 2 * 128 * 32 * 64 and gemm.matmul_dtype == "bfloat16"
  assert kernels["loop_maximum_fusion"].vector_flops == 8 * 16 * 16 * 32
  assert kernels["loop_maximum_fusion"].bytes_accessed == 2 * 4 * 8 * 16 * 16 * 32
  host = kernels["copy-start"]
  assert host.host_bytes == 4 * 8 * 16 * 16 * 32 and host.bytes_accessed == 0
  h100 = device_profile("h100-sxm")
  assert host.seconds(h100) > h100.copy_seconds(int(host.host_bytes))


def test_text_without_an_entry_computation_is_refused():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_kernels("HloModule m\n")


def test_the_docstring_example_runs():
  import doctest
  from jaxmem._src.verify import hlo_cost
  result = doctest.testmod(hlo_cost, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 3 and result.failed == 0
