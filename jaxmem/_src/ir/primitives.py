"""One registry of what jaxmem knows about each JAX primitive.

Every module that needs a fact about a primitive reads it here: how XLA fuses
it (:class:`Fusion`), whether it is elementwise and what shape rule it follows
(:class:`Shape`, for sharding propagation), whether a recomputation may
re-execute it, whether XLA's common-subexpression elimination may merge two of
them, whether it runs on the matrix units, what its sub-jaxprs mean
(:class:`Body`), and its FLOPs. The layout follows jax's
``experimental/roofline/roofline.py``: facts are registered per primitive name
(:func:`register`, and :func:`register_flops` as a decorator for FLOPs rules),
:func:`facts` looks them up, and a primitive the registry does not know gets
the default facts (:data:`DEFAULT`: stored, not elementwise, one FLOP per
result element) with a warning naming it, once per primitive.

The fusion classes were measured on XLA:CPU with jax 0.10.2 (see
:mod:`jaxmem._src.estimate.xla_model`); the other facts are properties of the
primitives themselves.

>>> facts("tanh").fusion is Fusion.EXPENSIVE, facts("tanh").elementwise
(True, True)
>>> facts("dot_general").matrix_unit, facts("scan").body is Body.BLOCK
(True, True)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from jaxmem._src import _compat


class Fusion(enum.Enum):
  """How XLA fuses an op of a primitive with its neighbours."""
  CHEAP = "cheap"                # elementwise, duplicated into every consumer
  EXPENSIVE = "expensive"        # elementwise, fused into a single consumer only
  VIEW = "view"                  # reshape-like: a bitcast or fused index remap
  REDUCE = "reduce"              # fuses its producers (input fusion), result stored
  MATERIALIZED = "materialized"  # library call / custom call / control flow: stored

  # Members are singletons compared by identity: hash them by identity too.
  # `enum.Enum.__hash__` is a Python function, and the estimate looks kinds up
  # in sets hundreds of thousands of times per plan.
  __hash__ = object.__hash__


#: Kinds of consumer that an elementwise producer can be fused into.
FUSIBLE_CONSUMERS = frozenset({Fusion.CHEAP, Fusion.EXPENSIVE, Fusion.VIEW, Fusion.REDUCE})


class Body(enum.Enum):
  """What the jaxprs in an equation's params are."""
  NONE = "none"            # no sub-jaxpr
  INLINE = "inline"        # a call (jit, custom_jvp...): the flat program inlines its body
  BLOCK = "block"          # control flow or remat run as one op (scan, while, cond, checkpoint)
  COMBINER = "combiner"    # a per-element scalar function (scatter's update, reduce's monoid)


class Shape(enum.Enum):
  """How a primitive's result dimensions follow its operands' (for sharding propagation)."""
  ELEMENTWISE = "elementwise"  # the result has the shape of its (broadcast) operands
  REDUCTION = "reduction"      # the ``axes`` parameter's dimensions are reduced away
  CUMULATIVE = "cumulative"    # same shape, a scan along the ``axis`` parameter
  SCATTER = "scatter"          # the result has the shape of the first operand
  OTHER = "other"              # a rule of its own, or unknown


FlopsRule = Callable[[_compat.JaxprEqn], float]


@dataclasses.dataclass(frozen=True)
class PrimitiveFacts:
  """What jaxmem knows about one primitive.

  Attributes:
    name: the primitive's name (``eqn.primitive.name``).
    fusion: how XLA fuses it (see :class:`Fusion`).
    shape: how its result dimensions follow its operands (see :class:`Shape`).
    rematerializable: a recomputation may re-execute it; False for effects,
      random state, custom calls and control flow, whose second run would not
      be the same computation or whose cost is not the op's own.
    cse: XLA's common-subexpression elimination may merge two of them with
      the same operands; False for random bits, custom calls, copies made on
      purpose and collectives.
    matrix_unit: a library call on the matrix units (GEMM, convolution): it
      reads materialized operands and its FLOPs run at the dtype's matmul rate.
    moves_data: a view that writes a new buffer layout (``concatenate``,
      ``pad``, ``stack``): XLA stores it for a library-call consumer.
    relayout: a view that is not a bitcast of its operand (``transpose``,
      ``slice``, ``split``): an index remap XLA fuses into its consumers, or
      writes as a copy of its own for a custom call that reads it.
    ynn_window: on XLA:CPU a YNNPACK fusion takes its elementwise producers
      and their scalar constants as full-size broadcasts (``reduce_window_sum``).
    body: what the jaxprs in its params are (see :class:`Body`).
    flops: ``rule(eqn) -> FLOPs`` (None: one FLOP per result element, or the
      body's FLOPs for an op with a body).
    known: False for the default facts of an unregistered primitive.
  """
  name: str
  fusion: Fusion = Fusion.MATERIALIZED
  shape: Shape = Shape.OTHER
  rematerializable: bool = True
  cse: bool = True
  matrix_unit: bool = False
  moves_data: bool = False
  relayout: bool = False
  ynn_window: bool = False
  body: Body = Body.NONE
  flops: FlopsRule | None = None
  known: bool = True

  @property
  def elementwise(self) -> bool:
    return self.shape is Shape.ELEMENTWISE

  @property
  def fuses_as_elementwise(self) -> bool:
    """XLA fuses it like an elementwise op (cheap or expensive), iotas and broadcasts included."""
    return self.fusion in (Fusion.CHEAP, Fusion.EXPENSIVE)


_FACTS: dict[str, PrimitiveFacts] = {}

#: The facts of a primitive the registry does not know.
DEFAULT = PrimitiveFacts("<unknown>", known=False)


def register(names: str | Iterable[str], **facts: object) -> None:
  """Registers the same facts for one or more primitive names (updating earlier ones)."""
  for name in [names] if isinstance(names, str) else names:
    old = _FACTS.get(name, PrimitiveFacts(name))
    _FACTS[name] = dataclasses.replace(old, **facts)  # type: ignore[arg-type]


def register_flops(name: str) -> Callable[[FlopsRule], FlopsRule]:
  """Decorator: registers ``rule(eqn) -> FLOPs`` for a primitive name."""
  def deco(rule: FlopsRule) -> FlopsRule:
    register(name, flops=rule)
    return rule
  return deco


def facts(name: str) -> PrimitiveFacts:
  """The facts of primitive ``name``; the :data:`DEFAULT` ones, with a warning, if unknown."""
  f = _FACTS.get(name)
  if f is not None:
    return f
  _warn_unknown(name)
  return dataclasses.replace(DEFAULT, name=name)


@functools.cache
def _warn_unknown(name: str) -> None:
  """Warns about an unregistered primitive, once per process and name."""
  warnings.warn(f"jaxmem: no facts registered for primitive `{name}`; assuming its result is "
                "stored (materialized), it is not elementwise and costs one FLOP per result "
                "element.", stacklevel=4)


def eqn_facts(eqn: _compat.JaxprEqn) -> PrimitiveFacts:
  """:func:`facts` of an equation's primitive."""
  return facts(eqn.primitive.name)


def is_known(name: str) -> bool:
  return name in _FACTS


def registered() -> Mapping[str, PrimitiveFacts]:
  """A read-only view of the whole registry."""
  return MappingProxyType(_FACTS)


def names_where(predicate: Callable[[PrimitiveFacts], bool]) -> frozenset[str]:
  """The registered primitive names whose facts satisfy ``predicate``."""
  return frozenset(n for n, f in _FACTS.items() if predicate(f))


# -- the facts ---------------------------------------------------------------------------------

_ELEMENTWISE_CHEAP = """abs add add_any and clamp convert_element_type copy copy_p eq ge gt imag
integer_pow is_finite le lt max min mul ne neg not or real reduce_precision select_n shift_left
shift_right_arithmetic shift_right_logical sign square sub xor stop_gradient nextafter
population_count round floor ceil complex conj mulhi eq_to le_to lt_to""".split()
_ELEMENTWISE_EXPENSIVE = """acos acosh asin asinh atan atan2 atanh cbrt cos cosh digamma div erf
erf_inv erfc exp exp2 expm1 lgamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh
bessel_i0e bessel_i1e igamma igammac random_gamma_grad polygamma zeta igamma_grad_a
regularized_incomplete_beta""".split()
# Fused like elementwise ops, but their result is not their operands' shape.
_CHEAP_NOT_ELEMENTWISE = "broadcast_in_dim iota tile pvary pbroadcast".split()
# split/unstack are slices and stack a concatenate of reshapes: XLA lowers
# them to those HLOs, which fuse into their consumers.
# ``name`` (``checkpoint_name``) lowers to its operand: the same buffer.
_VIEW = """reshape squeeze expand_dims transpose slice rev pad concatenate dynamic_slice
bitcast_convert_type split unstack stack name""".split()
_REDUCTIONS = """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin""".split()
_CUMULATIVE = "cumsum cumprod cummax cummin".split()
_SCATTERS = """scatter scatter-add scatter_add scatter_mul scatter_min scatter_max scatter-sub
scatter-mul scatter-min scatter-max scatter_apply""".split()
_MATERIALIZED = """dot_general conv_general_dilated ffi_call custom_call
select_and_scatter_add select_and_gather_add reduce_window_max reduce_window_min
reduce_window_sum reduce_window gather dynamic_update_slice sort top_k cumlogsumexp fft
triangular_solve cholesky lu qr eigh svd threefry2x32 random_bits random_seed random_wrap
random_unwrap random_fold_in random_split rng_bit_generator rng_uniform
pure_callback io_callback debug_callback psum all_gather reduce_scatter ppermute all_to_all
axis_index pmax pmin optimization_barrier sharding_constraint device_put mesh_cast reshard clz
approx_top_k eig geqrf geqp3 hessenberg householder_product ormqr schur tridiagonal
tridiagonal_solve cholesky_update symmetric_product lu_pivots_to_permutation ragged_dot_general
ragged_all_to_all select_and_scatter custom_linear_solve empty create_token after_all
layout_constraint psum_invariant all_gather_invariant""".split()
# Control flow and remat: one op of the flat program, with a body of its own.
_BLOCKS = "scan while cond checkpoint remat remat2 custom_lin shard_map".split()

register(_ELEMENTWISE_CHEAP, fusion=Fusion.CHEAP, shape=Shape.ELEMENTWISE)
register(_ELEMENTWISE_EXPENSIVE, fusion=Fusion.EXPENSIVE, shape=Shape.ELEMENTWISE)
register(_CHEAP_NOT_ELEMENTWISE, fusion=Fusion.CHEAP)
register(_VIEW, fusion=Fusion.VIEW)
register("bitcast_convert_type", shape=Shape.ELEMENTWISE)
register(_REDUCTIONS, fusion=Fusion.REDUCE, shape=Shape.REDUCTION)
register(_CUMULATIVE, fusion=Fusion.REDUCE, shape=Shape.CUMULATIVE)
register("reduce", fusion=Fusion.REDUCE, body=Body.COMBINER)
register(_MATERIALIZED, fusion=Fusion.MATERIALIZED)
register("clz", shape=Shape.ELEMENTWISE)
register("cumlogsumexp", shape=Shape.CUMULATIVE)
register(_SCATTERS, fusion=Fusion.MATERIALIZED, shape=Shape.SCATTER, body=Body.COMBINER)
register(["reduce_window", "select_and_scatter", "select_and_scatter_add",
          "select_and_gather_add"], body=Body.COMBINER)
register(_BLOCKS, fusion=Fusion.MATERIALIZED, body=Body.BLOCK)
register(list(_compat.INLINE_BODIES), fusion=Fusion.MATERIALIZED, body=Body.INLINE)
register(["dot_general", "conv_general_dilated"], matrix_unit=True)
register(["concatenate", "pad", "stack"], moves_data=True)
register(["transpose", "slice", "split", "unstack", "rev", "dynamic_slice"], relayout=True)
register("reduce_window_sum", ynn_window=True)
# Effects, random state, callbacks, our own custom calls and control flow: a
# second run is not the same computation, or not one whose cost is the op's own.
register(["scan", "while", "cond", "checkpoint", "remat", "remat2", "shard_map", "ffi_call",
          "custom_call", "pure_callback", "io_callback", "debug_callback", "rng_uniform",
          "random_seed", "random_bits", "random_wrap", "random_unwrap"], rematerializable=False)
# Ops whose results differ between two identical-looking calls, or that XLA
# keeps apart (custom calls, collectives, copies made on purpose).
register(["rng_bit_generator", "rng_uniform", "random_bits", "iota_2x32_shape", "ffi_call",
          "custom_call", "optimization_barrier", "copy", "copy_p", "device_put", "pure_callback",
          "io_callback", "debug_callback", "psum", "all_gather", "ppermute", "all_to_all",
          "reduce_scatter", "axis_index"], cse=False)


@register_flops("dot_general")
def _dot_general_flops(eqn: _compat.JaxprEqn) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  k = math.prod(lhs_shape[d] for d in lhs_contract)
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k


@register_flops("conv_general_dilated")
def _conv_flops(eqn: _compat.JaxprEqn) -> float:
  rhs = eqn.invars[1].aval.shape
  rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, *spatial)
  spatial = math.prod(rhs[d] for d in rhs_spec[2:])
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * rhs[rhs_spec[1]] * spatial


def out_element_flops(eqn: _compat.JaxprEqn) -> float:
  """The default FLOPs of an equation: one per result element."""
  return float(sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars))


__all__ = ["Body", "DEFAULT", "FUSIBLE_CONSUMERS", "Fusion", "PrimitiveFacts", "Shape", "eqn_facts",
           "facts", "is_known", "names_where", "out_element_flops", "register", "register_flops",
           "registered"]
