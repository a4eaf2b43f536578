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
nextafter population_count round floor ceil tile complex conj mulhi pvary pbroadcast
eq_to le_to lt_to""".split()
_EXPENSIVE = """acos acosh asin asinh atan atan2 atanh cbrt cos cosh digamma div erf erf_inv erfc exp
exp2 expm1 lgamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh
bessel_i0e bessel_i1e igamma igammac random_gamma_grad polygamma zeta igamma_grad_a
regularized_incomplete_beta""".split()
# split/unstack are slices and stack a concatenate of reshapes: XLA lowers
# them to those HLOs, which fuse into their consumers.
_VIEW = """reshape squeeze expand_dims transpose slice rev pad concatenate dynamic_slice
bitcast_convert_type split unstack stack""".split()
_REDUCE = """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin cumsum cumprod cummax cummin reduce""".split()
_MATERIALIZED = """dot_general conv_general_dilated ffi_call custom_call scan while cond
select_and_scatter_add select_and_gather_add reduce_window_max reduce_window_min
reduce_window_sum reduce_window gather scatter scatter-add scatter_add scatter_mul
scatter_min scatter_max dynamic_update_slice sort top_k cumlogsumexp fft
triangular_solve cholesky lu qr eigh svd threefry2x32 random_bits random_seed random_wrap
random_unwrap random_fold_in random_split rng_bit_generator rng_uniform checkpoint remat remat2
custom_lin shard_map pure_callback io_callback debug_callback psum all_gather
reduce_scatter ppermute all_to_all axis_index pmax pmin optimization_barrier
sharding_constraint device_put mesh_cast reshard clz approx_top_k eig geqrf geqp3 hessenberg
householder_product ormqr schur tridiagonal tridiagonal_solve cholesky_update symmetric_product
lu_pivots_to_permutation ragged_dot_general ragged_all_to_all scatter-sub scatter-mul scatter-min
scatter-max select_and_scatter custom_linear_solve empty create_token after_all layout_constraint
psum_invariant all_gather_invariant""".split()

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



def _elementwise(primitive: str) -> bool:
  return FUSION_RULES.get(primitive) in (Fusion.CHEAP, Fusion.EXPENSIVE)


def shared_broadcasts(program: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
  """Per op, ``(input position, bytes)`` of operands XLA broadcasts into a stored buffer.

  jax lets elementwise ops broadcast size-1 dimensions (``x[B,H,L,L] /
  s[B,H,L,1]``); XLA makes each such broadcast an explicit HLO ``broadcast``.
  When the same broadcast is read in the forward pass and again in the
  backward pass (the softmax denominator, LayerNorm's ``rsqrt`` and scale),
  CSE leaves one full-size broadcast, and on the CPU it is stored because the
  backward consumer is a YNNPACK fusion, which cannot fuse a broadcast
  (measured on the GPT example: one [B,H,L,L] buffer per attention layer and
  two [B,L,D] per LayerNorm, live from the forward use to the backward one).
  Values XLA computes from constants (masks from ``iota``) are excluded: they
  are recomputed, not kept.

  The estimator charges each such ``(value, broadcast size)`` pair once, from
  its first reader to its last (:class:`~jaxmem._src.lifetimes.Flow`).
  """
  if program.backend != "cpu":
    return tuple(() for _ in program.ops)
  readers: dict[tuple[int, int], set[str]] = {}
  cands: list[list[tuple[int, int, int]]] = []
  for op in program.ops:
    found = []
    if _elementwise(op.primitive) and op.outputs:
      out = program.vars[op.outputs[0]]
      for pos, x in enumerate(op.inputs):
        if not isinstance(x, int) or program.constant_like[x]:
          continue
        v = program.vars[x]
        size = int(np.prod(v.shape)) if v.shape else 1
        if size > 1 and v.nbytes < out.nbytes and len(v.shape) == len(out.shape):
          # bytes of the broadcast in the operand's own dtype
          nbytes = v.nbytes * (int(np.prod(out.shape)) // size)
          found.append((pos, x, nbytes))
          readers.setdefault((x, nbytes), set()).add(op.phase.value)
    cands.append(found)
  return tuple(tuple((pos, b) for pos, x, b in found
                     if {"forward", "backward"} <= readers[(x, b)]) for found in cands)




def stored_broadcast_spans(program: Any) -> list[tuple[int, int, int, int]]:
  """``(value id, bytes, first reader, last reader)`` of the broadcasts XLA stores.

  The unplanned program's view of :func:`shared_broadcasts`: one entry per
  broadcast of a value that is read at two or more program points (a single
  reader fuses it, nothing is stored).
  """
  span: dict[tuple[int, int], list[int]] = {}
  for op, (_, _, _, shared) in zip(program.ops, program.op_memory_model(planned=False)):
    for pos, b in shared:
      span.setdefault((op.inputs[pos], b), [op.index, op.index])[1] = op.index
  return [(v, b, s, e) for (v, b), (s, e) in span.items() if e > s]


# Consumers that XLA:CPU turns into a YNNPACK fusion together with their
# elementwise producers (measured: avg_pool's reduce_window_sum).
_YNN_WINDOW_CONSUMERS = frozenset({"reduce_window_sum"})


def hoisted_scalar_broadcasts(program: Any) -> tuple[int, ...]:
  """Per op, bytes of constant broadcasts XLA:CPU builds at the program start for it.

  An elementwise op with a scalar constant operand (``relu``'s ``max(x, 0)``)
  fused with an avg_pool's ``reduce_window_sum`` into a YNNPACK fusion gets
  that scalar as a materialized full-size broadcast, which XLA schedules at
  the start of the program and keeps until the fusion runs (measured on a
  BatchNorm CNN: one buffer of the ReLU's output size per pooling layer).
  """
  out = [0] * program.num_ops
  if program.backend != "cpu":
    return tuple(out)
  for op in program.ops:
    if op.primitive not in _YNN_WINDOW_CONSUMERS:
      continue
    for x in op.input_ids():
      d = program.vars[x].defined_by
      if d < 0:
        continue
      producer = program.ops[d]
      if not _elementwise(producer.primitive):
        continue
      if any((not isinstance(y, int) or (program.constant_like[y] and not program.vars[y].shape))
             for y in producer.inputs) and len(producer.inputs) > 1:
        out[op.index] += program.vars[x].nbytes
  return tuple(out)


# Views that write a new buffer layout. XLA fuses them into elementwise and
# reduction consumers like any cheap producer, but a library call (a dot, a
# convolution) reads a stored operand: measured on DenseNet-BC, where the
# concatenated features are read by BatchNorm's statistics and the next
# layer (estimate -10.7% -> -1.4% of the compiled peak), and on the char-LSTM
# and UNet, whose XLA buffer assignments hold the `concatenate`/`stack` results.
_DATA_MOVING_VIEWS = frozenset({"concatenate", "pad", "stack"})


def op_fusion_kind(program: Any, op: Any) -> Fusion:
  """:func:`fusion_kind` of ``op`` refined by where its result is used in ``program``.

  A broadcast of a non-scalar value used both by the forward pass and by the
  backward pass is stored: XLA:CPU hands the backward consumer (a product
  feeding a reduction, or the softmax-denominator divide) to a YNNPACK fusion,
  which cannot fuse a broadcast, so CSE keeps one materialized broadcast for
  both phases (measured on the GPT example's softmax and LayerNorm).
  """
  kind = fusion_kind(op.primitive)
  if op.primitive in _DATA_MOVING_VIEWS and program.backend == "cpu":
    return Fusion.CHEAP
  if op.primitive == "broadcast_in_dim" and program.backend == "cpu":
    ins = op.input_ids()
    if (ins and not program.constant_like[ins[0]] and program.vars[ins[0]].shape
        and program.vars[ins[0]].nbytes < program.vars[op.outputs[0]].nbytes):
      phases = {program.ops[u].phase.value for u in program.vars[op.outputs[0]].uses}
      if "backward" in phases and op.phase.value == "forward":
        return Fusion.MATERIALIZED
  return kind
