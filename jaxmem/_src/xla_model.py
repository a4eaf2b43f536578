"""What XLA does with the buffers: fusion, layout copies and expansions, per primitive.

The estimate must describe the compiled program, not the jaxpr. Three effects
dominate on the models we measure (XLA:CPU, jax 0.10.2; see README "What XLA
does behind the plan's back"):

* **Fusion.** Elementwise ops are fused into their consumers, so their results
  are never stored: a value whose producer is fusible and whose consumers are
  all fusible is *virtual*, and its inputs stay alive until its last use
  instead. XLA duplicates cheap producers into every consumer, however far
  apart: a ReLU mask kept for the backward pass is recomputed there from its
  float input, which is what stays alive. Expensive ops (exp, tanh, divide...)
  are fused only into a single consumer.
* **Layout copies.** A convolution whose operand is not in the backend's native
  layout gets a transposed copy of it (on the CPU the weight-gradient
  convolution transposes both its input and its output gradient).
* **Expansions.** ``select_and_scatter_add`` (max-pool gradient) is expanded on
  the CPU into index arrays of the operand's shape per dimension, hoisted to the
  program start, plus a zeroed output and the reduce-window index outputs.

Rules are per primitive name, with a default (materialized, no hidden
temporaries) and a one-time warning for primitives the registry does not know.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import numpy as np

from jaxmem._src import _compat


class Fusion(enum.Enum):
  CHEAP = "cheap"                # elementwise, duplicated into every consumer
  EXPENSIVE = "expensive"        # elementwise, fused into a single consumer only
  VIEW = "view"                  # reshape-like: a bitcast or fused index remap
  REDUCE = "reduce"              # fuses its producers (input fusion), result stored
  MATERIALIZED = "materialized"  # library call / custom call / control flow: stored


_CHEAP = """abs add add_any and broadcast_in_dim clamp convert_element_type copy copy_p eq ge gt
imag integer_pow iota is_finite le lt max min mul ne neg not or real reduce_precision select_n
shift_left shift_right_arithmetic shift_right_logical sign square sub xor stop_gradient
nextafter population_count round floor ceil""".split()
_EXPENSIVE = """acos acosh asin asinh atan atan2 atanh cbrt cos cosh digamma div erf erf_inv erfc exp
exp2 expm1 lgamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh
bessel_i0e bessel_i1e igamma igammac random_gamma_grad polygamma zeta""".split()
_VIEW = """reshape squeeze expand_dims transpose slice rev pad concatenate dynamic_slice
bitcast_convert_type""".split()
_REDUCE = """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin cumsum cumprod cummax cummin""".split()
_MATERIALIZED = """dot_general conv_general_dilated ffi_call custom_call scan while cond
select_and_scatter_add select_and_gather_add reduce_window_max reduce_window_min
reduce_window_sum reduce_window gather scatter scatter-add scatter_add scatter_mul
scatter_min scatter_max dynamic_update_slice sort top_k cumlogsumexp fft
triangular_solve cholesky lu qr eigh svd threefry2x32 random_bits random_seed random_wrap
random_unwrap random_fold_in random_split rng_bit_generator rng_uniform checkpoint remat remat2
custom_lin shard_map pure_callback io_callback debug_callback psum all_gather
reduce_scatter ppermute all_to_all axis_index pmax pmin optimization_barrier
sharding_constraint device_put mesh_cast reshard clz""".split()

FUSION_RULES: dict[str, Fusion] = {}
for _names, _kind in ((_CHEAP, Fusion.CHEAP), (_EXPENSIVE, Fusion.EXPENSIVE), (_VIEW, Fusion.VIEW),
                      (_REDUCE, Fusion.REDUCE), (_MATERIALIZED, Fusion.MATERIALIZED)):
  for _n in _names:
    FUSION_RULES[_n] = _kind

FUSIBLE_CONSUMERS = {Fusion.CHEAP, Fusion.EXPENSIVE, Fusion.VIEW, Fusion.REDUCE}
_WARNED: set[str] = set()


def fusion_kind(primitive: str) -> Fusion:
  """How XLA fuses an op of this primitive (default: materialized, with a warning)."""
  kind = FUSION_RULES.get(primitive)
  if kind is None:
    if primitive not in _WARNED:
      _WARNED.add(primitive)
      warnings.warn(f"jaxmem: no fusion rule for primitive `{primitive}`; assuming its result "
                    "is stored (materialized).", stacklevel=3)
    return Fusion.MATERIALIZED
  return kind


def _nbytes(aval: Any) -> int:
  return _compat.aval_nbytes(aval)


def _native_spec(n: int, kind: str) -> tuple[int, ...]:
  spatial = tuple(range(1, n - 1)) if kind != "rhs" else tuple(range(0, n - 2))
  if kind == "rhs":
    return (n - 1, n - 2) + spatial     # HWIO: out features last, in features before
  return (0, n - 1) + spatial           # NHWC: batch first, features last


def hidden_bytes(eqn: Any, backend: str, substituted: bool = False) -> tuple[int, int]:
  """``(transient, hoisted)`` bytes XLA adds for ``eqn`` beyond its inputs and outputs.

  ``transient`` is live only while the op runs; ``hoisted`` is live from the
  program start until the op (index arrays XLA builds once, up front).
  """
  name = eqn.primitive.name
  if backend != "cpu":
    return 0, 0
  if name == "conv_general_dilated":
    dn = eqn.params["dimension_numbers"]
    n = len(eqn.invars[0].aval.shape)
    extra = 0
    if tuple(dn.lhs_spec) != _native_spec(n, "lhs"):
      extra += _nbytes(eqn.invars[0].aval)
    if tuple(dn.rhs_spec) != _native_spec(n, "rhs"):
      extra += _nbytes(eqn.invars[1].aval)
    if tuple(dn.out_spec) != _native_spec(n, "out"):
      extra += _nbytes(eqn.outvars[0].aval)
    return extra, 0
  if name == "select_and_scatter_add":
    source, operand = eqn.invars[0].aval, eqn.invars[1].aval
    if substituted:
      # reshape + argmax + select: a transposed copy of the operand and the
      # scattered result before its inverse transpose.
      return 2 * _nbytes(operand), 0
    elems = int(np.prod(operand.shape)) if operand.shape else 1
    src_elems = int(np.prod(source.shape)) if source.shape else 1
    rank = len(operand.shape)
    hoisted = rank * elems * 4                      # s32 iotas, one per dimension
    transient = _nbytes(operand) + (rank + 1) * src_elems * 4
    return transient, hoisted
  return 0, 0
