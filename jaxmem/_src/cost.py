"""Cost model: per-equation FLOPs and bytes, device profiles, a roofline time per op.

A small rule registry in the style of ``jax.experimental.roofline``: a FLOPs
rule per primitive, a default rule for everything else (one FLOP per output
element), and a warning the first time an unknown higher-order primitive is
met. Bytes are operands read plus results written. Device profiles carry the
vendor figures (cited beside each) of the GPUs the papers measured on and of
current ones; the ``cpu`` profile is measured on the running machine.
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


_OPAQUE = {"scan", "while", "cond", "checkpoint", "remat", "remat2", "custom_lin", "shard_map",
           # calls whose body runs once where they stand
           "pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
           "custom_vjp_call_jaxpr"}
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


def _nbytes(atoms: Any) -> int:
  return sum(_compat.aval_nbytes(getattr(a, "aval", None)) for a in atoms)


def eqn_bytes(eqn: Any) -> float:
  """Device-memory bytes one equation moves if nothing is fused: operands read, results written."""
  return float(_nbytes(eqn.invars) + _nbytes(eqn.outvars))


_MATRIX_UNITS = {"dot_general", "conv_general_dilated"}
_HALF = {"bfloat16", "float16"}


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """What the planners and the simulator need to price a step on a device.

  The first three fields are what a planner needs to weigh recomputation
  against copies; the rest make the roofline (:func:`eqn_seconds`).

  Attributes:
    name: profile name.
    flops_per_s: dense matmul/convolution rate for float32 operands as JAX
      runs them by default (TF32 tensor cores where the GPU has them).
    host_bytes_per_s: achievable device<->host copy bandwidth, one direction.
    half_flops_per_s: dense matmul rate for bfloat16/float16 operands.
    vector_flops_per_s: rate of everything else (elementwise, reductions).
    memory_bytes_per_s: device memory bandwidth.
    memory_bytes: device memory capacity.
    op_overhead_s: fixed cost per executed op (kernel launch, dispatch).
    duplex: device->host and host->device copies run at full rate at once.
    source: where the figures come from.
  """
  name: str
  flops_per_s: float
  host_bytes_per_s: float
  half_flops_per_s: float | None = None
  vector_flops_per_s: float | None = None
  memory_bytes_per_s: float | None = None
  memory_bytes: int | None = None
  op_overhead_s: float = 0.0
  duplex: bool = True
  source: str = ""

  def matmul_rate(self, dtype: str) -> float:
    if dtype in _HALF and self.half_flops_per_s:
      return self.half_flops_per_s
    return self.flops_per_s

  @property
  def vector_rate(self) -> float:
    return self.vector_flops_per_s or self.flops_per_s / 8

  def copy_seconds(self, nbytes: float) -> float:
    """Seconds to copy ``nbytes`` between device and host (one direction)."""
    return nbytes / self.host_bytes_per_s


def _body_seconds(eqn: Any, profile: DeviceProfile) -> float | None:
  """Time of an op with a body (scan, remat, cond...): its equations' times, ``None`` otherwise."""
  name = eqn.primitive.name
  if name in _COMBINERS:
    return None
  subs = _compat.sub_jaxprs(eqn)
  if not subs:
    return None
  from jaxmem._src.xla_model import FUSION_RULES, Fusion
  fusible = (Fusion.CHEAP, Fusion.EXPENSIVE, Fusion.VIEW)

  def body_time(j: Any) -> float:
    # As at top level: an elementwise result read only inside the body is fused
    # into its consumer; the body's results are stored.
    outs = {id(v) for v in j.outvars}
    return sum(eqn_seconds(e, profile, fused=FUSION_RULES.get(e.primitive.name) in fusible
                           and not any(id(v) in outs for v in e.outvars))
               for e in j.eqns)

  per_body = [body_time(j) for j in subs]
  if name == "cond":
    return max(per_body)            # one branch runs; price the slowest
  trips = eqn.params.get("length", 1) if name == "scan" else 1
  return float(sum(per_body)) * trips


def eqn_seconds(eqn: Any, profile: DeviceProfile, *, fused: bool = False) -> float:
  """Roofline time of one equation: ``max(FLOPs / rate, bytes / bandwidth) + overhead``.

  ``fused``: XLA fuses the op into its consumer, so it moves no bytes of its
  own and costs no launch (only its arithmetic). An op with a body (``scan``,
  ``jax.checkpoint``, ``cond``...) costs the time of the equations inside it
  (a loop body times its trip count, the slowest ``cond`` branch).
  """
  body = _body_seconds(eqn, profile)
  if body is not None:
    return body
  flops = eqn_flops(eqn)
  name = eqn.primitive.name
  if name in _MATRIX_UNITS:
    dtype = str(getattr(eqn.invars[0].aval, "dtype", ""))
    compute = flops / profile.matmul_rate(dtype)
  else:
    compute = flops / profile.vector_rate
  if fused:
    return compute
  memory = eqn_bytes(eqn) / profile.memory_bytes_per_s if profile.memory_bytes_per_s else 0.0
  return max(compute, memory) + profile.op_overhead_s


_GiB = 1 << 30

# Vendor figures (dense, no sparsity). Host links are PCIe unless noted; the
# achievable rate is taken as 80% of the link's theoretical per-direction rate.
PROFILES: dict[str, DeviceProfile] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): TF32 494.7, BF16 989.4,
    # FP32 66.9 TFLOP/s (dense), HBM3 3.35 TB/s, 80 GB, PCIe Gen5 x16 64 GB/s.
    "h100-sxm": DeviceProfile("h100-sxm", 494.7e12, 0.8 * 64e9, 989.4e12, 66.9e12, 3.35e12,
                              80 * 10**9, 4e-6, True,
                              "NVIDIA H100 datasheet (SXM5); PCIe Gen5 x16"),
    # Same datasheet (PCIe card): TF32 378, BF16 756, FP32 51.2 TFLOP/s,
    # HBM2e 2.0 TB/s, 80 GB, PCIe Gen5 x16.
    "h100-pcie": DeviceProfile("h100-pcie", 378e12, 0.8 * 64e9, 756e12, 51.2e12, 2.0e12,
                               80 * 10**9, 4e-6, True,
                               "NVIDIA H100 datasheet (PCIe); PCIe Gen5 x16"),
    # NVIDIA A100 Tensor Core GPU datasheet (40GB SXM4): TF32 156, BF16 312,
    # FP32 19.5 TFLOP/s, HBM2 1.555 TB/s, PCIe Gen4 x16 32 GB/s.
    "a100-40g": DeviceProfile("a100-40g", 156e12, 0.8 * 32e9, 312e12, 19.5e12, 1.555e12,
                              40 * 10**9, 5e-6, True,
                              "NVIDIA A100 datasheet (40GB SXM4); PCIe Gen4 x16"),
    # Paper 001's machine: Tesla V100 16 GB (SXM2) on IBM POWER9 with two
    # NVLink 2.0 links to the CPU, "each can transfer memory at 50GB/s" (§5).
    # V100 datasheet: FP32 15.7 TFLOP/s (no TF32), FP16 tensor 125, HBM2 900 GB/s.
    "v100": DeviceProfile("v100", 15.7e12, 0.8 * 2 * 25e9, 125e12, 15.7e12, 900e9, 16 * _GiB,
                          5e-6, True,
                          "NVIDIA V100 datasheet (SXM2 16GB); 2x NVLink 2.0 to POWER9 (paper 001)"),
    # Papers 000 and 003: GeForce GTX 1080 Ti, 11 GB. NVIDIA specs: FP32 11.34
    # TFLOP/s (no tensor cores), GDDR5X 484 GB/s, PCIe Gen3 x16 (16 GB/s).
    "gtx-1080ti": DeviceProfile("gtx-1080ti", 11.34e12, 0.8 * 16e9, 11.34e12, 11.34e12, 484e9,
                                11 * _GiB, 5e-6, True,
                                "NVIDIA GTX 1080 Ti specs; PCIe Gen3 x16 (papers 000, 003)"),
    # Papers 002 and 004: Tesla K40, 12 GB, "single precision throughput of
    # 5 TFLOPS, memory bandwidth (max 288 GB/sec)", PCIe gen3 "maximum 16
    # GB/sec" (paper 004 §5). One copy engine direction at a time is not
    # modelled: K40 has two copy engines.
    "k40": DeviceProfile("k40", 5.0e12, 0.8 * 16e9, 5.0e12, 5.0e12, 288e9, 12 * _GiB, 5e-6, True,
                         "Tesla K40 as quoted in papers 002 and 004; PCIe Gen3 x16"),
}

# The default ``cpu`` profile: a 2-core x86 VM, FP32 GEMM ~50 GFLOP/s, memcpy
# ~10 GB/s (calibrate_cpu on this machine measures 2-4x faster matmuls).
STATIC_CPU = DeviceProfile("cpu", 5e10, 1e10, 5e10, 5e9, 1e10, None, 2e-6, False,
                           "static default (JAXMEM_CPU_PROFILE=measured measures instead)")
_CALIBRATED: DeviceProfile | None = None


def _cache_path() -> str:
  import os
  import platform

  import jax
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  key = f"{platform.node()}-{os.cpu_count()}-jax{jax.__version__}".replace(os.sep, "_")
  return os.path.join(base, "jaxmem", f"cpu-profile-{key}.json")


def calibrate_cpu(*, repeats: int = 5, cache: bool = True) -> DeviceProfile:
  """Measures this machine's CPU profile (matmul rate, vector rate, memory and copy bandwidth).

  Times, with ``jax.jit`` on the default CPU backend, a 1024x1024 float32
  matmul (dense rate), an elementwise ``x * y + x`` over 16 MiB (memory
  bandwidth; its FLOPs give the vector rate) and a native host-store round
  trip of 32 MiB (the copy jaxmem's offload performs). Best of ``repeats``.
  The result is cached per machine and JAX version under
  ``~/.cache/jaxmem`` so that plans are reproducible on one machine; pass
  ``cache=False`` to measure again.

  Example:
    >>> prof = calibrate_cpu(cache=False)
    >>> prof.flops_per_s > 1e8 and prof.host_bytes_per_s > 1e8
    True
  """
  import json
  import os
  import time

  import jax
  import jax.numpy as jnp

  path = _cache_path()
  if cache and os.path.exists(path):
    try:
      data = json.loads(open(path).read())
      return DeviceProfile(**data)
    except (OSError, ValueError, TypeError):
      pass

  def best(fn: Callable[[], Any]) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times.append(time.perf_counter() - t)
    return min(times)

  a = jnp.ones((1024, 1024), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  flops = 2.0 * 1024 ** 3 / best(lambda: matmul(a))
  n = 4 * 1024 * 1024
  x = jnp.ones((n,), jnp.float32)
  y = jnp.full((n,), 2.0, jnp.float32)
  fma = jax.jit(lambda x, y: x * y + x)
  t = best(lambda: fma(x, y))
  mem_bw = 3 * 4 * n / t
  vec = 2.0 * n / t
  copy_bw = mem_bw / 2
  try:
    from jaxmem._src import native
    buf = jnp.ones((8 * 1024 * 1024,), jnp.float32)
    rt = jax.jit(lambda b: native.fetch(native.offload(b), b[:1]))
    copy_bw = 2 * buf.nbytes / best(lambda: rt(buf))   # a D2H and an H2D copy
  except Exception:  # noqa: BLE001 (no extension: fall back to memory bandwidth)
    pass
  prof = DeviceProfile("cpu", flops, copy_bw, flops, vec, mem_bw, None, 2e-6, False,
                       f"measured by jaxmem.cost.calibrate_cpu on {time.strftime('%Y-%m-%d')}")
  if cache:
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        json.dump(dataclasses.asdict(prof), f)
    except OSError:
      pass
  return prof


def cpu_profile() -> DeviceProfile:
  """The ``cpu`` profile.

  Fixed figures (:data:`STATIC_CPU`) unless ``JAXMEM_CPU_PROFILE=measured``,
  which measures this machine once (see :func:`calibrate_cpu`, cached on
  disk). The planners' choices depend on the ratio of compute to copy speed,
  so the measured profile is opt-in until the planners are evaluated with it.
  """
  import os
  global _CALIBRATED
  if os.environ.get("JAXMEM_CPU_PROFILE", "static").lower() != "measured":
    return STATIC_CPU
  if _CALIBRATED is None:
    _CALIBRATED = calibrate_cpu()
  return _CALIBRATED


# `jax.Device.device_kind` substrings -> profile, most specific first.
_KINDS = (("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100", "a100-40g"),
          ("v100", "v100"), ("1080 ti", "gtx-1080ti"), ("k40", "k40"))


def profile_for_kind(kind: str) -> str:
  """The profile name for a ``jax.Device.device_kind`` (``"NVIDIA H100 PCIe"`` -> ``h100-pcie``).

  Unknown accelerators get ``h100-sxm``; pass ``device=`` to price for another.

  Example:
    >>> profile_for_kind("NVIDIA H100 PCIe"), profile_for_kind("Tesla V100-SXM2-16GB")
    ('h100-pcie', 'v100')
  """
  k = kind.lower()
  return next((name for key, name in _KINDS if key in k), "h100-sxm")


def device_profile(device: str | DeviceProfile | None) -> DeviceProfile:
  """Looks up a device profile by name (default: the current JAX backend).

  Names: ``cpu`` (see :func:`cpu_profile`), ``h100-sxm``, ``h100-pcie``,
  ``a100-40g``, ``v100``, ``gtx-1080ti``, ``k40``.

  Example:
    >>> device_profile("k40").memory_bytes_per_s
    288000000000.0
  """
  if isinstance(device, DeviceProfile):
    return device
  if device is None:
    import jax
    device = "cpu" if jax.default_backend() == "cpu" else profile_for_kind(
        jax.devices()[0].device_kind)
  if device == "cpu":
    return cpu_profile()
  try:
    return PROFILES[device]
  except KeyError:
    raise ValueError(f"`device`={device!r} is not a known profile; use one of "
                     f"{sorted(['cpu', *PROFILES])} or pass a `jaxmem.DeviceProfile`.") from None
