"""The cost of a compiled program read from its HLO text, kernel by kernel.

XLA:GPU compiled ahead of time without a GPU (``target="gpu:h100"``) reports
no ``cost_analysis()``, yet its compiled program is the one the user's GPU
runs: its fusions, its cuDNN convolutions and cuBLAS/Triton GEMMs, its
rematerialization. This module counts what each launched kernel of that
program computes and moves, from the scheduled HLO text alone, and prices
each kernel as XLA's own GPU performance model does
(``xla/service/gpu/model/gpu_performance_model.cc``: a kernel takes the
longer of its compute time and its memory time, plus a launch overhead). It
is the compiled-program counterpart of the cost model's per-op roofline
(:mod:`jaxmem._src.estimate.cost`), which prices jaxpr equations under
jaxmem's own fusion rules: here the fusions are the compiler's.

What a kernel reads and writes follows ``HloCostAnalysis``'s conventions
where they matter for the steps jaxmem plans:

* a fusion reads its operands and writes its results; an operand the fused
  computation only slices (``slice``/``dynamic-slice``, a scan body reading
  one iteration of a stacked array) is read for the slices' bytes, and a
  result written by an in-place ``dynamic-update-slice`` (a scan body
  writing one iteration) writes only the update;
* a ``while`` loop's body counts times its known trip count
  (``known_trip_count`` in its backend config; 1 when unknown), a
  ``conditional`` its most expensive branch, a ``call`` its callee;
* FLOPs: ``dot`` 2·M·N·K, convolutions (and cuDNN's forward, backward-input
  and backward-filter custom calls) 2 per multiply-add of the forward
  convolution, cuBLAS GEMM custom calls from their dot dimensions; other
  arithmetic one per result element (a reduction one per input element);
* ``parameter``, ``get-tuple-element``, ``tuple``, ``bitcast``, ``constant``,
  barriers and the ``-done`` halves of asynchronous ops launch nothing;
  copies between device and host memory (memory space ``S(5)``) are host
  transfers, priced on the link.

Measured against XLA:CPU's own ``cost_analysis()`` in
``tests/verify/test_hlo_cost.py`` and against an H200's step times in
``bench/gpu_cost.py``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from jaxmem._src.estimate.devices import DeviceProfile

ITEM_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_MATMUL_DTYPE = {"bf16": "bfloat16", "f16": "float16"}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')

#: Opcodes that launch no kernel and move nothing of their own.
_FREE = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "opt-barrier", "add-dependency", "domain", "partition-id", "replica-id", "iota",
    "copy-done", "send-done", "recv-done", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "async-done", "async-update"})
#: Opcodes inside a fused computation that compute nothing (layout, data movement).
_NO_FLOPS = _FREE | frozenset({
    "broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "reverse", "gather", "convert",
    "bitcast-convert", "select", "compare", "scatter"})
_CONTROL = frozenset({"while", "conditional", "call"})


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]
  host: bool = False

  @property
  def elements(self) -> int:
    return math.prod(self.dims)

  @property
  def nbytes(self) -> int:
    return self.elements * ITEM_BYTES.get(self.dtype, 4)


@dataclasses.dataclass(frozen=True)
class _Instr:
  name: str
  opcode: str
  arrays: tuple[Array, ...]        # the result's arrays (a tuple result: each element)
  operands: tuple[str, ...]
  attrs: str
  root: bool
  args: str = ""                   # the text between the opcode's parentheses

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays)


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One launched kernel of a compiled program (times the trips of the loops around it).

  Attributes:
    name: the HLO instruction.
    opcode: ``fusion``, ``custom-call``, ``copy``...
    matrix_flops: FLOPs of its dots and convolutions (on the matrix units).
    vector_flops: FLOPs of its other arithmetic.
    bytes_accessed: device-memory bytes it reads and writes.
    host_bytes: bytes it copies between device and host memory.
    matmul_dtype: ``"bfloat16"``/``"float16"`` for a half-precision matmul,
      else ``"float32"``.
    reduction: a reduction kernel (XLA:GPU's ``kInput`` fusions).
    count: how many times it runs per step (a loop's trip count).
  """
  name: str
  opcode: str
  matrix_flops: float
  vector_flops: float
  bytes_accessed: float
  host_bytes: float = 0.0
  matmul_dtype: str = "float32"
  reduction: bool = False
  count: int = 1

  def seconds(self, profile: DeviceProfile) -> float:
    """``count`` runs of the kernel: the longer of compute and memory, plus a launch each."""
    compute = (self.matrix_flops / profile.matmul_rate(self.matmul_dtype)
               + self.vector_flops / profile.vector_rate)
    bandwidth = profile.reduction_bytes_per_s if self.reduction else profile.stream_bytes_per_s
    memory = self.bytes_accessed / bandwidth if bandwidth else 0.0
    host = profile.copy_seconds(int(self.host_bytes)) if self.host_bytes else 0.0
    return self.count * (max(compute, memory) + host + profile.op_overhead_s)


def _split_type(text: str) -> tuple[str, str]:
  """``(result type, the rest)`` of the text after ``%name = `` (a tuple type is balanced)."""
  if text.startswith("("):
    depth = 0
    for k, ch in enumerate(text):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return text[:k + 1], text[k + 1:]
  head, _, rest = text.partition(" ")
  return head, " " + rest


def _arrays(type_text: str) -> tuple[Array, ...]:
  out = []
  for dtype, dims, layout in _ARRAY.findall(type_text):
    if dtype not in ITEM_BYTES:
      continue
    shape = tuple(int(d) for d in dims.split(",") if d)
    out.append(Array(dtype, shape, host="S(5)" in (layout or "")))
  return tuple(out)


def _operands(text: str) -> tuple[tuple[str, ...], str, str]:
  """``(operand names, the text inside, attributes)`` of ``(…), attrs`` (balanced parentheses)."""
  depth = 0
  for k, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      inner = text[1:k]
      return tuple(re.findall(r"%([\w.\-]+)", inner)), inner, text[k + 1:]
  return (), "", text


def parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
  """The computations of an HLO module's text (name -> instructions) and the entry's name."""
  comps: dict[str, list[_Instr]] = {}
  entry = None
  current: list[_Instr] | None = None
  for line in text.splitlines():
    head = _HEADER.match(line)
    if head:
      current = comps.setdefault(head.group(2), [])
      if head.group(1):
        entry = head.group(2)
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    type_text, rest = _split_type(line[m.end():])
    op = _OPCODE.match(rest)
    if not op:
      continue
    operands, args, attrs = _operands(rest[op.end() - 1:])
    current.append(_Instr(m.group(1), op.group(1), _arrays(type_text), operands, attrs,
                          line.lstrip().startswith("ROOT"), args))
  return comps, entry


class _Module:
  def __init__(self, text: str) -> None:
    self.comps, self.entry = parse_hlo(text)
    self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.comps.items()}
    self._flops: dict[str, tuple[float, float, str]] = {}

  # -- FLOPs of a fused (or called) computation ---------------------------------------------------
  def flops(self, comp: str) -> tuple[float, float, str]:
    """``(matrix FLOPs, vector FLOPs, matmul dtype)`` of one computation's instructions."""
    if comp in self._flops:
      return self._flops[comp]
    self._flops[comp] = (0.0, 0.0, "float32")        # a cycle guard
    matrix = vector = 0.0
    dtype = "float32"
    table = self.by_name.get(comp, {})
    for ins in self.comps.get(comp, []):
      m, v, d = self.instr_flops(ins, table)
      matrix += m
      vector += v
      if m and d != "float32":
        dtype = d
    self._flops[comp] = (matrix, vector, dtype)
    return self._flops[comp]

  def instr_flops(self, ins: _Instr, table: dict[str, _Instr]) -> tuple[float, float, str]:
    def operand(k: int) -> _Instr | None:
      return table.get(ins.operands[k]) if k < len(ins.operands) else None

    out = ins.arrays[0] if ins.arrays else None
    if ins.opcode == "fusion":
      callee = _CALLEE.search(ins.attrs)
      return self.flops(callee.group(2)) if callee else (0.0, 0.0, "float32")
    if ins.opcode == "dot" and out is not None:
      lhs = operand(0)
      k = 1
      contract = _CONTRACT.search(ins.attrs)
      if lhs is not None and lhs.arrays and contract:
        for d in filter(None, contract.group(1).split(",")):
          k *= lhs.arrays[0].dims[int(d)]
      dtype = _MATMUL_DTYPE.get(lhs.arrays[0].dtype, "float32") if lhs and lhs.arrays else "float32"
      return 2.0 * out.elements * k, 0.0, dtype
    if ins.opcode == "convolution":
      return self._conv(ins, out, _first(operand(1)))
    if ins.opcode == "custom-call":
      target = _TARGET.search(ins.attrs)
      name = target.group(1) if target else ""
      if name.startswith("__cudnn$conv"):
        # The forward convolution's output and kernel: the result and operand 1
        # forward; operand 0 (the output's gradient) and operand 1 backward to
        # the input; operand 1 and the result backward to the filter.
        if "BackwardFilter" in name:
          return self._conv(ins, _first(operand(1)), out)
        if "BackwardInput" in name:
          return self._conv(ins, _first(operand(0)), _first(operand(1)))
        return self._conv(ins, out, _first(operand(1)))
      if "gemm" in name or "matmul" in name:
        lhs = operand(0)
        contract = _GEMM_CONTRACT.search(ins.attrs)
        k = 1
        if lhs is not None and lhs.arrays and contract:
          for d in re.findall(r"\d+", contract.group(1)):
            k *= lhs.arrays[0].dims[int(d)]
        dtype = _MATMUL_DTYPE.get(lhs.arrays[0].dtype, "float32") if lhs and lhs.arrays else "float32"
        return (2.0 * out.elements * k if out is not None else 0.0), 0.0, dtype
      return 0.0, 0.0, "float32"
    if ins.opcode in _NO_FLOPS or out is None or ins.opcode in _CONTROL:
      return 0.0, 0.0, "float32"
    if ins.opcode in ("reduce", "reduce-window"):
      src = operand(0)
      n = src.arrays[0].elements if src is not None and src.arrays else out.elements
      return 0.0, float(n), "float32"
    return 0.0, float(sum(a.elements for a in ins.arrays)), "float32"

  @staticmethod
  def _conv(ins: _Instr, fwd_out: Array | None, kernel: Array | None) -> tuple[float, float, str]:
    """2 FLOPs per multiply-add of the forward convolution: 2·|output|·|kernel| / out-features.

    ``|kernel|`` already holds the in-features of one group, so a grouped
    (depthwise) convolution needs no ``feature_group_count``.
    """
    if kernel is None or fwd_out is None:
      return 0.0, 0.0, "float32"
    labels = _LABELS.search(ins.attrs)
    o = labels.group(2).find("o") if labels else -1
    out_features = kernel.dims[o] if 0 <= o < len(kernel.dims) else 1
    flops = 2.0 * fwd_out.elements * kernel.elements / max(out_features, 1)
    return flops, 0.0, _MATMUL_DTYPE.get(kernel.dtype, "float32")

  # -- bytes of one kernel ----------------------------------------------------------------------
  def fusion_bytes(self, ins: _Instr, table: dict[str, _Instr]) -> float:
    """Operands read and results written, refined for slicing readers and in-place updates."""
    callee = _CALLEE.search(ins.attrs)
    body = self.comps.get(callee.group(2), []) if callee else []
    params = {int(b.args): b.name for b in body if b.opcode == "parameter" and b.args.isdigit()}
    users: dict[str, list[_Instr]] = {}
    for b in body:
      for o in b.operands:
        users.setdefault(o, []).append(b)
    roots = [b for b in body if b.root]
    root = roots[0] if roots else None
    outs = [root] if root is not None and root.opcode != "tuple" else [
        next((b for b in body if b.name == o), None) for o in (root.operands if root else ())]
    in_place = {o.operands[0] for o in outs if o is not None and o.opcode == "dynamic-update-slice"}

    read = 0.0
    for k, name in enumerate(ins.operands):
      src = table.get(name)
      size = float(src.nbytes) if src is not None else 0.0
      pname = params.get(k)
      if pname is not None:
        if pname in in_place:
          continue                  # updated in place: only the update is written
        uses = users.get(pname, [])
        if uses and all(u.opcode in ("slice", "dynamic-slice") for u in uses):
          size = float(sum(u.nbytes for u in uses))
      read += size
    written = 0.0
    for k, arr in enumerate(ins.arrays):
      o = outs[k] if k < len(outs) else None
      if o is not None and o.opcode == "dynamic-update-slice" and len(o.operands) > 1:
        upd = next((b for b in body if b.name == o.operands[1]), None)
        written += float(upd.nbytes) if upd is not None else arr.nbytes
      else:
        written += arr.nbytes
    return read + written

  def kernels(self, comp: str, count: int = 1, seen: tuple[str, ...] = ()) -> Iterator[KernelCost]:
    """The kernels one run of ``comp`` launches, each run ``count`` times."""
    if comp in seen:
      return
    table = self.by_name.get(comp, {})
    for ins in self.comps.get(comp, []):
      op = ins.opcode
      if op in _FREE:
        continue
      if op == "while":
        trips = _TRIPS.search(ins.attrs)
        n = int(trips.group(1)) if trips else 1
        for kind, callee in _CALLEE.findall(ins.attrs):
          yield from self.kernels(callee, count * (n if kind == "body" else n + 1),
                                  (*seen, comp))
        continue
      if op == "conditional":
        branches = _BRANCHES.search(ins.attrs)
        names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
        per = [list(self.kernels(b, count, (*seen, comp))) for b in names]
        if per:
          yield from max(per, key=lambda ks: sum(k.bytes_accessed + k.matrix_flops for k in ks))
        continue
      if op == "call":
        callee = _CALLEE.search(ins.attrs)
        if callee:
          yield from self.kernels(callee.group(2), count, (*seen, comp))
        continue
      if op in ("copy-start", "copy"):
        src = table.get(ins.operands[0]) if ins.operands else None
        src_host = bool(src is not None and src.arrays and src.arrays[0].host)
        # copy-start's result is (source, destination, context): the destination's memory space.
        dst = ins.arrays[1] if op == "copy-start" and len(ins.arrays) > 1 else (
            ins.arrays[0] if ins.arrays else None)
        if dst is not None and src_host != dst.host:
          nbytes = float(dst.nbytes)
          yield KernelCost(ins.name, op, 0.0, 0.0, 0.0, host_bytes=nbytes, count=count)
          continue
      matrix, vector, dtype = self.instr_flops(ins, table)
      if op == "fusion":
        nbytes = self.fusion_bytes(ins, table)
      else:
        read = sum(float(table[o].nbytes) for o in ins.operands if o in table)
        written = float(sum(a.nbytes for a in ins.arrays if not (a.dtype == "u8" and op == "custom-call")))
        nbytes = read + written
      reduction = op == "fusion" and "kind=kInput" in ins.attrs or op in ("reduce", "reduce-window")
      yield KernelCost(ins.name, op, matrix, vector, nbytes, matmul_dtype=dtype,
                       reduction=reduction, count=count)


def _first(ins: _Instr | None) -> Array | None:
  return ins.arrays[0] if ins is not None and ins.arrays else None


def hlo_kernels(hlo_text: str) -> tuple[KernelCost, ...]:
  """Every kernel the entry computation of a compiled module's HLO text launches, in order.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(
    ...     jnp.ones((256, 128)), jnp.ones((128, 64))).compile()
    >>> kernels = hlo_kernels(compiled.as_text())
    >>> sum(k.matrix_flops * k.count for k in kernels) == 2 * 256 * 128 * 64
    True
  """
  module = _Module(hlo_text)
  if module.entry is None:
    raise ValueError("`hlo_kernels` needs a module's HLO text with an ENTRY computation "
                     "(`compiled.as_text()`).")
  return tuple(module.kernels(module.entry))
