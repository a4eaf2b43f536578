"""Targets: the device a plan is verified for, compiled ahead of time when it is not here.

A budget belongs to the device the user trains on (``docs/design.md``,
"Targets and backends"). A :class:`Target` names that device's compiler and
its chip: ``"local"`` is whatever ``jax.devices()`` gives; ``"tpu:v5e"``,
``"tpu:v5p"``, ``"tpu:v6e"`` and ``"tpu:v4"`` are TPU chips that libtpu
(``pip install "jax[tpu]"``) compiles for on a machine without a TPU, through
``jax.experimental.topologies``. A suffix picks a slice topology
(``"tpu:v5e:2x2"``: 4 chips); the budget is per device. ``"gpu:h100"`` and
``"gpu:a100"`` are NVIDIA GPUs that jax's CUDA plugin (``pip install
"jax[cuda12]"``) compiles for on a machine without a GPU: XLA:GPU's deviceless
compilation, from the device description a GPU reports
(:data:`GPU_TARGET_CONFIGS`).

The target decides three things downstream: which compiler's
:func:`~jaxmem._src.estimate.xla_model.op_fusion_kind` rules the estimate
applies (``backend``), which :class:`~jaxmem._src.estimate.devices.DeviceProfile`
the simulator prices a plan with (``profile``), and which devices the step's
arguments are placed on for the ahead-of-time compile (:meth:`Target.place`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax

from jaxmem._src import _compat


@dataclasses.dataclass(frozen=True)
class Chip:
  """A chip compiled for ahead of time: a TPU generation (libtpu) or an NVIDIA GPU (XLA:GPU).

  Attributes:
    name: the short name in target strings (``v5e``, ``h100``).
    topology: ``topology_name`` of one chip (``v5e:1x1``; ``1x1x1`` for a GPU).
    bounds: ``chips_per_host_bounds`` of that one-chip topology.
    multi_bounds: ``chips_per_host_bounds`` of multi-chip slices.
    device_kind: what ``jax.Device.device_kind`` says on that chip.
    profile: the :data:`~jaxmem._src.estimate.devices.PROFILES` entry that prices it.
    platform: ``"tpu"`` or ``"gpu"``.
    on_chip_bytes: on-chip memory XLA sets aside for temporaries, outside the
      HBM that ``memory_analysis()`` counts (see :data:`ON_CHIP_MIB`; 0 on a GPU).
  """
  name: str
  topology: str
  bounds: tuple[int, int, int]
  multi_bounds: tuple[int, int, int]
  device_kind: str
  profile: str
  platform: str = "tpu"

  @property
  def on_chip_bytes(self) -> int:
    return ON_CHIP_MIB.get(self.name, 0) * 2 ** 20


#: On-chip memory XLA:TPU allocates for temporaries (a ``preallocated-temp``
#: allocation of memory color 1, VMEM, or on v4 color 3) in the buffer
#: assignment of a tanh MLP step (8 layers of 512, batch 8192; libtpu
#: 0.0.42.1). Buffers placed there for part of their life do not count in the
#: HBM peak; how much of it relieves the HBM peak varies (on a 16-layer MLP of
#: width 1024 the v6e kept its HBM temporaries as large as without it), which
#: ``bench/tpu_estimate.py`` measures.
ON_CHIP_MIB: Mapping[str, int] = MappingProxyType({"v5e": 112, "v6e": 95, "v5p": 45, "v4": 64})


#: TPU chips compiled for here (jax 0.10.2 + libtpu 0.0.42.1, all checked by
#: ``tests/verify/test_targets.py``). v4 has two TensorCores per chip that
#: libtpu shows as two devices; the budget is per device.
CHIPS: Mapping[str, Chip] = MappingProxyType({
    "v5e": Chip("v5e", "v5e:1x1", (1, 1, 1), (2, 2, 1), "TPU v5 lite", "tpu-v5e"),
    "v6e": Chip("v6e", "v6e:1x1", (1, 1, 1), (2, 2, 1), "TPU v6 lite", "tpu-v6e"),
    "v5p": Chip("v5p", "v5p:1x1x1", (1, 1, 1), (2, 2, 1), "TPU v5", "tpu-v5p"),
    "v4": Chip("v4", "v4:1x1x1", (1, 1, 1), (2, 2, 1), "TPU v4", "tpu-v4"),
})


#: The device descriptions XLA:GPU compiles against without a GPU (the
#: ``target_config`` of ``jax.experimental.topologies.get_topology_desc``, a
#: ``stream_executor.GpuTargetConfigProto`` in text form; on a GPU,
#: ``jax.lib.xla_client.get_topology_for_devices(jax.devices()).target_config``
#: prints that GPU's). h100: an H100 SXM 80GB HBM3 (132 SMs, 50 MiB L2,
#: compute capability 9.0), the description published in jax-ml/jax#28376; its
#: compiled peaks were checked against the same steps compiled on an H100 of
#: the device machine (``bench/results/gpu_aot.md``: 7 of 12 within 2.5%).
#: a100: an A100 SXM 40GB from NVIDIA's published figures (108 SMs, 40 MiB L2,
#: 164 KiB shared memory per SM, compute capability 8.0): not checked against
#: an A100.
def _gpu_target_config(name: str, *, sms: int, fpus_per_sm: int, shared_per_sm: int,
                       shared_optin: int, l2: int, bandwidth: float, clock_ghz: float,
                       memory: int, major: int) -> str:
  """A ``GpuTargetConfigProto`` (text) for an NVIDIA GPU from its data-sheet figures."""
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {shared_per_sm} threads_per_core_limit: 2048 core_count: {sms}
  fpus_per_core: {fpus_per_sm} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {int(bandwidth)} l2_cache_size: {l2}
  clock_rate_ghz: {clock_ghz} device_memory_size: {memory}
  shared_memory_per_block_optin: {shared_optin} cuda_compute_capability {{ major: {major} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""


GPU_TARGET_CONFIGS: Mapping[str, str] = MappingProxyType({
    "h100": _gpu_target_config("NVIDIA H100 80GB HBM3", sms=132, fpus_per_sm=128,
                               shared_per_sm=233472, shared_optin=232448, l2=52428800,
                               bandwidth=3.35232e12, clock_ghz=1.98, memory=84929347584,
                               major=9),
    "a100": _gpu_target_config("NVIDIA A100-SXM4-40GB", sms=108, fpus_per_sm=64,
                               shared_per_sm=167936, shared_optin=166912, l2=41943040,
                               bandwidth=1.555e12, clock_ghz=1.41, memory=42505273344,
                               major=8),
})

#: NVIDIA GPUs compiled for here (jax 0.10.2 + jax-cuda12-plugin 0.10.2).
GPUS: Mapping[str, Chip] = MappingProxyType({
    "h100": Chip("h100", "1x1x1", (1, 1, 1), (1, 1, 1), "NVIDIA H100 80GB HBM3", "h100-sxm",
                 "gpu"),
    "a100": Chip("a100", "1x1x1", (1, 1, 1), (1, 1, 1), "NVIDIA A100-SXM4-40GB", "a100-40g",
                 "gpu"),
})


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a plan is compiled and verified.

  Attributes:
    name: the canonical target string (``"local"``, ``"tpu:v5e"``, ``"tpu:v5e:2x2"``,
      ``"gpu:h100"``).
    platform: the XLA backend that compiles for it (``cpu``, ``gpu``, ``tpu``).
    chip: for ahead-of-time targets, the chip; ``None`` for the local devices.
    topology: the slice topology compiled for (ahead-of-time targets).
  """
  name: str
  platform: str
  chip: Chip | None = None
  topology: str | None = None

  @property
  def is_local(self) -> bool:
    return self.chip is None

  @property
  def profile(self) -> str | None:
    """The device profile a simulation uses (``None``: the local backend's)."""
    return None if self.chip is None else self.chip.profile

  @property
  def devices(self) -> tuple[Any, ...]:
    """The target's devices (``jax.devices()`` locally; topology devices ahead of time)."""
    if self.chip is None:
      return tuple(jax.devices())
    if self.chip.platform == "gpu":
      return _gpu_devices(self.chip.name)
    return _topology_devices(self.chip.name, self.topology or self.chip.topology)

  def place(self, args: Any) -> Any:
    """``args`` as ``jax.ShapeDtypeStruct`` s on this target's devices, for ``lower()``.

    Local targets take the arguments unchanged. For an ahead-of-time target,
    arrays and structs become shape-only structs; a struct that already has a
    sharding on this target's devices keeps it (that is how a sharded step is
    described), everything else goes to the first device.
    """
    if self.chip is None:
      return args
    devices = self.devices
    ids = {id(d) for d in devices}
    default = jax.sharding.SingleDeviceSharding(devices[0])

    def one(x: Any) -> Any:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
      sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
      if sharding is None or not all(id(d) in ids for d in sharding.device_set):
        sharding = default
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                                  weak_type=bool(getattr(x, "weak_type", False)))

    return jax.tree_util.tree_map(one, args)

  @property
  def takes_memory_limit(self) -> bool:
    """Whether :meth:`memory_limit_options` can steer this target's scheduler (TPU targets)."""
    return self.platform == "tpu"

  def memory_limit_options(self, temp_limit_bytes: int, reference_bytes: int) -> dict[str, int]:
    """XLA options that make the target's scheduler keep temporaries within ``temp_limit_bytes``.

    XLA:TPU's latency-hiding scheduler orders the program against a memory
    limit, by default the chip's HBM (16 GiB on a v5e). With gigabytes to
    spare it issues every host copy back right after the copy out, so a
    planned offload frees nothing (a tanh MLP with its 8 layer inputs staged
    to host: 275 MiB unplanned, 484 MiB with the offloads, 256 MiB on the
    host). The limit it schedules against is ``xla_tpu_max_hbm_size_mib`` x
    ``xla_tpu_scheduler_percent_shared_memory_limit`` / 100 bytes of
    temporaries (measured on libtpu 0.0.42.1: the same MLP compiles to
    131 MiB with the limit at 100 MiB, no extra FLOPs). The HBM size also
    bounds XLA's own rematerialization, which fails the compile when it
    cannot fit; it is kept at least twice ``reference_bytes`` (the unplanned
    step's compiled peak) so that only the scheduler reacts, and the percent
    (an integer) is chosen to hit ``temp_limit_bytes`` within 1%. Limits below
    2% of that HBM size are rounded up to it.

    Empty for targets whose scheduler takes no such limit here (the local
    CPU; a GPU's ``xla_gpu_memory_limit_slop_factor`` is the analogue, not
    set: unverified without a GPU).

    Example:
      >>> get_target("tpu:v5e").memory_limit_options(100 * 2**20, 400 * 2**20)
      {'xla_tpu_max_hbm_size_mib': 833, 'xla_tpu_scheduler_percent_shared_memory_limit': 12}
    """
    if not self.takes_memory_limit or temp_limit_bytes <= 0:
      return {}
    mib = 2 ** 20
    span = max(2 * reference_bytes, temp_limit_bytes)
    percent = max(1, min(100, 100 * temp_limit_bytes // span))
    hbm_mib = max(-(-100 * temp_limit_bytes // percent) // mib, -(-2 * reference_bytes // mib))
    return {"xla_tpu_max_hbm_size_mib": int(hbm_mib),
            "xla_tpu_scheduler_percent_shared_memory_limit": int(percent)}

  @property
  def probe_options(self) -> dict[str, Any]:
    """XLA options for compiles made only to read a candidate plan's memory.

    XLA:CPU spends most of a compile in LLVM's code generation, after buffer
    assignment has fixed every buffer: ``xla_backend_optimization_level=0``
    halves the compile (an unrolled 2-layer LSTM step: 11.8 s -> 6.0 s) and
    gives the same ``memory_analysis()`` (measured on every corpus step,
    unplanned and under two planners' plans: ``bench/probe_compiles.py``).
    The code it makes is slower, so the plan a search keeps is compiled again
    with the step's own options, and that compile is the one verified and run.

    Empty where this is not measured (GPU and TPU compilers).
    """
    if self.platform == "cpu" and self.is_local:
      return {"xla_backend_optimization_level": 0}
    return {}

  def __str__(self) -> str:
    return self.name


#: What ``target=`` takes: a target string, a :class:`Target`, or ``None`` (local).
TargetLike = str | Target | None


def _local() -> Target:
  return Target("local", jax.default_backend())


def get_target(target: TargetLike) -> Target:
  """Resolves a ``target=`` argument.

  Example:
    >>> t = get_target("tpu:v5e")
    >>> t.platform, t.chip.device_kind, t.profile
    ('tpu', 'TPU v5 lite', 'tpu-v5e')
    >>> get_target("tpu:v5e:2x2").topology
    'v5e:2x2'
    >>> get_target("gpu:h100").platform, get_target("gpu:h100").profile
    ('gpu', 'h100-sxm')
  """
  if target is None or target == "local":
    return _local()
  if isinstance(target, Target):
    return target
  if not isinstance(target, str):
    raise TypeError(f"`target` must be a string such as 'tpu:v5e', a `jaxmem.Target` or None, "
                    f"got {type(target).__name__}.")
  parts = target.lower().split(":")
  if parts[0] == "gpu" and len(parts) == 2 and parts[1] in GPUS:
    return Target("gpu:" + parts[1], "gpu", GPUS[parts[1]], GPUS[parts[1]].topology)
  if parts[0] != "tpu" or len(parts) not in (2, 3) or parts[1] not in CHIPS:
    raise ValueError(
        f"`target`={target!r} is not a known target; use 'local', 'tpu:<chip>' with a chip "
        f"in {sorted(CHIPS)}, optionally with a slice topology ('tpu:v5e:2x2'), or "
        f"'gpu:<model>' with a model in {sorted(GPUS)}.")
  chip = CHIPS[parts[1]]
  topology = chip.topology if len(parts) == 2 else f"{chip.name}:{parts[2]}"
  return Target("tpu:" + (chip.name if len(parts) == 2 else f"{chip.name}:{parts[2]}"),
                "tpu", chip, topology)


@functools.cache
def _topology_devices(chip: str, topology: str) -> tuple[Any, ...]:
  """The devices of a TPU topology, from libtpu (no TPU needed: ahead-of-time only)."""
  # libtpu looks for TPU hosts and takes a per-machine lock file unless told
  # otherwise; neither matters for compiling ahead of time.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  c = CHIPS[chip]
  bounds = c.bounds if topology == c.topology else c.multi_bounds
  try:
    return _compat.topology_devices("tpu", topology, bounds)
  except Exception as e:  # noqa: BLE001 (libtpu's errors are plain RuntimeErrors)
    raise RuntimeError(
        f"cannot compile for TPU topology {topology!r} here: {e}. Compiling for a TPU on a "
        "machine without one needs libtpu: `pip install \"jax[tpu]\"` (the libtpu that matches "
        "your jax).") from e


@functools.cache
def _gpu_devices(name: str) -> tuple[Any, ...]:
  """The device of a GPU compiled for without one (XLA:GPU's deviceless compilation)."""
  try:
    return _compat.gpu_topology_devices(GPU_TARGET_CONFIGS[name])
  except Exception as e:  # noqa: BLE001 (the plugin's errors are plain RuntimeErrors)
    raise RuntimeError(
        f"cannot compile for the GPU target 'gpu:{name}' here: {e}. Compiling for an NVIDIA "
        "GPU on a machine without one needs jax's CUDA plugin: `pip install \"jax[cuda12]\"` "
        "(the plugin that matches your jax).") from e


__all__ = ["CHIPS", "Chip", "GPUS", "GPU_TARGET_CONFIGS", "ON_CHIP_MIB", "Target", "TargetLike",
           "get_target"]
