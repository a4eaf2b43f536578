"""The optimal planner: remat + offload as a mixed-integer linear program (scipy/HiGHS).

Variables: for every candidate gap ``g`` (see :mod:`~jaxmem._src.planners.common`)
two binaries, ``r_g`` (recompute before its end) and ``o_g`` (stage to host
over it), with ``r_g + o_g <= 1``.

Constraints:

* memory, at every program position ``p`` whose unplanned estimate ``M(p)``
  is above the budget ``B``: ``M(p) - sum_{g : start_g < p < end_g}
  bytes_g (r_g + o_g) <= B``;
* a recompute reads its chain's inputs at ``end_g``: for every such input
  ``x`` and every gap ``h`` of ``x`` containing ``end_g``,
  ``r_g + r_h + o_h <= 1``.

Objective: minimise the extra step time, ``sum cost_r(g) r_g + cost_o(g) o_g``
priced by :mod:`jaxmem._src.estimate.cost` on the planning device.

Size: one memory row per position above the budget and two columns per gap,
so the model grows linearly with the program (no per-layer replication is
needed; repeated layers simply contribute their own columns). The estimate's
fusion effects are not linear; the solution is checked with the schedule
estimate and the budget tightened by the overshoot for a few rounds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.planners import common
from jaxmem._src.planners.segments import Segment, find_segments


@dataclasses.dataclass(frozen=True)
class MILPDiagnostics:
  """The solver's account of an :func:`optimal` call (on its plan's ``diagnostics``).

  Attributes:
    status: HiGHS's message for the round whose plan is returned (or why
      nothing was solved).
    seconds: wall time of the whole call.
    rounds: solves run (each with a target tightened by the estimate's overshoot).
    objective_s: the extra step time of the returned solution, as the model prices it.
    proven: the returned solution is a proven optimum of the linear model
      with every memory row met (no slack), and its schedule estimate meets
      the budget: a plan over budget is never proven.
  """
  status: str = ""
  seconds: float = 0.0
  rounds: int = 0
  objective_s: float = float("nan")
  proven: bool = False


# Segment columns are measured with the schedule estimate while
# segments x program ops stays under this (about 5 s of estimates).
MEASURE_LIMIT = 150_000


@without_gc
@common.never_worse_than_none
def optimal(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
            copies: CopyMode = "sync", window: Window = None, time_limit_s: float = 20.0,
            min_bytes: int | None = None, max_chain: int = 8, rounds: int = 4,
            allow_remat: bool = True, allow_offload: bool = True,
            offload_cost: Callable[[common.Gap, common.Pricer], float] | None = None,
            segment_groups: tuple[int, ...] = (1, 2, 4),
            measure_segments: bool | None = None) -> Plan:
  """Cheapest remat/offload plan whose estimated peak is at most ``budget_bytes`` (MILP).

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak.
    device: device profile (name or :class:`jaxmem.DeviceProfile`) pricing the decisions.
    time_limit_s: HiGHS time limit per solve; the best solution found is used
      when it runs out (the plan's :class:`MILPDiagnostics` say whether the
      last one was proven optimal).
    min_bytes: ignore values smaller than this (default: 0.1% of the peak).
    max_chain: most ops one recompute may re-execute.
    rounds: solves with a budget tightened by the estimate's overshoot.
    allow_remat, allow_offload: restrict the actions.
    offload_cost: optional ``f(gap, pricer) -> seconds`` (default: both copies
      synchronous, :meth:`Pricer.offload_seconds`).
    copies, window: how the plan's copies are scheduled (see :class:`jaxmem.Plan`).
    segment_groups: segment sizes (cuts per segment) offered as joint columns
      (:mod:`~jaxmem._src.planners.segments`); ``()`` for single values only.
    measure_segments: price each segment column by the schedule estimate
      (exact for the segment alone, one estimate per column); default: when
      segments x ops is at most ``MEASURE_LIMIT``.

  Returns:
    A :class:`jaxmem.Plan` named ``optimal``. When no assignment satisfies the
    linear model, the plan of the last feasible round (or no decisions) is
    returned and its estimated peak says how far it is.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> prog = jaxmem.analyze(jax.grad(lambda x: jnp.tanh(jnp.tanh(x) * 2).sum()), jnp.ones(1 << 16))
    >>> plan = optimal(prog, prog.peak_bytes, time_limit_s=1.0)
    >>> plan.planner
    'optimal'
  """
  from scipy.optimize import Bounds, LinearConstraint, milp
  from scipy.sparse import coo_matrix

  t0 = time.perf_counter()
  pricer = common.Pricer(program, device)
  pinned = common.pins(program)
  base, peak = common.position_profile(program, (), pinned)
  if min_bytes is None:
    min_bytes = max(1, program.profile.peak_bytes // 1000)
  # Values XLA keeps alive past their last use (a fused consumer reads them
  # later): dropping them over their own gaps frees nothing the linear model
  # can see, so they are left to the estimate-driven planners.
  gaps, freed = [], []
  for g in common.candidate_gaps(program, min_bytes):
    f = common.freed_bytes(program, g, pinned) if common.frees_over_gap(program, g, pinned) else 0
    if f >= min_bytes:
      gaps.append(g)
      freed.append(f)
  # Columns: (gap index or -1 for a segment, its decisions, the (start, end,
  # bytes) intervals it frees, its cost).
  cols: list[tuple[int, tuple[Decision, ...], list[tuple[int, int, int]], float]] = []
  for gi, g in enumerate(gaps):
    if allow_remat:
      d = common.remat_decision(program, g, pricer, max_chain)
      if d is not None:
        cols.append((gi, (d,), [(d.start, d.end, freed[gi])], d.cost_s))
    if allow_offload:
      d = common.offload_decision(program, g, pricer)
      if d is not None:
        if offload_cost is not None:
          d = Decision(d.var, d.action, d.start, d.end, (), d.nbytes, offload_cost(g, pricer))
        cols.append((gi, (d,), [(d.start, d.end, freed[gi])], d.cost_s))
  # Whole segments recomputed once from their checkpoint: one column each, so
  # the solver sees the shared recomputation that per-value columns repeat.
  segs = _segment_columns(program, device, min_bytes, segment_groups) if allow_remat else []
  virtual = program.profile.virtual
  # On programs small enough, a segment's effect is measured: the schedule
  # estimate with the segment alone, position by position. It sees what the
  # values' own bytes miss (XLA's stored broadcasts the recomputation removes,
  # the restored values and kept checkpoints it adds).
  measured: dict[int, np.ndarray] = {}
  measure = (len(segs) * program.num_ops <= MEASURE_LIMIT if measure_segments is None
             else measure_segments)
  for seg in segs:
    iv = [(d.start, d.end, 0 if virtual is not None and virtual[d.var] else d.nbytes)
          for d in seg.decisions]
    if measure:
      pins = tuple(p for p in pinned if not seg.lo < program.vars[p].defined_by <= seg.hi)
      measured[len(cols)] = base - common.position_profile(program, seg.decisions, pins)[0]
    cols.append((-1, seg.decisions, iv, seg.cost_s))
  status, rounds_run, proven, objective_s = "no decision needed", 0, True, float("nan")
  best: tuple[Decision, ...] = ()
  best_pins = pinned
  best_key: tuple[bool, int, float] | None = None
  target = int(budget_bytes)
  if peak <= budget_bytes or not cols:
    plan = common.finish(program, (), budget_bytes, "optimal", pinned, copies=copies,
                         window=window)
    return plan.replace(diagnostics=(MILPDiagnostics(
        status, time.perf_counter() - t0, rounds_run, objective_s, proven),))

  proven = False
  gaps_by_var: dict[int, list[int]] = {}
  for gi, g in enumerate(gaps):
    gaps_by_var.setdefault(g.var, []).append(gi)
  col_of_gap: dict[int, list[int]] = {}
  for c, (gi, _, _, _) in enumerate(cols):
    if gi >= 0:
      col_of_gap.setdefault(gi, []).append(c)
  n = len(cols)
  cost_vec = np.array([max(c[3], 0.0) for c in cols]) + 1e-12  # prefer fewer decisions

  # Pairwise rows: at most one action per gap; a recompute's inputs stay put.
  pair_rows: list[list[int]] = [cs for cs in col_of_gap.values() if len(cs) > 1]
  for c, (gi, ds, _, _) in enumerate(cols):
    if gi < 0 or ds[0].action is not Action.REMAT:
      continue
    d = ds[0]
    for x in common.chain_inputs(program, d.recompute):
      for hi in gaps_by_var.get(x, ()):
        h = gaps[hi]
        if h.start < d.end <= h.end:
          for c2 in col_of_gap.get(hi, ()):
            pair_rows.append([c, c2])
  # A segment excludes single-value columns on its values' gaps, and the
  # segments of another size that overlap it.
  seg_cols = [c for c, col in enumerate(cols) if col[0] < 0]
  seg_of_col = dict(zip(seg_cols, segs))
  for c in seg_cols:
    for d in cols[c][1]:
      for hi in gaps_by_var.get(d.var, ()):
        h = gaps[hi]
        if h.start < d.end and d.start < h.end:
          for c2 in col_of_gap.get(hi, ()):
            pair_rows.append([c, c2])
  for i, a in enumerate(seg_cols):
    for b in seg_cols[i + 1:]:
      sa, sb = seg_of_col[a], seg_of_col[b]
      if sa.lo < sb.hi and sb.lo < sa.hi:
        pair_rows.append([a, b])

  for rnd in range(rounds):
    rounds_run = rnd + 1
    over = np.nonzero(base > target)[0]
    upper = (target - base[over]).astype(float)
    rows_l, cols_l, vals_l = [], [], []
    for c, (_, _, intervals, _) in enumerate(cols):
      if c in measured:
        delta = measured[c][over]
        nz = np.nonzero(delta)[0]
        rows_l.append(nz)
        cols_l.append(np.full(len(nz), c))
        vals_l.append(-delta[nz].astype(float))
        continue
      for start, end, nbytes in intervals:
        lo = np.searchsorted(over, start, side="right")
        hi = np.searchsorted(over, end, side="left")
        if hi > lo and nbytes:
          rows_l.append(np.arange(lo, hi))
          cols_l.append(np.full(hi - lo, c))
          vals_l.append(np.full(hi - lo, -float(nbytes)))
    rows = np.concatenate(rows_l) if rows_l else np.zeros(0, int)
    colidx = np.concatenate(cols_l) if cols_l else np.zeros(0, int)
    vals = np.concatenate(vals_l) if vals_l else np.zeros(0)
    # Memory rows are soft: a slack per row, priced above any plan's whole
    # cost per ``min_bytes`` of excess. Where the linear model cannot reach the
    # target (XLA effects it does not see, such as stored broadcasts a
    # recomputed segment removes) the solver still returns the plan closest to
    # it, and the schedule estimate decides whether it fits.
    m = len(over)
    penalty = 10.0 * float(cost_vec.sum()) / max(1, min_bytes)
    objective = np.concatenate([cost_vec, np.full(m, penalty)])
    constraints = []
    if m:
      slack = coo_matrix((-np.ones(m), (np.arange(m), n + np.arange(m))), shape=(m, n + m))
      a = (coo_matrix((vals, (rows, colidx)), shape=(m, n + m)) + slack).tocsr()
      constraints.append(LinearConstraint(a, -np.inf, upper))
    if pair_rows:
      pr, pc = [], []
      for r, cs in enumerate(pair_rows):
        pr += [r] * len(cs)
        pc += cs
      b = coo_matrix((np.ones(len(pr)), (pr, pc)), shape=(len(pair_rows), n + m)).tocsr()
      constraints.append(LinearConstraint(b, -np.inf, 1.0))
    remaining = max(0.1, time_limit_s - (time.perf_counter() - t0))
    res = milp(objective, constraints=constraints,
               integrality=np.concatenate([np.ones(n), np.zeros(m)]),
               bounds=Bounds(0, np.concatenate([np.ones(n), np.full(m, np.inf)])),
               options={"time_limit": remaining, "disp": False})
    round_status = str(res.message)
    if res.x is None:
      if best_key is None:
        status = round_status
      break
    relaxed = bool(m and res.x[n:].max() > 0.5)
    if relaxed:
      round_status += " (linear model short of the target; relaxed)"
    res.x = res.x[:n]
    picked = np.nonzero(res.x > 0.5)[0]
    chosen = tuple(d for c in picked for d in cols[c][1])
    # No pins inside a recomputed segment (see segments._plan_for_segments).
    inside = [(seg_of_col[c].lo, seg_of_col[c].hi) for c in picked if c in seg_of_col]
    pins = tuple(p for p in pinned
                 if not any(lo < program.vars[p].defined_by <= hi for lo, hi in inside))
    plan = common.finish(program, chosen, budget_bytes, "optimal", pins, copies=copies,
                         window=window)
    # The best round is kept, not the last: a tighter target can give a plan
    # whose schedule estimate is higher (a GELU MLP of 73 ops at 0.9 of its
    # peak: 1.02x after four rounds). A plan is proven optimal only when the
    # solver proved it, no memory row needed its slack and the schedule
    # estimate meets the budget.
    round_s = float(cost_vec @ (res.x > 0.5))
    over = max(0, plan.estimated_peak_bytes - budget_bytes)
    key = (over > 0, over, round_s)
    if best_key is None or key < best_key:
      best, best_pins, best_key = chosen, pins, key
      status, objective_s = round_status, round_s
      proven = res.status == 0 and not relaxed and not over
    if plan.estimated_peak_bytes <= budget_bytes:
      break
    # The linear model missed fusion effects: aim lower by the overshoot.
    target -= plan.estimated_peak_bytes - budget_bytes + budget_bytes // 200
    if target <= 0:
      break
  plan = common.finish(program, best, budget_bytes, "optimal", best_pins, copies=copies,
                       window=window)
  return plan.replace(diagnostics=(MILPDiagnostics(
      status, time.perf_counter() - t0, rounds_run, objective_s, proven),))


def _segment_columns(program: AnalyzedProgram, device: DeviceLike, min_bytes: int,
                     groups: tuple[int, ...]) -> list[Segment]:
  """The segments of every size in ``groups`` (distinct ones only)."""
  out, seen = [], set()
  for group in groups:
    for seg in find_segments(program, device, min_bytes, group):
      if (seg.lo, seg.hi) not in seen:
        seen.add((seg.lo, seg.hi))
        out.append(seg)
  return out
