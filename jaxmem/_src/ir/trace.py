"""Trace: a step and its arguments -> a flat :class:`~jaxmem._src.ir.program.Program`.

The step is traced with ``jax.make_jaxpr`` and flattened into one program order:
nested ``jit`` and ``custom_jvp``/``custom_vjp`` calls are inlined, other
higher-order primitives (``scan``, ``while``, ``cond``, ``checkpoint``) stay
opaque blocks whose inner working set is charged to the block. Every variable
gets its bytes (per device, :mod:`jaxmem._src.ir.sharding`), defining op, uses,
role and source line (``docs/design.md``, "The program").
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

import jax

from jaxmem._src import _compat
from jaxmem._src.ir import blocks, sharding
from jaxmem._src.ir.program import Op, Phase, Program, Role, VarInfo
from jaxmem._src.ir.tiling import feature_minor_values, tiled_nbytes


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


def trace(fun: Callable[..., Any], args: Sequence[Any], *, donate_argnums: Sequence[int] = (),
          arg_names: Sequence[str] | None = None,
          closed_jaxpr: _compat.ClosedJaxpr | None = None, backend: str | None = None,
          target: str = "local") -> Program:
  """Traces ``fun(*args)`` into a flat :class:`Program`. Nothing is compiled.

  Args:
    fun: the step.
    args: its positional arguments (arrays, ``jax.ShapeDtypeStruct`` s or
      pytrees of them).
    donate_argnums: positions of donated arguments (their buffers may be reused).
    arg_names: a display name per argument (default: the parameter names of ``fun``).
    closed_jaxpr: the flat jaxpr of ``fun`` traced already, so that tracing
      can be timed apart from the rest (``bench/analyze_speed.py``); the
      program's ``out_tree`` is then unknown and it cannot be rewritten.
    backend: the XLA backend the estimate models (default: the local one,
      ``jax.default_backend()``); a target compiled ahead of time names its own.
    target: the name of the target planned for (recorded on the program).

  Returns:
    The :class:`Program`, with roles from the pass each op belongs to (the
    estimate refines them).
  """
  flat_args, in_tree = jax.tree_util.tree_flatten(tuple(args))
  out_trees: list[_compat.PyTreeDef] = []

  def flat_fun(*leaves: Any) -> list[Any]:
    out = fun(*jax.tree_util.tree_unflatten(in_tree, leaves))
    flat_out, tree = jax.tree_util.tree_flatten(out)
    out_trees.append(tree)
    return flat_out

  if closed_jaxpr is None:
    closed_jaxpr = _compat.make_jaxpr(flat_fun, *flat_args)
  # What no output needs XLA removes before anything is stored: a step
  # returning only gradients keeps its loss's forward arithmetic in the
  # jaxpr (`jax.grad` of a cross-entropy: the log-softmax, the label gather
  # and the mean), which kept full-size buffers alive in the estimate.
  closed_jaxpr = _compat.dce_closed_jaxpr(closed_jaxpr)
  names = list(arg_names) if arg_names is not None else arg_names_of(fun, len(args))
  input_roles = classify_inputs(args, names)
  leaf_arg = [i for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
  donated_args = set(donate_argnums)
  # Inner peaks of the blocks, walked once for both the ops' transient bytes
  # and the blocks' reports.
  memo: blocks.Memo = {}
  flat = _flatten(closed_jaxpr, input_roles, [i in donated_args for i in leaf_arg], memo)
  return _finish(flat, closed_jaxpr, in_tree, out_trees[-1] if out_trees else None, flat_args,
                 memo, backend or jax.default_backend(), target)


@dataclasses.dataclass
class _Flat:
  """The flattened equations and values, before uses, roles and bytes are known."""
  ops: list[Op]
  avals: list[_compat.AbstractValue]
  defined_by: list[int]
  meta: list[tuple[Role | None, str, str]]    # role (None: from the phase), name, source
  consts: dict[int, Any]
  invars: tuple[int, ...]
  outvars: tuple[int | _compat.Literal, ...]
  donated: frozenset[int]


def _flatten(closed: _compat.ClosedJaxpr, input_roles: list[tuple[Role, str]],
             donated: list[bool], memo: blocks.Memo) -> _Flat:
  """The equations of ``closed`` in one program order, nested calls inlined."""
  ops: list[Op] = []
  avals: list[_compat.AbstractValue] = []
  defined_by: list[int] = []
  meta: list[tuple[Role | None, str, str]] = []
  consts: dict[int, Any] = {}

  def new_var(aval: _compat.AbstractValue, op_index: int,
              info: tuple[Role | None, str, str]) -> int:
    avals.append(aval)
    defined_by.append(op_index)
    meta.append(info)
    return len(avals) - 1

  jaxpr = closed.jaxpr
  invars = tuple(new_var(v.aval, -1, (*input_roles[i], input_roles[i][1]))
                 for i, v in enumerate(jaxpr.invars))

  def inline(jaxpr: _compat.Jaxpr, const_vals: Sequence[Any], in_atoms: Sequence[Any],
             prefix: _compat.NameStack, outer_source: str = "?",
             outer_module: str = "") -> list[Any]:
    env: dict[_compat.Var, int | _compat.Literal] = {}
    for v, c in zip(jaxpr.constvars, const_vals):
      vid = new_var(v.aval, -1, (Role.CONSTANT, "constant", "constant"))
      consts[vid] = c
      env[v] = vid
    for v, a in zip(jaxpr.invars, in_atoms):
      env[v] = a

    def read(x: _compat.Atom) -> int | _compat.Literal:
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
      module = _compat.module_path(ns_str) or _compat.class_path(eqn) or outer_module
      if body is not None:
        outs = inline(body.jaxpr, body.consts, ins, ns, source, module)
      else:
        index = len(ops)
        phase = (Phase.BACKWARD if "transpose(" in ns_str else
                 Phase.FORWARD if "jvp(" in ns_str else Phase.OTHER)
        outs = [new_var(v.aval, index, (None, module, source)) for v in eqn.outvars]
        has_body = bool(_compat.sub_jaxprs(eqn))
        transient = blocks.inner_working_bytes(eqn, memo) if has_body else 0
        ops.append(Op(index, eqn, tuple(ins), tuple(outs), phase, ns, source, transient, module,
                      has_body))
      for v, a in zip(eqn.outvars, outs):
        if not isinstance(v, _compat.DropVar):
          env[v] = a
    return [read(x) for x in jaxpr.outvars]

  outvars = tuple(inline(jaxpr, closed.consts, invars, _compat.empty_name_stack()))
  return _Flat(ops, avals, defined_by, meta, consts, invars, outvars,
               frozenset(vid for vid, d in zip(invars, donated) if d))


def _finish(flat: _Flat, closed: _compat.ClosedJaxpr, in_tree: _compat.PyTreeDef,
            out_tree: _compat.PyTreeDef | None, arg_leaves: Sequence[Any],
            memo: blocks.Memo, backend: str, target: str) -> Program:
  """Uses, roles, bytes per device and constant-like values of the flattened program."""
  avals, ops = flat.avals, flat.ops
  layout = sharding.device_layout(avals, ops, flat.invars, flat.outvars, arg_leaves)
  uses: list[list[int]] = [[] for _ in avals]
  for op in ops:
    for x in op.inputs:
      if isinstance(x, int) and (not uses[x] or uses[x][-1] != op.index):
        uses[x].append(op.index)
  out_ids = {x for x in flat.outvars if isinstance(x, int)}
  vars_: list[VarInfo] = []
  feature_minor = feature_minor_values(ops, avals) if backend == "tpu" else frozenset()
  for vid, aval in enumerate(avals):
    role, name, source = flat.meta[vid]
    d = flat.defined_by[vid]
    if role is None:
      phase = ops[d].phase
      if phase is Phase.BACKWARD:
        role = Role.GRADIENT
      elif phase is Phase.FORWARD and any(ops[u].phase is Phase.BACKWARD for u in uses[vid]):
        role = Role.ACTIVATION
      elif vid in out_ids:
        role = Role.OUTPUT
      else:
        role = Role.TEMPORARY
    nbytes = _compat.aval_nbytes(aval)
    local = nbytes if layout is None else sharding.per_device_bytes(
        nbytes, getattr(aval, "shape", ()), layout.counts[vid])
    if backend == "tpu" and local and _compat.is_plain_array_aval(aval):
      # XLA:TPU pads every array to whole tiles (16 channels take 128 lanes).
      counts = layout.counts[vid] if layout is not None else ()
      local = tiled_nbytes(sharding.local_shape(aval.shape, counts),
                           aval.dtype.itemsize, backend, vid in feature_minor)
    vars_.append(VarInfo(vid, aval, local, d, tuple(uses[vid]), role, name, source,
                         vid in out_ids, global_nbytes=nbytes))
  fractions = None
  if layout is not None:
    ops, fractions = _scale_hidden_bytes(ops, vars_)
  # Values computed from literals and constants only (iota, zeros broadcasts):
  # XLA may compute them anywhere, so they must never order a copy or a fence.
  const_like = [False] * len(avals)
  for vid in flat.consts:
    const_like[vid] = True
  for op in ops:
    if all(const_like[x] for x in op.input_ids()) and not op.eqn.effects:
      for o in op.outputs:
        const_like[o] = True
  ops = tuple(ops)
  return Program(
      ops=ops, vars=tuple(vars_), invars=flat.invars, outvars=flat.outvars,
      consts=MappingProxyType(dict(flat.consts)), donated=flat.donated,
      constant_like=tuple(const_like), blocks=blocks.program_blocks(ops, memo),
      backend=backend, target=target, num_devices=layout.num_devices if layout is not None else 1,
      device_layout=layout, device_fraction=fractions, in_tree=in_tree, out_tree=out_tree,
      closed_jaxpr=closed)


def _scale_hidden_bytes(ops: Sequence[Op],
                        vars_: Sequence[VarInfo]) -> tuple[list[Op], tuple[float, ...]]:
  """Per-device share of the working bytes that are not program values.

  The inner working set of an opaque block (``scan``, ``checkpoint`` ...)
  and XLA's hidden temporaries are sized from global shapes; on a sharded
  step each device holds about the share of the op's own operands and
  results that it holds. ``shard_map`` bodies are per device already.
  """
  fractions = []
  scaled = []
  for op in ops:
    ids = [*op.input_ids(), *op.outputs]
    whole = sum(vars_[i].global_nbytes for i in ids)
    fraction = sum(vars_[i].nbytes for i in ids) / whole if whole else 1.0
    fractions.append(fraction)
    if op.transient_bytes and op.primitive != "shard_map":
      op = dataclasses.replace(op, transient_bytes=int(op.transient_bytes * fraction))
    scaled.append(op)
  return scaled, tuple(fractions)


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
