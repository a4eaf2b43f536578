"""AutoSwap (Zhang et al. §IV): priority-scored swapping.

Zhang et al., *Efficient Memory Management for GPU-based Deep Learning
Systems* (SmartPool and AutoSwap).

* §IV-A candidates: variables at least 1 MB large whose idle gap between two
  consecutive accesses ``(t_i, t_{i+1})`` spans the peak time of the
  unswapped memory load (one candidate per variable).
* §IV-B priority scores, with times from the cost model on the device and
  ``d_out = d_in`` the copy time:

  - ``DOA = (T(t_{i+1}) - T(t_i)) - (d_out + d_in)``, the duration of absence;
  - ``AOA = DOA * size`` if ``DOA >= 0`` else ``DOA / size``, area of absence;
  - ``WDOA`` = area under the original load curve between the two accesses;
  - ``SWDOA``: WDOA re-evaluated greedily on the load updated by each pick.
* §IV-C Bayesian optimisation of the weights ``(a, b, c, d)`` in ``[-1, 1]^4``
  of ``a*AOA + b*DOA + c*WDOA + d*SWDOA`` (each score standardised), against
  the simulated overhead (:func:`jaxmem.simulate`, §IV-E's stall model). The
  four single scores seed it, so it is never worse than the best of them.
* §IV-D selection: candidates in descending score are swapped until the peak
  load fits the limit; here "fits" is checked with jaxmem's estimate of the
  planned schedule, so what is selected is what the compiled program needs:
  the shortest prefix of the ranking whose estimate fits. It is searched from
  the paper's own prefix (the first whose linear load fits), stepping by what
  each estimate still exceeds the budget (a secant on the linear load; the
  gap between load and estimate is carried to the next weights), then
  bisecting back; a handful of schedule estimates per weight vector instead
  of one per candidate. Offloading more is not always less (a value XLA
  fuses becomes a buffer when copied); where the steps pass over every
  fitting prefix, a walk in growing steps from the paper's prefix follows.

The Gaussian process is a small exact one (RBF kernel, expected improvement
over random points) written with numpy; the paper does not name its
acquisition function.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.plan.simulate import op_start_times, simulate
from jaxmem._src.planners import common

SCORES = ("aoa", "doa", "wdoa", "swdoa")
MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class AutoSwapDiagnostics:
  """What an :func:`autoswap` call evaluated (on its plan's ``diagnostics``).

  Attributes:
    weights: the score weights ``(a, b, c, d)`` tried, in order (the four
      single scores first, then the Bayesian optimisation's points).
    overheads: the simulated overhead of each (plus 1e3 where the selection
      did not fit the budget).
    best: the weights of the plan returned.
  """
  weights: tuple[tuple[float, ...], ...] = ()
  overheads: tuple[float, ...] = ()
  best: tuple[float, ...] = ()


def _scores(gaps: list[common.Gap], times: np.ndarray, load: np.ndarray,
            copy_s: np.ndarray) -> dict[str, np.ndarray]:
  """The four priority scores of §IV-B, one entry per candidate gap."""
  size = np.array([g.nbytes for g in gaps], dtype=float)
  t0 = np.array([times[g.start + 1] for g in gaps])   # access t_i completes
  t1 = np.array([times[g.end] for g in gaps])         # access t_{i+1} starts
  doa = (t1 - t0) - 2.0 * copy_s
  aoa = np.where(doa >= 0, doa * size, doa / size)
  dt = np.diff(times)                                   # duration of each op
  area = np.concatenate([[0.0], np.cumsum(load[:-1] * dt[: len(load) - 1])])

  def wdoa_of(cur_area: np.ndarray) -> np.ndarray:
    return np.array([cur_area[g.end] - cur_area[g.start + 1] for g in gaps])

  wdoa = wdoa_of(area)
  # SWDOA: pick the largest WDOA, take its bytes off the load over its absence, re-score.
  cur = load.astype(float).copy()
  rank = np.zeros(len(gaps))
  left = list(range(len(gaps)))
  for r in range(len(gaps)):
    cur_area = np.concatenate([[0.0], np.cumsum(cur[:-1] * dt[: len(cur) - 1])])
    w = np.array([cur_area[gaps[k].end] - cur_area[gaps[k].start + 1] for k in left])
    j = left.pop(int(np.argmax(w)))
    rank[j] = len(gaps) - r
    cur[gaps[j].start + 1: gaps[j].end] -= gaps[j].nbytes
  return {"aoa": aoa, "doa": doa, "wdoa": wdoa, "swdoa": rank}


def _standardise(x: np.ndarray) -> np.ndarray:
  s = x.std()
  return (x - x.mean()) / s if s > 0 else np.zeros_like(x)


@without_gc
@common.never_worse_than_none
def autoswap(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
             copies: CopyMode = "async", window: Window = None, score: str = "bo",
             bo_iterations: int = 12, min_bytes: int | None = None, seed: int = 0) -> Plan:
  """AutoSwap's plan (Zhang et al. §IV).

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: the memory load limit (estimated peak).
    device: device profile for times, copy costs and the simulated overhead.
    score: ``"aoa"``, ``"doa"``, ``"wdoa"``, ``"swdoa"``, or ``"bo"`` (Bayesian
      optimisation of their weighted sum, §IV-C).
    bo_iterations: evaluations after the four seeds.
    copies, window: copy scheduling (default: asynchronous, device window).
    min_bytes: candidate size threshold (default: the paper's 1 MB, or 0.1%
      of the peak for programs under 1 GB).
    seed: random seed of the Bayesian optimisation.

  Returns:
    A :class:`jaxmem.Plan` named ``autoswap-<score>``; with ``score="bo"`` its
    diagnostics hold an :class:`AutoSwapDiagnostics`.
  """
  if score not in (*SCORES, "bo"):
    raise ValueError(f"`score` must be one of {(*SCORES, 'bo')}, got {score!r}.")
  peak = program.profile.peak_bytes
  if min_bytes is None:
    min_bytes = MB if peak >= 1 << 30 else max(1, peak // 1000)
  if window is None and copies == "async":
    window = common.device_window(device)
  pricer = common.Pricer(program, device)
  pinned = common.pins(program)
  load, base_peak = common.position_profile(program, (), pinned)
  name = f"autoswap-{score}"
  if base_peak <= budget_bytes:
    return common.finish(program, (), budget_bytes, name, pinned, copies=copies, window=window)
  peak_time = int(np.argmax(load))
  gaps = []
  for vid in common.candidate_vars(program, min_bytes):
    for g in common.gaps_of(program, vid):
      if g.start < peak_time < g.end:
        gaps.append(g)
        break
  decisions = [common.offload_decision(program, g, pricer) for g in gaps]
  keep = [i for i, d in enumerate(decisions) if d is not None]
  gaps = [gaps[i] for i in keep]
  decisions = [decisions[i] for i in keep]
  if not gaps:
    return common.finish(program, (), budget_bytes, name, pinned, copies=copies, window=window)
  times = op_start_times(program, device)
  copy_s = np.array([pricer.copy_seconds(g.nbytes) for g in gaps])
  raw = _scores(gaps, times, load, copy_s)
  z = np.stack([_standardise(raw[k]) for k in SCORES], axis=1)

  cache: dict[tuple[int, ...], tuple[float, Plan]] = {}
  plans: dict[tuple[int, ...], Plan] = {}

  def _finish(chosen: list[int]) -> Plan:
    key = tuple(sorted(chosen))
    if key not in plans:
      plans[key] = common.finish(program, [decisions[j] for j in key], budget_bytes, name,
                                 pinned, copies=copies, window=window)
    return plans[key]

  # What the schedule estimate adds to the linear load at its peak (XLA's
  # temporaries, the copies' buffers): learnt from each confirmation, carried
  # over to the next weights, so that most selections start close.
  offset = [0.0]

  def select(weights: np.ndarray) -> tuple[float, Plan]:
    order = [int(j) for j in np.argsort(-(z @ weights), kind="stable")]
    # §IV-D: swap in score order until the load fits: the shortest prefix of
    # `order` whose schedule estimate fits. The linear load (what each swap
    # takes off between its two accesses) finds where to look: add until it
    # meets the budget less the offset, confirm with the estimate, and while
    # that does not fit, lower the linear target by what the estimate
    # exceeded it with (a secant step). Then bisect back between the longest
    # prefix over and the first within.
    cur = load.astype(float).copy()
    lin_max = [float(cur.max())]       # linear peak after each prefix length
    for j in order:
      cur[gaps[j].start + 1: gaps[j].end] -= gaps[j].nbytes
      lin_max.append(float(cur.max()))

    def linear_prefix(target: float, at_least: int) -> int:
      k = at_least
      while k < len(order) and lin_max[k] > target:
        k += 1
      return k

    tried: dict[int, int] = {}         # prefix length -> estimate over the budget

    def over(k: int) -> int:
      if k not in tried:
        tried[k] = _finish(order[:k]).estimated_peak_bytes - budget_bytes
      return tried[k]

    # The paper's rule: no prefix whose linear load is over the budget.
    floor = linear_prefix(budget_bytes, 0)
    lo, hi = floor, None               # every prefix shorter than lo is over; over(hi) <= 0
    k = linear_prefix(budget_bytes - offset[0], floor)
    stalls = 0
    while True:
      excess = over(k)
      if excess <= 0:
        hi = k
        break
      lo = k + 1
      if k >= len(order):
        break
      offset[0] = float(excess + budget_bytes - lin_max[k])
      nxt = linear_prefix(budget_bytes - offset[0], lo)
      if nxt == lo and lin_max[lo] <= budget_bytes - offset[0]:
        stalls += 1                    # the linear load no longer moves: grow
        nxt = min(len(order), k + (1 << stalls))
      k = nxt
    if hi is None:
      # The secant stepped over every fitting prefix, if any: offloading more
      # is not always less (a value XLA fuses becomes a buffer when copied).
      # Walk up from the paper's prefix in growing steps instead.
      k, batch = floor, 1
      while k < len(order):
        k, batch = min(len(order), k + batch), 2 * batch
        if over(k) <= 0:
          hi = k
          lo = max([j + 1 for j in tried if j < k and tried[j] > 0], default=floor)
          break
    if hi is None:                     # none fits: the lowest estimate tried
      chosen = order[:min(tried, key=lambda k: (tried[k], k))]
    else:
      step = 1                         # a carried offset may overshoot: gallop down
      while hi - step >= lo and over(hi - step) <= 0:
        hi -= step
        step *= 2
      lo = max(lo, hi - step + 1)
      while lo < hi:                   # then bisect
        mid = (lo + hi) // 2
        if over(mid) <= 0:
          hi = mid
        else:
          lo = mid + 1
      chosen = order[:hi]
    plan = _finish(chosen)
    key = tuple(sorted(chosen))
    if key not in cache:
      exceeds = plan.estimated_peak_bytes > budget_bytes
      cache[key] = (simulate(plan, device).overhead + (1e3 if exceeds else 0.0), plan)
    return cache[key]

  seeds = np.eye(4)
  if score != "bo":
    return select(seeds[SCORES.index(score)])[1]
  xs: list[np.ndarray] = []
  ys: list[float] = []
  best = (float("inf"), None)
  for w in seeds:
    y, plan = select(w)
    xs.append(w)
    ys.append(y)
    if y < best[0]:
      best = (y, plan)
  rng = np.random.default_rng(seed)
  for _ in range(bo_iterations):
    w = _next_point(np.array(xs), np.array(ys), rng)
    y, plan = select(w)
    xs.append(w)
    ys.append(y)
    if y < best[0]:
      best = (y, plan)
  diagnostics = AutoSwapDiagnostics(
      weights=tuple(tuple(float(v) for v in w) for w in xs), overheads=tuple(ys),
      best=tuple(float(v) for v in xs[int(np.argmin(ys))]))
  return best[1].replace(planner=name, diagnostics=(diagnostics,))


def _next_point(x: np.ndarray, y: np.ndarray, rng: np.random.Generator,
                length: float = 0.6, candidates: int = 512) -> np.ndarray:
  """Expected-improvement maximiser of an RBF Gaussian process over ``[-1, 1]^4``."""
  from math import erf, sqrt

  mu_y, sd_y = y.mean(), y.std() or 1.0
  yn = (y - mu_y) / sd_y

  def k(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    return np.exp(-0.5 * d / length ** 2)

  kxx = k(x, x) + 1e-6 * np.eye(len(x))
  chol = np.linalg.cholesky(kxx)
  alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, yn))
  c = rng.uniform(-1, 1, size=(candidates, x.shape[1]))
  kc = k(c, x)
  mean = kc @ alpha
  v = np.linalg.solve(chol, kc.T)
  sd = np.sqrt(np.maximum(1e-12, 1.0 - (v * v).sum(0)))
  best = yn.min()
  zz = (best - mean) / sd
  cdf = 0.5 * (1 + np.vectorize(erf)(zz / sqrt(2)))
  pdf = np.exp(-0.5 * zz ** 2) / np.sqrt(2 * np.pi)
  ei = (best - mean) * cdf + sd * pdf
  return c[int(np.argmax(ei))]
