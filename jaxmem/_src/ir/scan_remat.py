"""Per-iteration recomputation of a scan's stacked residuals, as a rewrite of the step's jaxpr.

Differentiating a ``lax.scan`` (``nn.scan``, ``nnx.scan``) splits it in two:
a forward scan that, besides its carry, stacks every residual the backward
pass needs (one slice per iteration, ``ys``), and a backward scan that takes
those stacks as ``xs``. A GPT written with ``nn.scan`` keeps every layer's
activations in these stacks; jaxmem's planners see each stack as one value
and cannot cut it (``bench/results/scan_planning.md``: no plan below the
unplanned peak at 12, 24 or 48 layers).

:func:`recompute_scan_residuals` rewrites such a pair so that the backward
body recomputes chosen residuals of its iteration from what that iteration of
the forward body read (the carry coming in, the slices of ``xs``, the
loop-invariant operands), the per-iteration form of Chen et al.'s
recomputation (*Training Deep Nets with Sublinear Memory Cost*, 2016, §3) and
what ``jax.checkpoint`` on the scan body does when the user writes it. The
forward scan stops stacking those residuals; it stacks its incoming carry
instead when the backward pass did not already receive it. The arithmetic is
the forward body's own, on the same values, so outputs and gradients are
unchanged.

``jaxmem.fit`` tries the rewrites in turn when the step as written does not
fit (``FitResult.scans`` says which one it planned).

Each residual of a pair may instead be *staged* (:meth:`ScanPair.with_choices`):
the forward body copies its iteration's slice out of device memory and the
backward body copies it back, the per-layer offload of vDNN (Rhu et al.,
*vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural
Network Design*, §3.2) with a scan iteration as the layer. Where the slices go
is :attr:`ScanPair.offload`: host memory kinds (``jax.device_put`` to
``jax.memory.Space.Host``, which XLA:TPU and XLA:GPU honour and XLA:CPU
erases) or jaxmem's native host store (our ``offload``/``fetch`` FFI calls,
one per iteration, which any backend with our handlers runs; the forward scan
then stacks ``uint32[2]`` handles, not data). The stacks a recomputation
reads may also go out one by one (:attr:`ScanPair.on_device` keeps the
others): one plan then keeps, stages and recomputes values of the same body,
which ``jaxmem.fit`` uses when the point that stacks least does not fit on
the device but sending only some of its stacks out does.

Departures from the papers: the copies are synchronous within their
iteration (vDNN overlaps each layer's offload with its computation, and
Hayakawa et al.'s window prefetches a window of layers ahead); in a ``while``
loop a buffer an asynchronous copy writes into may be copied by XLA between
iterations, so jaxmem does not carry one across iterations. Nested scans are
left as they are (only the top-level pairs are rewritten), and so is a body
the user wrapped in ``jax.checkpoint``: its residuals are already what its
policy saves.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem._src import _compat
from jaxmem._src.native import ops as native

#: What :class:`ScanPair` may do with each residual stack.
RECOMPUTE, STAGE, KEEP = "recompute", "stage", "keep"
#: Where :attr:`ScanPair.offload` puts the slices it copies out of device memory.
MEMORY_KIND, NATIVE_STORE = "memory_kind", "native"


@dataclasses.dataclass(frozen=True)
class ScanPair:
  """A forward scan and the backward scan that takes its stacked residuals.

  Attributes:
    forward: index of the forward ``scan`` equation in the jaxpr.
    backward: index of the ``scan`` that reads the residuals.
    residuals: indexes, among the forward scan's ``ys``, of the stacks that
      only the backward scan reads (as ``xs``): what the rewrite may change.
    choices: per residual (same order), :data:`RECOMPUTE` (in the backward
      body, from what the forward body read), :data:`STAGE` (each slice copied
      out of device memory in the forward body and back in the backward body,
      to where ``offload`` says) or :data:`KEEP` (stacked as before). Empty:
      every residual recomputed.
    save_dots: the forward scan also stacks the outputs of the body's
      matmuls (``dot_general``) that the recomputation needs, which then
      recomputes only the rest from them, as
      ``jax.checkpoint_policies.dots_saveable`` does; else the recomputation
      starts from the body's inputs, as ``nothing_saveable`` does.
    saved: which values of the forward body the forward scan stacks for the
      recomputation, as indexes of the equations that make them in
      :func:`forward_body` (the body with nested calls inlined); the
      recomputation starts from them and the body's inputs. ``None``:
      ``save_dots`` decides. A chosen policy per body value, as
      ``jax.checkpoint`` with a custom policy would save them
      (``planners/scan_policy.py`` chooses them by cost). Saved values the
      recomputation does not read are not stacked.
    offload: ``""`` (nothing leaves device memory), :data:`MEMORY_KIND` or
      :data:`NATIVE_STORE`: the staged residuals and the stacks the rewrite
      adds (the carries the recomputation starts from, and the matmul
      outputs with ``save_dots``) leave device memory one slice per
      iteration. With :data:`MEMORY_KIND` each slice is ``jax.device_put``
      to ``jax.memory.Space.Host`` in the forward body and back to the
      device in the backward body, as ``save_and_offload_only_these_names``
      does for a remat-ed scan body: XLA:TPU (and XLA:GPU) keeps the whole
      stack on the host, XLA:CPU erases memory kinds. With
      :data:`NATIVE_STORE` each slice goes to jaxmem's host store (the
      ``offload`` and ``fetch`` FFI calls): what the forward scan stacks is
      a handle per iteration. (Layrub, §3, and the window-based scheduling
      of Hayakawa et al. move per-layer data a layer ahead; here each copy
      runs in its own iteration.)
    on_device: with ``offload``, the stacks the rewrite adds that stay in
      device memory all the same, so that a plan keeps some stacks, sends
      others out and recomputes the rest: equations of ``saved`` (their
      stacked outputs) and ``("carry", k)`` for the carry that is input
      ``k`` of the forward body (its stack, where the rewrite adds one).
  """
  forward: int
  backward: int
  residuals: tuple[int, ...]
  save_dots: bool = False
  offload: str = ""
  choices: tuple[str, ...] = ()
  saved: tuple[int, ...] | None = None
  on_device: tuple[int | tuple[str, int], ...] = ()

  def __post_init__(self) -> None:
    if self.saved is not None and self.save_dots:
      raise ValueError("`ScanPair`: pass `saved` (the body values to stack) or `save_dots`, not "
                       "both.")
    if self.offload not in ("", MEMORY_KIND, NATIVE_STORE):
      raise ValueError(f"`ScanPair.offload` must be '', {MEMORY_KIND!r} or {NATIVE_STORE!r}; "
                       f"got {self.offload!r}.")
    if self.choices and len(self.choices) != len(self.residuals):
      raise ValueError(f"`ScanPair.choices` needs one choice per residual ({len(self.residuals)});"
                       f" got {len(self.choices)}.")
    if bad := set(self.choices) - {RECOMPUTE, STAGE, KEEP}:
      raise ValueError(f"`ScanPair.choices`: unknown {sorted(bad)}; each is {RECOMPUTE!r}, "
                       f"{STAGE!r} or {KEEP!r}.")
    if self.on_device and not self.offload:
      raise ValueError("`ScanPair.on_device` keeps some stacks in device memory, but `offload` "
                       "sends none out: pass `offload` too, or leave `on_device` empty.")
    bad_on = [x for x in self.on_device
              if not (isinstance(x, int) and self.saved is not None and x in self.saved)
              and not (isinstance(x, tuple) and len(x) == 2 and x[0] == "carry")]
    if bad_on:
      raise ValueError(f"`ScanPair.on_device`: {bad_on} are neither equations of `saved` "
                       f"({self.saved}) nor ('carry', k) entries.")
    if STAGE in self.choices and not self.offload:
      raise ValueError("`ScanPair.choices` stages residuals but `offload` says nowhere: pass "
                       f"offload={MEMORY_KIND!r} (accelerators) or {NATIVE_STORE!r} (our host "
                       "store).")

  def _with(self, choice: str) -> tuple[int, ...]:
    choices = self.choices or (RECOMPUTE,) * len(self.residuals)
    return tuple(j for j, c in zip(self.residuals, choices) if c == choice)

  @property
  def recomputed(self) -> tuple[int, ...]:
    """The residuals the backward body recomputes."""
    return self._with(RECOMPUTE)

  @property
  def staged(self) -> tuple[int, ...]:
    """The residuals copied out of device memory per iteration and back."""
    return self._with(STAGE)

  def saving_dots(self) -> ScanPair:
    """This pair with ``save_dots``: the matmul outputs stacked, the rest recomputed."""
    return dataclasses.replace(self, save_dots=True, saved=None)

  def offloading(self, to: str = MEMORY_KIND) -> ScanPair:
    """This pair with ``offload``: the stacks the recomputation reads kept out of device memory."""
    return dataclasses.replace(self, offload=to)

  def with_choices(self, choice: str | Sequence[str]) -> ScanPair:
    """This pair with one choice for every residual, or one per residual."""
    choices = (choice,) * len(self.residuals) if isinstance(choice, str) else tuple(choice)
    return dataclasses.replace(self, choices=choices)

  def saving(self, eqns: Sequence[int]) -> ScanPair:
    """This pair stacking the outputs of these equations of :func:`forward_body` (``saved``)."""
    return dataclasses.replace(self, saved=tuple(sorted(set(int(i) for i in eqns))),
                               save_dots=False)

  def keeping_on_device(self, stacks: Sequence[int | tuple[str, int]]) -> ScanPair:
    """This pair with ``on_device``: these stacks stay in device memory although others go out."""
    return dataclasses.replace(self, on_device=tuple(stacks))


def _to_host(x: Any) -> Any:
  return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: Any) -> Any:
  return jax.device_put(x, jax.memory.Space.Device)


def _put(where: str) -> Callable[[Any], Any]:
  """How an iteration's slice leaves device memory in the forward body."""
  return native.offload if where == NATIVE_STORE else _to_host


def _get(where: str, x: Any, aval: Any) -> Any:
  """How the backward body gets back a slice :func:`_put` sent ``where``."""
  if where == NATIVE_STORE:
    # The fetch runs in its own iteration: its handle is its only dependency.
    return native.fetch(x, x, shape=aval.shape, dtype=aval.dtype)
  return _to_device(x)


def scan_pairs(jaxpr: _compat.Jaxpr) -> list[ScanPair]:
  """Forward/backward scan pairs of a differentiated step, and the residuals each could recompute.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(ws, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    ...   return h.sum()
    >>> closed = jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
    >>> [(p.forward, p.backward, len(p.residuals)) for p in scan_pairs(closed.jaxpr)]
    [(0, 4, 3)]
  """
  uses: dict[Any, list[tuple[int, int]]] = collections.defaultdict(list)
  for i, eqn in enumerate(jaxpr.eqns):
    for pos, v in enumerate(eqn.invars):
      if isinstance(v, _compat.Var):
        uses[v].append((i, pos))
  returned = {v for v in jaxpr.outvars if isinstance(v, _compat.Var)}
  pairs = []
  for fi, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "scan":
      continue
    _, _, num_carry, length, _ = _compat.scan_params(eqn)
    by_consumer: dict[int, list[int]] = collections.defaultdict(list)
    for j, out in enumerate(eqn.outvars[num_carry:]):
      if isinstance(out, _compat.DropVar) or out in returned or not uses[out]:
        continue
      users = {i for i, _ in uses[out]}
      if len(users) != 1:
        continue
      gi = users.pop()
      g = jaxpr.eqns[gi]
      if g.primitive.name != "scan":
        continue
      _, g_consts, g_carry, g_length, _ = _compat.scan_params(g)
      if g_length != length or any(pos < g_consts + g_carry for _, pos in uses[out]):
        continue
      by_consumer[gi].append(j)
    pairs += [ScanPair(fi, gi, tuple(js)) for gi, js in sorted(by_consumer.items())]
  return pairs


def forward_body(jaxpr: _compat.Jaxpr, pair: ScanPair) -> _compat.ClosedJaxpr:
  """The body of ``pair``'s forward scan with nested calls inlined: what :attr:`ScanPair.saved` indexes.

  Flax wraps each module in a call (``pjit``, ``custom_jvp_call``...): inlined,
  the matmuls and activations are equations of the body itself. The same
  jaxpr gives the same equations in the same order.
  """
  return _inlined(jaxpr.eqns[pair.forward].params["jaxpr"])


def recompute_scan_residuals(closed: _compat.ClosedJaxpr,
                             pairs: Sequence[ScanPair] | None = None) -> _compat.ClosedJaxpr:
  """``closed`` with each pair's residuals recomputed per iteration in the backward scan.

  Args:
    closed: a differentiated step's jaxpr (``jax.make_jaxpr`` of a train step).
    pairs: which residuals to recompute or stage (default: every pair of
      :func:`scan_pairs`, all of its residuals recomputed). A pair that
      changes no residual is left as it is; with none at all, ``closed``
      itself is returned.

  Returns:
    A jaxpr with the same inputs and outputs, whose forward scans stack
    fewer values.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(ws, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    ...   return h.sum()
    >>> ws, x = jnp.full((3, 4, 4), 0.1), jnp.ones((2, 4))
    >>> closed = jax.make_jaxpr(jax.grad(loss))(ws, x)
    >>> rewritten = recompute_scan_residuals(closed)
    >>> bool((jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, ws, x)[0]
    ...       == jax.grad(loss)(ws, x)).all())
    True
  """
  jaxpr = closed.jaxpr
  if pairs is None:
    pairs = scan_pairs(jaxpr)
  pairs = [p for p in pairs if p.recomputed or p.staged]
  if not pairs:
    return closed
  forward = {p.forward: p for p in pairs}
  backward = {p.backward: p for p in pairs}
  if len(forward) != len(pairs) or len(backward) != len(pairs):
    raise ValueError("`recompute_scan_residuals`: each scan may be in one pair only; got "
                     f"{[(p.forward, p.backward) for p in pairs]}.")
  plans = {p.forward: _PairPlan.make(jaxpr, p) for p in pairs}

  def run(*args: Any) -> list[Any]:
    env: dict[Any, Any] = {}
    stacked_carry: dict[int, list[Any]] = {}
    stacked_dots: dict[int, list[Any]] = {}

    def read(v: Any) -> Any:
      return v.val if isinstance(v, _compat.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, closed.consts):
      env[v] = c
    for v, a in zip(jaxpr.invars, args):
      env[v] = a
    for i, eqn in enumerate(jaxpr.eqns):
      # A backward scan's residual operands are no longer computed: None.
      invals = [None if isinstance(v, _compat.Var) and v not in env else read(v)
                for v in eqn.invars]
      if i in forward:
        plan = plans[i]
        outs, stacked_carry[i], stacked_dots[i] = plan.bind_forward(eqn, invals)
        kept = [v for j, v in enumerate(eqn.outvars)
                if j < plan.num_carry or j - plan.num_carry not in plan.pair.recomputed]
        for v, x in zip(kept, outs):
          if not isinstance(v, _compat.DropVar):
            env[v] = x
        continue
      if i in backward:
        pair = backward[i]
        plan = plans[pair.forward]
        f_eqn = jaxpr.eqns[pair.forward]
        f_invals = [read(v) for v in f_eqn.invars]
        f_outvals = {j: env.get(v) for j, v in enumerate(f_eqn.outvars)}
        outs = plan.bind_backward(eqn, invals, f_eqn, f_invals, f_outvals,
                                  stacked_carry[pair.forward], stacked_dots[pair.forward])
      else:
        outs = _compat.bind_eqn(eqn, invals)
      for v, x in zip(eqn.outvars, outs):
        if not isinstance(v, _compat.DropVar):
          env[v] = x
    return [read(v) for v in jaxpr.outvars]

  return _compat.make_jaxpr(run, *_abstract(jaxpr.invars))


@dataclasses.dataclass(frozen=True)
class _PairPlan:
  """How one pair is rewritten: the recomputation slice and where its inputs come from."""
  pair: ScanPair
  num_consts: int
  num_carry: int
  body: Any                 # the forward body, nested calls inlined (a ClosedJaxpr)
  saved_vars: tuple[Any, ...]   # body values stacked too (`save_dots`, `saved`)
  saved_out: tuple[bool, ...]   # per saved value: its stack leaves device memory (`offload`)
  slice_jaxpr: Any          # the body cut to the residuals (inputs: `needed`)
  needed: tuple[int, ...]   # inputs of the cut body the slice reads: the body's, then saved
  # For a needed carry input: the forward ys index that already stacks it, or
  # None when the rewritten forward scan must stack it (`new_carry_stacks`).
  carry_stack: dict[int, int | None]

  @property
  def new_carry_stacks(self) -> tuple[int, ...]:
    """Body inputs (carries) the rewritten forward scan stacks as extra results, in order."""
    return tuple(k for k, j in self.carry_stack.items() if j is None)

  @staticmethod
  def make(jaxpr: _compat.Jaxpr, pair: ScanPair) -> _PairPlan:
    eqn = jaxpr.eqns[pair.forward]
    _, num_consts, num_carry, _, _ = _compat.scan_params(eqn)
    # Nested calls (flax wraps modules in them) inlined, so that the matmuls
    # are equations of the body itself.
    closed_body = forward_body(jaxpr, pair)
    body = closed_body.jaxpr
    num_ys = len(body.outvars) - num_carry
    used = [False] * num_carry + [j in pair.recomputed for j in range(num_ys)]
    saved_vars: tuple[Any, ...] = ()
    on_device = set(pair.on_device)
    goes_out: dict[Any, bool] = {}
    if pair.save_dots:
      needed_part, _ = _compat.dce_jaxpr(body, used)
      saved_vars = tuple(o for e in needed_part.eqns if e.primitive.name == "dot_general"
                         for o in e.outvars)
    elif pair.saved is not None:
      if pair.saved and not 0 <= min(pair.saved) <= max(pair.saved) < len(body.eqns):
        raise ValueError(f"`ScanPair.saved`: equation indexes must be in [0, {len(body.eqns)}) "
                         f"for this forward body; got {pair.saved}.")
      saved_vars = tuple(o for i in pair.saved for o in body.eqns[i].outvars
                         if not isinstance(o, _compat.DropVar))
      goes_out = {o: i not in on_device for i in pair.saved for o in body.eqns[i].outvars}

    def cut_at(saved_vars: tuple[Any, ...]) -> tuple[Any, list[bool]]:
      # The saved values become inputs of the recomputation: the equations
      # that make them leave it.
      saved = set(saved_vars)
      cut_body = body.replace(invars=[*body.invars, *saved_vars],
                              eqns=[e for e in body.eqns if not saved & set(e.outvars)])
      return _compat.dce_jaxpr(cut_body, used)

    cut, used_inputs = cut_at(saved_vars)
    num_inputs = len(body.invars)
    if not all(used_inputs[num_inputs:]):
      # A saved value the recomputation does not read (a matmul output only
      # another saved matmul reads) is not stacked.
      saved_vars = tuple(v for v, u in zip(saved_vars, used_inputs[num_inputs:]) if u)
      cut, used_inputs = cut_at(saved_vars)
    needed = tuple(k for k, u in enumerate(used_inputs) if u)
    carry_stack: dict[int, int | None] = {}
    for k in needed:
      if num_consts <= k < num_consts + num_carry:
        src = body.invars[k]
        carry_stack[k] = next((j for j, o in enumerate(body.outvars[num_carry:])
                               if o is src and j not in pair.recomputed
                               and j not in pair.staged
                               and not isinstance(eqn.outvars[num_carry + j], _compat.DropVar)),
                              None)
    if len(cut.constvars) != len(body.constvars):
      raise AssertionError("the cut body lost constants")   # dce_jaxpr keeps them
    saved_out = tuple(bool(pair.offload) and goes_out.get(v, True) for v in saved_vars)
    return _PairPlan(pair, num_consts, num_carry, closed_body, saved_vars, saved_out, cut, needed,
                     carry_stack)

  def carry_out(self, k: int) -> bool:
    """Whether the stack the rewrite adds for carry input ``k`` leaves device memory."""
    return bool(self.pair.offload) and ("carry", k) not in self.pair.on_device

  def bind_forward(self, eqn: _compat.JaxprEqn,
                   invals: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """The forward scan without the residual stacks: (its other results, new carry stacks, saved stacks)."""
    body = self.body
    num_carry = self.num_carry
    num_outs = len(body.jaxpr.outvars)
    keep = [j for j in range(num_outs - num_carry) if j not in self.pair.recomputed]
    staged = set(self.pair.staged)
    stacking = body.jaxpr.replace(outvars=[*body.jaxpr.outvars, *self.saved_vars])

    stack = _put(self.pair.offload) if self.pair.offload else (lambda x: x)

    def new_body(*args: Any) -> list[Any]:
      outs = _compat.eval_jaxpr(stacking, body.consts, *args)
      return (outs[:num_carry]
              + [stack(outs[num_carry + j]) if j in staged else outs[num_carry + j] for j in keep]
              + [stack(args[k]) if self.carry_out(k) else args[k]
                 for k in self.new_carry_stacks]
              + [stack(o) if out else o for o, out in zip(outs[num_outs:], self.saved_out)])

    new = _compat.make_jaxpr(new_body, *_abstract(body.jaxpr.invars))
    with _compat.eqn_context(eqn):   # reports name the user's scan, not this module
      outs = list(eqn.primitive.bind(*invals, **{**eqn.params, "jaxpr": new}))
    n_main, n_new = num_carry + len(keep), len(self.new_carry_stacks)
    return outs[:n_main], outs[n_main:n_main + n_new], outs[n_main + n_new:]

  def bind_backward(self, eqn: _compat.JaxprEqn, invals: list[Any], f_eqn: _compat.JaxprEqn,
                    f_invals: list[Any], f_outvals: dict[int, Any],
                    new_stacks: list[Any], saved_stacks: list[Any]) -> list[Any]:
    """The backward scan, recomputing the residuals from the forward body's inputs."""
    body = eqn.params["jaxpr"]
    g_consts, g_carry = int(eqn.params["num_consts"]), int(eqn.params["num_carry"])
    where = self.pair.offload
    recomputed = self.pair.recomputed
    residual_vars = [f_eqn.outvars[self.num_carry + j] for j in recomputed]
    # Where each recomputed residual sits among the backward scan's operands.
    residual_pos = {pos: residual_vars.index(v) for pos, v in enumerate(eqn.invars)
                    if pos >= g_consts + g_carry and v in residual_vars}
    # Where each staged residual does (its operand is now what `_put` gave),
    # and the aval of its slice.
    staged_vars = {f_eqn.outvars[self.num_carry + j]:
                   self.body.jaxpr.outvars[self.num_carry + j].aval for j in self.pair.staged}
    staged_pos = {pos: v for pos, v in enumerate(eqn.invars)
                  if pos >= g_consts + g_carry and v in staged_vars}
    # The slice's inputs: loop invariants become consts, per-iteration values xs.
    num_inputs = len(self.body.jaxpr.invars)
    extra_consts, extra_xs, source = [], [], []
    # extra_xs the rewrite stacked out of device memory (`offload`): the aval of a slice.
    on_host: dict[int, Any] = {}
    for k in self.needed:
      if k >= num_inputs:
        source.append(("xs", len(extra_xs)))
        if self.saved_out[k - num_inputs]:
          on_host[len(extra_xs)] = self.saved_vars[k - num_inputs].aval
        extra_xs.append(saved_stacks[k - num_inputs])
      elif k < self.num_consts:
        source.append(("const", len(extra_consts)))
        extra_consts.append(f_invals[k])
      elif k < self.num_consts + self.num_carry:
        j = self.carry_stack[k]
        stack = (f_outvals[self.num_carry + j] if j is not None
                 else new_stacks[self.new_carry_stacks.index(k)])
        source.append(("xs", len(extra_xs)))
        if j is None and self.carry_out(k):
          on_host[len(extra_xs)] = self.body.jaxpr.invars[k].aval
        extra_xs.append(stack)
      else:
        source.append(("xs", len(extra_xs)))
        extra_xs.append(f_invals[k])
    kept_xs = [pos for pos in range(g_consts + g_carry, len(invals)) if pos not in residual_pos]
    n_kept = len(kept_xs)

    def new_body(*args: Any) -> list[Any]:
      consts = list(args[:g_consts])
      ec = list(args[g_consts:g_consts + len(extra_consts)])
      rest = args[g_consts + len(extra_consts):]
      carry = list(rest[:g_carry])
      xs = list(rest[g_carry:g_carry + n_kept])
      ex = list(rest[g_carry + n_kept:])
      fetched = {i: _get(where, ex[i], aval) for i, aval in on_host.items()}
      slice_in = [ec[i] if kind == "const" else fetched.get(i, ex[i]) for kind, i in source]
      values = _compat.eval_jaxpr(self.slice_jaxpr, self.body.consts, *slice_in)
      # A staged stack read at several positions is fetched once (the
      # native store's fetch erases what it returns).
      got: dict[Any, Any] = {}
      full_xs, it = [], iter(zip(kept_xs, xs))
      for pos in range(g_consts + g_carry, len(invals)):
        if pos in residual_pos:
          full_xs.append(values[residual_pos[pos]])
          continue
        kpos, x = next(it)
        if kpos in staged_pos:
          v = staged_pos[kpos]
          if v not in got:
            got[v] = _get(where, x, staged_vars[v])
          x = got[v]
        full_xs.append(x)
      return _compat.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *full_xs)

    def sds(x: Any, sliced: bool) -> Any:
      shape = x.shape[1:] if sliced else x.shape
      return jax.ShapeDtypeStruct(shape, x.dtype)

    operands = (invals[:g_consts] + extra_consts + invals[g_consts:g_consts + g_carry]
                + [invals[p] for p in kept_xs] + extra_xs)
    avals = ([sds(x, False) for x in invals[:g_consts] + extra_consts + invals[g_consts:g_consts + g_carry]]
             + [sds(x, True) for x in [invals[p] for p in kept_xs] + extra_xs])
    new = _compat.make_jaxpr(new_body, *avals)
    params = {**eqn.params, "jaxpr": new, "num_consts": g_consts + len(extra_consts)}
    with _compat.eqn_context(eqn):
      return list(eqn.primitive.bind(*operands, **params))


def _inlined(closed: _compat.ClosedJaxpr) -> _compat.ClosedJaxpr:
  """``closed`` with the bodies of nested calls (``pjit``, ``custom_jvp``, ...) inlined."""
  def evaluate(jaxpr: _compat.Jaxpr, consts: Any, args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]
    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      inner = _compat.body_of(eqn)
      outs = (evaluate(inner.jaxpr, inner.consts, invals) if inner is not None
              else _compat.bind_eqn(eqn, invals))
      env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, _compat.DropVar))
    return [read(v) for v in jaxpr.outvars]

  return _compat.make_jaxpr(lambda *args: evaluate(closed.jaxpr, closed.consts, args),
                            *_abstract(closed.jaxpr.invars))


def _abstract(invars: Sequence[_compat.Var]) -> list[jax.ShapeDtypeStruct]:
  """Shape-only arguments to trace a jaxpr with ``invars`` again."""
  return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
          for v in invars]


def traced_step(fun: Callable[..., Any], args: Sequence[Any]
                ) -> tuple[_compat.ClosedJaxpr, list[ScanPair], Any]:
  """``fun``'s jaxpr on the flattened ``args``, its scan pairs, and its output tree.

  The jaxpr :func:`with_scan_residuals_recomputed` rewrites, so that
  :attr:`ScanPair.saved` indexes chosen on it (``planners/scan_policy.py``)
  name the same equations.
  """
  leaves, in_tree = jax.tree_util.tree_flatten(tuple(args))
  out_trees = []

  def flat(*xs: Any) -> list[Any]:
    out, tree = jax.tree_util.tree_flatten(fun(*jax.tree_util.tree_unflatten(in_tree, xs)))
    out_trees.append(tree)
    return out

  closed = _compat.make_jaxpr(flat, *leaves)
  return closed, scan_pairs(closed.jaxpr), out_trees[0]


def traced_again(fun: Callable[..., Any], args: Sequence[Any],
                 traced: tuple[_compat.ClosedJaxpr, list[ScanPair], Any] | None
                 ) -> tuple[list[Any], tuple[_compat.ClosedJaxpr, list[ScanPair], Any]]:
  """``args``' leaves and :func:`traced_step` of ``fun`` on them: ``traced`` where it was made
  for arguments of the same abstract values, else a new trace."""
  leaves = jax.tree_util.tree_leaves(args)
  if traced is not None and [jax.typeof(x) for x in leaves] == list(traced[0].in_avals):
    return leaves, traced
  return leaves, traced_step(fun, args)


def with_scan_residuals_recomputed(fun: Callable[..., Any], *, save_dots: bool = False,
                                  offload: bool | str = False,
                                  residuals: str = RECOMPUTE,
                                  saved: Sequence[Sequence[int]] | None = None,
                                  on_device: Sequence[Sequence[int | tuple[str, int]]] | None = None,
                                  traced: tuple[_compat.ClosedJaxpr, list[ScanPair], Any] | None = None
                                  ) -> Callable[..., Any]:
  """``fun`` whose differentiated scans recompute (or stage) their stacked residuals per iteration.

  ``save_dots``: the scans stack their matmul outputs and recompute the rest
  (``ScanPair.save_dots``), else recompute from each iteration's inputs.
  ``offload``: what the recomputation reads (and the staged residuals) leave
  device memory, one slice per iteration (``ScanPair.offload``): ``True`` or
  :data:`MEMORY_KIND` for host memory kinds (an accelerator's compiler only),
  :data:`NATIVE_STORE` for jaxmem's host store (where our FFI handlers are
  registered: the CPU, CUDA builds). ``residuals``: :data:`RECOMPUTE`, or
  :data:`STAGE` to copy every residual out of device memory as it is
  (``offload`` must say where) instead of recomputing it. ``saved``: per
  pair of :func:`traced_step` (in its order), the equations of the forward
  body whose outputs are stacked for the recomputation (``ScanPair.saved``),
  instead of ``save_dots``. ``on_device``: per pair, with ``offload``, the
  stacks that stay in device memory (``ScanPair.on_device``), the others
  leaving it. ``traced``: :func:`traced_step` of ``fun`` made already, used
  when the arguments' abstract values are those it was traced on, so that a
  search rewriting one step many ways runs the user's Python once (a flax
  CTC GRU: 2.1 s a trace, ten rewrites in a `fit` at 0.3 of its peak).

  The wrapped function traces ``fun`` on its arguments, rewrites the jaxpr
  with :func:`recompute_scan_residuals` and evaluates the result, so it can
  be traced, jitted and analyzed like ``fun`` (same pytrees in and out).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(ws, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    ...   return h.sum()
    >>> grad = with_scan_residuals_recomputed(jax.grad(loss))
    >>> ws, x = jnp.full((3, 4, 4), 0.1), jnp.ones((2, 4))
    >>> bool((jax.jit(grad)(ws, x) == jax.grad(loss)(ws, x)).all())
    True
  """
  if saved is not None and save_dots:
    raise ValueError("`with_scan_residuals_recomputed`: pass `saved` or `save_dots`, not both.")

  @functools.wraps(fun)
  def wrapped(*args: Any) -> Any:
    leaves, (closed, pairs, out_tree) = traced_again(fun, args, traced)
    if save_dots:
      pairs = [p.saving_dots() for p in pairs]
    if saved is not None:
      if len(saved) != len(pairs):
        raise ValueError(f"`with_scan_residuals_recomputed`: `saved` has {len(saved)} entries for "
                         f"{len(pairs)} scan pairs; pass one per pair of `traced_step`.")
      pairs = [p.saving(s) for p, s in zip(pairs, saved)]
    if offload:
      pairs = [p.offloading(MEMORY_KIND if offload is True else offload) for p in pairs]
    if on_device is not None:
      if len(on_device) != len(pairs):
        raise ValueError(f"`with_scan_residuals_recomputed`: `on_device` has {len(on_device)} "
                         f"entries for {len(pairs)} scan pairs; pass one per pair.")
      pairs = [p.keeping_on_device(d) for p, d in zip(pairs, on_device)]
    if residuals != RECOMPUTE:
      pairs = [p.with_choices(residuals) for p in pairs]
    rewritten = recompute_scan_residuals(closed, pairs)
    outs = _compat.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *leaves)
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return wrapped
