"""Every use of JAX internals (``jax.core``, ``jax.extend``, ``jax._src``) lives here.

JAX's internal APIs move between releases; keeping them behind one module means a
JAX upgrade touches one file. Measured against jax/jaxlib 0.10.2.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

import jax
from jax import extend as jex
from jax._src import core as _core
from jax._src.interpreters import partial_eval as _pe
from jax._src import source_info_util as _siu

Var = jex.core.Var
Literal = jex.core.Literal
ClosedJaxpr = jex.core.ClosedJaxpr
Jaxpr = jex.core.Jaxpr
JaxprEqn = jex.core.JaxprEqn
DropVar = jex.core.DropVar
#: An equation operand: a variable or an inline literal.
Atom = Var | Literal
#: JAX's name stack of an equation (``transpose(jvp(MLP))/Dense_0``).
NameStack = _siu.NameStack
#: The abstract value of a variable (``ShapedArray``: shape, dtype; tokens, refs).
AbstractValue = _core.AbstractValue
#: The structure of a pytree.
PyTreeDef = jax.tree_util.PyTreeDef
#: A device mesh, concrete or abstract (``jax.sharding.Mesh`` / ``AbstractMesh``).
Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh

# Call-like primitives whose body is inlined into the flat program (``docs/design.md``,
# "Program"). Maps primitive name -> params key of the body jaxpr.
INLINE_BODIES: Mapping[str, str] = MappingProxyType({
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
})


def make_jaxpr(fun: Callable[..., Any], *args: Any) -> ClosedJaxpr:
  return jax.make_jaxpr(fun)(*args)


def eval_jaxpr(jaxpr: Jaxpr, consts: Any, *args: Any) -> list[Any]:
  """Evaluates (or, under a trace, re-binds) ``jaxpr`` on ``args``."""
  return list(_core.eval_jaxpr(jaxpr, consts, *args))


def dce_jaxpr(jaxpr: Jaxpr, used_outputs: list[bool]) -> tuple[Jaxpr, list[bool]]:
  """``jaxpr`` cut down to the equations ``used_outputs`` need; also which inputs it still takes."""
  cut, used_inputs = _pe.dce_jaxpr(jaxpr, used_outputs)
  return cut, list(used_inputs)


def dce_closed_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
  """``closed`` without the equations no output needs (effects kept), every input kept."""
  cut, _ = _pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
  return closed if len(cut.eqns) == len(closed.jaxpr.eqns) else ClosedJaxpr(cut, closed.consts)


def body_of(eqn: JaxprEqn) -> ClosedJaxpr | None:
  """The inlinable body of a call-like equation, as a ClosedJaxpr, else None."""
  key = INLINE_BODIES.get(eqn.primitive.name)
  if key is None or key not in eqn.params:
    return None
  body = eqn.params[key]
  if isinstance(body, ClosedJaxpr):
    return body
  if isinstance(body, Jaxpr):
    return ClosedJaxpr(body, ())
  return None


def sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
  """All jaxprs nested in an equation's params (scan/while/cond bodies...)."""
  return [j.jaxpr if isinstance(j, ClosedJaxpr) else j
          for j in jex.core.jaxprs_in_params(eqn.params)]


def bind_eqn(eqn: JaxprEqn, invals: list[Any], name_stack: NameStack | None = None) -> list[Any]:
  """Binds ``eqn``'s primitive on new inputs, keeping its source info.

  ``name_stack`` is the equation's full name stack when it was inlined from a
  nested call (default: its own).
  """
  params = eqn.primitive.get_bind_params(eqn.params)
  if name_stack is None:
    name_stack = eqn.source_info.name_stack
  name_stack = _siu.current_name_stack() + name_stack
  with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), \
       eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def source_of(eqn: JaxprEqn) -> Iterator[None]:
  """Equations made inside take ``eqn``'s source info (traceback and name stack)."""
  name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
  with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
    yield


def name_stack_of(eqn: JaxprEqn) -> NameStack:
  return eqn.source_info.name_stack


def join_name_stacks(outer: NameStack | None, inner: NameStack) -> NameStack:
  return outer + inner if outer is not None else inner


def empty_name_stack() -> NameStack:
  return _siu.NameStack()


_TRANSFORM = re.compile(r"[A-Za-z_]+\(")


@functools.lru_cache(maxsize=8192)
def module_path(name_stack: str) -> str:
  """``'transpose(jvp(MLP))/Dense_0'`` -> ``'MLP/Dense_0'``: the name stack without transformations."""
  path = _TRANSFORM.sub("", name_stack).replace(")", "")
  return "/".join(p for p in path.split("/") if p)


def user_frame(eqn: JaxprEqn) -> tuple[str, int, str] | None:
  """``(file, line, function)`` of the user code that emitted ``eqn``.

  The innermost frame outside JAX and outside installed libraries (flax,
  optax, ... under ``site-packages``): "which line of *my* model made it".
  Falls back to JAX's own notion of the user frame.
  """
  return _user_frame(eqn.source_info.traceback)


_LIBRARY_DIRS = ("/site-packages/", "/dist-packages/")


@functools.lru_cache(maxsize=4096)
def _user_frame(traceback: Any) -> tuple[str, int, str] | None:
  first = None
  for frame in _siu.user_frames(traceback):
    if first is None:
      first = frame
    if not any(d in frame.file_name for d in _LIBRARY_DIRS):
      return frame.file_name, frame.start_line, frame.function_name
  if first is None:
    return None
  return first.file_name, first.start_line, first.function_name


def class_path(eqn: JaxprEqn) -> str:
  """``'Net/Block/Linear'``: the ``__call__`` methods on ``eqn``'s call stack, outermost first.

  flax linen pushes its module path on JAX's name stack; flax nnx and
  equinox modules are plain Python objects and push nothing. Their calls
  still show in the traceback as ``Class.__call__`` frames (Python 3.11
  qualified names), which name the module classes the op was made in.
  """
  return _class_path(eqn.source_info.traceback)


_JAX_DIR = os.path.dirname(os.path.dirname(jax.__file__)) + os.sep + "jax" + os.sep


def _module_frames(traceback: Any) -> Iterator[str]:
  """Qualified names of ``traceback``'s frames outside JAX itself.

  Not ``source_info_util.user_frames``: it drops every file under the stdlib
  path, and with a system-wide install (``/usr/local/lib/python3.11/
  site-packages``) that prefix covers flax too, so nnx's ``Linear.__call__``
  would vanish. Library frames are wanted here: they name the layer.
  """
  code, _ = traceback.raw_frames()
  for c in code:
    if not c.co_filename.startswith(_JAX_DIR):
      yield c.co_qualname


@functools.lru_cache(maxsize=4096)
def _class_path(traceback: Any) -> str:
  if traceback is None:
    return ""
  names = []
  for function_name in _module_frames(traceback):
    parts = function_name.split(".")
    # 'Block.__call__', or 'test.<locals>.Block.__call__' for a class made in a function
    if len(parts) >= 2 and parts[-1] == "__call__" and parts[-2].isidentifier():
      names.append(parts[-2])
  return "/".join(reversed(names))


@contextlib.contextmanager
def eqn_context(eqn: JaxprEqn, name_stack: NameStack | None = None) -> Iterator[None]:
  """Source info of ``eqn`` for ops bound in its place."""
  name_stack = _siu.current_name_stack() + (
      eqn.source_info.name_stack if name_stack is None else name_stack)
  with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
    yield


def aval_nbytes(aval: AbstractValue | None) -> int:
  """Bytes of one value of abstract value ``aval`` (per device, unsharded)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:   # tokens, refs and other non-arrays
    return 0
  size = math.prod(shape)
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    # Typed PRNG keys: stored as their base representation.
    impl = getattr(dtype, "_impl", None)
    key_shape = getattr(impl, "key_shape", (2,))
    return size * math.prod(key_shape) * 4
  return size * np.dtype(dtype).itemsize


def is_plain_array_aval(aval: AbstractValue) -> bool:
  """True for dense arrays of a numpy dtype (what the native store can copy)."""
  dtype = getattr(aval, "dtype", None)
  if dtype is None or not hasattr(aval, "shape"):
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return False
  return isinstance(aval, _core.ShapedArray)


# -- control-flow parameters (jaxmem/_src/ir/blocks.py) -------------------------


def _open(j: Jaxpr | ClosedJaxpr) -> Jaxpr:
  return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def scan_params(eqn: JaxprEqn) -> tuple[Jaxpr, int, int, int, bool]:
  """``(body, num_consts, num_carry, length, reverse)`` of a ``scan`` equation.

  The body's inputs are ``consts + carry + one slice of each xs``, its outputs
  ``new carry + one slice of each ys``.
  """
  p = eqn.params
  return (_open(p["jaxpr"]), int(p["num_consts"]), int(p["num_carry"]), int(p["length"]),
          bool(p.get("reverse", False)))


def cond_branches(eqn: JaxprEqn) -> list[Jaxpr]:
  """The branches of a ``cond`` equation, by index (``lax.cond``: false, then true)."""
  return [_open(b) for b in eqn.params["branches"]]


def while_params(eqn: JaxprEqn) -> tuple[Jaxpr, Jaxpr, int, int]:
  """``(cond, body, cond_nconsts, body_nconsts)`` of a ``while`` equation."""
  p = eqn.params
  return (_open(p["cond_jaxpr"]), _open(p["body_jaxpr"]), int(p["cond_nconsts"]),
          int(p["body_nconsts"]))


def atom_nbytes(atom: Atom) -> int:
  """Bytes of a variable or literal operand (see :func:`aval_nbytes`)."""
  return aval_nbytes(getattr(atom, "aval", None))


# -- shardings (jaxmem/_src/ir/sharding.py) ------------------------------------


def sharding_of(x: object) -> jax.sharding.Sharding | None:
  """The ``jax.sharding.Sharding`` of a concrete argument, else None.

  ``jax.Array`` and ``jax.ShapeDtypeStruct(..., sharding=...)`` carry one;
  numpy arrays and Python scalars do not (they are placed whole on a device).
  """
  s = getattr(x, "sharding", None)
  return s if isinstance(s, jax.sharding.Sharding) else None


def is_committed(x: object) -> bool:
  """Whether ``jax.jit`` must keep argument ``x`` where it is.

  A committed ``jax.Array`` (placed with ``jax.device_put`` to a sharding or
  device) and a ``ShapeDtypeStruct`` with a sharding are kept; numpy arrays,
  scalars, uncommitted arrays (results of computations on the default
  device) and shape-only arguments without a sharding are placed by the
  compiler.
  """
  if isinstance(x, jax.Array):
    return bool(getattr(x, "_committed", True))
  return sharding_of(x) is not None


def sharding_num_devices(sharding: jax.sharding.Sharding) -> int:
  """How many devices ``sharding`` spreads over (1 for a single device)."""
  mesh = getattr(sharding, "mesh", None)
  if mesh is not None:         # NamedSharding, also over an abstract mesh
    return max(1, int(mesh.size))
  try:
    return max(1, len(sharding.device_set))
  except Exception:  # noqa: BLE001 (a sharding type without devices: count it as one)
    return 1


def sharding_shard_shape(sharding: jax.sharding.Sharding | jax.Device | None,
                         shape: tuple[int, ...]) -> tuple[int, ...] | None:
  """Shape of one device's shard of a ``shape`` array under ``sharding`` (None if unknown)."""
  if not isinstance(sharding, jax.sharding.Sharding):
    return None            # a Device or None (``device_put`` to one device, or "keep")
  try:
    return tuple(int(d) for d in sharding.shard_shape(tuple(shape)))
  except Exception:  # noqa: BLE001 (e.g. a rank mismatch: treat as unknown)
    return None


def spec_shard_counts(spec: jax.sharding.PartitionSpec, mesh: Mesh, ndim: int,
                      only_axes: frozenset[str] | None = None) -> tuple[int, ...]:
  """Per-dimension shard counts of a ``PartitionSpec`` over ``mesh``.

  ``only_axes``: count only these mesh axes (the Explicit ones of an aval's
  mesh); others, and ``P.UNCONSTRAINED``, count as unsharded.
  """
  sizes = dict(mesh.shape)
  counts = [1] * ndim
  for d, entry in enumerate(tuple(spec)[:ndim]):
    if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
      continue
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if isinstance(name, str) and (only_axes is None or name in only_axes):
        counts[d] *= int(sizes.get(name, 1))
  return tuple(counts)


@functools.lru_cache(maxsize=256)
def _explicit_axes(mesh: Mesh) -> frozenset[str]:
  types = getattr(mesh, "axis_types", ())
  return frozenset(n for n, t in zip(mesh.axis_names, types) if t == jax.sharding.AxisType.Explicit)


def aval_mesh_size(aval: AbstractValue) -> int:
  """Devices of the mesh an aval is typed over (0 or 1: none recorded)."""
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  return 0 if mesh is None or mesh.empty else int(mesh.size)


def typed_spec(x: Any) -> jax.sharding.PartitionSpec | None:
  """The ``PartitionSpec`` in the type of value ``x`` when its mesh's axes are all ``Explicit``.

  Then every value's split is known while tracing (``f32[16@data]``); under
  ``Auto`` axes (or a mix) the partitioner decides later and this is None.
  """
  s = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(s, "mesh", None)
  if mesh is None or mesh.empty or _explicit_axes(mesh) != frozenset(mesh.axis_names):
    return None
  return s.spec


def aval_explicit_counts(aval: AbstractValue) -> tuple[int, ...] | None:
  """Shard counts JAX records in an aval's type, under explicit sharding.

  Only mesh axes of type ``Explicit`` are part of the type (``f32[16@data]``);
  under ``Auto`` axes the aval's spec is always unsharded and says nothing,
  so this returns None and the caller propagates instead.
  """
  s = getattr(aval, "sharding", None)
  mesh = getattr(s, "mesh", None)
  if mesh is None or mesh.empty or not hasattr(aval, "shape"):
    return None
  explicit = _explicit_axes(mesh)
  if not explicit:
    return None
  return spec_shard_counts(s.spec, mesh, len(aval.shape), explicit)


def sharding_params(eqn: JaxprEqn) -> list[Any] | None:
  """Target shardings of a sharding op, one per output (None: not such an op).

  ``sharding_constraint`` (``sharding``), ``reshard`` / ``mesh_cast``
  (``dst_sharding``) and ``device_put`` (``devices``: a Sharding, a Device or
  None per operand).
  """
  p = eqn.params
  name = eqn.primitive.name
  if name == "sharding_constraint" and "sharding" in p:
    return [p["sharding"]] * len(eqn.outvars)
  if name in ("reshard", "mesh_cast") and "dst_sharding" in p:
    return [p["dst_sharding"]] * len(eqn.outvars)
  if name == "device_put" and "devices" in p:
    return list(p["devices"])
  return None


def unconstrained_dims(eqn: JaxprEqn) -> frozenset[int]:
  """Dimensions a ``sharding_constraint`` leaves to the partitioner."""
  return frozenset(eqn.params.get("unconstrained_dims", ()) or ())


def shard_map_mesh(eqn: JaxprEqn) -> Any | None:
  """The mesh of a ``shard_map`` equation (None for other primitives)."""
  if eqn.primitive.name != "shard_map":
    return None
  return eqn.params.get("mesh")


def shard_map_body(eqn: JaxprEqn) -> Jaxpr | None:
  """The per-device body of a ``shard_map`` equation (None for other primitives)."""
  if eqn.primitive.name != "shard_map":
    return None
  body = eqn.params.get("jaxpr")
  return getattr(body, "jaxpr", body)


def shard_map_out_counts(eqn: JaxprEqn) -> list[tuple[int, ...]] | None:
  """Per output of a ``shard_map``: shard counts from ``out_specs`` over its mesh.

  The global result is the concatenation of the per-device blocks along the
  spec's mesh axes, so each device holds ``global / counts``.
  """
  mesh = shard_map_mesh(eqn)
  specs = eqn.params.get("out_specs") if mesh is not None else None
  if specs is None:
    return None
  return [spec_shard_counts(spec, mesh, len(getattr(v.aval, "shape", ())))
          for spec, v in zip(specs, eqn.outvars)]


def mesh_size(mesh: Mesh) -> int:
  return int(getattr(mesh, "size", 1) or 1)


def remat_body(eqn: JaxprEqn) -> Jaxpr | None:
  """The body of a ``checkpoint`` (remat) equation, whose invars are its operands."""
  if eqn.primitive.name not in ("checkpoint", "remat", "remat2"):
    return None
  body = eqn.params.get("jaxpr")
  if isinstance(body, ClosedJaxpr):
    body = body.jaxpr
  return body if isinstance(body, Jaxpr) and not body.constvars else None


def loop_carry_sources(eqn: JaxprEqn) -> list[int] | None:
  """Per output of a ``scan`` / ``while``: the operand index carried into it (-1: none).

  A loop carry keeps its shape, and the partitioner keeps its sharding across
  iterations. ``scan``'s stacked outputs (``ys``) map to no operand.
  """
  p = eqn.params
  name = eqn.primitive.name
  if name == "while":
    first = int(p.get("cond_nconsts", 0)) + int(p.get("body_nconsts", 0))
    return [first + i for i in range(len(eqn.outvars))]
  if name == "scan":
    first, ncarry = int(p.get("num_consts", 0)), int(p.get("num_carry", 0))
    return [first + i if i < ncarry else -1 for i in range(len(eqn.outvars))]
  return None


def is_device(x: object) -> bool:
  """True for a ``jax.Device`` (a ``device_put`` target that is one whole device)."""
  return isinstance(x, jax.Device)



def topology_devices(platform: str, topology: str, chips_per_host_bounds: tuple[int, int, int]
                     ) -> tuple[Any, ...]:
  """The devices of an accelerator topology compiled for ahead of time (no device needed).

  ``jax.experimental.topologies`` is experimental; jax 0.10.2 + libtpu 0.0.42.1
  accept ``v5e:1x1``/``v6e:1x1`` with bounds ``(1, 1, 1)``, ``v5p:1x1x1``,
  ``v4:1x1x1`` and multi-chip slices with ``(2, 2, 1)``.
  """
  from jax.experimental import topologies
  desc = topologies.get_topology_desc(platform=platform, topology_name=topology,
                                      chip_config_name="default",
                                      chips_per_host_bounds=tuple(chips_per_host_bounds),
                                      num_slices=1)
  return tuple(desc.devices)


def gpu_topology_devices(target_config: str) -> tuple[Any, ...]:
  """The device of one NVIDIA GPU described by ``target_config``, compiled for without a GPU.

  XLA:GPU's deviceless compilation (openxla/xla#16913): jax's CUDA plugin
  builds the topology from the device description instead of a local GPU.
  jax 0.10.2 + jax-cuda12-plugin 0.10.2 compile for it on a CPU-only machine.
  """
  from jax.experimental import topologies
  desc = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                      topology="1x1x1")
  return tuple(desc.devices)


# -- sharding groups ------------------------------------------------------------
# A recomputed value must be split over the mesh as its original was, or the
# partitioner may reduce it in another order (and the plan's results would
# differ from jax.jit's in the last bits). Shardy's sharding groups say exactly
# that without tying the two values' lifetimes: `sdy.sharding_group` is an
# annotation on one value, removed after propagation. jax.experimental's
# `shard_alike` puts both values in one call, which would keep the original
# alive until its recomputation, so jaxmem binds its own one-value primitive
# (group ids from the same counter as shard_alike's, so the two never collide).

def _sharding_group_lowering(ctx: Any, x: Any, *, group_id: int) -> list[Any]:
  from jax._src.lib.mlir import dialects
  if jax.config.jax_use_shardy_partitioner:
    dialects.sdy.sharding_group(x, group_id)
  return [x]


def _make_sharding_group_p() -> Any:
  from jax._src.interpreters import mlir
  p = jex.core.Primitive("jaxmem_sharding_group")
  p.multiple_results = True
  p.def_impl(lambda x, *, group_id: [x])
  p.def_abstract_eval(lambda x, *, group_id: [x])
  mlir.register_lowering(p, _sharding_group_lowering)
  return p


_sharding_group_p = _make_sharding_group_p()


def new_sharding_group() -> int:
  """A fresh Shardy sharding group id (unique in any program jax lowers)."""
  from jax._src import shard_alike
  return next(shard_alike._next_shard_group_id)


def sharding_group(x: Any, group_id: int) -> Any:
  """``x``, annotated to be split over the mesh like every value of group ``group_id``.

  Only Shardy (jax's default partitioner) reads the annotation; with the
  older GSPMD partitioner it is a no-op.
  """
  return _sharding_group_p.bind(x, group_id=group_id)[0]
