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
priced by :mod:`jaxmem._src.cost` on the planning device.

Size: one memory row per position above the budget and two columns per gap,
so the model grows linearly with the program (no per-layer replication is
needed; repeated layers simply contribute their own columns). The estimate's
fusion effects are not linear; the solution is checked with the schedule
estimate and the budget tightened by the overshoot for a few rounds.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxmem._src.plan import Action, Decision, Plan
from jaxmem._src.planners import common


class MILPResult:
  """Solver status of the last :func:`optimal` call (for benchmarks)."""
  status: str = ""
  seconds: float = 0.0
  rounds: int = 0
  objective_s: float = float("nan")
  proven: bool = False


LAST = MILPResult()


def optimal(program: Any, budget_bytes: int, device: Any = None, *, time_limit_s: float = 20.0,
            min_bytes: int | None = None, max_chain: int = 8, rounds: int = 4,
            allow_remat: bool = True, allow_offload: bool = True,
            offload_cost: Any = None, copies: str = "sync",
            window: int | float | None = None) -> Plan:
  """Cheapest remat/offload plan whose estimated peak is at most ``budget_bytes`` (MILP).

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak.
    device: device profile (name or :class:`jaxmem.DeviceProfile`) pricing the decisions.
    time_limit_s: HiGHS time limit per solve; the best solution found is used
      when it runs out (``LAST.proven`` says whether the last one was optimal).
    min_bytes: ignore values smaller than this (default: 0.1% of the peak).
    max_chain: most ops one recompute may re-execute.
    rounds: solves with a budget tightened by the estimate's overshoot.
    allow_remat, allow_offload: restrict the actions.
    offload_cost: optional ``f(gap, pricer) -> seconds`` (default: both copies
      synchronous, :meth:`Pricer.offload_seconds`).
    copies, window: how the plan's copies are scheduled (see :class:`jaxmem.Plan`).

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
  pinned = common.base_pins(program)
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
  # Options per gap: (gap, action, decision) columns.
  cols: list[tuple[int, Decision]] = []
  for gi, g in enumerate(gaps):
    if allow_remat:
      d = common.remat_decision(program, g, pricer, max_chain)
      if d is not None:
        cols.append((gi, d))
    if allow_offload:
      d = common.offload_decision(program, g, pricer)
      if d is not None:
        if offload_cost is not None:
          d = Decision(d.var, d.action, d.start, d.end, (), d.nbytes, offload_cost(g, pricer))
        cols.append((gi, d))
  LAST.status, LAST.rounds, LAST.proven = "no decision needed", 0, True
  best: tuple[Decision, ...] = ()
  target = int(budget_bytes)
  if peak <= budget_bytes or not cols:
    LAST.seconds = time.perf_counter() - t0
    return common.finish(program, (), budget_bytes, "optimal", pinned, copies=copies,
                           window=window)

  gaps_by_var: dict[int, list[int]] = {}
  for gi, g in enumerate(gaps):
    gaps_by_var.setdefault(g.var, []).append(gi)
  col_of_gap: dict[int, list[int]] = {}
  for c, (gi, _) in enumerate(cols):
    col_of_gap.setdefault(gi, []).append(c)
  n = len(cols)
  cost_vec = np.array([max(d.cost_s, 0.0) for _, d in cols]) + 1e-12  # prefer fewer decisions

  # Pairwise rows: at most one action per gap; a recompute's inputs stay put.
  pair_rows: list[list[int]] = [cs for cs in col_of_gap.values() if len(cs) > 1]
  for c, (gi, d) in enumerate(cols):
    if d.action is not Action.REMAT:
      continue
    for x in common.chain_inputs(program, d.recompute):
      for hi in gaps_by_var.get(x, ()):
        h = gaps[hi]
        if h.start < d.end <= h.end:
          for c2 in col_of_gap.get(hi, ()):
            pair_rows.append([c, c2])

  for rnd in range(rounds):
    LAST.rounds = rnd + 1
    over = np.nonzero(base > target)[0]
    upper = (target - base[over]).astype(float)
    rows_l, cols_l, vals_l = [], [], []
    for c, (_, d) in enumerate(cols):
      lo = np.searchsorted(over, d.start, side="right")
      hi = np.searchsorted(over, d.end, side="left")
      if hi > lo:
        rows_l.append(np.arange(lo, hi))
        cols_l.append(np.full(hi - lo, c))
        vals_l.append(np.full(hi - lo, -float(freed[cols[c][0]])))
    rows = np.concatenate(rows_l) if rows_l else np.zeros(0, int)
    colidx = np.concatenate(cols_l) if cols_l else np.zeros(0, int)
    vals = np.concatenate(vals_l) if vals_l else np.zeros(0)
    constraints = []
    if len(over):
      a = coo_matrix((vals, (rows, colidx)), shape=(len(over), n)).tocsr()
      constraints.append(LinearConstraint(a, -np.inf, upper))
    if pair_rows:
      pr, pc = [], []
      for r, cs in enumerate(pair_rows):
        pr += [r] * len(cs)
        pc += cs
      b = coo_matrix((np.ones(len(pr)), (pr, pc)), shape=(len(pair_rows), n)).tocsr()
      constraints.append(LinearConstraint(b, -np.inf, 1.0))
    remaining = max(0.1, time_limit_s - (time.perf_counter() - t0))
    res = milp(cost_vec, constraints=constraints, integrality=np.ones(n),
               bounds=Bounds(0, 1), options={"time_limit": remaining, "disp": False})
    LAST.status = str(res.message)
    if res.x is None:
      break
    LAST.proven = res.status == 0
    LAST.objective_s = float(res.fun)
    chosen = tuple(cols[c][1] for c in np.nonzero(res.x > 0.5)[0])
    plan = common.finish(program, chosen, budget_bytes, "optimal", pinned, copies=copies,
                         window=window)
    best = chosen
    if plan.estimated_peak_bytes <= budget_bytes:
      break
    # The linear model missed fusion effects: aim lower by the overshoot.
    target -= plan.estimated_peak_bytes - budget_bytes + budget_bytes // 200
    if target <= 0:
      break
  LAST.seconds = time.perf_counter() - t0
  return common.finish(program, best, budget_bytes, "optimal", pinned, copies=copies,
                       window=window)
