"""Device profiles: what the planners and the simulator need to price a step on a device.

Profiles carry vendor figures (cited beside each) of the GPUs the papers
measured on and of current ones; the ``cpu`` profile is static by default or
measured on the running machine (:func:`calibrate_cpu`). Papers are cited by
their short names; the bibliography is in ``docs/design.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp

from jaxmem._src.native import ops as native_ops

HALF_DTYPES = frozenset({"bfloat16", "float16"})


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fractions of a device's peak rates that each class of op achieves, and a per-copy latency.

  A roofline priced at 100% of the datasheet's FLOP/s and memory bandwidth
  but copies at a realistic fraction of their link biases every plan toward
  recomputation: it under-prices the recomputation and not the copy. Each
  class of op is therefore derated by what it really achieves on the device:

  Attributes:
    matmul: dense matmuls and convolutions, of the matrix rate
      (``flops_per_s`` / ``half_flops_per_s``).
    vector: the arithmetic of everything else, of ``vector_flops_per_s``.
    memory: memory-bound elementwise kernels (fusions, copies inside the
      device), of ``memory_bytes_per_s``.
    reduction: memory-bound reductions, of ``memory_bytes_per_s``.
    copy: device<->host copies, of the link's per-direction rate
      (``host_bytes_per_s``).
    copy_latency_s: fixed time per device<->host copy (issue and DMA setup).
    source: where the fractions come from.

  The default (every fraction 1, no latency) means the profile's rates are
  already achieved rates, as :func:`calibrate_cpu` measures them and as a
  user-built :class:`DeviceProfile` usually gives them.
  """
  matmul: float = 1.0
  vector: float = 1.0
  memory: float = 1.0
  reduction: float = 1.0
  copy: float = 1.0
  copy_latency_s: float = 0.0
  source: str = "rates given are achieved rates"

  def __post_init__(self) -> None:
    for f in ("matmul", "vector", "memory", "reduction", "copy"):
      x = getattr(self, f)
      if not 0.0 < x <= 1.0:
        raise ValueError(f"`Efficiency.{f}`={x!r} must be a fraction of the peak in (0, 1].")
    if self.copy_latency_s < 0:
      raise ValueError(f"`Efficiency.copy_latency_s`={self.copy_latency_s!r} must be >= 0.")


#: Achieved fractions on NVIDIA datacenter GPUs, from published measurements:
#:
#: * matmul 0.80: the "maximum achievable matmul FLOPS" of bf16 GEMMs over a
#:   search of shapes is 80.1% of peak on an H100 SXM, 82.2-85.9% on A100s,
#:   83.0% on a GH200 (S. Bekman, *Machine Learning Engineering*,
#:   compute/accelerator, "Maximum Achievable Matmul FLOPS comparison
#:   table"); the shapes of a model do no better than the best shape;
#: * memory 0.83: V100 streams global memory at about 750 of its 900 GB/s
#:   (Jia et al., *Dissecting the NVIDIA Volta GPU Architecture via
#:   Microbenchmarking*, 2018, §3);
#: * reduction 0.70: an assumption (a reduction's last pass writes a small
#:   result and its tree costs more than a stream); no published figure;
#: * vector 0.80: an assumption, like the matmul fraction (it rarely decides
#:   a time: elementwise kernels are memory-bound);
#: * copy 0.80, 5 us per copy: pinned-memory copies reach about 80% of a PCIe
#:   link's per-direction rate (protocol overhead); the latency of one
#:   ``cudaMemcpyAsync`` is a few microseconds.
#:
#: ``bench/cost_calibration.py`` measures these against a lent GPU's step times
#: (``bench/results/cost_calibration.md``).
GPU_EFFICIENCY = Efficiency(matmul=0.80, vector=0.80, memory=0.83, reduction=0.70, copy=0.80,
                            copy_latency_s=5e-6,
                            source="published GPU measurements (see GPU_EFFICIENCY)")

#: TPU chips: no published per-class figures; the matmul and stream fractions
#: of the GPUs are assumed, with a shorter per-copy latency (DMA engines on
#: the chip). An assumption, recorded beside every simulated TPU figure.
TPU_EFFICIENCY = Efficiency(matmul=0.80, vector=0.80, memory=0.83, reduction=0.70, copy=0.80,
                            copy_latency_s=2e-6, source="assumed as for GPUs (see TPU_EFFICIENCY)")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """What the planners and the simulator need to price a step on a device.

  The first three fields are what a planner needs to weigh recomputation
  against copies; the rest make the roofline
  (:func:`jaxmem._src.estimate.cost.eqn_seconds`).

  Attributes:
    name: profile name.
    flops_per_s: dense matmul/convolution rate for float32 operands as JAX
      runs them by default (TF32 tensor cores where the GPU has them).
    host_bytes_per_s: device<->host link rate, one direction (the built-in
      profiles give the link's theoretical rate; ``efficiency.copy`` derates it).
    half_flops_per_s: dense matmul rate for bfloat16/float16 operands.
    vector_flops_per_s: rate of everything else (elementwise, reductions).
    memory_bytes_per_s: device memory bandwidth.
    memory_bytes: device memory capacity.
    op_overhead_s: fixed cost per executed op (kernel launch, dispatch).
    duplex: device->host and host->device copies run at full rate at once.
    source: where the figures come from.
    efficiency: what fraction of each rate an op class achieves
      (:class:`Efficiency`; the default says the rates are achieved rates).
    fuses_into_convolutions: the compiler computes an elementwise producer
      (a BatchNorm's scale and shift, a ReLU) inside the convolution that
      reads it, so a ``jax.checkpoint`` body is priced with it fused
      (XLA:TPU's convolution fusions). False: the convolution reads it from
      memory (XLA:GPU's cuDNN calls and XLA:CPU's library calls take no
      fused producers; ``cost._body_fused``).
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
  efficiency: Efficiency = Efficiency()
  fuses_into_convolutions: bool = False

  def __post_init__(self) -> None:
    if isinstance(self.efficiency, Mapping):     # read back from JSON (calibrate_cpu's cache)
      object.__setattr__(self, "efficiency", Efficiency(**self.efficiency))
    if not isinstance(self.efficiency, Efficiency):
      raise TypeError(f"`DeviceProfile.efficiency` must be a `jaxmem.Efficiency`, got "
                      f"{type(self.efficiency).__name__}.")

  def matmul_rate(self, dtype: str) -> float:
    """Achieved dense matmul rate for operands of ``dtype`` (peak x ``efficiency.matmul``)."""
    if dtype in HALF_DTYPES and self.half_flops_per_s:
      return self.half_flops_per_s * self.efficiency.matmul
    return self.flops_per_s * self.efficiency.matmul

  @property
  def vector_rate(self) -> float:
    """Achieved rate of non-matrix arithmetic (peak x ``efficiency.vector``)."""
    return (self.vector_flops_per_s or self.flops_per_s / 8) * self.efficiency.vector

  def _memory_rate(self, fraction: float) -> float | None:
    return self.memory_bytes_per_s * fraction if self.memory_bytes_per_s else None

  @property
  def stream_bytes_per_s(self) -> float | None:
    """Achieved device-memory bandwidth of elementwise kernels (``None``: not modelled)."""
    return self._memory_rate(self.efficiency.memory)

  @property
  def reduction_bytes_per_s(self) -> float | None:
    """Achieved device-memory bandwidth of reductions (``None``: not modelled)."""
    return self._memory_rate(self.efficiency.reduction)

  @property
  def copy_bytes_per_s(self) -> float:
    """Achieved device<->host rate, one direction (link x ``efficiency.copy``)."""
    return self.host_bytes_per_s * self.efficiency.copy

  def copy_seconds(self, nbytes: float) -> float:
    """Seconds to copy ``nbytes`` between device and host (one direction), latency included."""
    return self.efficiency.copy_latency_s + nbytes / self.copy_bytes_per_s


_GiB = 1 << 30

# Vendor figures (dense, no sparsity). Host links are PCIe unless noted, at
# their theoretical per-direction rate; what each class of op achieves of
# these peaks is the profile's `efficiency` (GPU_EFFICIENCY, TPU_EFFICIENCY).
PROFILES: Mapping[str, DeviceProfile] = MappingProxyType({
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): TF32 494.7, BF16 989.4,
    # FP32 66.9 TFLOP/s (dense), HBM3 3.35 TB/s, 80 GB, PCIe Gen5 x16 64 GB/s.
    "h100-sxm": DeviceProfile("h100-sxm", 494.7e12, 64e9, 989.4e12, 66.9e12, 3.35e12,
                              80 * 10**9, 4e-6, True,
                              "NVIDIA H100 datasheet (SXM5); PCIe Gen5 x16", GPU_EFFICIENCY),
    # Same datasheet (PCIe card): TF32 378, BF16 756, FP32 51.2 TFLOP/s,
    # HBM2e 2.0 TB/s, 80 GB, PCIe Gen5 x16.
    "h100-pcie": DeviceProfile("h100-pcie", 378e12, 64e9, 756e12, 51.2e12, 2.0e12,
                               80 * 10**9, 4e-6, True,
                               "NVIDIA H100 datasheet (PCIe); PCIe Gen5 x16", GPU_EFFICIENCY),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): TF32 494.7, BF16 989.4,
    # FP32 67 TFLOP/s (dense), HBM3e 4.8 TB/s, 141 GB, PCIe Gen5 x16 (the GPU
    # lent to this project in its stop 41: bench/results/gpu.md).
    "h200": DeviceProfile("h200", 494.7e12, 64e9, 989.4e12, 67e12, 4.8e12, 141 * 10**9, 4e-6,
                          True, "NVIDIA H200 datasheet (SXM); PCIe Gen5 x16", GPU_EFFICIENCY),
    # NVIDIA A100 Tensor Core GPU datasheet (40GB SXM4): TF32 156, BF16 312,
    # FP32 19.5 TFLOP/s, HBM2 1.555 TB/s, PCIe Gen4 x16 32 GB/s.
    "a100-40g": DeviceProfile("a100-40g", 156e12, 32e9, 312e12, 19.5e12, 1.555e12,
                              40 * 10**9, 5e-6, True,
                              "NVIDIA A100 datasheet (40GB SXM4); PCIe Gen4 x16", GPU_EFFICIENCY),
    # The machine of Hayakawa et al.'s window-based out-of-core training: Tesla
    # V100 16 GB (SXM2) on IBM POWER9 with two NVLink 2.0 links to the CPU,
    # "each can transfer memory at 50GB/s" (§5).
    # V100 datasheet: FP32 15.7 TFLOP/s (no TF32), FP16 tensor 125, HBM2 900 GB/s.
    "v100": DeviceProfile("v100", 15.7e12, 2 * 25e9, 125e12, 15.7e12, 900e9, 16 * _GiB,
                          5e-6, True,
                          "NVIDIA V100 datasheet (SXM2 16GB); 2x NVLink 2.0 to POWER9 "
                          "(Hayakawa et al.)", GPU_EFFICIENCY),
    # The GPU of the DQN planner and of SmartPool/AutoSwap (Zhang et al.):
    # GeForce GTX 1080 Ti, 11 GB. NVIDIA specs: FP32 11.34 TFLOP/s (no tensor
    # cores), GDDR5X 484 GB/s, PCIe Gen3 x16 (16 GB/s).
    "gtx-1080ti": DeviceProfile("gtx-1080ti", 11.34e12, 16e9, 11.34e12, 11.34e12, 484e9,
                                11 * _GiB, 5e-6, True,
                                "NVIDIA GTX 1080 Ti specs; PCIe Gen3 x16 (DQN planner, "
                                "SmartPool/AutoSwap)", GPU_EFFICIENCY),
    # Layrub's (Jin et al.) and vDNN's (Rhu et al.) GPU: Tesla K40, 12 GB,
    # "single precision throughput of 5 TFLOPS, memory bandwidth (max 288
    # GB/sec)", PCIe gen3 "maximum 16 GB/sec" (vDNN §5). One copy engine
    # direction at a time is not modelled: K40 has two copy engines.
    "k40": DeviceProfile("k40", 5.0e12, 16e9, 5.0e12, 5.0e12, 288e9, 12 * _GiB, 5e-6, True,
                         "Tesla K40 as quoted by Layrub and vDNN; PCIe Gen3 x16", GPU_EFFICIENCY),
    # TPU chips (the ahead-of-time targets of jaxmem._src.estimate.targets),
    # per chip, from Google Cloud's TPU system-architecture pages (v4, v5e,
    # v5p, v6e): peak bf16 matmul, HBM capacity and bandwidth. JAX's default
    # matmul precision on TPU runs float32 operands as one bf16 pass, so the
    # float32 rate is the bf16 rate. The vector unit's rate and the host link
    # are not published per chip: the vector rate is left at 1/8 of the matrix
    # rate (DeviceProfile.vector_rate), and the link is taken as PCIe Gen4 x16
    # (32 GB/s per direction) for every generation -- an assumption,
    # which bench/results records beside every simulated figure.
    "tpu-v4": DeviceProfile("tpu-v4", 275e12, 32e9, 275e12, None, 1200e9, 32 * _GiB,
                            1e-6, True, "Cloud TPU v4 (275 TFLOP/s bf16, 32 GiB, 1200 GB/s); "
                            "host link assumed PCIe Gen4 x16", TPU_EFFICIENCY, True),
    "tpu-v5e": DeviceProfile("tpu-v5e", 197e12, 32e9, 197e12, None, 819e9, 16 * _GiB,
                             1e-6, True, "Cloud TPU v5e (197 TFLOP/s bf16, 16 GiB, 819 GB/s); "
                             "host link assumed PCIe Gen4 x16", TPU_EFFICIENCY, True),
    "tpu-v5p": DeviceProfile("tpu-v5p", 459e12, 32e9, 459e12, None, 2765e9, 95 * _GiB,
                             1e-6, True, "Cloud TPU v5p (459 TFLOP/s bf16, 95 GiB, 2765 GB/s); "
                             "host link assumed PCIe Gen4 x16", TPU_EFFICIENCY, True),
    "tpu-v6e": DeviceProfile("tpu-v6e", 918e12, 32e9, 918e12, None, 1640e9, 32 * _GiB,
                             1e-6, True, "Cloud TPU v6e (918 TFLOP/s bf16, 32 GiB, 1640 GB/s); "
                             "host link assumed PCIe Gen4 x16", TPU_EFFICIENCY, True),
    # Not a device: every FLOP at one rate (1 TFLOP/s, matmul or elementwise,
    # as XLA's `cost_analysis()["flops"]` counts them) and memory traffic free,
    # so a plan's simulated overhead is its extra FLOPs. For targets whose
    # step time nobody measured (TPU chips compiled ahead of time here) and
    # for users who judge a plan by the compiled program's FLOPs. A host copy
    # costs what a v5e's bf16 rate over the assumed PCIe Gen4 x16 link makes
    # it: one byte, about 6,000 FLOPs.
    "flops": DeviceProfile("flops", 1e12, 1e12 * 32e9 / 197e12, 1e12, 1e12, None, None, 0.0,
                           True, "FLOP count only (memory traffic free); host copies at a "
                           "v5e's FLOPs per byte of PCIe Gen4 x16"),
})

# The default ``cpu`` profile: a 2-core x86 VM, FP32 GEMM ~50 GFLOP/s, memcpy
# ~10 GB/s (calibrate_cpu on this machine measures 2-4x faster matmuls).
STATIC_CPU = DeviceProfile("cpu", 5e10, 1e10, 5e10, 5e9, 1e10, None, 2e-6, False,
                           "static default (JAXMEM_CPU_PROFILE=measured measures instead)")


def _cache_path() -> str:
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
  path = _cache_path()
  if cache and os.path.exists(path):
    try:
      data = json.loads(open(path).read())
      return DeviceProfile(**data)
    except (OSError, ValueError, TypeError):
      pass

  def best(fn: Callable[[], jax.Array]) -> float:
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
  buf = jnp.ones((8 * 1024 * 1024,), jnp.float32)
  rt = jax.jit(lambda b: native_ops.fetch(native_ops.offload(b), b[:1], shape=b.shape,
                                          dtype=b.dtype))
  copy_bw = 2 * buf.nbytes / best(lambda: rt(buf))   # a D2H and an H2D copy
  prof = DeviceProfile("cpu", flops, copy_bw, flops, vec, mem_bw, None, 2e-6, False,
                       "measured by jaxmem._src.estimate.devices.calibrate_cpu on "
                       f"{time.strftime('%Y-%m-%d')}")
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
  if os.environ.get("JAXMEM_CPU_PROFILE", "static").lower() != "measured":
    return STATIC_CPU
  return _measured_cpu()


@functools.cache
def _measured_cpu() -> DeviceProfile:
  """:func:`calibrate_cpu` once per process (it reads its disk cache after the first run)."""
  return calibrate_cpu()


# `jax.Device.device_kind` substrings -> profile, most specific first.
_KINDS = (("h100 pcie", "h100-pcie"), ("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-40g"),
          ("v100", "v100"), ("1080 ti", "gtx-1080ti"), ("k40", "k40"),
          ("tpu v5 lite", "tpu-v5e"), ("tpu v6 lite", "tpu-v6e"), ("tpu v5", "tpu-v5p"),
          ("tpu v4", "tpu-v4"))


def profile_for_kind(kind: str) -> str:
  """The profile name for a ``jax.Device.device_kind`` (``"NVIDIA H100 PCIe"`` -> ``h100-pcie``).

  Unknown accelerators get ``h100-sxm``; pass ``device=`` to price for another.

  Example:
    >>> profile_for_kind("NVIDIA H100 PCIe"), profile_for_kind("Tesla V100-SXM2-16GB")
    ('h100-pcie', 'v100')
  """
  k = kind.lower()
  return next((name for key, name in _KINDS if key in k), "h100-sxm")


#: What a ``device=`` argument takes: a profile name, a profile, or None (the backend's).
DeviceLike = str | DeviceProfile | None


def device_profile(device: DeviceLike) -> DeviceProfile:
  """Looks up a device profile by name (default: the current JAX backend).

  Names: ``cpu`` (see :func:`cpu_profile`), ``h100-sxm``, ``h100-pcie``, ``h200``,
  ``a100-40g``, ``v100``, ``gtx-1080ti``, ``k40``, ``tpu-v4``, ``tpu-v5e``,
  ``tpu-v5p``, ``tpu-v6e``, and ``flops`` (no device: FLOPs only, memory
  traffic free; a plan's overhead is its extra FLOPs).

  Example:
    >>> device_profile("k40").memory_bytes_per_s
    288000000000.0
  """
  if isinstance(device, DeviceProfile):
    return device
  if device is None:
    device = "cpu" if jax.default_backend() == "cpu" else profile_for_kind(
        jax.devices()[0].device_kind)
  if device == "cpu":
    return cpu_profile()
  try:
    return PROFILES[device]
  except KeyError:
    raise ValueError(f"`device`={device!r} is not a known profile; use one of "
                     f"{sorted(['cpu', *PROFILES])} or pass a `jaxmem.DeviceProfile`.") from None
