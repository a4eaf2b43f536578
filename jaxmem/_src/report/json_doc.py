"""The JSON report: a program's lifetimes in a documented schema (``jaxmem.program/1``).

The schema is ``jaxmem/schema/program-1.json``, described in ``docs/json_schema.md``.
"""

from __future__ import annotations

from typing import Any

from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.report.text import stored_broadcasts

SCHEMA = "jaxmem.program/1"


def program_json(program: AnalyzedProgram) -> dict[str, Any]:
  """JSON-serialisable view of a program's lifetimes (schema ``jaxmem.program/1``)."""
  prof = program.profile
  return {
      "schema": SCHEMA,
      "num_ops": program.num_ops,
      "peak_bytes": prof.peak_bytes,
      "peak_index": prof.peak_index,
      "live_bytes": [int(x) for x in prof.live_bytes],
      "holders_at_peak": list(prof.holders),
      "values": [{
          "id": v.id, "shape": list(v.shape), "dtype": v.dtype, "bytes": v.nbytes,
          "defined_by": v.defined_by, "uses": list(v.uses), "interval": list(program.interval(v.id)),
          "estimated_interval": (list(prof.intervals[v.id]) if prof.intervals is not None
                                 else list(program.interval(v.id))),
          "fused": bool(prof.virtual[v.id]) if prof.virtual is not None else False,
          "role": v.role.value, "name": v.name, "source": v.source, "is_output": v.is_output,
      } for v in program.vars],
      "ops": [{"index": op.index, "primitive": op.primitive, "phase": op.phase.value,
               "module": op.module_path, "source": op.source,
               "inputs": [x if isinstance(x, int) else None for x in op.inputs],
               "outputs": list(op.outputs)} for op in program.ops],
      "blocks": [b.to_json() for b in program.blocks],
      "xla_broadcasts": [{"value": vid, "bytes": b, "interval": [s, e]}
                         for vid, b, s, e in stored_broadcasts(program)],
  }


__all__ = ["SCHEMA", "program_json"]
