"""Selective recomputation: the cheapest bytes first, alone and on top of recomputed segments.

Korthikanti et al. (*Reducing Activation Recomputation in Large Transformer
Models*, 2022, §4.2) observe that in a transformer layer the attention
scores, their softmax and the dropout masks hold most of the activation memory
and cost little to rebuild from the kept queries and keys, while the matmul
outputs are small for the FLOPs they took: recompute the former, keep the
latter, and most activation memory goes for a few percent of time. Where they
name those values for one architecture, this planner ranks every value that
spans the estimated peak by its recomputation's price per byte freed (the
simulator's calibrated per-op times, :class:`~jaxmem._src.planners.common.Pricer`)
and recomputes the cheapest first (:func:`~jaxmem._src.planners.greedy.greedy`
with ``rank="cost"``, recomputation only), so it applies to any model.

Selection alone stalls once the peak moves into the backward pass (the values
that span it there are gradients, not activations); the paper then recomputes
whole layers. So does this planner: a segment plan
(:func:`~jaxmem._src.planners.segments.segments_within`, Chen et al.'s whole
forward segments) covers part of the excess over the budget (a fifth, two
fifths, ... of it) and selection covers the rest. The fastest fitting plan of
these, simulated on the device, is returned.

Departures from the paper: no sequence parallelism (that is a sharding, not a
plan); the choice is per value and priced, not per named tensor; plans are
estimated without Layrub's pins (pins store the kept masks, which costs
unfused kernels that selection exists to avoid).

Measured (simulated, ``h100-sxm``) on the GPT example (4x128, seq 128, batch
16): at 0.7 of its estimated peak ``segments`` costs +7.7% and this planner
+2.2%; on ResNet-50 selection alone loses to whole segments (its BatchNorm
outputs are cheap per FLOP but their recomputation moves as many bytes as it
frees), which is why ``auto`` compares both.

With ``xla_lifetimes`` its chains take XLA's view of what is stored
(:class:`~jaxmem._src.planners.chains.ChainState` with ``xla_lifetimes``): a
value XLA fuses away is rebuilt from the stored values it is computed from,
not read (which would make XLA store it over the gap), and a value is read
as long as the estimate keeps it alive. A ReLU after a BatchNorm is then one
elementwise kernel from the convolution's output: ResNet-50 at half its peak
on ``h100-sxm`` went from +12.4% (``auto``'s whole segments) to +8.7%.
"""

from __future__ import annotations

from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.plan.simulate import program_time, simulate
from jaxmem._src.planners import common
from jaxmem._src.planners.greedy import greedy
from jaxmem._src.planners.segments import segmentations, segments_within

#: Shares of the excess over the budget that whole segments cover before
#: selection covers the rest (0: selection alone).
SEGMENT_SHARES = (0.0, 0.2, 0.4, 0.6, 0.8)


@without_gc
@common.never_worse_than_none
def selective(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
              copies: CopyMode = "sync", window: Window = None, max_chain: int = 16,
              shares: tuple[float, ...] = SEGMENT_SHARES,
              cap_s: float = float("inf"), beat_s: float = float("inf"),
              xla_lifetimes: bool = False) -> Plan:
  """Selective recomputation (cheapest bytes first), alone and on top of segment plans.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak.
    device: device profile pricing recomputation and simulating the plans.
    copies, window: accepted for the planner protocol; the plans only recompute.
    max_chain: most ops one recomputation may re-execute (a softmax rebuilt
      from the queries and keys is about ten).
    shares: shares of the excess over the budget covered by whole segments
      first (each in ``[0, 1)``; ``0`` is selection alone).
    cap_s: segment plans whose least recomputation costs more (seconds) are
      not searched (``auto`` passes twice its best overhead).
    beat_s: the simulated step time of the fastest fitting plan the caller
      has (``auto``'s). A share whose segment plan alone simulates no faster
      than it (or than a plan of this search) is not completed, and the
      selection of a share gives up once what it added is priced at twice
      the time left to it: recomputing more only adds time (on the
      frontier's six models at three budgets, no share's plan simulated
      faster than its segments alone), and the simulator prices a plan's
      recomputation at no less than about half its per-op price (the
      whole plans there at 0.83 of it at the least). The plan returned is
      the same where a share's plan would not have been faster; only a
      plan that fits nowhere may differ.
    xla_lifetimes: plan the chains, of the segments and of the selection,
      with XLA's view of what is stored
      (:class:`~jaxmem._src.planners.chains.ChainState`); the plans are named
      with a ``(xla)`` suffix. ``auto`` runs both.

  Returns:
    The fastest fitting plan, named ``selective`` or ``segments+selective``
    (``selective(xla)``, ``segments+selective(xla)``); the lowest when none
    fits.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def attention(q, k):
    ...   for _ in range(3):
    ...     q = jax.nn.softmax(q @ k.T, axis=-1) @ k
    ...   return jnp.sum(q * q)
    >>> q, k = jnp.ones((512, 64)), jnp.ones((512, 64)) / 64
    >>> prog = jaxmem.analyze(jax.grad(attention), q, k)
    >>> plan = selective(prog, int(0.7 * prog.peak_bytes), "h100-pcie")
    >>> plan.estimated_peak_bytes <= 0.7 * prog.peak_bytes, plan.num_offload
    (True, 0)
  """
  bad = [s for s in shares if not 0.0 <= s < 1.0]
  if bad or not shares:
    raise ValueError(f"`selective`: `shares` must be a non-empty tuple of numbers in [0, 1), "
                     f"got {shares!r}.")
  dev = device_profile(device)
  peak = program.profile.peak_bytes
  budget_bytes = int(budget_bytes)
  opts = dict(rank="cost", allow_offload=False, pinned=False, max_chain=max_chain,
              xla_lifetimes=xla_lifetimes)
  # The segmentations are cut once; each share searches them for the
  # fastest segment plan that fits its looser budget.
  # With `xla_lifetimes` its segment plans' chains read what the estimate
  # keeps alive (a BatchNorm's input, live as long as its fused
  # normalization is read): selection on top then rebuilds elementwise
  # outputs from them instead of whole segments (ResNet-50 at half its peak
  # on h100-sxm: +12.4% -> +8.7%). Alone, such segments fit less often:
  # their chains keep the values the segments' restores would let go.
  cut = segmentations(program, dev, xla_lifetimes=xla_lifetimes) if any(shares) else []
  suffix = "(xla)" if xla_lifetimes else ""
  best: tuple[tuple[float, int], Plan] | None = None
  base_s = program_time(program, dev)
  for share in shares:
    # The time a plan must beat: the caller's, or the fastest found here.
    limit = min(beat_s, best[0][0] if best is not None else float("inf"))
    if share == 0.0:
      plan = greedy(program, budget_bytes, dev, max_cost_s=2.0 * (limit - base_s), **opts)
      plan = plan.replace(planner="selective" + suffix)
    else:
      loose = int(peak - share * (peak - budget_bytes))
      seg = segments_within(program, loose, dev, cap_s, pinned=False, fill=False,
                            max_tries=1, cut=cut)
      if seg is None or not seg.decisions:
        continue
      prefix_s = simulate(seg, dev).step_time_s if limit < float("inf") else 0.0
      if prefix_s >= limit:
        continue            # the segments alone are no faster than a plan we have
      plan = greedy(program, budget_bytes, dev, initial=seg.decisions,
                    max_cost_s=2.0 * (limit - prefix_s), **opts)
      plan = plan.replace(planner="segments+selective" + suffix)
    fits = plan.estimated_peak_bytes <= budget_bytes
    key = ((simulate(plan, dev).step_time_s if fits else float("inf")),
           plan.estimated_peak_bytes)
    if best is None or key < best[0]:
      best = (key, plan)
  if best is None:      # every segment plan was capped: selection alone
    return greedy(program, budget_bytes, dev, **opts).replace(planner="selective" + suffix)
  return best[1]


__all__ = ["SEGMENT_SHARES", "selective"]
