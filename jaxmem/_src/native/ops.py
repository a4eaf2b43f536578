"""The native ops: jaxmem's XLA FFI custom calls, as JAX functions.

Side-effecting custom calls implemented in ``ffi/`` (registered by
:mod:`jaxmem._src.native.extension`):

* :func:`fence` -- ``fence(x, dep) -> x``: an identity that aliases ``x``
  (``input_output_aliases={0: 0}``) and is ordered after ``dep``. XLA can
  neither CSE it nor hoist it above ``dep`` (``docs/design.md``, "Why native ops").
* :func:`offload` -- ``offload(x) -> handle``: copies ``x`` into the native host
  store and returns a ``uint32[2]`` handle (the 64-bit id as ``(lo, hi)``, so
  it works with ``jax_enable_x64`` off).
* :func:`fetch` -- ``fetch(handle, dep, shape=, dtype=) -> x``: copies the entry
  back (after ``dep``) and erases it. A handle can be fetched exactly once;
  a stale, foreign or double-fetched handle, or a shape/dtype that does not
  match what was offloaded, fails with an ``INVALID_ARGUMENT`` runtime error
  (``jax.errors.JaxRuntimeError``) mentioning the host store -- never a crash.

Window-scheduled asynchronous copies (``docs/design.md``, "The native
extension"; Hayakawa et al., *Out-of-core training for extremely large-scale
neural networks with adaptive window-based scheduling*, §3), run by worker
threads of ``ffi/copy_engine.cc`` on the CPU and by copy streams on CUDA
(``ffi/cuda/``, where the CUDA runtime loaded: ``CUDA_STATUS``):

* :func:`offload_start` -- ``offload_start(x) -> ticket``: queues a copy of
  ``x`` to host memory and returns at once.
* :func:`offload_done` -- ``offload_done(x, ticket, dep) -> handle``: waits
  for that copy (after ``dep``) and returns the host store handle. That the
  done reads ``x`` is what keeps the source allocated (and unwritten) while
  the copy is in flight; XLA may reuse its memory after the done. (An aliased
  output ``x_keep`` of the start was tried first: measured, XLA's copy
  insertion then copies ``x`` whenever another reader of it is not provably
  ordered before the start, doubling its bytes for the window.)
* :func:`fetch_start` -- ``fetch_start(handle, dep) -> (buf, ticket)``: takes
  the entry out of the host store (after ``dep``) and queues its copy into
  ``buf``, a fresh buffer XLA allocates here.
* :func:`fetch_done` -- ``fetch_done(buf, ticket, dep) -> x``: waits for it;
  ``x`` aliases ``buf``.

The distance between a start and its done is the window in which the copy
overlaps computation. Tickets, like handles, are ``uint32[2]`` words of a
never-reused 64-bit id: a stale, foreign or wrong-kind ticket, like a bad
handle, fails the execution with a ``jax.errors.JaxRuntimeError`` -- never a
crash. :func:`~jaxmem._src.native.store.copy_stats` reports outstanding
tickets; :func:`~jaxmem._src.native.store.store_clear` also frees tickets
orphaned by a failed execution (see ``copy_engine.h``).

None of the ops has a JVP/transpose rule: they are inserted into an already
differentiated step by the ``ffi`` backend (:mod:`jaxmem._src.lower.ffi`), not
differentiated through.
Under ``jax.vmap``, ``fence`` runs once on the broadcast operands (an unbatched
``dep`` is materialised at batch size) and ``offload``/``fetch`` loop over the
batch (one handle per element: handles get shape ``(batch, 2)``). The
asynchronous ops do not support ``vmap``: a copy in flight would outlive the
loop iteration that owns its buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src.native.extension import HANDLE_DTYPE, HANDLE_SHAPE, TARGET_PREFIX

#: What the ops take as an array operand: a ``jax.Array`` (or tracer), or
#: anything ``jnp.asarray`` converts.
ArrayLike = jax.typing.ArrayLike
#: What ``dtype=`` takes.
DTypeLike = jax.typing.DTypeLike


def _as_array(x: ArrayLike) -> jax.Array:
  # Tracers are instances of jax.Array too.
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def fence(x: ArrayLike, dep: ArrayLike) -> jax.Array:
  """Identity on ``x`` that XLA must order after ``dep``.

  The output aliases ``x`` (no copy when ``x``'s buffer can be reused), and the
  op has a side effect, so it is neither CSE'd nor moved above ``dep``.

  Args:
    x: The array to pass through.
    dep: Any array; the fence runs after it is computed. Its value is unused.

  Returns:
    An array equal to ``x`` (same shape and dtype).
  """
  x = _as_array(x)
  dep = _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "fence",
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      has_side_effect=True,
      input_output_aliases={0: 0},
      vmap_method="broadcast_all",
  )(x, dep)


def offload(x: ArrayLike, *, slot: tuple[int, int] | None = None,
            dep: ArrayLike | None = None) -> jax.Array:
  """Copies ``x`` into the native host store.

  Args:
    x: The array to stage to host memory. Any shape (including scalars and
      0-size arrays) and any byte-sized dtype (bool, bfloat16, ...); sub-byte
      dtypes (int4, ...) are refused at run time.
    slot: ``(plan, slot)``: the host memory is that slot of a layout
      registered with :func:`~jaxmem._src.native.store.store_register_plan`
      (SmartPool's planned arena); where the plan is not registered or the
      slot is still live, the store's arena serves it (counted in
      ``store_plan_stats``). None: the store's arena.
    dep: with ``slot``, the copy runs after ``dep`` (the plan's previous
      copy: slots are taken in the order the layout was solved for).

  Returns:
    A ``uint32[2]`` handle for :func:`fetch`.
  """
  return _copy_out("offload", x, slot, dep, vmap_method="sequential")


def _copy_out(op: str, x: ArrayLike, slot: tuple[int, int] | None, dep: ArrayLike | None,
              **call_kw: str) -> jax.Array:
  """The ``op`` (offload or offload_start) custom call: its planned variant with ``slot``."""
  x = _as_array(x)
  if slot is None:
    if dep is not None:
      raise ValueError(f"`{op}`: `dep` orders a planned copy; pass `slot` too.")
    operands, target, attrs = (x,), op, {}
  else:
    operands, target, attrs = (x, _dep_or_none(dep)), op + "_planned", _slot_attrs(slot)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + target,
      jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE),
      has_side_effect=True,
      **call_kw,
  )(*operands, **attrs)


def _dep_or_none(dep: ArrayLike | None) -> jax.Array:
  return jnp.zeros((), jnp.uint8) if dep is None else _as_array(dep)


def _slot_attrs(slot: tuple[int, int]) -> dict[str, np.int64]:
  plan, index = (int(v) for v in slot)
  if plan < 0 or index < 0:
    raise ValueError(f"`slot` must be (plan, slot) with both >= 0; got {slot!r}")
  return dict(plan=np.int64(plan), slot=np.int64(index))


def fetch(handle: ArrayLike, dep: ArrayLike, *, shape: tuple[int, ...],
          dtype: DTypeLike) -> jax.Array:
  """Copies an offloaded array back (after ``dep``) and erases it from the store.

  Args:
    handle: A ``uint32[2]`` handle returned by :func:`offload`.
    dep: Any array; the fetch runs after it is computed (e.g. the incoming
      gradient of the layer that needs the fetched activation).
    shape: Shape of the offloaded array.
    dtype: Dtype of the offloaded array.

  Returns:
    The offloaded array.

  Raises:
    jax.errors.JaxRuntimeError: At run time (``INVALID_ARGUMENT: jaxmem
      fetch: ...``) if the handle is not in the host store (already fetched,
      cleared, or from another process), or ``shape``/``dtype`` do not match
      what was offloaded. Under asynchronous dispatch the error may surface
      when the result is used or blocked on.
  """
  handle = _as_array(handle)
  if tuple(handle.shape) != HANDLE_SHAPE or handle.dtype != HANDLE_DTYPE:
    raise TypeError(
        f"jaxmem fetch: a handle must be {np.dtype(HANDLE_DTYPE).name}"
        f"{list(HANDLE_SHAPE)}, got {handle.dtype}{list(handle.shape)}")
  dep = _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "fetch",
      jax.ShapeDtypeStruct(tuple(shape), dtype),
      has_side_effect=True,
      vmap_method="sequential",
  )(handle, dep)


_NO_DEP = np.zeros((), np.uint8)


def _check_words(x: ArrayLike, what: str, op: str) -> jax.Array:
  x = _as_array(x)
  if tuple(x.shape) != HANDLE_SHAPE or x.dtype != HANDLE_DTYPE:
    raise TypeError(
        f"jaxmem {op}: a {what} must be {np.dtype(HANDLE_DTYPE).name}"
        f"{list(HANDLE_SHAPE)}, got {x.dtype}{list(x.shape)}")
  return x


def offload_start(x: ArrayLike, *, slot: tuple[int, int] | None = None,
                  dep: ArrayLike | None = None) -> jax.Array:
  """Starts copying ``x`` to host memory; returns a ``uint32[2]`` ticket at once.

  Args:
    x: The array to stage (any shape, any byte-sized dtype). Pass the same
      array to :func:`offload_done`: that read keeps it allocated meanwhile.
    slot: ``(plan, slot)`` of a planned layout, as for :func:`offload`.
    dep: with ``slot``, as for :func:`offload`.

  Returns:
    A ``uint32[2]`` ticket for :func:`offload_done`.
  """
  return _copy_out("offload_start", x, slot, dep)


def offload_done(x: ArrayLike, ticket: ArrayLike, dep: ArrayLike | None = None) -> jax.Array:
  """Waits (after ``dep``) for the copy of :func:`offload_start`; returns its handle.

  Args:
    x: The array passed to :func:`offload_start`.
    ticket: The ticket it returned.
    dep: Any array; the done runs after it is computed (``None``: no order).

  Returns:
    A ``uint32[2]`` host store handle for :func:`fetch` / :func:`fetch_start`.

  Raises:
    jax.errors.JaxRuntimeError: At run time for a stale, foreign or fetch
      ticket, or when ``x`` is not the buffer the copy read (the start and the
      done ran in different computations and XLA copied ``x``).
  """
  x = _as_array(x)
  ticket = _check_words(ticket, "ticket", "offload_done")
  dep = _NO_DEP if dep is None else _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "offload_done",
      jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE),
      has_side_effect=True,
  )(x, ticket, dep)


def fetch_start(handle: ArrayLike, dep: ArrayLike, *, shape: tuple[int, ...],
                dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
  """Starts copying an offloaded array back (after ``dep``); returns ``(buf, ticket)``.

  The entry leaves the host store here: a second fetch of ``handle`` fails.

  Args:
    handle: A ``uint32[2]`` handle from :func:`offload` or :func:`offload_done`.
    dep: Any array; the fetch starts after it is computed.
    shape: Shape of the offloaded array.
    dtype: Dtype of the offloaded array.

  Returns:
    ``buf``, the destination being filled (pass it to :func:`fetch_done`,
    never read it directly), and a ``uint32[2]`` ticket.

  Raises:
    jax.errors.JaxRuntimeError: At run time, as :func:`fetch`.
  """
  handle = _check_words(handle, "handle", "fetch_start")
  dep = _as_array(dep)
  return tuple(jax.ffi.ffi_call(
      TARGET_PREFIX + "fetch_start",
      (jax.ShapeDtypeStruct(tuple(shape), dtype),
       jax.ShapeDtypeStruct(HANDLE_SHAPE, HANDLE_DTYPE)),
      has_side_effect=True,
  )(handle, dep))


def fetch_done(buf: ArrayLike, ticket: ArrayLike, dep: ArrayLike | None = None) -> jax.Array:
  """Waits (after ``dep``) for the copy of :func:`fetch_start`; returns the array.

  Args:
    buf: The first output of :func:`fetch_start`.
    ticket: Its second output.
    dep: Any array; the done runs after it is computed (``None``: no order).

  Returns:
    The fetched array (an alias of ``buf``).

  Raises:
    jax.errors.JaxRuntimeError: At run time for a stale, foreign or offload
      ticket, or when XLA moved ``buf`` while the copy was in flight.
  """
  buf = _as_array(buf)
  ticket = _check_words(ticket, "ticket", "fetch_done")
  dep = _NO_DEP if dep is None else _as_array(dep)
  return jax.ffi.ffi_call(
      TARGET_PREFIX + "fetch_done",
      jax.ShapeDtypeStruct(buf.shape, buf.dtype),
      has_side_effect=True,
      input_output_aliases={0: 0},
  )(buf, ticket, dep)


def handle_id(handle: ArrayLike) -> int:
  """The 64-bit host-store id of a concrete ``uint32[2]`` handle."""
  words = np.asarray(handle, dtype=np.uint32).reshape(-1)
  if words.shape != (2,):
    raise ValueError(f"a handle has 2 words, got {words.shape[0]}")
  return int(words[0]) | (int(words[1]) << 32)


__all__ = ["fence", "fetch", "fetch_done", "fetch_start", "handle_id", "offload", "offload_done",
           "offload_start"]
