"""What a scanned layer stacks for its backward pass: a per-value remat policy chosen by cost.

A differentiated ``scan`` stacks, per iteration, every residual its backward
scan reads (``ir/scan_remat.py``). JAX's policies choose what to stack by
kind: ``nothing_saveable`` only the carry, ``dots_saveable`` every matmul
output. Neither is right for every budget: on a v5e GPT of 12 scanned
layers the first reaches 0.08 of the peak at +22% FLOPs and the second 0.48
at +1% (``bench/results/scan_planning.md``), with nothing in between.

:func:`scan_frontier` orders the body's values by what stacking them saves
in recomputation per byte stacked, the greedy of Chen et al. (*Training Deep
Nets with Sublinear Memory Cost*, 2016, §4: drop the results of low-cost
operations, keep the values expensive to recompute) priced by jaxmem's cost
model, and returns
the sets it passes through, from "stack nothing" (only what the
recomputation starts from: the carry) to "stack every residual" (no
recomputation): a frontier of stacked bytes against recomputation time.
It recovers selective recomputation (Korthikanti et al., *Reducing
Activation Recomputation in Large Transformer Models*, 2022, §4) where the
cost model says so: a matmul output costs ``2·k`` FLOPs per element to
recompute, an elementwise value (softmax, GeLU, a norm) a few, so the
matmul outputs with the most arithmetic per byte are stacked first and the
large elementwise values last. ``jaxmem.fit`` compiles points of the
frontier and keeps the cheapest one that fits the budget; below the point
that stacks least, the stacks of the point whose recomputation and copies
are cheapest leave device memory (``ScanPair.offload``).

Departures: the greedy is Chen et al.'s with a cost per value instead of
their uniform one, over the equations of one iteration (the body is planned
once, not unrolled, so planning time does not grow with the layer count);
it is not the optimum of Checkmate's MILP on the body. The recomputation is
priced with XLA's fusion of elementwise chains into their consumers
(``estimate/cost.py``), which makes elementwise values nearly free to
recompute, as on an accelerator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxmem._src import _compat
from jaxmem._src.estimate.cost import eqn_seconds
from jaxmem._src.estimate.devices import DeviceProfile
from jaxmem._src.ir import primitives
from jaxmem._src.ir.primitives import Fusion
from jaxmem._src.ir.scan_remat import ScanPair, forward_body

_FUSED = (Fusion.CHEAP, Fusion.EXPENSIVE, Fusion.VIEW)


@dataclasses.dataclass(frozen=True)
class ScanPolicyPoint:
  """One point of :func:`scan_frontier`: what every pair's forward scan stacks.

  Attributes:
    saved: per pair, the equations of its forward body (:func:`forward_body`)
      whose outputs are stacked (``ScanPair.saved``).
    stacked_bytes: bytes the forward scans stack for the backward pass, all
      iterations (saved values and the carries the recomputation starts from).
    recompute_s: the recomputation's time per step on the profile, all
      iterations.
    stacks: per pair, ``(stack, bytes)`` of every stack the point adds, all
      iterations: an equation of ``saved`` or ``("carry", k)`` for the carry
      that is input ``k`` of the forward body (``ScanPair.on_device``).
  """
  saved: tuple[tuple[int, ...], ...]
  stacked_bytes: int
  recompute_s: float
  stacks: tuple[tuple[tuple[int | tuple[str, int], int], ...], ...] = ()

  @property
  def num_saved(self) -> int:
    """How many body values the point stacks, over all pairs."""
    return sum(len(s) for s in self.saved)


class _Body:
  """One forward body as an integer graph, to price saved sets quickly."""

  def __init__(self, jaxpr: _compat.Jaxpr, pair: ScanPair, profile: DeviceProfile) -> None:
    eqn = jaxpr.eqns[pair.forward]
    _, num_consts, num_carry, length, _ = _compat.scan_params(eqn)
    body = forward_body(jaxpr, pair).jaxpr
    self.length = int(length)
    targets = [body.outvars[num_carry + j] for j in pair.recomputed]
    producer: dict[int, int] = {}
    for i, e in enumerate(body.eqns):
      for o in e.outvars:
        producer[id(o)] = i
    # Per equation: the equations its operands come from, and the carries it reads.
    self.inputs: list[tuple[int, ...]] = []
    self.carries: list[tuple[int, ...]] = []
    carry_pos = {id(v): k for k, v in enumerate(body.invars)
                 if num_consts <= k < num_consts + num_carry}
    self.carry_bytes = {k: _compat.aval_nbytes(body.invars[k].aval) for k in carry_pos.values()}
    for e in body.eqns:
      vs = [v for v in e.invars if isinstance(v, _compat.Var)]
      self.inputs.append(tuple(sorted({producer[id(v)] for v in vs if id(v) in producer})))
      self.carries.append(tuple(sorted({carry_pos[id(v)] for v in vs if id(v) in carry_pos})))
    self.out_bytes = [sum(_compat.aval_nbytes(o.aval) for o in e.outvars
                          if not isinstance(o, _compat.DropVar)) for e in body.eqns]
    # Recomputed in the backward body, an elementwise value is fused into
    # what reads it there, residuals included: only its arithmetic is paid.
    self.seconds = [eqn_seconds(e, profile, fused=primitives.eqn_facts(e).fusion in _FUSED)
                    for e in body.eqns]
    self.target_eqns = tuple(sorted({producer[id(v)] for v in targets if id(v) in producer}))
    self.target_carries = tuple(sorted({carry_pos[id(v)] for v in targets
                                        if id(v) in carry_pos}))
    self.num_eqns = len(body.eqns)

  def _walk(self, saved: frozenset[int]) -> tuple[set[int], set[int], set[int]]:
    """(equations recomputed, saved equations they read, carries they read) of one iteration."""
    live: set[int] = set()
    used_saved: set[int] = set()
    carries: set[int] = set(self.target_carries)
    stack = list(self.target_eqns)
    while stack:
      i = stack.pop()
      if i in saved:
        used_saved.add(i)
        continue
      if i in live:
        continue
      live.add(i)
      carries.update(self.carries[i])
      stack.extend(self.inputs[i])
    return live, used_saved, carries

  def stacks(self, saved: frozenset[int]) -> tuple[tuple[int | tuple[str, int], int], ...]:
    """``(stack, bytes over all iterations)`` of what stacking ``saved`` stacks (:meth:`price`)."""
    _, used_saved, carries = self._walk(saved)
    return (tuple((i, self.out_bytes[i] * self.length) for i in sorted(used_saved))
            + tuple((("carry", k), self.carry_bytes[k] * self.length) for k in sorted(carries)))

  def price(self, saved: frozenset[int]) -> tuple[float, int, frozenset[int]]:
    """(recompute seconds, stacked bytes, equations recomputed) of one iteration."""
    live, used_saved, carries = self._walk(saved)
    seconds = sum(self.seconds[i] for i in live)
    stacked = sum(self.out_bytes[i] for i in used_saved) + sum(self.carry_bytes[k]
                                                              for k in carries)
    return seconds, stacked, frozenset(live)


def scan_frontier(jaxpr: _compat.Jaxpr, pairs: Sequence[ScanPair],
                  profile: DeviceProfile) -> list[ScanPolicyPoint]:
  """The greedy's sets of stacked body values, from the least stacked bytes to the most.

  Args:
    jaxpr: the differentiated step (``ir/scan_remat.traced_step``).
    pairs: its forward/backward scan pairs (every residual recomputable).
    profile: the device whose cost model prices the recomputation.

  Returns:
    Points whose stacked bytes rise and recomputation time falls strictly:
    the first stacks no body value (each iteration recomputed from its
    carry, as ``nothing_saveable``), the last recomputes nothing.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem._src.estimate.devices import device_profile
    >>> from jaxmem._src.ir.scan_remat import scan_pairs
    >>> def loss(ws, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    ...   return h.sum()
    >>> closed = jax.make_jaxpr(jax.grad(loss))(jnp.ones((8, 64, 64)), jnp.ones((32, 64)))
    >>> points = scan_frontier(closed.jaxpr, scan_pairs(closed.jaxpr), device_profile("h100-sxm"))
    >>> points[0].recompute_s > points[-1].recompute_s == 0.0
    True
  """
  bodies = [_Body(jaxpr, p, profile) for p in pairs]
  saved: list[frozenset[int]] = [frozenset() for _ in bodies]
  priced = [b.price(s) for b, s in zip(bodies, saved)]

  def point() -> ScanPolicyPoint:
    return ScanPolicyPoint(tuple(tuple(sorted(s)) for s in saved),
                           sum(b.length * p[1] for b, p in zip(bodies, priced)),
                           sum(b.length * p[0] for b, p in zip(bodies, priced)),
                           tuple(b.stacks(s) for b, s in zip(bodies, saved)))

  points = [point()]
  while any(p[0] > 0 for p in priced):
    best: tuple[float, int, int, Any] | None = None
    for k, (body, (secs, stacked, live)) in enumerate(zip(bodies, priced)):
      for i in live:
        if not body.out_bytes[i]:
          continue
        new = body.price(saved[k] | {i})
        gain = (secs - new[0]) * body.length
        if gain <= 0:
          continue
        extra = (new[1] - stacked) * body.length
        # Stacking that frees more than it adds comes first; then seconds
        # saved per byte stacked.
        score = float("inf") if extra <= 0 else gain / extra
        if best is None or score > best[0]:
          best = (score, k, i, new)
    if best is None:
      break
    _, k, i, new = best
    saved[k] = saved[k] | {i}
    priced[k] = new
    # An equation no longer recomputed needs no stack of its own outputs:
    # keep only the saved values the recomputation reads.
    live = new[2]
    reads = {j for e in live for j in bodies[k].inputs[e]} | set(bodies[k].target_eqns)
    saved[k] = frozenset(j for j in saved[k] if j in reads)
    priced[k] = bodies[k].price(saved[k])
    points.append(point())
  # Strictly better in one coordinate as bytes rise: a later point that
  # stacks more for no less recomputation is dropped.
  frontier: list[ScanPolicyPoint] = []
  for p in points:
    if frontier and p.recompute_s >= frontier[-1].recompute_s:
      continue
    while frontier and p.stacked_bytes <= frontier[-1].stacked_bytes:
      frontier.pop()
    frontier.append(p)
  return frontier
