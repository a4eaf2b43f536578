"""Lifetime reports: what holds memory at the peak, and which line made it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from jaxmem._src.errors import format_bytes

SCHEMA = "jaxmem.program/1"


def _interval(program: Any, vid: int) -> str:
  """Estimated live interval; ``*`` marks an end extended by a fused-away use."""
  s, e = program.interval(vid)
  ivs = program.profile.intervals
  mark = ""
  if ivs is not None:
    s2, e2 = ivs[vid]
    if e2 > e:
      mark = "*"
    s, e = s2, e2
  end = "exit" if e >= program.num_ops else str(e)
  return f"{s}..{end}{mark}"


def _stored_broadcasts(program: Any) -> list[tuple[int, int, int, int]]:
  from jaxmem._src import xla_model
  return xla_model.stored_broadcast_spans(program)


def stored_broadcasts_at(program: Any, position: int) -> list[tuple[int, int, int, int]]:
  """``(value id, bytes, first, last)`` of the broadcasts XLA stores that are live at ``position``."""
  from jaxmem._src import xla_model
  return sorted((t for t in xla_model.stored_broadcast_spans(program) if t[2] <= position <= t[3]),
                key=lambda t: -t[1])


def program_report(program: Any, top: int = 15) -> str:
  """Text report: peak, bytes by role and by module at the peak, top holders."""
  prof = program.profile
  vars_ = program.vars
  peak_op = (f"op {prof.peak_index} `{program.ops[prof.peak_index].primitive}` "
             f"({program.ops[prof.peak_index].source})"
             if prof.peak_index < program.num_ops else "the exit")
  lines = [
      f"jaxmem lifetime report: {program.num_ops} ops, {len(vars_)} values",
      f"estimated peak: {format_bytes(prof.peak_bytes)} at {peak_op}",
  ]
  by_role: dict[str, int] = defaultdict(int)
  by_module: dict[str, int] = defaultdict(int)
  for vid, nbytes in zip(prof.holders, prof.holder_bytes):
    v = vars_[vid]
    by_role[v.role.value] += nbytes
    module = v.name if not v.is_input else "(arguments)"
    by_module[module or "(top level)"] += nbytes
  # Broadcasts XLA stores are no jaxpr value: charge them to the value they
  # broadcast (its module, its source line), so the big ones are attributed.
  broadcasts = stored_broadcasts_at(program, prof.peak_index)
  for vid, nbytes, _, _ in broadcasts:
    v = vars_[vid]
    by_role["XLA broadcast"] += nbytes
    by_module[(v.name if not v.is_input else "(arguments)") or "(top level)"] += nbytes
  lines.append("live at the peak, by role:")
  for role, b in sorted(by_role.items(), key=lambda kv: -kv[1]):
    lines.append(f"  {role:16} {format_bytes(b):>12}  {b / max(1, prof.peak_bytes):6.1%}")
  lines.append("live at the peak, by module:")
  for mod, b in sorted(by_module.items(), key=lambda kv: -kv[1])[:10]:
    lines.append(f"  {mod[:40]:40} {format_bytes(b):>12}")
  hidden = prof.peak_bytes - sum(prof.holder_bytes) - sum(b for _, b, _, _ in broadcasts)
  if hidden > prof.peak_bytes // 1000:
    lines.append(f"  {'XLA temporaries':16} {format_bytes(hidden):>12}  {hidden / max(1, prof.peak_bytes):6.1%}"
                 "  (layout copies, expansions, loop bodies: not jaxpr values)")
  rows = [(nbytes, vid, False) for vid, nbytes in zip(prof.holders, prof.holder_bytes)]
  rows += [(nbytes, vid, (s, e)) for vid, nbytes, s, e in broadcasts]
  rows.sort(key=lambda r: -r[0])
  lines.append(f"top {min(top, len(rows))} buffers at the peak "
               "(live: op positions; * = kept for a use XLA fuses into a later op; "
               "XLA broadcast = a full-size broadcast of this value that XLA stores):")
  lines.append(f"  {'bytes':>11}  {'type':24} {'role':15} {'live':>12}  source / name")
  for nbytes, vid, span in rows[:top]:
    v = vars_[vid]
    where = v.name if v.is_input else f"{v.source}  {v.name}"
    if span:
      lines.append(f"  {format_bytes(nbytes):>11}  {v.type_str[:24]:24} "
                   f"{'XLA broadcast':15} {f'{span[0]}..{span[1]}':>12}  {where}")
      continue
    lines.append(f"  {format_bytes(nbytes):>11}  {v.type_str[:24]:24} {v.role.value:15} "
                 f"{_interval(program, vid):>12}  {where}")
  lines += blocks_report(program)
  return "\n".join(lines)


def block_details(block: Any) -> str:
  """One line of what is inside a block: loop sizes, branch peaks."""
  if block.primitive == "scan":
    parts = [f"{block.length} × {format_bytes(block.per_iteration_bytes)}/iteration",
             f"carry {format_bytes(block.carry_bytes)}",
             f"stacked outputs {format_bytes(block.stacked_output_bytes)}",
             f"xs {format_bytes(block.xs_bytes)}"]
    if block.consts_bytes:
      parts.append(f"consts {format_bytes(block.consts_bytes)}")
    if block.reverse:
      parts.append("reverse")
    return ", ".join(parts)
  if block.primitive == "while":
    return (f"{format_bytes(block.per_iteration_bytes)}/iteration, "
            f"carry {format_bytes(block.carry_bytes)}, cond {format_bytes(block.cond_peak_bytes)}, "
            f"body {format_bytes(block.body_peak_bytes)}")
  if block.branch_peaks is not None:
    return "branches " + " / ".join(format_bytes(b) for b in block.branch_peaks)
  return ""


def blocks_report(program: Any, limit: int = 25) -> list[str]:
  """Lines of the control-flow blocks section; none when the program has no block.

  Nested blocks follow their parent, indented; at most ``limit`` rows (a
  program of many small ``cond``s would otherwise drown the report).
  """
  rows = [b for top in program.blocks for b in top.walk()]
  if not rows:
    return []
  lines = [(f"control-flow blocks ({len(rows)}; inner peak: working set inside beyond the op's "
            "operands and results, charged to the op;"),
           ("  per iteration: live bytes in one iteration of the body, its inputs and outputs "
            "included):"),
           f"  {'op':>6}  {'primitive':18} {'inner peak':>11}  details / source"]
  for b in rows[:limit]:
    name = ("  " * b.depth + ("↳ " if b.depth else "") + b.primitive)
    where = f"{b.source}  {b.module}".rstrip()
    details = block_details(b)
    region = f"in {b.region}" if b.region else ""
    tail = "; ".join(x for x in (region, details) if x)
    lines.append(f"  {b.op_index:>6}  {name[:18]:18} {format_bytes(b.inner_peak_bytes):>11}  "
                 f"{tail + '  ' if tail else ''}{where}")
  if len(rows) > limit:
    lines.append(f"  ... {len(rows) - limit} more (Program.blocks, to_json()['blocks'])")
  return lines


def program_json(program: Any) -> dict[str, Any]:
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
                         for vid, b, s, e in _stored_broadcasts(program)],
  }
