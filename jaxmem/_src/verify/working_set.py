"""The largest working set of one instruction of a compiled program.

An instruction's operands and results are live together while it runs. So a
step's arguments and outputs, plus the temporaries of its largest
instruction, bound the peak of any order of that program's instructions from
below. No keep, recompute or offload decision splits one instruction: when a
step's smallest compiled peak is close to that bound, the error that reports
the floor names the instruction and says what would lower it (a smaller
batch, micro-batches, or splitting that computation).

Read from the compiled HLO text (``compiled.as_text()``) of the entry
computation, after the compiler's fusion. The buffers counted:

* each launched instruction's result, and each distinct operand buffer it
  reads;
* a ``bitcast`` or ``get-tuple-element`` is followed to the buffer it views
  (the element of a multi-output fusion is its own buffer);
* arguments (``parameter``), constants, and the step's outputs are left out:
  they are in the executable's argument and output bytes
  (``memory_analysis()``), which the bound adds once.

Buffer sharing can make a count too high: XLA may write an elementwise
fusion's result over an operand of its shape that dies there. A working set
whose count, with the arguments and outputs, is above the compiled peak is
therefore not reported (:func:`working_set_floor`).
"""

from __future__ import annotations

import dataclasses
import re

from jaxmem._src.verify.hlo_cost import _Instr, parse_hlo

#: Instructions that launch nothing and own no buffer of their own.
_NO_BUFFER = frozenset({"parameter", "constant", "get-tuple-element", "bitcast", "tuple",
                        "after-all", "partition-id", "replica-id"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INDEX = re.compile(r"\bindex=(\d+)")
_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class WorkingSet:
  """One instruction's temporaries: what it reads and writes at once.

  Attributes:
    instruction: the HLO instruction (``fusion.12``, ``dot.3``).
    op_name: the jaxpr path XLA kept as metadata
      (``jvp(MLP)/Dense_0/dot_general``), empty when it has none.
    read_bytes: the temporaries it reads (distinct buffers).
    written_bytes: the temporaries it writes.
  """
  instruction: str
  op_name: str
  read_bytes: int
  written_bytes: int

  @property
  def nbytes(self) -> int:
    return self.read_bytes + self.written_bytes


def largest_working_set(hlo_text: str) -> WorkingSet | None:
  """The instruction of the entry computation whose temporaries are the largest.

  ``None`` for a module with no launched instruction.

  Example:
    >>> text = '''
    ... ENTRY %main (p: f32[1024]) -> f32[] {
    ...   %p = f32[1024]{0} parameter(0)
    ...   %a = f32[1024]{0} exponential(%p)
    ...   %b = f32[1024]{0} add(%a, %a)
    ...   %zero = f32[] constant(0)
    ...   ROOT %r = f32[] reduce(%b, %zero), dimensions={0}, to_apply=%sum
    ... }'''
    >>> ws = largest_working_set(text)
    >>> ws.instruction, ws.read_bytes, ws.written_bytes
    ('b', 4096, 4096)

  With a compiled step, pass ``compiled.as_text()``.
  """
  buffers = _EntryBuffers.of(hlo_text, "largest_working_set")
  sources, temporary, nbytes = buffers.sources, buffers.temporary, buffers.nbytes
  best: WorkingSet | None = None
  for ins in buffers.instrs:
    if ins.opcode in _NO_BUFFER:
      continue
    read = {s for op in ins.operands for s in sources(op) if temporary(s)}
    written = sum(a.nbytes for k, a in enumerate(ins.arrays) if temporary((ins.name, k)))
    found = WorkingSet(ins.name, _op_name(ins.attrs), sum(map(nbytes, read)), written)
    if best is None or found.nbytes > best.nbytes:
      best = found
  return best


def working_set_floor(hlo_text: str, fixed_bytes: int, peak_bytes: int,
                      share: float = 0.9, slack: float = 0.02) -> WorkingSet | None:
  """The largest working set when it, with ``fixed_bytes``, holds ``share`` of ``peak_bytes``.

  ``fixed_bytes``: the executable's arguments and outputs (less what they
  alias). ``None`` when the largest working set is smaller, or when its
  count is more than ``slack`` above the compiled peak: then buffers XLA
  shares were counted twice (see the module docstring), and the count
  explains nothing. Small operands a step also returns or shares account for
  the slack (a hypernetwork's tanh gradient: 16.09 MiB read and written with
  14.82 MiB of arguments and outputs, under a compiled peak of 30.82 MiB).
  """
  found = largest_working_set(hlo_text)
  if found is None:
    return None
  bound = fixed_bytes + found.nbytes
  if bound > (1.0 + slack) * peak_bytes or bound < share * peak_bytes:
    return None
  return found


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
  """A temporary live at the compiled peak (:func:`live_at_peak`).

  Attributes:
    instruction: the HLO instruction that writes it (``wrapped_broadcast.5``).
    op_name: the jaxpr path XLA kept as metadata
      (``jvp(PointNet)/LayerNorm_2/mul``); for a custom call without one
      (jaxmem's own ops), its target (``jaxmem_fetch``); empty otherwise.
    shape: its array type, ``f32[8,512,512]``.
    nbytes: its bytes.
  """
  instruction: str
  op_name: str
  shape: str
  nbytes: int


@dataclasses.dataclass(frozen=True)
class CompiledPeak:
  """The most temporaries a compiled program holds at once, read from its schedule.

  Attributes:
    live_bytes: the temporaries live at that point of the schedule.
    instruction: the instruction that runs there.
    buffers: the temporaries live there, largest first.
  """
  live_bytes: int
  instruction: str
  buffers: tuple[LiveBuffer, ...]


def live_at_peak(hlo_text: str) -> CompiledPeak | None:
  """The temporaries a compiled program holds at the point of its schedule where they are most.

  A compiled module's entry computation is printed in its schedule's order
  (``is_scheduled=true``). Each temporary is live from the instruction that
  writes it to the last one that reads it (through its views); arguments,
  constants, outputs and host buffers are left out. A result XLA may write
  over an operand of its size that dies there (a loop fusion's, an
  elementwise op's, a loop's carry, an update in place) takes that buffer.
  This is about what XLA's heap simulator sees before it places the
  buffers: the heap's top (``memory_analysis().temp_size_in_bytes``) can be
  higher where the layout leaves holes, and either way where XLA shares
  buffers otherwise than this reading assumes. The temporaries of a loop's
  or a branch's body are not in the entry computation and are not counted.
  ``None`` when nothing is live.

  Example:
    >>> text = '''
    ... ENTRY %main (p: f32[1024]) -> f32[] {
    ...   %p = f32[1024]{0} parameter(0)
    ...   %a = f32[1024]{0} exponential(%p)
    ...   %b = f32[1024]{0} negate(%p)
    ...   %c = f32[1024]{0} add(%a, %b)
    ...   %zero = f32[] constant(0)
    ...   ROOT %r = f32[] reduce(%c, %zero), dimensions={0}, to_apply=%sum
    ... }'''
    >>> peak = live_at_peak(text)
    >>> peak.live_bytes, peak.instruction, [b.instruction for b in peak.buffers]
    (8192, 'b', ['a', 'b'])

  (``c`` is written over ``a``, which dies there.)

  With a compiled step, pass ``compiled.as_text()``.
  """
  buffers = _EntryBuffers.of(hlo_text, "live_at_peak")
  start: dict[tuple[str, int], int] = {}
  for k, ins in enumerate(buffers.instrs):
    if ins.opcode in _NO_BUFFER:
      continue
    for out in buffers.results(ins):
      if not ins.arrays[max(out[1], 0)].host:
        start[out] = k
  end = dict(start)
  for k, ins in enumerate(buffers.instrs):
    for op in ins.operands:
      for src in buffers.sources(op):
        if src not in start and (src[0], -1) in start:
          src = (src[0], -1)
        if src in end:
          end[src] = max(end[src], k)
  # A result XLA writes over an operand that dies there (a loop fusion's, an
  # elementwise op's, a loop's carry, an update in place) takes its buffer:
  # the operand's range ends before the instruction.
  for k, ins in enumerate(buffers.instrs):
    if not _shares_operand_buffer(ins):
      continue
    taken: set[tuple[str, int]] = set()
    operands = [src for op in ins.operands for src in buffers.sources(op)]
    for out in buffers.results(ins):
      if out not in start:
        continue
      size = buffers.nbytes(out)
      for src in operands:
        if (src in end and src not in taken and end[src] == k and start[src] < k
            and buffers.temporary(src) and buffers.nbytes(src) == size):
          end[src] = k - 1
          taken.add(src)
          break
  live = [(src, buffers.nbytes(src)) for src in start if buffers.temporary(src)]
  curve = [0] * (len(buffers.instrs) + 1)
  for src, nbytes in live:
    curve[start[src]] += nbytes
    curve[end[src] + 1] -= nbytes
  total, best, at = 0, 0, -1
  for k, delta in enumerate(curve[:-1]):
    total += delta
    if total > best:
      best, at = total, k
  if at < 0:
    return None
  held = []
  for src, nbytes in live:
    if start[src] <= at <= end[src]:
      ins = buffers.by_name[src[0]]
      array = ins.arrays[max(src[1], 0)]
      shape = f"{array.dtype}[{','.join(map(str, array.dims))}]"
      what = _op_name(ins.attrs)
      target = _CALL_TARGET.search(ins.attrs)
      if target and what.rsplit("/", 1)[-1] in ("", "ffi_call"):
        what = target.group(1)           # jaxmem's own ops: `jaxmem_fetch`, not `ffi_call`
      held.append(LiveBuffer(src[0] if src[1] < 0 else f"{src[0]}#{src[1]}", what, shape, nbytes))
  held.sort(key=lambda b: (-b.nbytes, b.instruction))
  return CompiledPeak(best, buffers.instrs[at].name, tuple(held))


class _EntryBuffers:
  """The buffers of a compiled module's entry computation, as its instructions view them."""

  def __init__(self, instrs: list[_Instr]):
    self.instrs = instrs
    self.by_name = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.root), None)
    self.outputs = set(self.sources(root.name)) if root is not None else set()

  @classmethod
  def of(cls, hlo_text: str, api: str) -> "_EntryBuffers":
    comps, entry = parse_hlo(hlo_text)
    if entry is None:
      raise ValueError(f"`{api}` needs a module's HLO text with an ENTRY computation "
                       "(`compiled.as_text()`).")
    return cls(comps[entry])

  def sources(self, name: str) -> list[tuple[str, int]]:
    """The buffers ``name`` views: ``(instruction, element)`` pairs; none for arguments."""
    ins = self.by_name.get(name)
    if ins is None or ins.opcode in ("parameter", "constant"):
      return []
    if ins.opcode == "bitcast" and ins.operands:
      return self.sources(ins.operands[0])
    if ins.opcode == "get-tuple-element" and ins.operands:
      index = _INDEX.search(ins.attrs)
      k = int(index.group(1)) if index else 0
      inner = self.by_name.get(ins.operands[0])
      if inner is None or inner.opcode in ("parameter", "constant"):
        return []                      # an element of an argument
      if inner.opcode == "tuple":
        return self.sources(inner.operands[k]) if k < len(inner.operands) else []
      if inner.opcode in ("get-tuple-element", "bitcast"):
        return self.sources(inner.name)     # a nested tuple: its whole buffer
      return [(inner.name, k)]         # an element of a multi-output instruction
    if ins.opcode == "tuple":
      return [s for op in ins.operands for s in self.sources(op)]
    return [(name, -1)]

  @staticmethod
  def results(ins: _Instr) -> list[tuple[str, int]]:
    """The buffers ``ins`` writes: one per element of a tuple result, else the whole one."""
    if len(ins.arrays) > 1:
      return [(ins.name, j) for j in range(len(ins.arrays))]
    return [(ins.name, -1)]

  def nbytes(self, src: tuple[str, int]) -> int:
    ins = self.by_name[src[0]]
    if src[1] < 0:
      return ins.nbytes
    return ins.arrays[src[1]].nbytes if src[1] < len(ins.arrays) else 0

  def temporary(self, src: tuple[str, int]) -> bool:
    """Neither an argument nor (part of) the step's output."""
    return src not in self.outputs and (src[0], -1) not in self.outputs


#: Instructions whose result may be written over a dying operand of its size.
_IN_PLACE = frozenset({"while", "dynamic-update-slice", "scatter", "add", "subtract",
                       "multiply", "divide", "maximum", "minimum", "negate", "exponential",
                       "tanh", "log", "sqrt", "rsqrt", "select", "convert", "abs"})


def _shares_operand_buffer(ins: _Instr) -> bool:
  """Whether XLA may give ``ins``'s result the buffer of an operand that dies there."""
  if ins.opcode == "fusion":
    return "kind=kLoop" in ins.attrs
  return ins.opcode in _IN_PLACE


def _op_name(attrs: str) -> str:
  """The jaxpr path of the metadata, without the outer ``jit(...)``."""
  m = _OP_NAME.search(attrs)
  if not m:
    return ""
  parts = m.group(1).split("/")
  if parts and parts[0].startswith("jit("):
    parts = parts[1:]
  return "/".join(parts)
