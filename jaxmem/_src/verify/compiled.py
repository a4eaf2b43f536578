"""Verify: the compiled executable's peak, from ``memory_analysis()``, and its cost.

peak = argument + output + temp - alias bytes (``docs/design.md``, "Verify":
on the CPU the entry outputs can share the temp arena, so temp alone is not
comparable). The cost is the compiler's own count of what the program
computes and moves (``cost_analysis()``), after its fusion and its
rematerialization: what a plan's recomputation really costs on that
compiler, not what the cost model expects.
"""

from __future__ import annotations

import dataclasses
import re

import jax

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.devices import DeviceProfile
from jaxmem._src.verify.hlo_cost import ITEM_BYTES, KernelCost, hlo_kernels


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Memory of a compiled executable, per device, in bytes."""
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  host_temp_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  def __str__(self) -> str:
    return (f"{format_bytes(self.peak_bytes)} (arguments {format_bytes(self.argument_bytes)} + "
            f"outputs {format_bytes(self.output_bytes)} + temp {format_bytes(self.temp_bytes)} - "
            f"aliased {format_bytes(self.alias_bytes)})")


def compiled_memory(compiled: jax.stages.Compiled) -> CompiledMemory:
  """Reads ``compiled.memory_analysis()`` into a :class:`CompiledMemory`."""
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError("This backend's compiled executables report no `memory_analysis()`; "
                       "jaxmem cannot verify a budget on it.")
  return CompiledMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                        int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes),
                        int(getattr(stats, "host_temp_size_in_bytes", 0) or 0))


@dataclasses.dataclass(frozen=True)
class CompiledCost:
  """What a compiled executable computes and moves, per device.

  Either XLA's ``cost_analysis()`` (whole-program totals) or, where the
  compiler has none or counts a loop body once, the compiled HLO read kernel
  by kernel (:func:`~jaxmem._src.verify.hlo_cost.hlo_kernels`).

  Attributes:
    flops: floating-point operations (``"flops"``).
    bytes_accessed: bytes its fusions read and write in device memory
      (``"bytes accessed"``: every fusion's operands and results after the
      compiler's own fusion; XLA:TPU counts on-chip temporaries too).
    kernels: the kernels it launches, when read from its HLO (empty when
      the totals are ``cost_analysis()``'s).
  """
  flops: float
  bytes_accessed: float
  kernels: tuple[KernelCost, ...] = dataclasses.field(default=(), repr=False, compare=False)

  def seconds(self, profile: DeviceProfile, host_bytes: int = 0) -> float:
    """A roofline time of the whole program on ``profile``.

    With :attr:`kernels`, XLA's GPU performance model's: each kernel the
    longer of its compute and memory time, plus a launch
    (:meth:`KernelCost.seconds`; host copies included). Measured against an
    H200's busy time (``bench/results/gpu_cost.md``), its ratios of JAX's
    policies to plain ``jax.jit`` on the GPT were within 0.2% of the
    measured ones. Without kernels, FLOPs at the profile's achieved matmul
    rate plus bytes at its achieved memory bandwidth (a sum, not a maximum:
    ``cost_analysis()`` gives whole-program totals, so which ops are bound by
    which is not known), plus ``host_bytes`` out to the host and back. It
    ranks plans of one step on one compiler, where the compiler's counts are
    the truth and the cost model's per-op times are not.
    """
    if self.kernels:
      return sum(k.seconds(profile) for k in self.kernels)
    compute = self.flops / profile.matmul_rate("float32")
    memory = (self.bytes_accessed / (profile.memory_bytes_per_s * profile.efficiency.memory)
              if profile.memory_bytes_per_s else 0.0)
    return compute + memory + (2 * profile.copy_seconds(host_bytes) if host_bytes else 0.0)

  def relative_to(self, other: CompiledCost) -> str:
    """``"FLOPs +7.6%, bytes accessed -9.6%"`` against ``other`` (plain ``jax.jit``)."""
    def pct(a: float, b: float) -> str:
      return f"{a / b - 1:+.1%}" if b else "n/a"
    return (f"FLOPs {pct(self.flops, other.flops)}, "
            f"bytes accessed {pct(self.bytes_accessed, other.bytes_accessed)}")


def compiled_cost(compiled: jax.stages.Compiled, *,
                  from_hlo: bool | None = None) -> CompiledCost | None:
  """What ``compiled`` computes and moves, as a :class:`CompiledCost`; ``None`` if unknown.

  Args:
    compiled: a compiled executable.
    from_hlo: read the compiled HLO kernel by kernel
      (:func:`~jaxmem._src.verify.hlo_cost.hlo_kernels`: a loop body counts
      times its trip count, which ``cost_analysis()`` counts once) instead of
      ``compiled.cost_analysis()``; ``None``: only where the compiler has no
      cost analysis (XLA:GPU compiled ahead of time without a GPU). A
      multi-program executable's list holds one dict per program, the first
      being the step's.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> f = jax.jit(lambda x, w: jnp.tanh(x @ w))
    >>> x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    >>> w = jax.ShapeDtypeStruct((128, 64), jnp.float32)
    >>> cost = jaxmem.compiled_cost(f.lower(x, w).compile())
    >>> cost.flops >= 2 * 256 * 128 * 64
    True
  """
  cost = None
  if not from_hlo:
    try:
      cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without a cost analysis raises its own error
      cost = None
    if isinstance(cost, (list, tuple)):
      cost = cost[0] if cost else None
    if cost and "flops" in cost:
      return CompiledCost(float(cost["flops"]), float(cost.get("bytes accessed", 0.0)))
    if from_hlo is False:
      return None
  try:
    kernels = hlo_kernels(compiled.as_text())
  except Exception:  # noqa: BLE001 - no HLO text, or text without an entry computation
    return None
  return CompiledCost(sum((k.matrix_flops + k.vector_flops) * k.count for k in kernels),
                      sum(k.bytes_accessed * k.count for k in kernels), kernels)


@dataclasses.dataclass(frozen=True)
class CollectiveBuffers:
  """Results of one kind of collective XLA's partitioner put in a compiled program.

  Attributes:
    op: the HLO opcode (``all-gather``, ``all-reduce``, ``reduce-scatter``,
      ``all-to-all``, ``collective-permute``; asynchronous ``-start`` halves
      are counted under the same name).
    type_str: the result type (``f32[512,512]``), per device.
    nbytes: bytes of one result.
    count: how many such collectives produce a result of that type.
  """
  op: str
  type_str: str
  nbytes: int
  count: int

  def __str__(self) -> str:
    times = f" x{self.count}" if self.count > 1 else ""
    return f"{self.op} {self.type_str} ({format_bytes(self.nbytes)}){times}"


_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def collective_buffers(compiled: jax.stages.Compiled) -> tuple[CollectiveBuffers, ...]:
  """The collectives in ``compiled``'s HLO and the device bytes of their results, largest first.

  Under a mesh these buffers are XLA's own (an FSDP step's gathered weights,
  a data-parallel step's all-reduced gradients): no jaxpr value holds them,
  so neither jaxmem's estimate nor its plans can move them. A ``-start``
  half's tuple result counts its largest element.
  """
  found: dict[tuple[str, str], list[int]] = {}
  for line in compiled.as_text().splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    best = ("", 0)
    for dtype, dims in _ARRAY.findall(m.group(1)):
      if dtype not in ITEM_BYTES:
        continue
      n = ITEM_BYTES[dtype]
      for d in filter(None, dims.split(",")):
        n *= int(d)
      if n > best[1]:
        best = (f"{dtype}[{dims}]", n)
    if best[1]:
      found.setdefault((m.group(2), best[0]), []).append(best[1])
  out = [CollectiveBuffers(op, t, sizes[0], len(sizes)) for (op, t), sizes in found.items()]
  return tuple(sorted(out, key=lambda c: (-c.nbytes * c.count, c.op, c.type_str)))
