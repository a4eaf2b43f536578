"""The text report: what holds memory at the peak, and which line of the model made it."""

from __future__ import annotations

from collections import defaultdict

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.ir.blocks import Block


def _interval(program: AnalyzedProgram, vid: int) -> str:
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


def stored_broadcasts(program: AnalyzedProgram) -> list[tuple[int, int, int, int]]:
  """``(value id, bytes, first, last)`` of the full-size broadcasts the estimate counts as stored."""
  return list(program.profile.stored_broadcasts)


def stored_broadcasts_at(program: AnalyzedProgram,
                         position: int) -> list[tuple[int, int, int, int]]:
  """``(value id, bytes, first, last)`` of the broadcasts XLA stores that are live at ``position``."""
  return sorted((t for t in stored_broadcasts(program) if t[2] <= position <= t[3]),
                key=lambda t: -t[1])


def program_report(program: AnalyzedProgram, top: int = 15) -> str:
  """Text report: peak, bytes by role and by module at the peak, top holders."""
  prof = program.profile
  vars_ = program.vars
  peak_op = (f"op {prof.peak_index} `{program.ops[prof.peak_index].primitive}` "
             f"({program.ops[prof.peak_index].source})"
             if prof.peak_index < program.num_ops else "the exit")
  sharded = program.num_devices > 1
  lines = [
      f"jaxmem lifetime report: {program.num_ops} ops, {len(vars_)} values"
      + (f", spread over {program.num_devices} devices: every byte below is one device's"
         if sharded else ""),
      f"estimated peak: {format_bytes(prof.peak_bytes)}{' per device' if sharded else ''} "
      f"at {peak_op}",
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
    share = hidden / max(1, prof.peak_bytes)
    lines.append(f"  {'XLA temporaries':16} {format_bytes(hidden):>12}  {share:6.1%}"
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
    if sharded and v.global_nbytes > v.nbytes:
      # A split value: its share of the whole, so "1/8 of 16 MiB" reads at a glance.
      where += f"  (1/{round(v.global_nbytes / max(1, v.nbytes))} of {format_bytes(v.global_nbytes)})"
    lines.append(f"  {format_bytes(nbytes):>11}  {v.type_str[:24]:24} {v.role.value:15} "
                 f"{_interval(program, vid):>12}  {where}")
  lines += blocks_report(program)
  return "\n".join(lines)


def block_details(block: Block) -> str:
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


def blocks_report(program: AnalyzedProgram, limit: int = 25) -> list[str]:
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


__all__ = ["block_details", "blocks_report", "program_report", "stored_broadcasts",
           "stored_broadcasts_at"]
