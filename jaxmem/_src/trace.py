"""Trace: a step and its arguments -> a flat :class:`Program`.

The step is traced with ``jax.make_jaxpr`` and flattened into one program order:
nested ``jit`` and ``custom_jvp``/``custom_vjp`` calls are inlined, other
higher-order primitives (``scan``, ``while``, ``cond``, ``checkpoint``) stay
opaque blocks whose inner working set is charged to the block. Every variable
gets its bytes, defining op, uses, role and source line (DESIGN.md, "Program").
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import re
from typing import Any, Callable, Sequence

import numpy as np

import jax

from jaxmem._src import _compat, sharding
from jaxmem._src import blocks as _blocks


class Role(str, enum.Enum):
  """What a variable is, for reports and for the planners."""
  PARAMETER = "parameter"
  OPTIMIZER_STATE = "optimizer_state"
  INPUT = "input"              # other step arguments: batch, labels, rng, step count
  CONSTANT = "constant"        # constants captured by the traced program
  ACTIVATION = "activation"    # forward value saved for the backward pass
  GRADIENT = "gradient"        # value computed by the backward pass
  TEMPORARY = "temporary"      # everything else
  OUTPUT = "output"            # a non-gradient result of the step (new params, loss)


class Phase(str, enum.Enum):
  FORWARD = "forward"
  BACKWARD = "backward"
  OTHER = "other"


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
  """One equation of the flat program.

  Attributes:
    index: position in program order.
    eqn: the JAX equation (primitive and params) to re-bind when rewriting.
    inputs: variable ids, or ``Literal`` objects for inline literals.
    outputs: variable ids.
    phase: forward / backward (under ``transpose``) / other.
    name_stack: JAX name stack, joined across inlined calls.
    source: ``file:line`` of the user code that emitted it.
    transient_bytes: working memory inside an opaque block beyond its inputs
      and outputs (0 for plain primitives).
    module: module path (see :attr:`module_path`).
  """
  index: int
  eqn: Any
  inputs: tuple[Any, ...]
  outputs: tuple[int, ...]
  phase: Phase
  name_stack: Any
  source: str
  transient_bytes: int = 0
  module: str | None = None

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def module_path(self) -> str:
    """flax linen module path from the name stack, else the ``__call__`` classes on the stack."""
    return self.module if self.module is not None else module_path(str(self.name_stack))

  def input_ids(self) -> list[int]:
    return [x for x in self.inputs if isinstance(x, int)]


# Primitives whose results differ between two identical-looking calls, or
# that XLA keeps apart (custom calls, collectives, copies made on purpose).
_NEVER_MERGED = frozenset({
    "rng_bit_generator", "rng_uniform", "random_bits", "iota_2x32_shape", "ffi_call",
    "custom_call", "optimization_barrier", "copy", "copy_p", "device_put", "pure_callback",
    "io_callback", "debug_callback", "psum", "all_gather", "ppermute", "all_to_all",
    "reduce_scatter", "axis_index"})


@dataclasses.dataclass(frozen=True)
class VarInfo:
  """One variable (buffer) of the program.

  Attributes:
    id: index into ``Program.vars``.
    aval: abstract value (shape, dtype).
    nbytes: bytes per device: the local shard's size when the step is sharded
      over several devices (:mod:`jaxmem._src.sharding`), else the whole value.
    defined_by: index of the defining op; -1 for arguments and constants.
    uses: indices of the ops that read it, ascending.
    role: see :class:`Role`.
    name: argument path for inputs (``params['Dense_0']['kernel']``), module path otherwise.
    source: ``file:line`` where it was made (the argument path for inputs).
    is_output: returned by the step.
    global_nbytes: bytes of the whole (unsharded) value; equals ``nbytes``
      unless the value is split over devices.
  """
  id: int
  aval: Any
  nbytes: int
  defined_by: int
  uses: tuple[int, ...]
  role: Role
  name: str
  source: str
  is_output: bool
  global_nbytes: int = -1

  def __post_init__(self) -> None:
    if self.global_nbytes < 0:     # not given: an unsharded value
      object.__setattr__(self, "global_nbytes", self.nbytes)

  @property
  def is_input(self) -> bool:
    return self.defined_by < 0

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self.aval, "shape", ()))

  @property
  def dtype(self) -> str:
    return str(getattr(self.aval, "dtype", "?"))

  @property
  def type_str(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.shape))}]"


_TRANSFORM = re.compile(r"[A-Za-z_]+\(")


@functools.lru_cache(maxsize=8192)
def module_path(name_stack: str) -> str:
  """``'transpose(jvp(MLP))/Dense_0'`` -> ``'MLP/Dense_0'``."""
  path = _TRANSFORM.sub("", name_stack).replace(")", "")
  return "/".join(p for p in path.split("/") if p)


def _is_optax_state(x: Any) -> bool:
  return type(x).__module__.split(".")[0] == "optax" and hasattr(x, "_fields")


def _nnx_variable_kind(x: Any) -> str | None:
  """``'Param'``/``'BatchStat'``/... for a flax nnx ``Variable``, else ``None``."""
  mro = type(x).__mro__
  if any(c.__name__ == "Variable" and c.__module__.startswith("flax.nnx") for c in mro):
    return "Param" if any(c.__name__ == "Param" for c in mro) else type(x).__name__
  return None


def _key_name(k: Any) -> str | None:
  for attr in ("key", "name"):
    v = getattr(k, attr, None)
    if isinstance(v, str):
      return v
  return None


def classify_inputs(args: Sequence[Any], arg_names: Sequence[str]) -> list[tuple[Role, str]]:
  """Role and readable name of every leaf of ``args``, in flattening order.

  Optimizer state: leaves under an optax state (``ScaleByAdamState`` ...).
  Parameters: flax nnx ``Param`` variables, leaves under a ``params`` key or
  attribute (flax linen, TrainState),
  or of an argument whose name says so (``params``, ``model_params``).
  Everything else is an input (batch, labels, rng, counters).
  """
  out: list[tuple[Role, str]] = []
  for i, arg in enumerate(args):
    prefix = arg_names[i] if i < len(arg_names) else f"args[{i}]"
    outer, _ = jax.tree_util.tree_flatten_with_path(
        arg, is_leaf=lambda x: _is_optax_state(x) or _nnx_variable_kind(x) is not None)
    for path, node in outer:
      if _is_optax_state(node):
        inner, _ = jax.tree_util.tree_flatten_with_path(node)
        out += [(Role.OPTIMIZER_STATE, prefix + jax.tree_util.keystr(tuple(path) + tuple(p)))
                for p, _ in inner]
        continue
      nnx_kind = _nnx_variable_kind(node)
      if nnx_kind is not None:   # an nnx.Param inside an nnx.State: a parameter wherever it sits
        role = Role.PARAMETER if nnx_kind == "Param" else Role.INPUT
        inner, _ = jax.tree_util.tree_flatten_with_path(node)
        out += [(role, prefix + jax.tree_util.keystr(tuple(path))) for _ in inner]
        continue
      names = {_key_name(k) for k in path}
      is_param = "params" in names or prefix.split("[")[0].endswith(("params", "param"))
      role = Role.PARAMETER if is_param else Role.INPUT
      out.append((role, prefix + jax.tree_util.keystr(tuple(path))))
  return out


def arg_names_of(fun: Callable[..., Any], nargs: int) -> list[str]:
  try:
    params = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):
    return [f"args[{i}]" for i in range(nargs)]
  names: list[str] = []
  for p in params:
    if p.kind == p.VAR_POSITIONAL:
      names += [f"{p.name}[{i}]" for i in range(nargs - len(names))]
      break
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      names.append(p.name)
  names += [f"args[{i}]" for i in range(len(names), nargs)]
  return names[:nargs]


def _inner_working_bytes(eqn: Any) -> int:
  """Working set of an opaque block beyond its own inputs and outputs.

  One walk serves both this charge and :attr:`Program.blocks`, so a block's
  ``inner_peak_bytes`` is what the profile charges to its op.
  """
  return _blocks.inner_working_bytes(eqn)


def _jaxpr_peak_minus_io(jaxpr: Any) -> int:
  return _blocks.peak_minus_io(jaxpr)


class Program:
  """The flat program of a traced step (see :func:`jaxmem.analyze`).

  Attributes:
    ops: the equations in program order.
    vars: every variable, indexed by id.
    invars: ids of the flat step arguments.
    outvars: ids (or ``Literal``) of the flat results.
    consts: constant values by id.
    donated: ids of donated arguments (their buffers may be reused).
    num_devices: devices the step is spread over (1 when unsharded); every
      ``VarInfo.nbytes`` is then bytes per device, as ``memory_analysis()``
      of the compiled step reports them.
    device_layout: per-value shard counts (:class:`~jaxmem._src.sharding.DeviceLayout`),
      or None when unsharded.

  ``closed_jaxpr`` (optional) is the flat jaxpr of ``fun`` traced already, so
  that tracing can be timed apart from the analysis (``bench/analyze_speed.py``);
  ``out_tree`` is then unknown (``None``) and the program cannot be rewritten.
  """

  def __init__(self, fun: Callable[..., Any], args: Sequence[Any], *,
               donate_argnums: Sequence[int] = (), arg_names: Sequence[str] | None = None,
               closed_jaxpr: Any | None = None):
    flat_args, self.in_tree = jax.tree_util.tree_flatten(tuple(args))
    self.backend: str = jax.default_backend()
    self._out_tree: Any = None

    def flat_fun(*leaves: Any) -> list[Any]:
      out = fun(*jax.tree_util.tree_unflatten(self.in_tree, leaves))
      flat_out, self._out_tree = jax.tree_util.tree_flatten(out)
      return flat_out

    if closed_jaxpr is None:
      closed_jaxpr = _compat.make_jaxpr(flat_fun, *flat_args)
    else:
      self._out_tree = None
    self.closed_jaxpr = closed_jaxpr
    self.out_tree = self._out_tree
    names = list(arg_names) if arg_names is not None else arg_names_of(fun, len(args))
    input_roles = classify_inputs(args, names)
    leaf_arg = [i for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
    donated_args = set(donate_argnums)
    # Only their shardings are read (in _finish); the reference is dropped there.
    self._arg_leaves: Sequence[Any] = flat_args
    self._build(closed_jaxpr, input_roles, [i in donated_args for i in leaf_arg])

  # -- construction ---------------------------------------------------------

  def _build(self, closed: Any, input_roles: list[tuple[Role, str]], donated: list[bool]) -> None:
    self.ops: list[Op] = []
    avals: list[Any] = []
    self._def: list[int] = []
    self._meta: list[tuple[Role | None, str, str]] = []
    self.consts: dict[int, Any] = {}

    def new_var(aval: Any, defined_by: int, meta: tuple[Role | None, str, str]) -> int:
      avals.append(aval)
      self._def.append(defined_by)
      self._meta.append(meta)
      return len(avals) - 1

    jaxpr = closed.jaxpr
    self.invars = tuple(new_var(v.aval, -1, (*input_roles[i], input_roles[i][1]))
                        for i, v in enumerate(jaxpr.invars))
    self.donated = frozenset(vid for vid, d in zip(self.invars, donated) if d)

    def inline(jaxpr: Any, consts: Sequence[Any], in_atoms: Sequence[Any], prefix: Any,
               outer_source: str = "?", outer_module: str = "") -> list[Any]:
      env: dict[Any, Any] = {}
      for v, c in zip(jaxpr.constvars, consts):
        vid = new_var(v.aval, -1, (Role.CONSTANT, "constant", "constant"))
        self.consts[vid] = c
        env[v] = vid
      for v, a in zip(jaxpr.invars, in_atoms):
        env[v] = a

      def read(x: Any) -> Any:
        return x if isinstance(x, _compat.Literal) else env[x]

      for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        ns = _compat.join_name_stacks(prefix, _compat.name_stack_of(eqn))
        body = _compat.body_of(eqn)
        frame = _compat.user_frame(eqn)
        # Bodies of custom_jvp/custom_vjp calls often carry no traceback of
        # their own: attribute them to the line that made the call.
        source = f"{frame[0]}:{frame[1]}" if frame else outer_source
        ns_str = str(ns)
        module = module_path(ns_str) or _compat.class_path(eqn) or outer_module
        if body is not None:
          outs = inline(body.jaxpr, body.consts, ins, ns, source, module)
        else:
          index = len(self.ops)
          phase = (Phase.BACKWARD if "transpose(" in ns_str else
                   Phase.FORWARD if "jvp(" in ns_str else Phase.OTHER)
          outs = [new_var(v.aval, index, (None, module, source)) for v in eqn.outvars]
          transient = _inner_working_bytes(eqn) if _compat.sub_jaxprs(eqn) else 0
          self.ops.append(Op(index, eqn, tuple(ins), tuple(outs), phase, ns, source, transient,
                             module))
        for v, a in zip(eqn.outvars, outs):
          if not isinstance(v, _compat.DropVar):
            env[v] = a
      return [read(x) for x in jaxpr.outvars]

    self.outvars = tuple(inline(jaxpr, closed.consts, self.invars, _compat.empty_name_stack()))
    self._finish(avals)

  def _finish(self, avals: list[Any]) -> None:
    layout = sharding.device_layout(avals, self.ops, self.invars, self.outvars,
                                    getattr(self, "_arg_leaves", ()))
    self.device_layout: sharding.DeviceLayout | None = layout
    self.num_devices: int = layout.num_devices if layout is not None else 1
    uses: list[list[int]] = [[] for _ in avals]
    for op in self.ops:
      for x in op.inputs:
        if isinstance(x, int) and (not uses[x] or uses[x][-1] != op.index):
          uses[x].append(op.index)
    out_ids = {x for x in self.outvars if isinstance(x, int)}
    vars_: list[VarInfo] = []
    for vid, aval in enumerate(avals):
      role, name, source = self._meta[vid]
      d = self._def[vid]
      if role is None:
        phase = self.ops[d].phase
        if phase is Phase.BACKWARD:
          role = Role.GRADIENT
        elif phase is Phase.FORWARD and any(self.ops[u].phase is Phase.BACKWARD for u in uses[vid]):
          role = Role.ACTIVATION
        elif vid in out_ids:
          role = Role.OUTPUT
        else:
          role = Role.TEMPORARY
      nbytes = _compat.aval_nbytes(aval)
      local = nbytes if layout is None else sharding.per_device_bytes(
          nbytes, getattr(aval, "shape", ()), layout.counts[vid])
      vars_.append(VarInfo(vid, aval, local, d, tuple(uses[vid]), role,
                           name, source, vid in out_ids, global_nbytes=nbytes))
    self.vars: tuple[VarInfo, ...] = tuple(vars_)
    self._device_fraction: tuple[float, ...] | None = None
    if layout is not None:
      self._scale_hidden_bytes()
    # Values computed from literals and constants only (iota, zeros broadcasts):
    # XLA may compute them anywhere, so they must never order a copy or a fence.
    const_like = [False] * len(avals)
    for vid in self.consts:
      const_like[vid] = True
    for op in self.ops:
      if all(const_like[x] for x in op.input_ids()) and not op.eqn.effects:
        for o in op.outputs:
          const_like[o] = True
    self.constant_like: tuple[bool, ...] = tuple(const_like)
    self.ops = list(self.ops)
    del self._def, self._meta
    self._arg_leaves = ()
    self._profile: Any = None

  def _scale_hidden_bytes(self) -> None:
    """Per-device share of the working bytes that are not program values.

    The inner working set of an opaque block (``scan``, ``checkpoint`` ...)
    and XLA's hidden temporaries are sized from global shapes; on a sharded
    step each device holds about the share of the op's own operands and
    results that it holds. ``shard_map`` bodies are per device already.
    """
    fractions = []
    ops = []
    for op in self.ops:
      ids = [*op.input_ids(), *op.outputs]
      whole = sum(self.vars[i].global_nbytes for i in ids)
      fraction = sum(self.vars[i].nbytes for i in ids) / whole if whole else 1.0
      fractions.append(fraction)
      if op.transient_bytes and op.primitive != "shard_map":
        op = dataclasses.replace(op, transient_bytes=int(op.transient_bytes * fraction))
      ops.append(op)
    self.ops = ops
    self._device_fraction = tuple(fractions)

  # -- queries --------------------------------------------------------------

  @functools.cached_property
  def cse_keys(self) -> tuple[Any, ...]:
    """Per op, what XLA's common-subexpression elimination compares, or ``None``.

    XLA merges instructions with the same opcode, attributes and operands
    (HLO CSE), so an op repeated on the same inputs is computed and stored
    once. flax's ``OptimizedLSTMCell`` concatenates its gate kernels at every
    time step: the jaxpr has one ``[hidden, 4*hidden]`` copy per step, XLA's
    buffer assignment one (measured on the char-LSTM example). The key holds
    the primitive and its parameters; :func:`~jaxmem._src.lifetimes.estimate`
    adds the operands. Ops with bodies, effects or random bits are never
    merged.
    """
    keys: list[Any] = []
    for op in self.ops:
      eqn = op.eqn
      if (eqn.effects or not op.outputs or op.primitive in _NEVER_MERGED
          or _compat.sub_jaxprs(eqn)):
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
                   tuple(str(self.vars[o].aval) for o in op.outputs)))
    return tuple(keys)

  def op_memory_model(self, planned: bool) -> tuple[tuple[Any, int, int, Any], ...]:
    """Per op: ``(fusion kind, transient bytes, hoisted bytes, shared broadcasts)``.

    The XLA model of each op (:mod:`jaxmem._src.xla_model`); shared broadcasts
    are ``(input position, bytes)`` pairs (:func:`~jaxmem._src.xla_model.shared_broadcasts`).

    ``planned``: describe the op as a planned schedule runs it, i.e. by its
    lowering substitution where one applies; otherwise as plain ``jax.jit``
    compiles it. Cached per flag.
    """
    cache = self.__dict__.setdefault("_op_memory_model", {})
    if planned not in cache:
      from jaxmem._src import substitutions, xla_model
      out = []
      shared = xla_model.shared_broadcasts(self)
      scalar_hoists = xla_model.hoisted_scalar_broadcasts(self)
      for op, sh, sc in zip(self.ops, shared, scalar_hoists):
        subst = planned and substitutions.applies(op.eqn)
        kind = xla_model.Fusion.MATERIALIZED if subst else xla_model.op_fusion_kind(self, op)
        t, h = xla_model.hidden_bytes(op.eqn, self.backend, substituted=subst)
        h += sc
        if self._device_fraction is not None:   # sharded: this device's share
          fraction = self._device_fraction[op.index]
          t, h = int(t * fraction), int(h * fraction)
        out.append((kind, t + op.transient_bytes, h, sh))
      cache[planned] = tuple(out)
    return cache[planned]

  @functools.cached_property
  def blocks(self) -> tuple[_blocks.Block, ...]:
    """Opaque control-flow and remat ops (``scan``, ``while``, ``cond``, ``remat2``).

    One :class:`jaxmem.Block` per op with sub-jaxprs, in program order, with
    the inner peak charged to it, per-iteration and stacked bytes of a
    ``scan``, per-branch peaks of a ``cond``, and the blocks nested in its
    bodies as ``children``.
    """
    return _blocks.program_blocks(self)

  @property
  def num_ops(self) -> int:
    return len(self.ops)

  @property
  def profile(self) -> Any:
    """Live bytes at every program point (:class:`jaxmem.Profile`)."""
    if self._profile is None:
      from jaxmem._src import lifetimes
      self._profile = lifetimes.program_profile(self)
      self._refine_roles()
    return self._profile

  def _refine_roles(self) -> None:
    """A forward value kept alive into the backward pass by a fused use is an activation.

    (XLA recomputes a fused ReLU mask in the backward pass from the matmul
    output: that output is what is saved for backward.)
    """
    ivs = self._profile.intervals
    backward = [op.index for op in self.ops if op.phase is Phase.BACKWARD]
    if ivs is None or not backward:
      return
    first_backward = backward[0]
    vars_ = list(self.vars)
    for v in vars_:
      if (v.role is Role.TEMPORARY and not v.is_input
          and self.ops[v.defined_by].phase is Phase.FORWARD
          and first_backward <= ivs[v.id][1] < self.num_ops):
        vars_[v.id] = dataclasses.replace(v, role=Role.ACTIVATION)
    self.vars = tuple(vars_)

  @property
  def peak_bytes(self) -> int:
    """Estimated peak live bytes (arguments + outputs + temporaries)."""
    return self.profile.peak_bytes

  def interval(self, vid: int) -> tuple[int, int]:
    """``[start, end]`` op positions where variable ``vid`` is live.

    Position ``num_ops`` is the step's exit, where outputs and non-donated
    arguments are still held. Outputs are held from the start: the compiled
    peak we verify against (``memory_analysis()``: argument + output + temp -
    alias) reserves the output buffers for the whole step.
    """
    v = self.vars[vid]
    end_of_program = self.num_ops
    if v.is_input:
      if vid in self.donated and not v.is_output:
        return 0, (v.uses[-1] if v.uses else 0)
      return 0, end_of_program
    start = v.defined_by
    if v.is_output:
      return 0, end_of_program
    return start, (v.uses[-1] if v.uses else start)

  def plot(self, path: str, *, budget_bytes: int | None = None, plan: Any = None,
           title: str | None = None) -> str:
    """PNG of live bytes over program order, stacked by role (needs matplotlib)."""
    from jaxmem._src.plot import plot_program
    return plot_program(self, path, budget_bytes=budget_bytes, plan=plan, title=title)

  def to_html(self, path: str | None = None, *, budget_bytes: int | None = None,
              plan: Any = None, top: int = 30) -> str:
    """A self-contained HTML report (chart, tables by role and module, top buffers)."""
    from jaxmem._src.html_report import html_report
    return html_report(self, path, budget_bytes=budget_bytes, plan=plan, top=top)

  def report(self, top: int = 15) -> str:
    """A table of the peak and the largest holders there, with source lines."""
    from jaxmem._src import report
    return report.program_report(self, top=top)

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable summary (schema ``jaxmem.program/1``)."""
    from jaxmem._src import report
    return report.program_json(self)

  def __repr__(self) -> str:
    return f"Program(ops={self.num_ops}, vars={len(self.vars)}, peak_bytes={self.peak_bytes})"


def analyze(fun: Callable[..., Any], *args: Any) -> Program:
  """Traces ``fun(*args)`` and measures every variable's lifetime. Nothing is compiled.

  Args:
    fun: a step function taking pytrees of arrays.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).

  Returns:
    A :class:`Program`; ``.report()``, ``.peak_bytes``, ``.profile``, ``.to_json()``.

  Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> prog = jaxmem.analyze(lambda x: jnp.sin(x).sum(), jnp.ones((1024,)))
    >>> prog.peak_bytes > 0
    True
  """
  if not callable(fun):
    raise TypeError(f"`jaxmem.analyze` takes the step function first, got {type(fun).__name__}.")
  check_array_args(args, "jaxmem.analyze")
  return Program(fun, args)


def check_array_args(args: Sequence[Any], api: str, static_hint: bool = False) -> None:
  """Raises a clear TypeError for arguments that are not pytrees of arrays."""
  for i, arg in enumerate(args):
    leaves, _ = jax.tree_util.tree_flatten_with_path(arg)
    for path, leaf in leaves:
      if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex,
                           jax.ShapeDtypeStruct)):
        continue
      if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        continue
      where = f"argument {i}" + (jax.tree_util.keystr(path) if path else "")
      fix = (f" Mark it static with `{api}(..., static_argnums=({i},))`" if static_hint else
             " Close over it instead (functools.partial)")
      raise TypeError(f"`{api}`: {where} is a {type(leaf).__name__} ({leaf!r:.60}), not an array "
                      f"or a pytree of arrays.{fix}, or convert it with jnp.asarray.")
