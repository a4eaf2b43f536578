"""Checkmate's exact MILP: the reference optimum of recomputation on small graphs.

Jain et al., *Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization* (MLSys 2020), §4. A program of ``n`` nodes in topological
order runs as ``n`` stages; stage ``t`` computes node ``t`` and whatever it
recomputes for it. Binary variables, for ``i <= t``:

* ``R[t, i]``: node ``i`` is (re)computed in stage ``t`` (``R[t, t] = 1``);
* ``S[t, i]`` (``i < t``): node ``i``'s result is kept from stage ``t - 1`` into
  stage ``t`` (a checkpoint);
* ``FREE[t, i, k]``: ``i``'s result is freed right after node ``k`` runs in
  stage ``t`` (``i`` an input of ``k``, or ``k`` itself);

and the continuous ``U[t, k]``, the memory right after node ``k`` of stage ``t``.

Constraints (§4.2-4.4): a node runs only with its inputs computed or kept in
its stage, ``R[t, k] <= R[t, j] + S[t, j]``; a checkpoint is something
computed or kept in the stage before, ``S[t+1, i] <= S[t, i] + R[t, i]``;
``U[t, 0] = fixed + sum_i S[t, i] M_i + R[t, 0] M_0`` and ``U[t, k] = U[t, k-1]
- sum_i M_i FREE[t, i, k-1] + R[t, k] M_k``, each ``<= budget``. Objective:
``sum C_i R[t, i]``, the step's compute time with its recomputations.

Where this departs from the paper, and why:

* ``FREE`` is linearised by the three implications of its definition
  (``FREE <= R[t, k]``, ``FREE <= 1 - S[t+1, i]``, ``FREE <= 1 - R[t, j]`` for
  every later user ``j`` of ``i`` in the stage) instead of the paper's
  hazard count with a big-M: minimising cost never leaves memory unfreed that
  could be freed, so only "freed implies allowed" is needed, and it is tight.
* Results the program returns (``RematGraph.keep``) are never freed and are
  kept in every stage after they are computed: Checkmate's graphs end in a
  loss; a train step returns its gradients and new state.
* Memory is counted per node, as in the paper: a node's ``M`` is the bytes of
  all its results, whether or not XLA would fuse the op away. Counting fused
  values as 0 (as jaxmem's estimate does inside a stage) let the optimum keep
  a fused value across stages for free, which no compiler can: keeping it
  means storing it. This is Checkmate's model, not jaxmem's whole estimate
  (no XLA temporaries, no fusion): a plan is compared with the optimum in this
  one model (:func:`rs_of_plan`), which is what the reference is for.

The formulation has ``O(n^2)`` variables (``n^2/2`` each of R, S and U, and
``FREE`` per edge and stage), as the paper's: it is the reference for graphs of
up to about a hundred nodes, not a planner for whole steps (see
:mod:`~jaxmem._src.planners.optimal` for the ``O(n)`` MILP ``fit`` uses).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.plan.decisions import Action
from jaxmem._src.plan.plan import Plan


@dataclasses.dataclass(frozen=True)
class RematGraph:
  """A program as Checkmate sees it: nodes in topological order, each with a cost and a result size.

  Attributes:
    costs: seconds each node takes.
    sizes: bytes of each node's result.
    deps: per node, the earlier nodes whose results it reads.
    keep: nodes whose results the program returns (never freed once computed).
    fixed_bytes: bytes live throughout (the step's arguments).
    ops: per node, the program op it stands for (from :func:`graph_of`).
  """
  costs: tuple[float, ...]
  sizes: tuple[int, ...]
  deps: tuple[tuple[int, ...], ...]
  keep: frozenset[int] = frozenset()
  fixed_bytes: int = 0
  ops: tuple[int, ...] = ()

  def __post_init__(self) -> None:
    n = len(self.costs)
    if len(self.sizes) != n or len(self.deps) != n:
      raise ValueError(f"`RematGraph` needs one cost, size and deps per node; got {n} costs, "
                       f"{len(self.sizes)} sizes and {len(self.deps)} deps.")
    for k, ds in enumerate(self.deps):
      if any(not 0 <= j < k for j in ds):
        raise ValueError(f"`RematGraph.deps[{k}]`={ds!r}: a node reads earlier nodes only "
                         "(topological order).")

  @property
  def n(self) -> int:
    return len(self.costs)

  def users(self) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(self.n)]
    for k, ds in enumerate(self.deps):
      for j in set(ds):
        out[j].append(k)
    return out


@dataclasses.dataclass(frozen=True)
class Solution:
  """A Checkmate schedule and what it costs.

  Attributes:
    R: ``(n, n)`` bool, ``R[t, i]``: node ``i`` computed in stage ``t``.
    S: ``(n, n)`` bool, ``S[t, i]``: node ``i`` kept into stage ``t``.
    cost_s: the step's compute time, ``sum C_i R[t, i]``.
    extra_s: its recomputation, ``cost_s`` less every node once.
    peak_bytes: the schedule's peak in Checkmate's memory model (:func:`memory_peak`).
    status: the solver's message.
    proven: the solver proved the optimum.
    gap: the solver's relative optimality gap (0 when proven).
    seconds: wall time of the solve.
  """
  R: np.ndarray
  S: np.ndarray
  cost_s: float
  extra_s: float
  peak_bytes: int
  status: str = ""
  proven: bool = False
  gap: float = float("nan")
  seconds: float = 0.0


def graph_of(program: AnalyzedProgram, device: DeviceLike = None) -> RematGraph:
  """The Checkmate graph of ``program``'s top-level ops, priced on ``device`` as the simulator does.

  Each op is a node; its size is the bytes of its results; a node reads the
  nodes that made its inputs; the program's arguments are fixed bytes and its
  results are kept.
  """
  dev = device_profile(device)
  seconds = program.op_seconds(dev)
  maker = {}
  for op in program.ops:
    for o in op.outputs:
      maker[o] = op.index
  sizes, deps, keep = [], [], set()
  for op in program.ops:
    sizes.append(sum(program.vars[o].nbytes for o in op.outputs))
    deps.append(tuple(sorted({maker[x] for x in op.input_ids() if x in maker})))
    if any(program.vars[o].is_output for o in op.outputs):
      keep.add(op.index)
  fixed = sum(v.nbytes for v in program.vars if v.is_input)
  return RematGraph(tuple(float(s) for s in seconds), tuple(sizes), tuple(deps), frozenset(keep),
                    fixed, tuple(op.index for op in program.ops))


def check(graph: RematGraph, R: np.ndarray, S: np.ndarray) -> None:
  """Raises ``ValueError`` unless ``(R, S)`` is a valid Checkmate schedule of ``graph``."""
  n = graph.n
  if R.shape != (n, n) or S.shape != (n, n):
    raise ValueError(f"R and S must be ({n}, {n}); got {R.shape} and {S.shape}.")
  if np.triu(R, 1).any() or np.triu(S).any():
    raise ValueError("R[t, i] needs i <= t and S[t, i] needs i < t.")
  if not R.diagonal().all():
    raise ValueError("every stage t computes its node: R[t, t] = 1.")
  for t in range(n):
    for k in np.nonzero(R[t])[0]:
      for j in graph.deps[k]:
        if not (R[t, j] or S[t, j]):
          raise ValueError(f"stage {t} runs node {k} without its input {j}.")
    if t + 1 < n:
      bad = S[t + 1, :t + 1] & ~(S[t, :t + 1] | R[t, :t + 1])
      if bad.any():
        raise ValueError(f"stage {t + 1} keeps node {int(np.nonzero(bad)[0][0])}, which stage "
                         f"{t} neither computed nor kept.")
    for i in graph.keep:
      if i < t and not S[t, i]:
        raise ValueError(f"returned node {i} must be kept into stage {t}.")


def memory_peak(graph: RematGraph, R: np.ndarray, S: np.ndarray) -> int:
  """The peak of a schedule in Checkmate's memory model (results freed as early as allowed)."""
  n = graph.n
  users = graph.users()
  sizes = graph.sizes
  peak = 0
  for t in range(n):
    live = {i for i in range(t) if S[t, i]}
    mem = graph.fixed_bytes + sum(sizes[i] for i in live)
    peak = max(peak, mem)
    for k in range(t + 1):
      if not R[t, k]:
        continue
      mem += sizes[k]
      live.add(k)
      peak = max(peak, mem)
      for i in {*graph.deps[k], k}:
        if i not in live or i in graph.keep or (t + 1 < n and S[t + 1, i]):
          continue
        if any(k < j <= t and R[t, j] for j in users[i]):
          continue
        live.discard(i)
        mem -= sizes[i]
  return int(peak)


def _cost(graph: RematGraph, R: np.ndarray) -> tuple[float, float]:
  costs = np.asarray(graph.costs)
  total = float((R * costs[None, :]).sum())
  return total, total - float(costs.sum())


def checkpoint_all(graph: RematGraph) -> tuple[np.ndarray, np.ndarray]:
  """The schedule that recomputes nothing: every result kept from its stage to its last use."""
  n = graph.n
  R = np.eye(n, dtype=bool)
  S = np.zeros((n, n), dtype=bool)
  users = graph.users()
  for i in range(n):
    last = n - 1 if i in graph.keep else max(users[i], default=i)
    S[i + 1:last + 1, i] = True
  return R, S


def rs_of_plan(graph: RematGraph, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
  """A jaxmem remat plan as a Checkmate schedule of ``graph`` (made by :func:`graph_of` of its program).

  Each remat decision recomputes its chain in the stage of the op after its
  gap; a result is kept into a stage when it is needed there or later and not
  recomputed at the next stage that needs it. Decisions are per value and
  Checkmate's nodes per op: dropping one result of a multi-result op drops the
  node. Offloads have no Checkmate form.

  Raises:
    ValueError: the plan offloads, or does not belong to the graph's program.
  """
  if any(d.action is Action.OFFLOAD for d in plan.decisions):
    raise ValueError("`rs_of_plan` takes remat-only plans: Checkmate has no offload.")
  node = {op: k for k, op in enumerate(graph.ops)}
  n = graph.n
  R = np.eye(n, dtype=bool)
  for d in plan.decisions:
    try:
      t = node[d.end]
      for op in d.recompute:
        R[t, node[op]] = True
    except KeyError:
      raise ValueError("`rs_of_plan`: the plan's ops are not the graph's; build the graph with "
                       "`graph_of(plan.program)`.") from None
  users = graph.users()
  S = np.zeros((n, n), dtype=bool)
  for i in range(n):
    made = np.nonzero(R[:, i])[0]
    need = sorted({t for j in users[i] for t in np.nonzero(R[:, j])[0]})
    if i in graph.keep:
      need.append(n)            # needed after the last stage
    for t in range(i + 1, n):
      if not (made < t).any():
        continue
      nxt = next((s for s in need if s >= t), None)
      if nxt is None:
        continue
      # Kept unless recomputed at the next stage that needs it (and not
      # since the last time it was made before t).
      if nxt < n and R[nxt, i] and not (made[(made >= t) & (made < nxt)]).size:
        continue
      S[t, i] = True
  return R, S


def solve(graph: RematGraph, budget_bytes: int, *, time_limit_s: float = 60.0) -> Solution | None:
  """The cheapest Checkmate schedule of ``graph`` within ``budget_bytes`` (HiGHS through scipy).

  Returns ``None`` when the solver finds no schedule within the budget in
  ``time_limit_s`` (none exists, or none was found in time).

  Example:
    >>> g = RematGraph(costs=(1.0,) * 4, sizes=(10,) * 4, deps=((), (0,), (1,), (2, 0)))
    >>> sol = solve(g, 30)
    >>> sol.peak_bytes <= 30 and sol.proven
    True
  """
  from scipy.optimize import Bounds, LinearConstraint, milp
  from scipy.sparse import coo_matrix

  t0 = time.perf_counter()
  n = graph.n
  users = graph.users()
  scale = float(max(budget_bytes, 1))
  sizes = np.asarray(graph.sizes, np.float64) / scale
  index: dict[tuple, int] = {}

  def var(*key: object) -> int:
    k = index.get(key)
    if k is None:
      k = index[key] = len(index)
    return k

  for t in range(n):
    for i in range(t + 1):
      var("R", t, i)
      if i < t:
        var("S", t, i)
  free_keys = []
  for t in range(n):
    for k in range(t + 1):
      for i in sorted({*graph.deps[k], k}):
        if i not in graph.keep:
          free_keys.append((t, i, k))
          var("F", t, i, k)
  for t in range(n):
    for k in range(t + 1):
      var("U", t, k)
  nv = len(index)
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0

  def row(entries: Sequence[tuple[int, float]], lower: float, upper: float) -> None:
    nonlocal r
    for c, v in entries:
      rows.append(r)
      cols.append(c)
      vals.append(v)
    lo.append(lower)
    hi.append(upper)
    r += 1

  for t in range(n):
    for k in range(t + 1):
      for j in graph.deps[k]:           # R[t,k] <= R[t,j] + S[t,j]
        entries = [(var("R", t, k), 1.0), (var("R", t, j), -1.0)]
        if j < t:
          entries.append((var("S", t, j), -1.0))
        row(entries, -np.inf, 0.0)
    if t + 1 < n:
      for i in range(t + 1):            # S[t+1,i] <= S[t,i] + R[t,i]
        entries = [(var("S", t + 1, i), 1.0), (var("R", t, i), -1.0)]
        if i < t:
          entries.append((var("S", t, i), -1.0))
        row(entries, -np.inf, 0.0)
  for t, i, k in free_keys:
    f = var("F", t, i, k)
    row([(f, 1.0), (var("R", t, k), -1.0)], -np.inf, 0.0)
    if t + 1 < n:
      row([(f, 1.0), (var("S", t + 1, i), 1.0)], -np.inf, 1.0)
    for j in users[i]:
      if k < j <= t:
        row([(f, 1.0), (var("R", t, j), 1.0)], -np.inf, 1.0)
  frees_after: dict[tuple[int, int], list[int]] = {}
  for t, i, k in free_keys:
    frees_after.setdefault((t, k), []).append(i)
  fixed = graph.fixed_bytes / scale
  for t in range(n):
    # U[t,0] - sum S[t,i] M_i - R[t,0] M_0 = fixed
    entries = [(var("U", t, 0), 1.0), (var("R", t, 0), -sizes[0])]
    entries += [(var("S", t, i), -sizes[i]) for i in range(t)]
    row(entries, fixed, fixed)
    for k in range(1, t + 1):
      # U[t,k] - U[t,k-1] + sum M_i F[t,i,k-1] - R[t,k] M_k = 0
      entries = [(var("U", t, k), 1.0), (var("U", t, k - 1), -1.0),
                 (var("R", t, k), -sizes[k])]
      entries += [(var("F", t, i, k - 1), sizes[i]) for i in frees_after.get((t, k - 1), [])]
      row(entries, 0.0, 0.0)
  a = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
  lower = np.zeros(nv)
  upper = np.ones(nv)
  integrality = np.ones(nv)
  costs = np.zeros(nv)
  for (kind, *key), c in index.items():
    if kind == "R":
      t, i = key
      costs[c] = graph.costs[i]
      if i == t:
        lower[c] = 1.0
    elif kind == "S":
      t, i = key
      if i in graph.keep:
        lower[c] = 1.0
    elif kind == "U":
      integrality[c] = 0
      lower[c] = 0.0
      upper[c] = budget_bytes / scale     # U <= budget (sizes in units of the budget)
  res = milp(costs, constraints=[LinearConstraint(a, np.asarray(lo), np.asarray(hi))],
             integrality=integrality, bounds=Bounds(lower, upper),
             options={"time_limit": time_limit_s, "disp": False})
  if res.x is None:
    return None
  x = res.x > 0.5
  R = np.zeros((n, n), dtype=bool)
  S = np.zeros((n, n), dtype=bool)
  for (kind, *key), c in index.items():
    if kind == "R":
      R[key[0], key[1]] = x[c]
    elif kind == "S":
      S[key[0], key[1]] = x[c]
  check(graph, R, S)
  total, extra = _cost(graph, R)
  gap = float(res.get("mip_gap", float("nan")))
  return Solution(R, S, total, extra, memory_peak(graph, R, S), str(res.message),
                  res.status == 0, gap, time.perf_counter() - t0)


def schedule_cost(graph: RematGraph, R: np.ndarray) -> float:
  """Extra compute time of a schedule: ``sum C_i R[t, i]`` less every node once."""
  return _cost(graph, R)[1]


__all__ = ["RematGraph", "Solution", "check", "checkpoint_all", "graph_of", "memory_peak",
           "rs_of_plan", "schedule_cost", "solve"]
