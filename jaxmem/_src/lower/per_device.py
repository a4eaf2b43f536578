"""jaxmem's native ops in a step spread over a mesh: each device works on its own shard.

XLA's SPMD partitioner cannot split a side-effecting custom call: it refuses
one without a sharding ("Side-effect HLO must have sharding"), and for one
with a sharding it would gather the whole array onto every device first. The
ops are therefore wrapped in ``jax.experimental.custom_partitioning``, whose
``partition`` callback runs *inside* the partitioner and sees the sharding it
actually chose for every operand (Shardy's propagation of the user's
shardings, not jaxmem's estimate of it):

* ``fence(x, dep)`` keeps both operands as they are and returns ``x``'s
  sharding: no collective, no change to how anything else is split, so a
  plan of fences and recomputation is bit-identical to the unplanned step
  under a mesh as it is on one device.
* ``offload(x)`` (and ``offload_start`` / ``offload_done``) copies each
  device's shard of ``x`` to host memory. Handles and tickets are per device:
  a ``uint32[2 * devices]`` array split over every mesh axis, one word pair
  per device.
* ``fetch(handle, dep)`` (and ``fetch_start`` / ``fetch_done``) must give back
  the shards as they were offloaded, but a fetch's operands do not carry
  ``x``'s sharding. The offload's ``partition`` callback records it under the
  round trip's key and the fetch's reads it: the partitioner visits an
  instruction's operands before the instruction, so the offload (the
  handle's producer) is always partitioned first. Where the fetched value's
  users want another split, XLA reshards after the fetch, exact data
  movement the verified peak accounts for.

The sharding rules (Shardy) tie a fence's result to ``x``'s dimensions and
leave handles, tickets and ``dep`` free. On one device ``custom_partitioning``
calls the op directly.

Under a mesh whose axes are all ``Explicit`` every value's split is in its
type while tracing, and a ``custom_partitioning`` result would be typed
unsplit; there each op runs in ``jax.shard_map`` with the specs of its
operands' types instead (the offload's spec is kept for its fetch then).
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxmem._src import _compat
from jaxmem._src.native import ops as native
from jaxmem._src.native.extension import HANDLE_SHAPE

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_keys = itertools.count()
# Round-trip key -> the sharding its offload's partition callback saw. Written
# and read while XLA partitions a program (again at each compile of it).
_recorded: dict[int, Any] = {}
_lock = threading.Lock()


def new_key() -> int:
  """A key for one host round trip (offload ... fetch) of a value."""
  return next(_keys)


def _rule(in_ranks: tuple[int, ...], out_ranks: tuple[int, ...],
          tie: dict[int, int] | None = None) -> str:
  """A Shardy rule with independent factors, except output ``o`` tied to input ``tie[o]``.

  ``_rule((2, 1), (2,), {0: 0})`` is ``"a b, c -> a b"``.
  """
  letters = iter(_LETTERS)
  ins = [" ".join(next(letters) for _ in range(r)) for r in in_ranks]
  outs = [" ".join(next(letters) for _ in range(r)) for r in out_ranks]
  for o, i in (tie or {}).items():
    outs[o] = ins[i]
  return ", ".join(ins) + " -> " + ", ".join(outs)


def _words_sharding(mesh: Any) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


class PerDevice:
  """The native ops of one program spread over ``mesh``, each device on its shard.

  Args:
    mesh: the step's ``jax.sharding.Mesh`` (where handles and tickets live).
  """

  def __init__(self, mesh: jax.sharding.Mesh):
    self.mesh = mesh
    self.words = (2 * int(mesh.size),)     # one uint32[2] per device
    self.word_spec = _words_sharding(mesh).spec
    self.typed_specs: dict[int, PartitionSpec] = {}   # explicit axes: key -> offloaded spec
    assert HANDLE_SHAPE == (2,)

  def _typed(self, op: Any, args: tuple[Any, ...], out_specs: Any) -> Any:
    """``op`` in ``jax.shard_map`` with the operands' typed specs (literals whole)."""
    in_specs = tuple(self._spec(a) or PartitionSpec() for a in args)
    return jax.shard_map(op, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)

  def _spec(self, x: Any) -> PartitionSpec | None:
    return None if isinstance(x, np.ndarray | np.generic) else _compat.typed_spec(x)

  # -- fence ------------------------------------------------------------------

  def fence(self, x: Any, dep: Any) -> jax.Array:
    if self._spec(dep) is not None or self._spec(x) is not None:
      return self._typed(native.fence, (x, dep), self._spec(x) or PartitionSpec())
    return _fence(np.ndim(x), np.ndim(dep))(x, dep)

  # -- synchronous copies -----------------------------------------------------

  def offload(self, x: Any, key: int) -> jax.Array:
    spec = self._spec(x)
    if spec is not None:
      self.typed_specs[key] = spec
      return self._typed(native.offload, (x,), self.word_spec)
    return _offload(np.ndim(x), self.mesh, self.words, key)(x)

  def fetch(self, handle: Any, dep: Any, key: int, shape: tuple[int, ...],
            dtype: Any) -> jax.Array:
    if key in self.typed_specs:
      spec = self.typed_specs[key]
      op = _on_shard(native.fetch, NamedSharding(self.mesh, spec), shape, dtype)
      return self._typed(op, (handle, dep), spec)
    return _fetch(np.ndim(dep), self.mesh, key, tuple(shape), np.dtype(dtype))(handle, dep)

  # -- asynchronous copies ----------------------------------------------------

  def offload_start(self, x: Any) -> jax.Array:
    if self._spec(x) is not None:
      return self._typed(native.offload_start, (x,), self.word_spec)
    return _offload_start(np.ndim(x), self.mesh, self.words)(x)

  def offload_done(self, x: Any, ticket: Any, dep: Any, key: int) -> jax.Array:
    spec = self._spec(x)
    if spec is not None:
      self.typed_specs[key] = spec
      return self._typed(native.offload_done, (x, ticket, dep), self.word_spec)
    return _offload_done(np.ndim(x), np.ndim(dep), self.mesh, key)(x, ticket, dep)

  def fetch_start(self, handle: Any, dep: Any, key: int, shape: tuple[int, ...],
                  dtype: Any) -> tuple[jax.Array, jax.Array]:
    if key in self.typed_specs:
      spec = self.typed_specs[key]
      op = _on_shard(native.fetch_start, NamedSharding(self.mesh, spec), shape, dtype)
      return self._typed(op, (handle, dep), (spec, self.word_spec))
    return _fetch_start(np.ndim(dep), self.mesh, self.words, key, tuple(shape),
                        np.dtype(dtype))(handle, dep)

  def fetch_done(self, buf: Any, ticket: Any, dep: Any) -> jax.Array:
    spec = self._spec(buf)
    if spec is not None:
      return self._typed(native.fetch_done, (buf, ticket, dep), spec)
    return _fetch_done(np.ndim(buf), np.ndim(dep), self.mesh)(buf, ticket, dep)


def _record(key: int, sharding: Any) -> None:
  with _lock:
    _recorded[key] = sharding


def _offloaded_sharding(key: int) -> Any:
  with _lock:
    if key not in _recorded:
      raise RuntimeError(
          f"jaxmem: the fetch of host round trip {key} was partitioned before its offload; "
          "XLA's partitioner visits operands first, so this is a jaxmem bug: please report it")
    return _recorded[key]


@functools.cache
def _fence(rx: int, rd: int) -> Any:
  op = custom_partitioning(native.fence)

  def partition(mesh, arg_shapes, result_shape):
    xs, ds = arg_shapes
    return mesh, native.fence, xs.sharding, (xs.sharding, ds.sharding)

  op.def_partition(partition, sharding_rule=_rule((rx, rd), (rx,), {0: 0}))
  return op


def _offload(rx: int, mesh: Any, words: tuple[int, ...], key: int) -> Any:
  def whole(x):   # one device: the op itself, its handle repeated per "device"
    return _tile_words(native.offload(x), words)

  op = custom_partitioning(whole)

  def partition(_mesh, arg_shapes, result_shape):
    (xs,) = arg_shapes
    _record(key, xs.sharding)
    return _mesh, native.offload, _words_sharding(mesh), (xs.sharding,)

  op.def_partition(partition, sharding_rule=_rule((rx,), (1,)))
  return op


def _on_shard(op: Any, sharding: Any, shape: tuple[int, ...], dtype: Any) -> Any:
  """A fetch ``op`` for one device's shard of a ``shape`` value split by ``sharding``."""
  return functools.partial(op, shape=tuple(sharding.shard_shape(tuple(shape))), dtype=dtype)


def _fetch(rd: int, mesh: Any, key: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
  def whole(handle, dep):
    return native.fetch(handle[:2], dep, shape=shape, dtype=dtype)

  op = custom_partitioning(whole)

  def partition(_mesh, arg_shapes, result_shape):
    x_sharding = _offloaded_sharding(key)
    lower = _on_shard(native.fetch, x_sharding, shape, dtype)
    return _mesh, lower, x_sharding, (_words_sharding(mesh), arg_shapes[1].sharding)

  op.def_partition(partition, sharding_rule=_rule((1, rd), (len(shape),)))
  return op


@functools.cache
def _offload_start(rx: int, mesh: Any, words: tuple[int, ...]) -> Any:
  def whole(x):
    return _tile_words(native.offload_start(x), words)

  op = custom_partitioning(whole)

  def partition(_mesh, arg_shapes, result_shape):
    (xs,) = arg_shapes
    return _mesh, native.offload_start, _words_sharding(mesh), (xs.sharding,)

  op.def_partition(partition, sharding_rule=_rule((rx,), (1,)))
  return op


def _offload_done(rx: int, rd: int, mesh: Any, key: int) -> Any:
  def whole(x, ticket, dep):
    return _tile_words(native.offload_done(x, ticket[:2], dep), (ticket.shape[0],))

  op = custom_partitioning(whole)

  def partition(_mesh, arg_shapes, result_shape):
    xs, _, ds = arg_shapes
    _record(key, xs.sharding)
    words = _words_sharding(mesh)
    return _mesh, native.offload_done, words, (xs.sharding, words, ds.sharding)

  op.def_partition(partition, sharding_rule=_rule((rx, 1, rd), (1,)))
  return op


def _fetch_start(rd: int, mesh: Any, words: tuple[int, ...], key: int, shape: tuple[int, ...],
                 dtype: np.dtype) -> Any:
  def whole(handle, dep):
    buf, ticket = native.fetch_start(handle[:2], dep, shape=shape, dtype=dtype)
    return buf, _tile_words(ticket, words)

  op = custom_partitioning(whole)

  def partition(_mesh, arg_shapes, result_shape):
    x_sharding = _offloaded_sharding(key)
    lower = _on_shard(native.fetch_start, x_sharding, shape, dtype)
    w = _words_sharding(mesh)
    return _mesh, lower, (x_sharding, w), (w, arg_shapes[1].sharding)

  op.def_partition(partition, sharding_rule=_rule((1, rd), (len(shape), 1)))
  return op


@functools.cache
def _fetch_done(rb: int, rd: int, mesh: Any) -> Any:
  def whole(buf, ticket, dep):
    return native.fetch_done(buf, ticket[:2], dep)

  op = custom_partitioning(whole)

  def partition(_mesh, arg_shapes, result_shape):
    bs, _, ds = arg_shapes
    return _mesh, native.fetch_done, bs.sharding, (bs.sharding, _words_sharding(mesh), ds.sharding)

  op.def_partition(partition, sharding_rule=_rule((rb, 1, rd), (rb,), {0: 0}))
  return op


def _tile_words(words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """A handle or ticket repeated to the per-device array's global shape (one device)."""
  return jax.numpy.tile(words, shape[0] // words.shape[0])


__all__ = ["PerDevice", "new_key"]
