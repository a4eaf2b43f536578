"""``auto``: the best of the fast planners, and the MILP when it solves in time.

Every fast planner (greedy, segments, selective recomputation, vDNN, Layrub,
AutoSwap, the window scheduler)
plans for the budget; the plans whose estimated peak fits are simulated on
the device (:func:`jaxmem.simulate`) and the fastest step wins. The MILP
(:mod:`~jaxmem._src.planners.optimal`) joins when it finishes within
``milp_time_s``. When no plan fits, the one with the lowest estimated peak is
returned (``fit`` then tightens the target or raises ``BudgetError``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.plan.decisions import Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.plan.simulate import program_time, simulate
from jaxmem._src.planners import common
from jaxmem._src.planners.autoswap import autoswap
from jaxmem._src.planners.greedy import greedy
from jaxmem._src.planners.layrub import layrub
from jaxmem._src.planners.optimal import MILPDiagnostics, optimal
from jaxmem._src.planners.prune import prune
from jaxmem._src.planners.segments import segments, segments_within
from jaxmem._src.planners.selective import selective
from jaxmem._src.planners.vdnn import vdnn
from jaxmem._src.planners.window import window_planner

#: The fast planners ``auto`` compares, by name, in the order they run:
#: greedy first, the quickest, whose plan bounds the segment search.
CANDIDATES: Mapping[str, Callable[..., Plan]] = MappingProxyType({
    "greedy": greedy, "segments": segments, "selective": selective, "vdnn": vdnn,
    "layrub": layrub, "autoswap": autoswap, "window": window_planner})
FAST = tuple(CANDIDATES)
# Planners that only offload: each byte they free crosses the host link twice.
OFFLOAD_ONLY = frozenset({"vdnn", "layrub", "autoswap", "window"})
# The MILP joins on programs up to this many ops (beyond, it rarely proves
# optimality within a time limit that suits `fit`).
MILP_MAX_OPS = 1500


@dataclasses.dataclass(frozen=True)
class AutoDiagnostics:
  """What an :func:`auto` call compared (on its plan's ``diagnostics``).

  Attributes:
    rows: ``(planner, estimated peak bytes, simulated step seconds, decisions)``
      per plan considered, in order; the time is infinite for a plan over the
      budget.
    chosen: the name of the plan returned.
    skipped: ``(planner, why)`` of the planners not run (see :func:`auto`).
  """
  rows: tuple[tuple[str, int, float, int], ...] = ()
  chosen: str = ""
  skipped: tuple[tuple[str, str], ...] = ()


def offload_overhead_bound(program: AnalyzedProgram, budget_bytes: int,
                           device: DeviceLike) -> float:
  """A lower bound of the overhead of any plan that reaches ``budget_bytes`` by offloading only.

  At the estimated peak (with the pins every offload planner applies) at least
  ``peak - budget`` bytes are on the host, so
  each copy stream carries at least that many bytes and the step takes at
  least as long as copying them one way (both ways on a device with one copy
  engine).
  """
  dev = device_profile(device)
  # From the peak with Layrub's pins, which every offload planner applies and
  # which free bytes without a copy.
  pinned_peak = common.finish(program, (), budget_bytes, "pins").estimated_peak_bytes
  excess = max(0, pinned_peak - budget_bytes)
  base = program_time(program, dev)
  if base <= 0:
    return 0.0
  copy_s = dev.copy_seconds(excess) * (1 if dev.duplex else 2)
  return max(0.0, copy_s / base - 1.0)


#: :func:`worth_pruning`: runner-ups whose overhead is within this factor of the
#: fastest plan's are pruned too, at most ``MAX_PRUNED`` plans in all.
PRUNE_RUNNER_UP = 1.25
MAX_PRUNED = 3


def worth_pruning(timed: Sequence[tuple[float, Plan]], base_s: float) -> list[Plan]:
  """The fitting plans the reverse delete runs on: the fastest, and the runner-ups
  within ``PRUNE_RUNNER_UP`` times its overhead, fastest first, each set of
  decisions once, at most ``MAX_PRUNED``.

  ``timed``: (simulated step time, plan) per plan tried, ``inf`` for one that
  does not fit; ``base_s``: the unplanned step's time.
  """
  # (A stable sort: of plans with the same time, the one tried first leads.)
  fitting = sorted((tp for tp in timed if tp[0] < float("inf")), key=lambda tp: tp[0])
  chosen: list[Plan] = []
  seen: set[frozenset[Decision]] = set()
  for t, plan in fitting:
    if chosen and (t - base_s) > PRUNE_RUNNER_UP * (fitting[0][0] - base_s):
      break
    key = frozenset(plan.decisions)
    if key in seen:
      continue
    seen.add(key)
    chosen.append(plan)
    if len(chosen) == MAX_PRUNED:
      break
  return chosen


def unpinned(plan: Plan, budget_bytes: int) -> Plan:
  """``plan``'s decisions without Layrub's pins, named ``<planner>/unpinned``, re-estimated."""
  out = common.finish(plan.program, plan.decisions, budget_bytes, f"{plan.planner}/unpinned", (),
                      copies=plan.copies, window=plan.window)
  return out.replace(diagnostics=plan.diagnostics)


@without_gc
@common.never_worse_than_none
def auto(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
         copies: CopyMode = "sync", window: Window = None, planners: tuple[str, ...] = FAST,
         milp_time_s: float = 2.0, bo_iterations: int = 2,
         prune_estimates: int | None = None) -> Plan:
  """The fastest plan (simulated on ``device``) among the planners that fit ``budget_bytes``.

  Planners run in ``planners`` order, the offload-only ones last (after
  selective recomputation). An offload-only planner (vDNN, Layrub,
  AutoSwap, the window scheduler) is skipped once a fitting plan is faster
  than :func:`offload_overhead_bound`: it cannot win (ResNet-50 at half its
  peak on a PCIe GPU moves gigabytes per step). The segment planner searches
  only the segmentations whose least recomputation costs less than twice the
  fastest fitting plan's overhead
  (:func:`~jaxmem._src.planners.segments.segments_within`), and is skipped
  when none does. The MILP joins on programs of
  at most ``MILP_MAX_OPS`` ops when it proves optimality within ``milp_time_s``.
  The segment search runs with every prefix estimated without pins first
  (``segments(unpinned)``), and with the pins only where that finds no
  fitting plan. Selective recomputation
  (:func:`~jaxmem._src.planners.selective.selective`) runs after both segment
  searches and searches its segment plans under the same cap, from the best
  plan found by then. Last, every fitting plan's decisions are estimated and
  simulated without Layrub's pins (:func:`unpinned`; the lowest plan's when
  none fits), and kept so when that is faster or fits where the pinned plan
  does not: pins are kept only where they pay. The fastest fitting plan,
  and the runner-ups whose overhead is within ``PRUNE_RUNNER_UP`` of its own
  (:func:`worth_pruning`), then lose every decision the budget does not need
  (:func:`~jaxmem._src.planners.prune.prune`), each kept as
  ``<planner>/pruned`` when that simulates faster.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak.
    device: device profile for pricing and simulation (default: current backend).
    copies, window: how every candidate plan's copies are scheduled (``window``
      ``None``: each planner's default).
    planners: the fast planners to run.
    milp_time_s: time limit of the MILP (0 skips it).
    bo_iterations: AutoSwap's Bayesian-optimisation steps after its four seeds.
    prune_estimates: most removals the final reverse delete tries (0 skips
      it; ``None``: :func:`~jaxmem._src.planners.prune.default_estimates`).

  Returns:
    A :class:`jaxmem.Plan` named ``auto(<winner>)``, with the winner's
    diagnostics and an :class:`AutoDiagnostics` of the comparison.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def f(w, x):
    ...   for _ in range(4):
    ...     x = jnp.tanh(x @ w)
    ...   return x.sum()
    >>> prog = jaxmem.analyze(jax.grad(f), jnp.ones((128, 128)), jnp.ones((512, 128)))
    >>> plan = auto(prog, int(0.8 * prog.peak_bytes), "h100-pcie")
    >>> plan.estimated_peak_bytes <= 0.8 * prog.peak_bytes
    True
  """
  unknown = sorted(set(planners) - set(CANDIDATES))
  if unknown:
    raise ValueError(f"`planners` of `auto` must be names among {sorted(CANDIDATES)}, "
                     f"got {unknown}.")
  bound = offload_overhead_bound(program, budget_bytes, device)
  best: tuple[float, Plan] | None = None
  rows: list[tuple[str, int, float, int]] = []
  skipped: list[tuple[str, str]] = []

  tried: list[Plan] = []

  def consider(plan: Plan) -> None:
    nonlocal best
    tried.append(plan)
    fits = plan.estimated_peak_bytes <= budget_bytes
    sim = simulate(plan, device) if fits else None
    t = sim.step_time_s if sim else float("inf")
    rows.append((plan.planner, plan.estimated_peak_bytes, t, len(plan.decisions)))
    if best is None or t < best[0] or (t == best[0] == float("inf") and
                                       plan.estimated_peak_bytes < best[1].estimated_peak_bytes):
      best = (t, plan)

  base = program_time(program, device)

  def best_extra_s() -> float | None:
    """Seconds the best fitting plan so far adds to the step (``None``: none fits yet)."""
    if best is None or best[0] == float("inf") or base <= 0:
      return None
    return best[0] - base
  # Selective recomputation runs last, under the cap of the best plan found
  # by then: its segment plans are segment searches too, and the unpinned
  # one usually lowers the cap (ResNet-50 at half its peak: +23.8% -> +17.3%).
  selective_last = "selective" in planners and "segments" in planners
  # The offload-only planners run after every recomputing one, selective
  # recomputation included, so that the offload bound meets the fastest
  # recomputing plan: where no segment plan fits on its own (ResNet-50 at
  # half its peak, where selection on top of segments rebuilds the
  # BatchNorm outputs), four planners that cannot win would run.
  order = [n for n in planners if n not in OFFLOAD_ONLY]
  if selective_last:
    order = [n for n in order if n != "selective"] + ["selective"]
  order += [n for n in planners if n in OFFLOAD_ONLY]
  for name in order:
    if name == "selective" and selective_last:
      # Twice: with the program's lifetimes, and with XLA's view of what is
      # stored (`ChainState(xla_lifetimes=True)`), each capped by the best
      # plan by then. Neither wins everywhere: on h100-sxm at half the peak,
      # XLA's view took ResNet-50 from +12.4% to +8.7% and the GPT from
      # +7.4% to +6.5%, and a UNet from +26.9% to +32.8%.
      for xla in (False, True):
        extra = best_extra_s()
        consider(selective(program, budget_bytes, device, copies=copies, window=window,
                           cap_s=float("inf") if extra is None else 2.0 * extra,
                           beat_s=float("inf") if extra is None or best is None else best[0],
                           xla_lifetimes=xla))
      continue
    extra = best_extra_s()
    if name in OFFLOAD_ONLY and extra is not None and extra / base <= bound:
      skipped.append((name, f"offload bound +{bound:.0%} >= best +{extra / base:.0%}"))
      continue
    if name == "autoswap":
      plan = autoswap(program, budget_bytes, device, copies=copies, window=window,
                      bo_iterations=bo_iterations)
    elif name == "segments" and extra is not None:
      # Only segment plans that can be faster than the best one are searched.
      # (Twice its overhead: segments price a recomputation as the unplanned
      # program's ops, the simulator as the plan fuses them, which measured
      # up to 5% less on ResNet-18.) Every prefix is estimated without
      # Layrub's pins first: a pinned search ranks prefixes by what fits with
      # the pins, and its winner, unpinned afterwards, may no longer fit where
      # a longer unpinned prefix would, faster (ResNet-50 at 0.9 of its peak
      # on an H100: +19.2% pinned, while the unpinned plan for 0.7 fits 0.9
      # at +10.5%). The pinned search runs only where that finds no fitting
      # plan: on the 224 points of `bench/frontier.py` its plan won none
      # where the unpinned one fits (it did where nothing fits: filled by
      # greedy, then unpinned), and it cost ResNet-50 at half its peak 14 of
      # `auto`'s 50 schedule estimates.
      cap = 2.0 * extra
      found = segments_within(program, budget_bytes, device, cap, copies=copies,
                              window=window, pinned=False)
      if found is not None:
        consider(found)
        if found.estimated_peak_bytes <= budget_bytes:
          skipped.append((name, "pinned: the unpinned segment search fits"))
          continue
      found = segments_within(program, budget_bytes, device, cap, copies=copies, window=window)
      if found is None:
        skipped.append((name, f"its least recomputation >= 2x best +{extra / base:.0%}"))
        continue
      plan = found
    else:
      plan = CANDIDATES[name](program, budget_bytes, device, copies=copies, window=window)
      if name == "segments":
        # No fitting plan before it (greedy's was over the budget): the
        # pinned search ran uncapped, filled by greedy; the unpinned one
        # follows, capped by it where it fits.
        consider(plan)
        extra = best_extra_s()
        if extra is not None:
          found = segments_within(program, budget_bytes, device, 2.0 * extra,
                                  copies=copies, window=window, pinned=False)
          if found is not None:
            consider(found)
        continue
    consider(plan)
  if milp_time_s > 0 and program.num_ops <= MILP_MAX_OPS:
    t = time.perf_counter()
    plan = optimal(program, budget_bytes, device, time_limit_s=milp_time_s, copies=copies,
                   window=window)
    milp = plan.diagnostic(MILPDiagnostics)
    if milp is not None and milp.proven and time.perf_counter() - t <= milp_time_s * 1.5:
      consider(plan)
  assert best is not None
  # Layrub's pins (every planner starts from them) are only kept where they
  # pay: the same decisions without them can peak lower and run faster (on
  # ResNet-50 at half its peak, 297 pinned masks cost 1.7 ms of unfused
  # kernels and raise the peak by 133 MiB). Every fitting pinned plan is
  # tried without them, not only the fastest: the pins' cost differs from
  # plan to plan (the unrolled LSTM of the examples at 0.97 of its peak:
  # AutoSwap's plan pinned +63.8%, unpinned +5.3%, where the segments' plan,
  # faster when pinned, is +37.9% unpinned). When none fits, the lowest plan.
  fitting = [p for p in tried if p.estimated_peak_bytes <= budget_bytes]
  retries = fitting or [min(tried, key=lambda p: p.estimated_peak_bytes)]
  for retry in retries:
    if retry.pinned:
      consider(unpinned(retry, budget_bytes))
  # Last, the winner loses the decisions the budget does not need (reverse
  # delete, :func:`~jaxmem._src.planners.prune.prune`): segment plans
  # restore every residual of a segment where a few would do (ResNet-50 at
  # half its peak on an H100: +17.4% -> +12.4%, 240 -> 119 decisions).
  # Which of two plans of about the same time prunes further is not known
  # before pruning them: the runner-ups within ``PRUNE_RUNNER_UP`` of the
  # fastest plan's overhead are pruned too (the GPT example on tpu-v5e at
  # 0.7 of its peak: the fastest, +13.1%, prunes to +12.8%; the second,
  # +14.5%, to +9.2%).
  if best[0] < float("inf") and prune_estimates != 0:
    for plan in worth_pruning([(t, p) for p, (_, _, t, _) in zip(tried, rows)], base):
      pruned = prune(plan, budget_bytes, device, max_estimates=prune_estimates)
      if pruned is not plan:
        consider(pruned)
  chosen = best[1]
  report = AutoDiagnostics(tuple(rows), chosen.planner, tuple(skipped))
  return chosen.replace(planner=f"auto({chosen.planner})",
                             diagnostics=(*chosen.diagnostics, report))
