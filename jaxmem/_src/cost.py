"""Per-equation cost rules (FLOPs) and device profiles used by the planners.

A small rule registry in the style of ``jax.experimental.roofline``: a rule per
primitive, a default rule for everything else (one FLOP per output element),
and a warning the first time an unknown higher-order primitive is met. The full
cost model (bytes, roofline, calibrated profiles) grows here (issue 5).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import numpy as np

from jaxmem._src import _compat

FlopsRule = Callable[[Any], float]
_RULES: dict[str, FlopsRule] = {}
_WARNED: set[str] = set()


def register_flops_rule(primitive_name: str) -> Callable[[FlopsRule], FlopsRule]:
  """Registers ``rule(eqn) -> flops`` for a primitive name."""
  def deco(rule: FlopsRule) -> FlopsRule:
    _RULES[primitive_name] = rule
    return rule
  return deco


def _size(aval: Any) -> int:
  shape = getattr(aval, "shape", ())
  return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _out_elems(eqn: Any) -> float:
  return float(sum(_size(v.aval) for v in eqn.outvars))


@register_flops_rule("dot_general")
def _dot_general(eqn: Any) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  k = int(np.prod([lhs_shape[d] for d in lhs_contract], dtype=np.int64)) if lhs_contract else 1
  return 2.0 * _size(eqn.outvars[0].aval) * k


@register_flops_rule("conv_general_dilated")
def _conv(eqn: Any) -> float:
  rhs = eqn.invars[1].aval.shape
  dn = eqn.params["dimension_numbers"]
  rhs_spec = dn.rhs_spec  # (out_features, in_features, *spatial)
  in_feat = rhs[rhs_spec[1]]
  spatial = int(np.prod([rhs[d] for d in rhs_spec[2:]], dtype=np.int64))
  return 2.0 * _size(eqn.outvars[0].aval) * in_feat * spatial


_OPAQUE = {"scan", "while", "cond", "checkpoint", "remat", "remat2", "custom_lin", "shard_map"}
# Primitives whose params hold a scalar combiner jaxpr, not a body to run: one
# combiner application per output element (the default rule).
_COMBINERS = {"scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min",
              "scatter_max", "scatter_apply", "reduce_window", "select_and_scatter",
              "select_and_gather_add", "reduce", "sort", "argsort", "reduce_precision"}


def eqn_flops(eqn: Any) -> float:
  """FLOPs of one equation (nested bodies: summed once, loops: times trip count)."""
  rule = _RULES.get(eqn.primitive.name)
  if rule is not None:
    return rule(eqn)
  subs = _compat.sub_jaxprs(eqn) if eqn.primitive.name not in _COMBINERS else []
  if subs:
    inner = sum(eqn_flops(e) for j in subs for e in j.eqns)
    trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    if eqn.primitive.name not in _OPAQUE and eqn.primitive.name not in _WARNED:
      _WARNED.add(eqn.primitive.name)
      warnings.warn(f"jaxmem.cost: no FLOPs rule for higher-order primitive "
                    f"`{eqn.primitive.name}`; summing its body once.", stacklevel=2)
    return float(inner) * trips
  return _out_elems(eqn)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """What the planner needs to price a decision.

  Attributes:
    name: profile name.
    flops_per_s: sustained dense FLOP rate.
    host_bytes_per_s: device<->host copy bandwidth (one direction).
  """
  name: str
  flops_per_s: float
  host_bytes_per_s: float


# CPU: our host store copies are memcpy (~10 GB/s on one core); 2-core FP32
# GEMM on this class of machine is ~50 GFLOP/s. Refined by calibration in issue 5.
# H100 SXM: 989 TFLOP/s dense BF16 (NVIDIA H100 datasheet), PCIe Gen5 x16 64 GB/s
# per direction theoretical, ~50 GB/s achieved.
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", 5e10, 1e10),
    "h100-sxm": DeviceProfile("h100-sxm", 9.89e14, 5.0e10),
}


def device_profile(device: str | DeviceProfile | None) -> DeviceProfile:
  """Looks up a device profile by name (default: the current JAX backend)."""
  if isinstance(device, DeviceProfile):
    return device
  if device is None:
    import jax
    device = "cpu" if jax.default_backend() == "cpu" else "h100-sxm"
  try:
    return PROFILES[device]
  except KeyError:
    raise ValueError(f"`device`={device!r} is not a known profile; use one of "
                     f"{sorted(PROFILES)} or pass a `jaxmem.DeviceProfile`.") from None
