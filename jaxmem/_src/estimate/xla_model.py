"""What XLA does with the buffers: fusion, layout copies, expansions, CSE and scheduling.

The estimate must describe the compiled program, not the jaxpr. The effects
that dominate on the models we measure (XLA:CPU, jax 0.10.2; ``docs/design.md``,
"What XLA does behind the plan's back"):

* **Fusion.** Elementwise ops are fused into their consumers, so their results
  are never stored: a value whose producer is fusible and whose consumers are
  all fusible is *virtual*, and its inputs stay alive until its last use
  instead (:mod:`jaxmem._src.estimate.lifetimes`). XLA duplicates cheap
  producers into every consumer, however far apart: a ReLU mask kept for the
  backward pass is recomputed there from its float input, which is what stays
  alive. Expensive ops (exp, tanh, divide...) are fused only into a single
  consumer. The fusion class of each primitive is in the registry
  (:class:`~jaxmem._src.ir.primitives.Fusion`); :func:`op_fusion_kind` refines
  it by where a result is used.
* **Layout copies.** A convolution whose operand is not in the backend's native
  layout gets a transposed copy of it (on the CPU the weight-gradient
  convolution transposes both its input and its output gradient), made where
  the operand is made (:func:`early_layout_copies`); a result in another
  layout is transposed while the convolution runs (:func:`hidden_bytes`).
* **Expansions.** ``select_and_scatter_add`` (max-pool gradient) is expanded on
  the CPU into an argmax over the windows, run in the forward pass from index
  arrays of the operand's shape built at the program start, whose index array
  lives until a scatter into zeros in the backward pass
  (:func:`pool_argmax_expansions`).
* **Stored broadcasts** (:func:`shared_broadcasts`), **constants hoisted to the
  program start** (:func:`hoisted_constants`, :func:`hoisted_scalar_broadcasts`),
  **common-subexpression elimination** (:func:`cse_keys`) and **the optimizer
  update scheduled as early as its gradient** (:func:`movable_ops`).

:func:`op_memory_model` gathers the per-op part into one :class:`OpMemory` per op.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxmem._src import _compat
from jaxmem._src.estimate import targets
from jaxmem._src.ir import primitives, substitutions
from jaxmem._src.ir.primitives import Fusion
from jaxmem._src.ir.program import Op, Phase, Program


class OpMemory(NamedTuple):
  """What XLA adds to one op's own inputs and outputs.

  Attributes:
    kind: how the op fuses (:func:`op_fusion_kind`).
    transient: bytes live only while it runs (layout copies, expansions, the
      working set inside a block).
    hoisted: bytes live from the program start until it runs (index arrays,
      constant broadcasts XLA builds up front).
    shared: ``(input position, bytes)`` of operands XLA broadcasts into a
      stored buffer (:func:`shared_broadcasts`).
    early: ``(input position, bytes, layout)`` of operands the op reads
      through a layout copy XLA makes as soon as the operand exists
      (:func:`early_layout_copies`): the copy, not the operand, lives until
      the op; ops reading one value in one ``layout`` share the copy.
  """
  kind: Fusion
  transient: int
  hoisted: int
  shared: tuple[tuple[int, int], ...]
  early: tuple[tuple[int, int, int], ...] = ()


#: A value of :func:`cse_keys`: what XLA's CSE compares besides the operands.
CseKey = tuple[str, str, tuple[tuple[int, str], ...], tuple[str, ...]]


def _nbytes(aval: _compat.AbstractValue) -> int:
  return _compat.aval_nbytes(aval)


def _native_spec(n: int, kind: str) -> tuple[int, ...]:
  spatial = tuple(range(1, n - 1)) if kind != "rhs" else tuple(range(0, n - 2))
  if kind == "rhs":
    return (n - 1, n - 2) + spatial     # HWIO: out features last, in features before
  return (0, n - 1) + spatial           # NHWC: batch first, features last


def hidden_bytes(eqn: _compat.JaxprEqn, backend: str, substituted: bool = False) -> tuple[int, int]:
  """``(transient, hoisted)`` bytes XLA adds for ``eqn`` beyond its inputs and outputs.

  ``transient`` is live only while the op runs; ``hoisted`` is live from the
  program start until the op (index arrays XLA builds once, up front).
  """
  name = eqn.primitive.name
  if backend != "cpu":
    return 0, 0
  if name == "conv_general_dilated":
    out_bytes = _nbytes(eqn.outvars[0].aval)
    # A batch-grouped convolution (the kernel gradient of a grouped or
    # depthwise one) is expanded by XLA:CPU's ConvolutionGroupConverter into
    # a dense convolution whose kernel is masked: its result, `groups` times
    # the kernel gradient, and the masked copy of it (measured on a
    # MobileNet-v2 step: f32[384,3,3,384] and f32[3,3,384,384] for the
    # gradient of a 3x3 depthwise kernel over 384 channels, both live at the
    # compiled peak; the estimate was 7.6% under it without them).
    groups = int(eqn.params.get("batch_group_count", 1) or 1)
    expanded = 2 * out_bytes * groups if groups > 1 else 0
    # Operands in a layout of their own are copied where they are made
    # (`early_layout_copies`); a result in one is written natively, then
    # transposed: both buffers live while the convolution runs.
    dn = eqn.params["dimension_numbers"]
    n = len(eqn.invars[0].aval.shape)
    if tuple(dn.out_spec) != _native_spec(n, "out"):
      return out_bytes + expanded, 0
    return expanded, 0
  if name == "select_and_scatter_add":
    source, operand = eqn.invars[0].aval, eqn.invars[1].aval
    if substituted:
      # reshape + argmax + select: a transposed copy of the operand and the
      # scattered result before its inverse transpose.
      return 2 * _nbytes(operand), 0
    # XLA:CPU's expansion finds the window maxima beside the forward pool
    # (`pool_argmax_expansions`); the scatter itself reads the index array
    # made there (`early_layout_copies`) and a copy of the source.
    return _nbytes(source), 0
  return 0, 0


def pool_argmax_expansions(program: Program,
                           planned: bool = False) -> dict[int, tuple[int, int]]:
  """``{op index: (hoisted, transient)}``: XLA:CPU's max-pool argmax, charged at the forward pool.

  XLA:CPU expands ``select_and_scatter_add`` (the gradient of a max pool)
  into a variadic ``reduce-window`` over the operand and one ``s32`` iota
  per operand dimension (the window maxima and their coordinates), whose
  coordinates are concatenated into one ``s32[source elements, rank]``
  index array, and a ``scatter`` of the source at those indices. The iotas
  are built at the program start; the ``reduce-window`` runs as soon as
  the operand exists, in the forward pass, where the iotas die, and only
  the index array lives until the backward scatter (measured on a UNet
  step, jax 0.10.2: iotas ``s32[12,60,60,24]`` x4 made at the start and
  read once at the forward pool; ``s32[259200,4]`` from there to the
  scatter). The scatter writes into zeros also built at the start, unless
  its result is only added to another gradient of its shape (a UNet's skip
  connection), which XLA scatters into instead (as :func:`_added_into`).
  Charging the iotas until the backward scatter put the estimate +28% over
  the compiled peak. So: the iotas are hoisted bytes of the op where the
  ``reduce-window`` runs, the window maxima a transient of that op, the
  index array (their coordinates) an early copy read by the scatter
  (:func:`early_layout_copies`) and the zeros hoisted bytes of the scatter.
  The ``reduce-window`` runs right after the forward pool that reads the
  same operand (XLA:CPU's schedule of a BatchNorm CNN and of a triplet-loss
  embedder, jax 0.10.2: the pool's ``reduce_window_max`` fusion, then the
  argmax), so the pool's result is live beside the iotas: charged at that
  pool where there is one (triplet embedder -8.1% -> -2.7% of the compiled
  peak, BatchNorm CNNs -1.5..0.0% -> +1.4..+1.9%), else where the operand
  is made. An operand that is an argument is pooled at the start: no iotas.
  ``planned``: as :func:`op_memory_model`, a substituted gradient
  (:mod:`jaxmem._src.ir.substitutions`) expands to none of it.
  """
  if program.backend != "cpu":
    return {}
  out: dict[int, tuple[int, int]] = {}
  for op in program.ops:
    if op.primitive != "select_and_scatter_add" or (planned and substitutions.applies(op.eqn)):
      continue
    source, operand = op.eqn.invars[0].aval, op.eqn.invars[1].aval
    elems = int(np.prod(operand.shape)) if operand.shape else 1
    rank = len(operand.shape)
    x = op.inputs[1]
    maker = program.vars[x].defined_by if isinstance(x, int) else None
    at = maker if maker is not None and maker >= 0 else op.index
    if at != op.index:
      pools = [u for u in program.vars[x].uses
               if u < op.index and program.ops[u].primitive == "reduce_window_max"]
      at = min(pools, default=at)
    hoisted = rank * elems * 4 if at != op.index else 0      # s32 iotas, one per dimension
    # The maxima; their coordinates are the index array, an early copy the
    # scatter reads from here on (`early_layout_copies`).
    transient = _nbytes(source)
    h, t = out.get(at, (0, 0))
    out[at] = (h + hoisted, t + transient)
    if not _added_to_another(program, op.outputs[0]):
      # The zeros the scatter writes into, built at the start with the iotas,
      # unless the gradient is added to another one (a UNet's skip
      # connection), which XLA scatters into instead.
      h, t = out.get(op.index, (0, 0))
      out[op.index] = (h + _nbytes(operand), t)
  return out


def early_layout_copies(eqn: _compat.JaxprEqn, backend: str) -> tuple[tuple[int, int, int], ...]:
  """``(input position, bytes, layout)`` of the operands XLA copies into another layout early.

  A convolution whose operand is not in the backend's native layout reads a
  transposed copy of it. XLA:CPU makes the copy as soon as the operand
  exists, fusing the transpose into a copy of the operand's own producer
  when that is elementwise: a weight-gradient convolution's input (a
  forward activation, batch and features swapped) is transposed in the
  forward pass and the copy lives until the backward convolution, while the
  activation itself dies at its last other use. Measured on XLA:CPU (jax
  0.10.2): a BatchNorm CNN's ``f32[16,28,28,24]`` transposed activation made
  at position 85 of 218 and read at 203; a DCGAN generator's transposed
  BatchNorm+ReLU output live beside the output itself, which the backward
  pass also reads (the estimate was 17% under the compiled peak without
  this rule). Kernels are copied early the same way (they are arguments); an
  output gradient is made just before its convolution, so its copy is
  short-lived wherever it starts.

  ``layout`` tells copies of one value apart: ops that read a value in the
  same layout share one copy (CSE), those reading it in two layouts read
  two. 0 for these; a dot's operands are copied in layouts of their own
  (:func:`dot_layout_copies`).
  """
  if backend != "cpu":
    return ()
  if eqn.primitive.name == "select_and_scatter_add":
    # The argmax index array (`pool_argmax_expansions`), made where the
    # operand is: the scatter reads it, not the operand.
    source, operand = eqn.invars[0].aval, eqn.invars[1].aval
    src_elems = int(np.prod(source.shape)) if source.shape else 1
    return ((1, len(operand.shape) * src_elems * 4, 0),)
  if eqn.primitive.name in _INDEXED:
    return _batched_index_array(eqn)
  if eqn.primitive.name != "conv_general_dilated":
    return ()
  dn = eqn.params["dimension_numbers"]
  n = len(eqn.invars[0].aval.shape)
  out_shape = eqn.outvars[0].aval.shape
  if (all(out_shape[d] == 1 for d in dn.out_spec[2:])
      and all(lo == 0 and hi == 0 for lo, hi in eqn.params["padding"])
      and all(d == 1 for d in eqn.params["lhs_dilation"])):
    # One output position, the window covering the whole input: a dot
    # (the weight gradient of a 1x1 convolution), which reads its operands
    # in any layout.
    return ()
  out = []
  if tuple(dn.lhs_spec) != _native_spec(n, "lhs"):
    out.append((0, _nbytes(eqn.invars[0].aval), 0))
  if tuple(dn.rhs_spec) != _native_spec(n, "rhs"):
    out.append((1, _nbytes(eqn.invars[1].aval), 0))
  return tuple(out)


def dot_layout_copies(program: Program) -> dict[int, tuple[tuple[tuple[int, int, int], ...], int]]:
  """``{op index: (early copies, transient bytes)}`` of the operands XLA:CPU transposes for a dot.

  XLA:CPU runs a batched dot as a batched matrix product whose batch
  dimensions lead: ``DotDecomposer`` transposes an operand whose batch
  dimensions are not its leading ones to ``[batch, free, contracting]`` (the
  left) or ``[batch, contracting, free]`` (the right). That transpose is a
  copy of the operand; CSE merges the copies of one value in one layout
  across every dot that reads it so, and the copy is made where the value
  is (the forward pass) and lives until its last reader (the backward
  pass), while the value itself dies at its last other reader: an early
  copy (``(input position, bytes, layout)``, ``layout`` coding the
  permutation). A step argument is copied just before the dot that reads
  it: transient bytes of that dot.

  Measured on XLA:CPU (jax 0.10.2): an encoder-decoder's attention
  (``einsum("bqhd,bkhd->bhqk")``, batch dimensions 0 and 2) keeps ``[b, h,
  t, d]`` copies of its queries from the forward dots to the backward ones;
  a capsule network's routing reads its ``[b, n, j, o]`` predictions in two
  layouts, ``[b, j, n, o]`` and ``[b, j, o, n]``, and the compiled program
  keeps both copies beside the predictions themselves through the routing
  iterations (the estimate was 22% under the compiled peak without them).

  Left out on purpose: operands whose batch dimensions lead but whose other
  dimensions need reordering (a weight gradient contracting a ``[b, t, d]``
  activation over its first two). XLA:CPU collapses such dimensions into a
  matrix and transposes only what its matmul library cannot read
  transposed, a copy made just before the dot in the backward pass;
  counting them as copies put attention and mixture-of-experts steps 12-23%
  over their compiled peaks. A dot without contracting dimensions is a
  multiply (:func:`_outer_product`), with no copy.

  A cheap product XLA duplicates into every fusion reading it is copied for
  each of them: :func:`duplicated_product_copies`.
  """
  if program.backend != "cpu":
    return {}
  out = {}
  for op in program.ops:
    if op.primitive != "dot_general" or _outer_product(op):
      continue
    (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
    leading = tuple(lb) == tuple(range(len(lb))) and tuple(rb) == tuple(range(len(rb)))
    early, transient = [], 0
    for pos, batch, contract, free_first in ((0, lb, lc, True), (1, rb, rc, False)):
      x = op.inputs[pos]
      if not isinstance(x, int):
        continue
      aval = op.eqn.invars[pos].aval
      upcast = str(aval.dtype) in _HALF_FLOATS
      shape = program.vars[x].shape
      free = [d for d in range(len(shape)) if d not in batch and d not in contract]
      perm = list(batch) + (free + list(contract) if free_first else list(contract) + free)
      # Dimensions of size 1 move no data: the transpose is a bitcast when
      # the others keep their order.
      moved = [p for p in perm if shape[p] != 1]
      transposed = not leading and moved != sorted(moved)
      # A stored slice (`op_fusion_kind`) is written out dense for the
      # matmul library: a dot that needs its dimensions reordered reads a
      # transposed copy of it, made as soon as the slice exists.
      transposed = transposed or (moved != sorted(moved) and _sliced(program, x))
      if not transposed and not upcast:
        continue
      # The global bytes, as for every op's memory: `_op_memory` takes this
      # device's share of a sharded step.
      nbytes = _nbytes(aval) * (2 if upcast else 1)
      if program.vars[x].is_input and not upcast:
        transient += nbytes
      else:
        # A code per permutation, kept within the native columns' int64.
        code = (sum((p + 1) * 64 ** i for i, p in enumerate(perm)) % UPCAST if transposed else 0)
        early.append((pos, nbytes, 1 + code + (UPCAST if upcast else 0)))
    # A bfloat16 result read more than once is written in float32, then
    # converted once (`stored_var_bytes`).
    transient += sum(2 * _nbytes(v.aval) for o, v in zip(op.outputs, op.eqn.outvars)
                     if str(v.aval.dtype) == "bfloat16" and not _bf16_read_once(program, o))
    if early or transient:
      out[op.index] = (tuple(early), transient)
  return out


def duplicated_product_copies(program: Program) -> dict[int, tuple[tuple[int, int, int], ...]]:
  """``{op index: early copies}``: the copies XLA:CPU writes of a cheap product it duplicates.

  Where :func:`_duplicated_operand` holds, XLA stores the product once per
  fusion that reads it, each copy made where the product is made and live
  until its reader. The estimate keeps the product itself for its last
  reader (usually the dot, which waits longest) and gives every earlier
  reader an early copy (``(input position, bytes, DUPLICATE)``, as
  :func:`early_layout_copies`): the same buffers, and the value a plan can
  move stays the one that lives long (offloading a DP-SGD per-example
  gradient from its norm to the weighted sum reaches 0.59 of the unplanned
  peak; with the copy charged to the sum's dot, no plan saw that gap).
  """
  if program.backend != "cpu":
    return {}
  out: dict[int, list[tuple[int, int, int]]] = {}
  done: set[int] = set()
  for op in program.ops:
    if op.primitive != "dot_general" or _outer_product(op):
      continue
    for pos in (0, 1):
      chain = _duplicated_operand(program, op, pos)
      if chain is None or chain[-1] in done:
        continue
      done.add(chain[-1])
      values = set(chain)
      readers = sorted({u for v in chain for u in program.vars[v].uses}
                       - {program.vars[v].defined_by for v in chain[:-1]})
      for r in readers[:-1]:
        reader = program.ops[r]
        for i, x in enumerate(reader.inputs):
          if isinstance(x, int) and x in values:
            out.setdefault(r, []).append((i, program.vars[x].nbytes, DUPLICATE))
  return {r: tuple(c) for r, c in out.items()}


def _duplicated_operand(program: Program, dot: Op, pos: int) -> list[int] | None:
  """The values from ``dot``'s operand ``pos`` back to a cheap product XLA:CPU writes per reader.

  ``None`` where it is not such a product; else the operand, the views it
  is read through and, last, the product (:func:`duplicated_product_copies`).

  XLA's fusion duplicates a cheap producer that is effectively unary (it
  reads at most one operand of its own size, or no more bytes than it
  writes: an outer product of two vectors per example) into every fusion
  that reads it, rather than storing it once. A dot, which fuses no
  producer it does not read alone, then reads a loop fusion of its own that
  computes the product again and writes it out; XLA's breadth-first
  scheduler (XLA:CPU's default, ``xla_cpu_enable_concurrency_optimized_scheduler``)
  runs that fusion as soon as the product's inputs exist, beside the other
  readers' copies, and the copy lives until the dot. Measured on a DP-SGD
  step (``vmap(grad)`` per-example gradients, clipped and summed;
  XLA:CPU, jax 0.10.2): the first layer's ``[64, 784, 256]`` gradient is two
  49 MiB buffers made one after the other from the same operands, one for
  the norm's reduction, one (``copy_bitcast_fusion``) for the sum weighted
  by the clip factors, which waits for every layer's norm; the estimate,
  which stored the product once, was 41.2% under the compiled peak.

  The dot reads the product through a transpose (and maybe reshapes): the
  copy is the product written in the dot's layout, as the reduction's is in
  its own. The product must have a reader other than ``dot`` (the only
  reader takes the product into its own fusion), and must not be a
  broadcast or made from constants. Departure: only dots are modelled; a
  convolution reading such a product is not measured. Looser forms
  over-count: a copy for every dot reading any cheap value put a Fourier
  neural operator 22.7% over its compiled peak (11.4% without; its forward
  activations are products of full-size values, stored once), and one for
  every dot reading an effectively unary product directly put flax ReLU
  MLPs 5-7% over (a ReLU's output, read by the next layer and by its weight
  gradient, is stored once).
  """
  x = dot.inputs[pos]
  if not isinstance(x, int) or program.vars[x].is_input:
    return None
  chain = [x]
  maker = program.ops[program.vars[x].defined_by]
  while maker.primitive in _DUPLICATE_VIEWS and len(maker.input_ids()) == 1:
    x = maker.input_ids()[0]
    if program.vars[x].is_input:
      return None
    chain.append(x)
    maker = program.ops[program.vars[x].defined_by]
  if (op_fusion_kind(program, maker) is not Fusion.CHEAP or len(maker.outputs) != 1
      or maker.primitive == "broadcast_in_dim" or program.constant_like[maker.outputs[0]]):
    # (A broadcast or a value made from constants is built once, up front
    # (`hoisted_constants`, `shared_broadcasts`): a copy from there would
    # live through the whole forward pass; a loss's cotangent of ones read by
    # the last layer's two dots put a two-layer MLP's estimate 20% over.)
    return None
  if not any(program.ops[program.vars[v].defined_by].primitive == "transpose"
             for v in chain[:-1]):
    # Read as it is made, the product is stored once and every dot reads that
    # buffer (a ReLU's output read by the next layer's dot and by its weight
    # gradient: copies for both put flax MLPs 5-7% over their compiled peaks).
    return None
  path = {program.vars[v].defined_by for v in chain[:-1]} | {dot.index}
  if all(u in path for v in chain for u in program.vars[v].uses):
    return None
  out_bytes = program.vars[maker.outputs[0]].nbytes
  full = total = 0
  for y in maker.input_ids():
    v = program.vars[y]
    total += v.nbytes
    if v.defined_by >= 0 and program.ops[v.defined_by].primitive == "broadcast_in_dim":
      continue                     # a broadcast is read with another index: it does not count
    if v.nbytes * 4 >= out_bytes:
      full += 1
  return chain if full <= 1 or total <= out_bytes else None


def stored_var_bytes(program: Program) -> tuple[int, ...]:
  """Per value of ``program``, the bytes XLA stores for it: its own, or a float32 buffer's.

  XLA:CPU has no 16-bit float matmul: a ``dot_general`` of ``bfloat16`` or
  ``float16`` operands reads float32 copies of them (:func:`dot_layout_copies`)
  and writes a float32 result. A ``float16`` result stays stored in float32:
  its readers convert it as they read it, fused into their own loops. A
  ``bfloat16`` one is converted once, right after the dot, into the buffer
  its readers share (the float32 result is the dot's transient:
  :func:`dot_layout_copies`). Measured on XLA:CPU (jax 0.10.2): a ``float16``
  MLP keeps each layer's ``f32[2048,1024]`` matmul output for the ReLU's
  backward pass (the estimate was 50% under the compiled peak without this
  and the operands' copies), where a ``bfloat16`` one keeps a ``bf16`` one
  written by a convert fusion after the matmul (counting it as float32 put
  the estimate 14% over).
  """
  out = [v.nbytes for v in program.vars]
  if program.backend != "cpu":
    return tuple(out)
  for op in program.ops:
    if op.primitive == "dot_general" and not _outer_product(op):
      for o, aval in zip(op.outputs, (v.aval for v in op.eqn.outvars)):
        if str(aval.dtype) == "float16" or _bf16_read_once(program, o):
          out[o] *= 2
  return tuple(out)


#: 16-bit floats: XLA:CPU's dots read them as float32 copies (`dot_layout_copies`).
_HALF_FLOATS = frozenset({"bfloat16", "float16"})
#: The layout code of a copy converted to float32 (`dot_layout_copies`), besides any transpose's.
UPCAST = 1 << 60
#: The layout code of a copy of a product XLA duplicates (`duplicated_product_copies`).
DUPLICATE = 1 << 61
#: Views a duplicated product is read through on its way to a dot (`_duplicated_operand`).
_DUPLICATE_VIEWS = frozenset({"transpose", "reshape", "squeeze", "expand_dims"})


_INDEXED = frozenset({"gather", "scatter", "scatter-add", "scatter_add", "scatter-mul",
                      "scatter-min", "scatter-max", "scatter-sub"})


def _batched_index_array(eqn: _compat.JaxprEqn) -> tuple[tuple[int, int, int], ...]:
  """A gather's or scatter's index array as XLA:CPU rewrites it when it has batching dimensions.

  ``take_along_axis`` gathers with batching dimensions (every axis but the
  one taken along); XLA's ``BatchedGatherScatterNormalizer`` makes them
  explicit: an ``s32[index rows, batching + indexed dimensions]`` array of
  iotas and the indices, built where the indices are and shared by the
  forward gather and the backward scatter (CSE), so it lives from one to the
  other. Measured on a UNet whose per-pixel cross-entropy gathers its
  logits: two ``s32[8,36,36,1,4]`` and ``s32[10368,4]`` arrays at the
  compiled peak, 0.3 MiB of 10.4.
  """
  dn = eqn.params.get("dimension_numbers")
  batching = getattr(dn, "operand_batching_dims", ())
  if not batching:
    return ()
  indexed = getattr(dn, "start_index_map", None)
  if indexed is None:
    indexed = getattr(dn, "scatter_dims_to_operand_dims", ())
  indices = eqn.invars[1].aval
  rows = int(np.prod(indices.shape[:-1])) if len(indices.shape) > 1 else 1
  return ((1, rows * (len(batching) + len(indexed)) * 4, 0),)


def shared_broadcasts(program: Program) -> tuple[tuple[tuple[int, int], ...], ...]:
  """Per op, ``(input position, bytes)`` of operands XLA may broadcast into a stored buffer.

  jax lets elementwise ops broadcast size-1 dimensions (``x[B,H,L,L] /
  s[B,H,L,1]``); XLA makes each such broadcast an explicit HLO ``broadcast``,
  which CSE merges across its readers. Loop fusions recompute it; XLA:CPU's
  YNNPACK reduction fusions cannot take it when another fusion reads it too,
  and it is stored full size (measured on the GPT example: one [B,H,L,L]
  buffer per attention layer and two [B,L,D] per LayerNorm, live from the
  forward use to the backward one; a BatchNorm's broadcasts, read only by
  loop fusions, are not stored). These are the candidates; the estimator
  decides which are stored from the fusions their readers end up in
  (:func:`~jaxmem._src.estimate.lifetimes.estimate`, ``_closed_readers``)
  and charges each stored ``(value, broadcast size)`` pair once, from its
  first reader to the last reduction fusion that reads it (the loop fusions
  among its readers broadcast it again;
  :class:`~jaxmem._src.estimate.lifetimes.Flow`). Values XLA computes from
  constants (masks from ``iota``) are excluded: they are recomputed, not
  kept. A ``FILL_OR_DROP`` gather's masked copy is a candidate the same way
  (:func:`_masked_gather`).
  """
  if program.backend != "cpu":
    return tuple(() for _ in program.ops)
  cands: list[list[tuple[int, int, int]]] = []
  for op in program.ops:
    found = []
    if primitives.facts(op.primitive).fuses_as_elementwise and op.outputs:
      out = program.vars[op.outputs[0]]
      for pos, x in enumerate(op.inputs):
        if not isinstance(x, int) or program.constant_like[x]:
          continue
        v = program.vars[x]
        size = int(np.prod(v.shape)) if v.shape else 1
        if size > 1 and v.nbytes < out.nbytes and len(v.shape) == len(out.shape):
          # bytes of the broadcast in the operand's own dtype, per device:
          # the result's local elements (the step may be sharded)
          out_elems = int(np.prod(out.shape))
          local = out_elems * out.nbytes // out.global_nbytes if out.global_nbytes else out_elems
          nbytes = v.global_nbytes // size * local
          found.append((pos, x, nbytes))
        elif _masked_gather(program, x):
          found.append((pos, x, v.nbytes))
    cands.append(found)
  return tuple(tuple((pos, b) for pos, x, b in found) for found in cands)


def _masked_gather(program: Program, x: int) -> bool:
  """Whether ``x`` is a ``gather`` in ``FILL_OR_DROP`` mode (a segment sum's transpose).

  jax lowers such a gather to a clamped gather and a ``select`` of its
  result against the in-bounds mask: an elementwise op on the gather that,
  like a broadcast (:func:`shared_broadcasts`), loop fusions duplicate into
  themselves and XLA:CPU's reduction fusions take as a stored operand
  (measured on a graph attention step: the backward gather of each layer's
  cotangent is read by a multiply and by a sum, and its masked copy is a
  buffer of its own for the sum, 16 MiB per layer at the compiled peak).
  """
  d = program.vars[x].defined_by
  if d < 0 or program.ops[d].primitive != "gather":
    return False
  mode = program.ops[d].eqn.params.get("mode")
  return getattr(mode, "name", str(mode)) == "FILL_OR_DROP"


def hoisted_scalar_broadcasts(program: Program) -> tuple[int, ...]:
  """Per op, bytes of constant broadcasts XLA:CPU builds at the program start for it.

  An elementwise op with a scalar constant operand (``relu``'s ``max(x, 0)``)
  fused with an avg_pool's ``reduce_window_sum`` into a YNNPACK fusion
  (:attr:`~jaxmem._src.ir.primitives.PrimitiveFacts.ynn_window`) gets that
  scalar as a materialized full-size broadcast, which XLA schedules at the
  start of the program and keeps until the fusion runs (measured on a
  BatchNorm CNN: one buffer of the ReLU's output size per pooling layer).
  """
  out = [0] * program.num_ops
  if program.backend != "cpu":
    return tuple(out)
  for op in program.ops:
    if not primitives.facts(op.primitive).ynn_window:
      continue
    for x in op.input_ids():
      d = program.vars[x].defined_by
      if d < 0:
        continue
      producer = program.ops[d]
      if not primitives.facts(producer.primitive).fuses_as_elementwise:
        continue
      if any((not isinstance(y, int) or (program.constant_like[y] and not program.vars[y].shape))
             for y in producer.inputs) and len(producer.inputs) > 1:
        out[op.index] += program.vars[x].nbytes
  return tuple(out)


# Primitives lowered to HLO ops that XLA's fusion fuses into one reader only
# (their emitted code branches; duplicating it is refused).
_ONE_READER_FUSIONS = frozenset({"pad", "concatenate"})


def op_fusion_kind(program: Program, op: Op) -> Fusion:
  """The registry's fusion class of ``op`` refined by where its result is used in ``program``.

  * Views that write a new buffer layout (``concatenate``, ``pad``, ``stack``)
    fuse into elementwise and reduction consumers like any cheap producer, but
    a library call (a dot, a convolution) reads a stored operand: on the CPU
    they are cheap producers, stored unless every consumer fuses them
    (measured on DenseNet-BC, where the concatenated features are read by
    BatchNorm's statistics and the next layer: estimate -10.7% -> -1.4% of
    the compiled peak, and on the char-LSTM and UNet, whose XLA buffer
    assignments hold the ``concatenate``/``stack`` results).
  * A broadcast of a non-scalar value used both by the forward pass and by the
    backward pass is stored: XLA:CPU hands the backward consumer (a product
    feeding a reduction, or the softmax-denominator divide) to a YNNPACK
    fusion, which cannot fuse a broadcast, so CSE keeps one materialized
    broadcast for both phases (measured on the GPT example's softmax and
    LayerNorm).
  * A ``with_sharding_constraint`` whose operand already has the split it
    asks for is no instruction at all: the partitioner computes the operand
    in that split (:func:`~jaxmem._src.ir.sharding.device_layout` follows
    constraints backwards) and drops the annotation, so its result is its
    operand's buffer, a view. A constraint that changes the split is a
    collective or a local slice writing a new buffer: stored. Measured on a
    tensor-parallel MLP written with constraints on its activations (8 CPU
    devices): estimated 67.0 MiB per device, compiled 34.0 MiB, because the
    ``tanh`` before each constraint and the constraint's result were
    counted as two buffers.
  * On the CPU a slice (``slice``, ``split``, ``dynamic_slice``) that a dot
    or a convolution reads, directly or through bitcast views, is a stored
    buffer, not a view: a matmul library reads a dense operand, and XLA:CPU
    writes the slice out (a ``slice_bitcast_fusion``). Where a weight
    gradient reads that slice with its dimensions reordered, it reads a
    transposed copy of it too (:func:`dot_layout_copies`). Measured on a
    NeRF step whose field splits a dense layer's output into density and
    features: -12.5% -> -5.8% of the compiled peak.
  * On a TPU, transcendental elementwise ops (``tanh``, ``exp``, ``div``)
    fuse into every consumer like cheap ones, each recomputing them: XLA:TPU
    stores neither the GELU's ``tanh`` nor a copy of it for the backward pass
    of the GPT example (measured on the estimate of its step for a v5e:
    +123% -> +97% of the compiled peak).
  """
  facts = primitives.facts(op.primitive)
  if op.primitive == "sharding_constraint" and _keeps_split(program, op):
    return Fusion.VIEW
  if facts.fusion is Fusion.REDUCE and _trivial_reduction(op):
    return Fusion.VIEW
  if op.primitive == "dot_general" and _outer_product(op):
    return Fusion.CHEAP
  if op.primitive == "div" and _by_constant(program, op):
    # XLA's algebraic simplifier turns `x / c` into `x * (1 / c)` for a
    # floating-point constant `c` (a mean's division by the count): a cheap
    # multiply, duplicated into every fusion that reads it.
    return Fusion.CHEAP
  if facts.moves_data and program.backend == "cpu":
    # XLA's elemental emitter opens new basic blocks for a pad or a
    # concatenate, so its fusion refuses to duplicate one: read by more than
    # one instruction it is stored (`OpInvalidatesCache` in XLA's
    # `FusionNodeIndexingEvaluation::CodeDuplicationTooHigh`).
    return Fusion.EXPENSIVE if op.primitive in _ONE_READER_FUSIONS else Fusion.CHEAP
  if op.primitive in _SLICES and program.backend == "cpu" and _read_by_library_call(program, op):
    return Fusion.CHEAP
  if op.primitive == "broadcast_in_dim" and program.backend == "cpu":
    ins = op.input_ids()
    if (ins and not program.constant_like[ins[0]] and program.vars[ins[0]].shape
        and program.vars[ins[0]].nbytes < program.vars[op.outputs[0]].nbytes):
      phases = {program.ops[u].phase for u in program.vars[op.outputs[0]].uses}
      if Phase.BACKWARD in phases and op.phase is Phase.FORWARD:
        return Fusion.MATERIALIZED
  if facts.fusion is Fusion.EXPENSIVE and program.backend == "tpu":
    return Fusion.CHEAP
  if facts.fusion is Fusion.CHEAP and program.backend == "cpu" and _reads_bf16_dot(program, op):
    return Fusion.EXPENSIVE
  return facts.fusion


#: Views that select part of their operand: a new buffer wherever they are stored.
_SLICES = frozenset({"slice", "split", "dynamic_slice"})
#: Views a library call reads a slice through without a copy of its own.
_BITCAST_VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})


def _read_by_library_call(program: Program, op: Op) -> bool:
  """Whether a result of ``op`` reaches a dot or a convolution through bitcast views only."""
  stack = list(op.outputs)
  while stack:
    v = stack.pop()
    for u in program.vars[v].uses:
      reader = program.ops[u]
      if primitives.facts(reader.primitive).matrix_unit and not (
          reader.primitive == "dot_general" and _outer_product(reader)):
        return True
      if reader.primitive in _BITCAST_VIEWS:
        stack.extend(reader.outputs)
  return False


def _sliced(program: Program, vid: int) -> bool:
  """Whether ``vid`` is a slice XLA:CPU stores (through bitcast views): see `op_fusion_kind`."""
  while True:
    k = program.vars[vid].defined_by
    if k < 0:
      return False
    op = program.ops[k]
    if op.primitive in _SLICES:
      return program.backend == "cpu" and _read_by_library_call(program, op)
    if op.primitive not in _BITCAST_VIEWS or len(op.input_ids()) != 1:
      return False
    vid = op.input_ids()[0]


def _bf16_read_once(program: Program, vid: int) -> bool:
  """Whether ``vid`` is a ``bfloat16`` value read by one op (a matmul's result kept in float32)."""
  return program.vars[vid].dtype == "bfloat16" and len(set(program.vars[vid].uses)) == 1


def _reads_bf16_dot(program: Program, op: Op) -> bool:
  """Whether ``op`` reads a ``bfloat16`` matmul's result (converted from float32 as it is read)."""
  for x in op.input_ids():
    d = program.vars[x].defined_by
    if (d >= 0 and program.ops[d].primitive == "dot_general" and not _outer_product(program.ops[d])
        and program.vars[x].dtype == "bfloat16"):
      return True
  return False


def _trivial_reduction(op: Op) -> bool:
  """Whether ``op`` reduces only dimensions of size 1: a reshape once XLA simplifies it.

  XLA's algebraic simplifier rewrites such a reduce as a reshape (a bitcast),
  so it is a view, not a reduction that ends a fusion: a LayerNorm's backward
  pass sums its ``[N, 1]`` row statistics over the size-1 axis (jax's
  transpose of the broadcast), and the chain from the real row sum back to
  the gradient is one fusion in XLA:CPU's compiled program.
  """
  axes = op.eqn.params.get("axes")
  if axes is None or not op.eqn.invars:
    return False
  shape = getattr(op.eqn.invars[0].aval, "shape", None)
  return shape is not None and all(shape[a] == 1 for a in axes)


def _outer_product(op: Op) -> bool:
  """Whether ``op`` is a ``dot_general`` contracting nothing (or size 1 only): a multiply in XLA.

  XLA's algebraic simplifier rewrites a dot without contracting dimensions
  as ``multiply(broadcast(x), broadcast(y))`` (``enable_dot_to_multiply_rewrite``),
  an elementwise product that fuses into its consumers like any other, so
  its result is never stored. jax makes such dots in the backward pass of a
  contraction whose operand carries a dimension the other lacks (the
  cotangent of ``u_hat`` in ``einsum("bnj,bnjo->bjo", c, u_hat)`` is the
  outer product of ``c`` and the output's cotangent). Measured on a capsule
  network's routing (XLA:CPU, jax 0.10.2): the five ``f32[32,10,16,576]``
  cotangents of its routing iterations are one loop fusion of their small
  factors in the compiled program, which jaxmem counted as five stored
  buffers (estimate +40.3% of the compiled peak).
  """
  dn = op.eqn.params.get("dimension_numbers")
  if dn is None:
    return False
  (lhs_contract, rhs_contract), _ = dn
  if not lhs_contract and not rhs_contract:
    return True
  # A contraction over dimensions of size 1 only is the same product: XLA
  # drops the degenerate dimensions and the dot is a `broadcast_multiply`
  # loop fusion (measured, XLA:CPU: `[64,1,256] x [64,1,784]` contracted over
  # the 1 and batched over the 64, jax's per-example weight gradient under
  # `vmap(grad)`).
  shape = getattr(op.eqn.invars[0].aval, "shape", None) if op.eqn.invars else None
  return shape is not None and all(shape[d] == 1 for d in lhs_contract)


def _by_constant(program: Program, op: Op) -> bool:
  """Whether ``op`` divides a floating-point value by a scalar literal or constant."""
  if len(op.inputs) != 2 or not op.eqn.outvars:
    return False
  if not np.issubdtype(np.dtype(op.eqn.outvars[0].aval.dtype), np.floating):
    return False
  d = op.inputs[1]
  if not isinstance(d, int):
    return True                               # a literal
  v = program.vars[d]
  return bool(program.constant_like[d]) and not v.shape


def _keeps_split(program: Program, op: Op) -> bool:
  """Whether a sharding op's result has its operand's per-device split (nothing moves)."""
  ins = op.input_ids()
  if len(ins) != 1 or len(op.outputs) != 1:
    return False
  layout = program.device_layout
  if layout is None:
    return True
  return tuple(layout.counts[ins[0]]) == tuple(layout.counts[op.outputs[0]])


def op_memory_model(program: Program, *, planned: bool) -> tuple[OpMemory, ...]:
  """Per op, its :class:`OpMemory`.

  ``planned``: describe the op as a planned schedule runs it, i.e. by its
  lowering substitution where one applies
  (:mod:`jaxmem._src.ir.substitutions`); otherwise as plain ``jax.jit``
  compiles it. On a sharded program the hidden bytes are this device's share.
  """
  return _op_memory(program, planned, *_walks(program))


def op_memory_models(program: Program) -> tuple[tuple[OpMemory, ...], tuple[OpMemory, ...]]:
  """``(unplanned, planned)`` :func:`op_memory_model` s, sharing the walks they have in common."""
  walks = _walks(program)
  return _op_memory(program, False, *walks), _op_memory(program, True, *walks)


def _walks(program: Program) -> tuple[Any, ...]:
  """The program walks :func:`_op_memory` takes after ``planned``, in its argument order."""
  kinds = tuple(op_fusion_kind(program, op) for op in program.ops)
  return (kinds, unduplicable_ops(program, kinds), shared_broadcasts(program),
          hoisted_scalar_broadcasts(program), scan_stack_zeros(program),
          dot_layout_copies(program), duplicated_product_copies(program))


def scan_stacks_at_start(program: Program) -> frozenset[int]:
  """The stacked outputs of scans, whose buffers XLA:CPU allocates at the program start.

  A scan is a while loop that writes its stacked outputs in place into
  buffers of zeros (:func:`scan_stack_zeros`). The zeros depend on a
  constant only, and XLA:CPU's default scheduler is breadth-first
  (``xla_cpu_enable_concurrency_optimized_scheduler``, see
  ``bench/results/xla_cpu_scheduler.md``): it schedules every broadcast of
  zeros, and every copy of one, before the first loop, so each stack's
  buffer is live from the program start, not from its scan. Read from the
  compiled schedules (jax 0.10.2): a two-layer bidirectional GRU under a CTC
  loss (four ``nn.RNN`` scans) makes all forty ``f32[120,32,128]`` stack
  buffers, its backward scans' ``f32[120,32,256]`` ones and the CTC scan's
  ``f32[120,32,24]`` ones before its first loop, and its compiled peak is
  there (the estimate went from -12.5% to -6.6% of it); a scanned GPT's
  backward scan allocates its weight-gradient stacks before the forward one
  runs (-4.9% -> -0.3%); a scanned GRU -5.4% -> -4.5%. No other corpus step
  moved by more than 0.3%.
  """
  if program.backend != "cpu":
    return frozenset()
  return frozenset(o for op in program.ops if op.primitive == "scan"
                   for o in op.outputs[op.eqn.params["num_carry"]:])


def scan_stack_zeros(program: Program) -> dict[int, int]:
  """``{op index: bytes}``: zeros XLA:CPU copies into scans' stacked outputs, live while each runs.

  A scan is a while loop that writes its stacked outputs in place into
  buffers of zeros. XLA broadcasts the zeros, and CSE merges the broadcasts
  of one shape across every scan of the step; where two or more stacks share
  one, copy insertion copies it into each (each needs a buffer of its own),
  so a stack-sized buffer of zeros is live beside the stacks. A stack whose
  shape is its own writes into its broadcast, with no copy. Charged while the
  scan runs, the largest of its shared shapes: the broadcast is made before
  the loop and, shared, lives through the earlier scans (a two-layer GRU's
  nine ``f32[48,24,320]`` stacks, forward and backward, copied from one
  broadcast; an ``nn.scan`` MLP's two stacks of distinct shapes, no copy).
  Measured on XLA:CPU (jax 0.10.2) against the compiled peak: a scanned
  decoder -4.0% -> -0.3%, a GRU -8.2% -> -5.4%. Charging every scan its
  largest stack, shared or not, put the ``nn.scan`` MLP 41% over; hoisting
  one buffer per shape from the first scan to the last over-counted the
  decoder (+10.9%): at its compiled peak, in the backward pass, the forward
  scans' zeros are gone. Stacks of one shape that all belong to one scan
  share the broadcast with no other loop: copy insertion copies it into all
  but one, which writes into the broadcast itself, so no buffer of zeros is
  live beside them (a Sinkhorn ``fori_loop``'s two ``f32[20,8,256,256]``
  stacks, compiled as the broadcast and one copy of it: the estimate was
  +33.9% of the compiled peak with a third stack-sized buffer charged, now
  +6.0%; the decoder's six ``f32[6,8,72,512]`` stacks compile to the
  broadcast and five copies, and its estimate, no longer charged, went from
  -0.9% to -4.9%: the earlier figure leaned on a buffer XLA does not make).
  """
  if program.backend != "cpu":
    return {}
  stacks = {op.index: [(tuple(v.aval.shape), str(v.aval.dtype), _nbytes(v.aval))
                       for v in op.eqn.outvars[op.eqn.params["num_carry"]:]]
            for op in program.ops if op.primitive == "scan"}
  # Per (shape, dtype), how many scans have a stack of it (two scans sharing
  # a shape means two stacks share its broadcast).
  scans = collections.Counter(key for ys in stacks.values()
                              for key in {(shape, dtype) for shape, dtype, _ in ys})
  out = {index: max((nb for shape, dtype, nb in ys if scans[shape, dtype] > 1), default=0)
         for index, ys in stacks.items()}
  return {index: nb for index, nb in out.items() if nb}


def unduplicable_ops(program: Program, kinds: Sequence[Fusion]) -> frozenset[int]:
  """Forward elementwise ops XLA:CPU stores because it may not duplicate them into every reader.

  XLA's fusion duplicates a producer into each of its readers only if doing
  so reads no more than it writes: a producer of more than one full-size
  operand (``z = fft(x) + dense(x)``) is fused only where it can be fused
  into every reader *on every path* (``InstructionFusion::
  ComputeGloballyUnfusible`` and ``CanFuseOnAllPaths``). A GELU reads ``z``
  directly and through its ``tanh``, which is stored (an expensive op with
  several readers, never duplicated), so ``z`` cannot reach that reader by
  fusion alone and is stored, while its two operands die once it is made.
  The estimate otherwise counts such a ``z`` as fused and keeps both operands
  until its last reader: a Fourier neural operator step (four spectral
  blocks, GELU of the sum of an inverse FFT and a dense layer) was estimated
  at +11.4% of its compiled peak with ``z`` fused, -0.1% with it stored; an
  RK4 neural ODE +9.8% -> +0.2%.

  ``kinds`` are the ops' fusion classes (:func:`op_fusion_kind`). Only ops of
  the forward pass are considered: in the backward pass XLA:CPU reassociates
  a LayerNorm's gradient products into YNNPACK reduction fusions that the
  estimate's own rules (`lifetimes._closed_readers`) already describe, and
  applying the rule there too took a listwise-ranking step from -4.3% to
  -18.7% of its compiled peak. An add that ends a matmul's YNNPACK epilogue
  is left to the epilogue rule (:func:`epilogue_fusions`): XLA:CPU's library
  rewriter takes it into the matmul before instruction fusion runs. Other
  compilers fuse by other rules: empty there.
  """
  if program.backend != "cpu":
    return frozenset()
  ops = program.ops
  pvars = program.vars
  readers = [sorted({u for o in op.outputs for u in pvars[o].uses}) for op in ops]
  candidates = [op.index for op in ops
                if kinds[op.index] is Fusion.CHEAP and op.phase is Phase.FORWARD
                and len(op.outputs) == 1 and len(readers[op.index]) >= 2
                and not _effectively_unary(program, op) and not _ends_matmul_epilogue(program, op)]
  if not candidates:
    return frozenset()
  # Per op, the ops reachable from it (itself included) as a bit mask.
  below = [0] * len(ops)
  for k in range(len(ops) - 1, -1, -1):
    mask = 1 << k
    for u in readers[k]:
      mask |= below[u]
    below[k] = mask
  stored: set[int] = set()
  memo: dict[tuple[int, int], bool] = {}

  def fuses_on_all_paths(p: int, c: int) -> bool:
    # Whether producer `p` can be fused into reader `c` along every path
    # from `p` to `c`: each operand of `c` that `p` reaches must itself be
    # fused into `c`, recursively.
    if c == p:
      return True
    if kinds[c] not in primitives.FUSIBLE_CONSUMERS:
      return False
    key = (p, c)
    if key not in memo:
      ok = True
      for x in set(ops[c].input_ids()):
        q = pvars[x].defined_by
        if q < 0 or q == p or not (below[p] >> q) & 1:
          continue
        kind = kinds[q]
        if (q in stored or kind in (Fusion.MATERIALIZED, Fusion.REDUCE)
            or (kind is Fusion.EXPENSIVE and len(readers[q]) > 1)
            or not fuses_on_all_paths(p, q)):
          ok = False
          break
      memo[key] = ok
    return memo[key]

  # Readers before producers, as XLA walks its post order backwards.
  for k in reversed(candidates):
    if not all(fuses_on_all_paths(k, c) for c in readers[k]):
      stored.add(k)
  return frozenset(stored)


def _effectively_unary(program: Program, op: Op) -> bool:
  """Whether XLA may duplicate ``op`` freely (``EffectivelyAtMostUnary``, or reads <= writes).

  Broadcasts and scalar constants do not count as operands; an operand counts
  as full-size from a quarter of the result's bytes (a boolean mask of a
  float result).
  """
  out = program.vars[op.outputs[0]]
  full = 0
  read = 0
  for x in set(op.input_ids()):
    v = program.vars[x]
    read += int(np.prod(v.shape, dtype=np.int64))
    d = v.defined_by
    if (d >= 0 and program.ops[d].primitive == "broadcast_in_dim") or (
        program.constant_like[x] and not v.shape):
      continue
    if v.nbytes * 4 >= out.nbytes:
      full += 1
  return full <= 1 or read <= int(np.prod(out.shape, dtype=np.int64))


def _ends_matmul_epilogue(program: Program, op: Op) -> bool:
  """Whether ``op`` reads a matmul's result that it alone reads (a YNNPACK epilogue on the CPU)."""
  for x in op.input_ids():
    d = program.vars[x].defined_by
    if (d >= 0 and program.ops[d].primitive == "dot_general"
        and set(program.vars[x].uses) == {op.index}):
      return True
  return False


def _op_memory(program: Program, planned: bool, kinds: Sequence[Fusion],
               unduplicable: frozenset[int], shared: tuple[tuple[tuple[int, int], ...], ...],
               scalar_hoists: tuple[int, ...], zeros: dict[int, int],
               dot_copies: dict[int, tuple[tuple[tuple[int, int, int], ...], int]],
               duplicates: dict[int, tuple[tuple[int, int, int], ...]]
               ) -> tuple[OpMemory, ...]:
  out = []
  pools = pool_argmax_expansions(program, planned)
  for op, sh, sc in zip(program.ops, shared, scalar_hoists):
    subst = planned and substitutions.applies(op.eqn)
    kind = Fusion.MATERIALIZED if subst else (
        Fusion.EXPENSIVE if op.index in unduplicable else kinds[op.index])
    t, h = hidden_bytes(op.eqn, program.backend, substituted=subst)
    early = () if subst else early_layout_copies(op.eqn, program.backend)
    if op.index in dot_copies:
      early, dot_transient = dot_copies[op.index]
      t += dot_transient
    if not subst and op.index in duplicates:
      early = tuple(early) + duplicates[op.index]
    if op.index in pools:
      ph, pt = pools[op.index]
      h, t = h + ph, t + pt
    h += sc
    t += zeros.get(op.index, 0)
    if program.device_fraction is not None:   # sharded: this device's share
      fraction = program.device_fraction[op.index]
      t, h = int(t * fraction), int(h * fraction)
      early = tuple((pos, int(b * fraction), t) for pos, b, t in early)
    out.append(OpMemory(kind, t + op.transient_bytes, h, sh, early))
  return tuple(out)


#: Primitives XLA lowers to an update of their first operand's buffer in place.
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                       "scatter-max", "dynamic_update_slice"})


def cse_keys(program: Program) -> tuple[CseKey | None, ...]:
  """Per op, what XLA's common-subexpression elimination compares, or ``None``.

  XLA merges instructions with the same opcode, attributes and operands
  (HLO CSE), so an op repeated on the same inputs is computed and stored
  once. flax's ``OptimizedLSTMCell`` concatenates its gate kernels at every
  time step: the jaxpr has one ``[hidden, 4*hidden]`` copy per step, XLA's
  buffer assignment one (measured on the char-LSTM example). The key holds
  the primitive and its parameters;
  :func:`~jaxmem._src.estimate.lifetimes.estimate` adds the operands. Ops
  with bodies, effects or random bits are never merged
  (:attr:`~jaxmem._src.ir.primitives.PrimitiveFacts.cse`), and neither is a
  value an in-place op writes into (the zeros a ``scatter-add`` accumulates
  into): CSE merges such buffers, then copy insertion gives every in-place
  writer but one a copy of its own (measured on a skip-gram step whose three
  scatter-adds into table-sized zeros hold three buffers from the forward
  pass on: -20.7% -> the compiled peak when they were merged into one).
  """
  # (Two scatter-adds whose results are only summed are one scatter to XLA's
  # algebraic simplifier, with their indices and updates concatenated, when
  # the concatenated updates have fewer elements than the operand: one
  # accumulator between them, which CSE's merge models. Measured on XLA:CPU
  # by sweeping both update counts against a [1000, 16] table: 999 rows of
  # updates were combined, 1000 were not; a skip-gram whose two lookups of
  # one table gather 73,728 rows of a 40,009-row table keeps both scatters,
  # each on its own copy of the zeros.)
  combined: set[int] = set()
  for op in program.ops:
    if op.primitive in ("add", "add_any") and len(op.input_ids()) == 2:
      makers = [program.vars[x].defined_by for x in op.input_ids()]
      if all(m is not None and m >= 0 and program.ops[m].primitive == "scatter-add"
             and len(program.vars[x].uses) == 1 for m, x in zip(makers, op.input_ids())):
        if _combined_updates_fit(program, [program.ops[m] for m in makers]):
          combined.update(makers)
  written = {op.inputs[0] for op in program.ops
             if op.primitive in IN_PLACE and op.index not in combined
             and op.inputs and isinstance(op.inputs[0], int)}
  keys: list[CseKey | None] = []
  for op in program.ops:
    eqn = op.eqn
    if (eqn.effects or not op.outputs or not primitives.facts(op.primitive).cse or op.has_body
        or not written.isdisjoint(op.outputs)):
      keys.append(None)
      continue
    try:
      params = repr(sorted(eqn.params.items()))
      # literals with their positions: `x - 1` and `1 - x` read the same values
      literals = tuple((i, repr(x)) for i, x in enumerate(op.inputs) if not isinstance(x, int))
    except Exception:  # noqa: BLE001 (a param without a stable repr: do not merge)
      keys.append(None)
      continue
    keys.append((op.primitive, params, literals,
                 tuple(str(program.vars[o].aval) for o in op.outputs)))
  return tuple(keys)


def _combined_updates_fit(program: Program, scatters: Sequence[Op]) -> bool:
  """Whether the scatters' updates, concatenated, have fewer elements than their operand."""
  def size(x: object) -> int:
    return int(np.prod(program.vars[x].aval.shape)) if isinstance(x, int) else 1
  if any(len(op.inputs) < 3 for op in scatters):
    return False
  return sum(size(op.inputs[2]) for op in scatters) < size(scatters[0].inputs[0])


def hoisted_constants(program: Program) -> frozenset[int]:
  """Constant-like values XLA computes at the program start.

  Measured on XLA:CPU: a constant operand of a library call (``x @ ones``, the
  cotangent broadcast of a ``sum`` feeding a matmul) is scheduled first and
  lives until its use; so are the zeros a ``scatter-add`` accumulates into
  (an embedding's or a ``segment_sum``'s gradient): a DLRM step's ten
  table-sized zero buffers are all created in the forward pass and live
  until their scatters in the backward pass, 19 MiB at its peak that the
  estimate missed (-22.4% of the compiled peak), and so are the zeros of a
  nearest resize's gradient, whose indices are constants. Constants feeding
  fusions are created next to their consumer (or fused away).
  ``select_and_scatter``'s hoisted iotas and zeros are charged by its own
  rule (:func:`pool_argmax_expansions`).
  """
  cpu = program.backend == "cpu"

  def hoisting(v: int, u: int) -> bool:
    op = program.ops[u]
    if primitives.facts(op.primitive).matrix_unit:
      return True
    # The accumulator only (operand 0), not constant updates (a sum's
    # cotangent), whatever the indices: a GroupNorm UNet's nearest-resize
    # gradients scatter into zeros made at the start (the estimate -9.8% of
    # its compiled peak without them; an earlier exclusion of constant
    # indices had been measured while max-pool iotas were over-counted).
    return (cpu and op.primitive == "scatter-add" and op.inputs[0] == v
            and not _added_into(program, op))

  return frozenset(
      v.id for v in program.vars
      if program.constant_like[v.id] and not v.is_input
      and any(hoisting(v.id, u) for u in v.uses))


def _a_scatter(program: Program, var: int, depth: int) -> bool:
  """Whether ``var`` is a scatter-add in XLA's program: made by one, or an addition one folds into."""
  maker = program.vars[var].defined_by
  if maker < 0:
    return False
  op = program.ops[maker]
  if op.primitive == "scatter-add":
    return True
  if op.primitive not in ("add", "add_any") or depth <= 0:
    return False
  for x in op.inputs:
    if isinstance(x, int) and program.vars[x].defined_by >= 0:
      made = program.ops[program.vars[x].defined_by]
      if made.primitive == "scatter-add" and _added_into(program, made, depth - 1):
        return True
  return False


def _added_into(program: Program, scatter: Op, depth: int = 4) -> bool:
  """Whether XLA folds ``add(x, scatter-add(zeros, i, u))`` into ``scatter-add(x, i, u)``.

  XLA's algebraic simplifier accumulates a scatter-add whose only reader is
  an addition straight into the other addend: the zeros are never made. JAX
  writes that form for the gradient of a gather whose operand has another
  use, e.g. a cross-entropy's ``take_along_axis`` beside its softmax, or a
  tied embedding's lookup beside its output projection (measured on XLA:CPU,
  an MQA language model: both scatters write into the other gradient, where
  the estimate held a [6,55,1201] zero buffer from the program start, +12%
  of the compiled peak).
  """
  zeros = program.vars[scatter.inputs[0]].defined_by
  if zeros < 0 or program.ops[zeros].primitive != "broadcast_in_dim":
    return False
  fill = program.ops[zeros].inputs[0]
  if not isinstance(fill, _compat.Literal) or np.any(np.asarray(fill.val) != 0):
    return False
  (out,) = scatter.outputs
  return _added_to_another(program, out, depth)


def _added_to_another(program: Program, out: int, depth: int = 4) -> bool:
  """Whether the only reader of ``out`` adds it to another value of its shape that is no scatter."""
  uses = program.vars[out].uses
  if len(uses) != 1:
    return False
  add = program.ops[uses[0]]
  if add.primitive not in ("add", "add_any") or len(add.inputs) != 2:
    return False
  other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
  if not isinstance(other, int) or other == out:
    return False
  if _a_scatter(program, other, depth):
    # A scatter added to a scatter is not taken as folded: XLA keeps the
    # second one's zeros when the first was folded into the gradient before
    # it (a graph net's senders and receivers; -4.3% -> -7.5% of the
    # compiled peak when both were taken as folded), and two scatters into
    # zeros are one to `cse_keys` (a skip-gram's two lookups in one table).
    # Where XLA concatenates the second into the folded first instead (two
    # lookups of a tied embedding table, measured), the estimate counts one
    # table of zeros too many.
    return False
  return (program.vars[other].aval.shape == program.vars[out].aval.shape
          and program.vars[other].aval.dtype == program.vars[out].aval.dtype)


def in_place_operands(program: Program) -> tuple[int, ...]:
  """Per op, the position among its value inputs (``op.input_ids()``) of the operand whose buffer
  it writes its result into, or -1.

  A scatter writes into its first operand (:data:`IN_PLACE`). An addition
  that XLA's simplifier folds a scatter-add into (:func:`_added_into`)
  becomes that scatter, writing into the other addend: the scatter's result
  and the sum are one buffer. Measured on XLA:CPU, a WaveNet whose
  cross-entropy's ``take_along_axis`` gradient is added to the softmax
  gradient: counting both put the estimate +14% over the compiled peak.
  """
  out = [-1] * program.num_ops
  for op in program.ops:
    if op.primitive in IN_PLACE and op.inputs and isinstance(op.inputs[0], int):
      out[op.index] = 0
  if program.backend == "cpu":
    for op in program.ops:
      if op.primitive != "scatter-add" or out[op.index] != 0 or not _added_into(program, op):
        continue
      (res,) = op.outputs
      add = program.ops[program.vars[res].uses[0]]
      ids = add.input_ids()
      if res in ids and out[add.index] < 0:
        out[add.index] = ids.index(res)
  return tuple(out)


def movable_ops(program: Program) -> tuple[bool, ...]:
  """Ops XLA may run as soon as their inputs exist: the update after the backward pass.

  Ops after the last backward op that are not part of the backward pass (the
  optimizer's per-parameter arithmetic); see
  :func:`~jaxmem._src.estimate.lifetimes.estimate`.
  """
  backward = [op.index for op in program.ops if op.phase is Phase.BACKWARD]
  if not backward:
    return (False,) * program.num_ops
  last = backward[-1]
  return tuple(op.index > last and op.phase is Phase.OTHER and not op.eqn.effects
               for op in program.ops)


def donation_copies(program: Program) -> dict[int, int]:
  """``{donated argument id: op index}``: arguments XLA copies before writing their new value in place.

  A result written into a donated argument's buffer
  (:attr:`~jaxmem._src.ir.program.Program.donation_aliases`) overwrites the
  old value; XLA's copy insertion keeps a copy of the old value when some read
  of it is not ordered before the op that makes the new one in the dataflow
  graph (the backward pass's ``dy @ W.T`` is not ordered with the update
  that needs only ``dW``). Measured on XLA:CPU (an MLP VAE with its adam
  state donated): each such parameter is copied at the program start and the
  copy lives until the update reads it; a parameter only the forward pass
  reads (the first layer's weight) is not copied. The value maps to the op
  that makes the new value (where the copy dies). The argument's own buffer
  holds temporaries meanwhile (:func:`~jaxmem._src.estimate.lifetimes.estimate`,
  ``_reuse_copied_arguments``). XLA:CPU only: the other compilers' copy
  placement is not measured.
  """
  if program.backend != "cpu" or not program.donation_aliases:
    return {}
  copies: dict[int, int] = {}
  for out, arg in program.donation_aliases.items():
    maker = program.vars[out].defined_by
    if maker is None or maker < 0:
      continue
    before = _ancestors(program, maker)
    if any(u != maker and u not in before for u in program.vars[arg].uses):
      copies[arg] = maker
  return copies


def _ancestors(program: Program, index: int) -> set[int]:
  """Indexes of the ops that op ``index`` depends on, transitively."""
  seen: set[int] = set()
  stack = [index]
  while stack:
    for x in program.ops[stack.pop()].input_ids():
      d = program.vars[x].defined_by
      if d is not None and d >= 0 and d not in seen:
        seen.add(d)
        stack.append(d)
  return seen


#: :func:`operand_fusions`: the op fuses its elementwise operands wherever
#: they are read (XLA:TPU, XLA:GPU), or only an operand it alone reads (XLA:CPU).
FUSES_ANY, FUSES_SOLE = 1, 2


def operand_fusions(program: Program) -> tuple[int, ...]:
  """Per op, whether the compiler fuses elementwise producers into its operands.

  XLA:TPU fuses the elementwise chain that feeds a dot into the dot's own
  fusion, so the chain's result is never stored and it is recomputed at
  every such dot, in the backward pass too, from the values it reads
  (measured on the GPT example for a v5e: the softmax probabilities are
  recomputed inside both the forward ``probs @ v`` fusion and the backward
  one from the stored masked logits, and the GELU output inside the next
  layer's matmuls from the stored pre-activation: estimate +97% -> +10% of
  the compiled peak; ``bench/results/tpu_estimate.md``).

  Convolutions are left out on purpose. XLA:TPU does the same for some
  convolution operands (a ResNet-18 stores its convolution outputs, not
  their BatchNorm + ReLU) but not for others (a UNet stores the ReLU output
  of a convolution's output fusion next to the convolution's own output);
  counting every convolution operand as fused took the estimate of the
  ResNet-18 from +31% to -15% and of held-out VGG and DenseNet steps to -23%
  and -29%. An estimate below the compiled peak misleads a budget more than
  one above it, so convolutions keep XLA:CPU's rule (operands stored).
  XLA:GPU's gemm fusions do the same (a Dense + ReLU stack for an H100 stores
  each dot's output, not the bias add or the ReLU: the demo MLP's estimate
  +61.5% -> +7.7%, the GPT's +14.3% -> -2.8%;
  ``bench/results/gpu_h100_estimate.md``). Those are :data:`FUSES_ANY`.

  XLA:CPU hands a float32 matmul to a YNNPACK fusion that grows up into an
  elementwise operand only when every reader of the operand is inside the
  fusion (``LibraryRewriter::AddFusionCandidates``): :data:`FUSES_SOLE`, an
  operand the matmul alone reads, directly. Measured on a K-means step:
  ``2.0 * points`` before ``@ centroids.T`` is computed inside the matmul's
  fusion, never stored (the estimate was +25% of the compiled peak with it
  stored). An operand also read elsewhere (a forward activation the
  backward pass reads too) stays stored. YNNPACK takes only a dot whose
  left operand contracts its last dimension after its batch dimensions; a
  weight gradient ``x.T @ g`` written as a contraction over the rows stays
  XLA's own dot, with stored operands (a ReLU output read by such a dot:
  the estimate 20% under the compiled peak with it counted as fused).
  """
  if program.backend == "cpu":
    return tuple(FUSES_SOLE if op.primitive == "dot_general" and all(
        program.vars[x].dtype == "float32" for x in op.input_ids()) and _ynn_dot(op) else 0
                 for op in program.ops)
  if program.backend not in ("tpu", "gpu"):
    return (0,) * program.num_ops
  return tuple(FUSES_ANY if op.primitive == "dot_general" else 0 for op in program.ops)


def _ynn_dot(op: Op) -> bool:
  """Whether XLA:CPU hands ``op`` (a ``dot_general``) to YNNPACK: its left operand canonical.

  ``IsDotSupportedByYnn`` wants the left operand's batch dimensions first and
  its contracting dimension last (``lhs_canonical``).
  """
  (lhs_contract, _), (lhs_batch, _) = op.eqn.params["dimension_numbers"]
  rank = len(op.eqn.invars[0].aval.shape)
  return (tuple(lhs_batch) == tuple(range(len(lhs_batch)))
          and tuple(lhs_contract) == (rank - 1,))


#: Per op, the results it stores nothing for: ``(result index, input
#: positions, result indexes)``, the result's bytes being those of the inputs
#: and results named (see :func:`shard_map_forwards`).
Forwards = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]

# Body primitives that give each device its operand's buffer as is.
_BODY_IDENTITY = frozenset({"pvary"})


def shard_map_forwards(program: Program) -> tuple[Forwards, ...]:
  """Per op, the ``shard_map`` results XLA holds no buffer of their own for.

  XLA inlines a ``shard_map`` body into the step, so what jax's partial
  evaluation makes its results (the residuals the backward ``shard_map``
  reads) are values of one program, not a block's stored outputs:

  * a result that is a body argument as it came in (or through ``pvary``,
    which only retypes it) is the argument's buffer: the input it came from
    lives as long as the result does, and nothing more is stored;
  * a result that is a cheap elementwise op of body arguments, other
    results and literals (``1 - tanh(x)`` of tanh's derivative) is fused
    into its readers when every reader fuses it (an elementwise op, or a
    ``shard_map`` whose body reads it only in elementwise ops): the values
    it is made from live as long as it does.

  Measured on tensor-parallel MLP blocks written with ``jax.shard_map`` (8
  CPU devices, 6 blocks): the forward body's three per-device
  ``[2048, 256]`` residuals were counted as stored buffers (67.3 MiB per
  device estimated, 34.0 MiB compiled), where XLA stores one of them.
  """
  out: list[Forwards] = []
  for op in program.ops:
    body = _compat.shard_map_body(op.eqn)
    out.append(() if body is None else _forwards_of(program, op, body))
  return tuple(out)


def _forwards_of(program: Program, op: Op, body: _compat.Jaxpr) -> Forwards:
  # The input position each body argument (or its `pvary`) comes from, and
  # the result index of each returned value.
  arg_pos: dict[Any, int] = {v: i for i, v in enumerate(body.invars)}
  producer: dict[Any, _compat.JaxprEqn] = {}
  for e in body.eqns:
    for v in e.outvars:
      producer[v] = e
    if (e.primitive.name in _BODY_IDENTITY and len(e.invars) == 1
        and not isinstance(e.invars[0], _compat.Literal) and e.invars[0] in arg_pos):
      arg_pos[e.outvars[0]] = arg_pos[e.invars[0]]
  out_index = {}
  for k, v in enumerate(body.outvars):
    if not isinstance(v, _compat.Literal):
      out_index.setdefault(v, k)
  forwards = []
  for k, v in enumerate(body.outvars):
    vid = op.outputs[k]
    if isinstance(v, _compat.Literal) or program.vars[vid].is_output:
      continue
    if v in arg_pos:
      if isinstance(op.inputs[arg_pos[v]], int):
        forwards.append((k, (arg_pos[v],), ()))
      continue
    e = producer.get(v)
    facts = None if e is None else primitives.facts(e.primitive.name)
    if facts is None or facts.fusion is not Fusion.CHEAP or not facts.elementwise:
      continue
    ins, outs, ok = [], [], True
    for x in e.invars:
      if isinstance(x, _compat.Literal) or not x.aval.shape:
        continue          # literals and scalars (a pvary'd 1.0) cost nothing
      if x in arg_pos and isinstance(op.inputs[arg_pos[x]], int):
        ins.append(arg_pos[x])
      elif x in out_index and out_index[x] != k:
        outs.append(out_index[x])
      else:
        ok = False
    if ok and _every_reader_fuses(program, vid):
      forwards.append((k, tuple(ins), tuple(outs)))
  return tuple(forwards)


def forwarded_values(forwards: Forwards, inputs: Sequence[Any],
                     outputs: Sequence[int]) -> dict[int, tuple[int, ...]]:
  """One op's :data:`Forwards` as ``{result id: source ids}`` (``Flow.forwarded``).

  ``inputs`` and ``outputs`` are the op's operand and result ids, in the
  unplanned program or in a schedule's step.
  """
  return {outputs[k]: tuple(inputs[p] for p in ins) + tuple(outputs[j] for j in outs)
          for k, ins, outs in forwards}


def _every_reader_fuses(program: Program, vid: int) -> bool:
  uses = program.vars[vid].uses
  if not uses:
    return False
  for u in uses:
    reader = program.ops[u]
    body = _compat.shard_map_body(reader.eqn)
    if body is None:
      if op_fusion_kind(program, reader) not in primitives.FUSIBLE_CONSUMERS:
        return False
      continue
    for pos, x in enumerate(reader.inputs):
      if x != vid:
        continue
      inner = body.invars[pos]
      for e in body.eqns:
        if any(y is inner for y in e.invars) and (
            primitives.facts(e.primitive.name).fusion not in primitives.FUSIBLE_CONSUMERS):
          return False
  return True


def epilogue_fusions(program: Program) -> tuple[bool, ...]:
  """Per op, whether the compiler fuses it into an elementwise epilogue that reads it alone.

  XLA:CPU hands a matmul to a YNNPACK fusion together with the cheap
  elementwise ops that follow it: in a K-means step,
  ``|x|^2 - 2 x @ c.T + |c|^2`` is one ``ynn_fusion`` whose only stored
  result is the distances, not the product (measured: an estimate of +67% of
  the compiled peak, one ``[n, k]`` buffer counted twice). The lifetime
  estimator applies it where the matmul's only reader starts a chain of
  cheap elementwise ops whose result is stored
  (:func:`~jaxmem._src.estimate.lifetimes.estimate`). Other compilers, and
  convolutions, keep the product.
  """
  if program.backend != "cpu":
    return (False,) * program.num_ops
  return tuple(op.primitive == "dot_general" and _arithmetic_epilogue(program, op.outputs[0])
               for op in program.ops)


# The elementwise ops measured inside a YNNPACK matmul fusion's epilogue. A
# ReLU gradient's `select_n` is not one: the backward matmul feeding it is
# stored (DLRM: the estimate fell 1-1.4 points below the compiled peak when
# it was counted as fused).
_YNN_EPILOGUE = frozenset({"add", "add_any", "sub", "mul", "max", "min", "neg"})


def _arithmetic_epilogue(program: Program, vid: int) -> bool:
  """Whether ``vid``'s chain of single readers starts with arithmetic ops only.

  Walks while each value has exactly one reader; the lifetime estimator
  decides where the chain's stored result is.
  """
  for _ in range(64):
    uses = program.vars[vid].uses
    if len(set(uses)) != 1:
      return True
    reader = program.ops[uses[0]]
    if reader.primitive not in _YNN_EPILOGUE:
      return False
    if len(reader.outputs) != 1:
      return False
    vid = reader.outputs[0]
  return True


# How an op reads its operands inside a fusion (`indexing_kinds`): with the
# index of its own result (elementwise ops, transposes), with a new index
# (every other shape change), with a new index and branching code (pad,
# concatenate), or a broadcast (which XLA fuses whatever it costs).
INDEX_SAME, INDEX_NEW, INDEX_BRANCHES, INDEX_BROADCAST = 0, 1, 2, 3
#: XLA's limit on how many times a fused producer may be emitted
#: (`FusionNodeIndexingEvaluation::kAllowedCodeDuplication`).
ALLOWED_CODE_DUPLICATION = 15


def indexing_kinds(program: Program) -> tuple[int, ...]:
  """Per op, how XLA:CPU's fusion indexes its operands (``INDEX_*``); ``()`` elsewhere.

  XLA fuses a producer into a consumer's fusion only while the code it
  emits stays small: the producer is emitted once per distinct index its
  readers in the fusion compute (an elementwise reader passes its own index
  on; a slice, pad, reshape or broadcast computes a new one), and
  ``FusionNodeIndexingEvaluation::CodeDuplicationTooHigh`` refuses a fusion
  that would emit it more than ``ALLOWED_CODE_DUPLICATION`` times, or more
  than once for a pad or a concatenate (their code branches: XLA's
  ``ElementalIrEmitter::OpInvalidatesCache``), broadcasts excepted. The
  lifetime estimator counts the emissions the same way
  (:func:`~jaxmem._src.estimate.lifetimes.estimate`). Measured on a
  diagonal state-space model whose recurrence is a ``lax.associative_scan``:
  its backward pass is a lattice of slices, pads and sums that XLA:CPU
  stores in part, where the estimate had fused it all.
  """
  if program.backend != "cpu":
    return ()
  out = []
  for op in program.ops:
    if op.primitive in _ONE_READER_FUSIONS:
      out.append(INDEX_BRANCHES)
    elif op.primitive == "broadcast_in_dim":
      out.append(INDEX_BROADCAST)
    elif op.primitive == "transpose":
      out.append(INDEX_SAME)
    elif (primitives.facts(op.primitive).shape is primitives.Shape.ELEMENTWISE
          and len(op.outputs) == 1
          and all(program.vars[x].shape == program.vars[op.outputs[0]].shape
                  for x in op.input_ids())):
      out.append(INDEX_SAME)
    else:
      out.append(INDEX_NEW)
  return tuple(out)


def on_chip_bytes(program: Program) -> int:
  """Temporaries the target's compiler keeps on chip, off the device-memory peak (TPU VMEM).

  XLA:TPU's memory-space assignment places temporaries in the chip's VMEM
  for part of their lives; the model lets up to
  :attr:`~jaxmem._src.estimate.targets.Chip.on_chip_bytes` of the live
  temporaries at any point stay there, each no larger than that (a
  ResNet-18 step for a v5e keeps its 128 MiB activations in HBM, and no
  buffer that large fits in 112 MiB). 0 for other backends.
  """
  if program.backend != "tpu":
    return 0
  chip = targets.get_target(program.target).chip
  return chip.on_chip_bytes if chip is not None else 0


__all__ = ["ALLOWED_CODE_DUPLICATION", "CseKey", "IN_PLACE", "INDEX_BRANCHES", "INDEX_BROADCAST",
           "INDEX_NEW", "INDEX_SAME", "OpMemory", "cse_keys", "donation_copies",
           "dot_layout_copies", "duplicated_product_copies", "early_layout_copies",
           "epilogue_fusions", "forwarded_values",
           "hidden_bytes", "hoisted_constants", "hoisted_scalar_broadcasts", "in_place_operands",
           "indexing_kinds", "movable_ops", "on_chip_bytes", "op_fusion_kind", "op_memory_model",
           "op_memory_models", "operand_fusions", "scan_stacks_at_start", "shard_map_forwards",
           "shared_broadcasts", "unduplicable_ops"]
