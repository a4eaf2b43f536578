"""Verify: the compiled executable's peak, from ``memory_analysis()``.

peak = argument + output + temp - alias bytes (``docs/design.md``, "Verify":
on the CPU the entry outputs can share the temp arena, so temp alone is not
comparable).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmem._src.base.errors import format_bytes


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
