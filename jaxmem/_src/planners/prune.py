"""Reverse delete: drop the decisions of a fitting plan that its budget does not need.

Every planner here builds its plan forward: greedy adds the cheapest bytes
until the estimate fits, segment plans recompute whole forward segments,
selective recomputation covers what segments left. Decisions added early
often stop mattering once later ones are in (a value dropped over a stretch
where, by the end, memory sits below the budget anyway), and a segment plan
restores every residual of a segment where a few would do. Greedy covering
heuristics end with the same step for the same reason: the *reverse delete*
of an approximate set cover, which walks the chosen sets from the most
expensive and removes each one the cover does not need. Here a decision is
removed when the plan without it is still estimated within the budget (the
same schedule estimate every planner finishes with,
:func:`~jaxmem._src.planners.common.finish`), and the pruned plan is kept
only when the simulator says it is faster. ``fit`` does not use it yet
(it calls ``auto`` with ``prune_estimates=0``; `docs/design.md`, "Reverse delete").

A remat decision shares its recomputation with the others restored at the
same point (the schedule runs the union of their chains once). Removing one
therefore saves only the ops no remaining decision of that point needs; the
value itself is then kept, so the union stops at it. Decisions are tried in
order of that saving, largest first, and one whose removal saves nothing is
not tried (it would only keep bytes).

Removals are tried in batches (adaptive group testing), after a screen
that refuses without an estimate a removal whose bytes, added over its gap
to the plan's live bytes there, would pass the budget; the screened-out ones
get a last pass while estimates last, until ``MAX_REFUSED_IN_A_ROW`` in a
row are refused. The number of estimates is bounded by a count scaled by the
program's size (:func:`default_estimates`), not by a clock.

Measured (simulated, ``h100-sxm``; ``auto`` before and after this step,
`bench/results/frontier.md`): the GPT example at 0.5 of its estimated peak
+10.2% -> +7.4%, ResNet-50 (224², batch 64) at 0.5 +17.3% -> +12.4%.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import Schedule
from jaxmem._src.plan.simulate import simulate
from jaxmem._src.planners import common

#: Most schedule estimates one prune spends (each is one estimate of the
#: whole plan: 15 ms on the GPT example's 2422 ops, 40 ms on ResNet-50's
#: 4613, 150 ms on DenseNet-121's 11138 on 2 CPU cores)...
MAX_ESTIMATES = 128
#: ...and at most this many ops estimated in all (a program of more than
#: 4,700 ops gets fewer estimates, at least ``MIN_ESTIMATES``). Counts, not a
#: clock, so plans do not depend on the machine's load.
MAX_OPS_ESTIMATED = 600_000
MIN_ESTIMATES = 32

#: The removals the screen refused are tried until this many in a row are
#: refused: by then the plan has no room left under the budget (16 cut the
#: GPT example's last pass short at half its peak: +7.9% instead of +7.4%).
MAX_REFUSED_IN_A_ROW = 32


@dataclasses.dataclass(frozen=True)
class PruneDiagnostics:
  """What a :func:`prune` did (on the pruned plan's ``diagnostics``).

  Attributes:
    planner: the plan pruned.
    tried: removals tried (schedule estimates).
    removed: decisions removed.
    step_s: simulated step time before and after.
  """
  planner: str
  tried: int
  removed: int
  step_s: tuple[float, float]

  def __str__(self) -> str:
    before, after = self.step_s
    return (f"pruned {self.removed} of {self.planner}'s decisions ({self.tried} tried): "
            f"{before * 1e3:.3f} -> {after * 1e3:.3f} ms simulated")


def _live_near(schedule: Schedule) -> np.ndarray:
  """Estimated live bytes at each op position, counting the steps inserted before it.

  Unlike :func:`~jaxmem._src.planners.common.live_by_position` (the op's own
  step), a restore point's recomputation and fetches count at the op they
  precede: where a plan peaks in the backward pass.
  """
  prof = schedule.profile()
  n = schedule.program.num_ops
  out = np.zeros(n, dtype=np.int64)
  pos = np.minimum(np.ceil([st.anchor for st in schedule.steps]).astype(np.int64), n - 1)
  np.maximum.at(out, pos, np.asarray(prof.live_bytes[:len(schedule.steps)], dtype=np.int64))
  return out


def _key(d: Decision) -> tuple[int, int, int, Action]:
  """A decision's identity across chain trims (which replace its ``recompute``)."""
  return (d.var, d.start, d.end, d.action)


def _held(program: AnalyzedProgram, d: Decision, pinned: Sequence[int]) -> int:
  """Bytes the estimate holds over ``d``'s gap once ``d`` is gone: its value's, or for a
  value XLA fuses away, the stored inputs it keeps alive (:func:`common.freed_bytes`)."""
  gap = common.Gap(d.var, d.start, d.end, d.nbytes, False)
  return max(d.nbytes, common.freed_bytes(program, gap, pinned))


def _union_without(program: AnalyzedProgram, group: Sequence[Decision],
                   removed: Decision) -> set[int]:
  """The ops of ``group``'s shared recomputation that its decisions other than ``removed`` need.

  The walk starts at the producers of the remaining decisions' values and
  follows inputs produced inside the union, except ``removed``'s value, which
  is kept (read where it is) once its decision is gone.
  """
  union = {k for d in group for k in d.recompute}
  producer = {o: k for k in union for o in program.ops[k].outputs}
  kept = removed.var
  stack = [producer[d.var] for d in group if d is not removed and d.var in producer]
  needed: set[int] = set()
  while stack:
    k = stack.pop()
    if k in needed:
      continue
    needed.add(k)
    for x in program.ops[k].input_ids():
      if x != kept and x in producer:
        stack.append(producer[x])
  return needed


def _without(program: AnalyzedProgram, decisions: Sequence[Decision], i: int,
             pricer: common.Pricer) -> tuple[list[Decision], float]:
  """``decisions`` less the ``i``-th, the others' chains trimmed to what they need; the time saved."""
  removed = decisions[i]
  if removed.action is not Action.REMAT:
    return [d for j, d in enumerate(decisions) if j != i], removed.cost_s
  group = [d for d in decisions if d.action is Action.REMAT and d.end == removed.end]
  union = {k for d in group for k in d.recompute}
  needed = _union_without(program, group, removed)
  saved = sum(pricer.op_seconds(k) for k in union - needed)
  rest = [d for d in group if d is not removed]
  # Each remaining decision keeps its own ops that are still needed; ops the
  # removed one listed and others still read go to the first remaining one
  # (the schedule runs the union of a point's chains, in program order).
  trimmed: dict[int, Decision] = {}
  placed: set[int] = set()
  for d in rest:
    ops = tuple(k for k in d.recompute if k in needed)
    placed.update(ops)
    trimmed[id(d)] = d
    if ops != d.recompute:
      trimmed[id(d)] = dataclasses.replace(d, recompute=ops, cost_s=pricer.remat_seconds(ops))
  orphans = needed - placed
  if orphans and rest:
    first = trimmed[id(rest[0])]
    ops = tuple(sorted({*first.recompute, *orphans}))
    trimmed[id(rest[0])] = dataclasses.replace(first, recompute=ops,
                                               cost_s=pricer.remat_seconds(ops))
  out = [trimmed.get(id(d), d) for j, d in enumerate(decisions) if j != i]
  return out, saved


def default_estimates(program: AnalyzedProgram) -> int:
  """How many removals :func:`prune` tries on ``program`` by default."""
  return min(MAX_ESTIMATES, max(MIN_ESTIMATES, MAX_OPS_ESTIMATED // max(1, program.num_ops)))


def prune(plan: Plan, budget_bytes: int, device: DeviceLike = None, *,
          max_estimates: int | None = None) -> Plan:
  """``plan`` without the decisions ``budget_bytes`` does not need, when that simulates faster.

  Args:
    plan: a plan whose estimated peak fits ``budget_bytes``.
    budget_bytes: the estimated peak the pruned plan must stay within.
    device: device profile pricing the ops saved and simulating both plans.
    max_estimates: most removals tried (one schedule estimate each;
      ``None``: :func:`default_estimates`).

  Returns:
    The pruned plan, named ``<planner>/pruned``, where it fits and simulates
    faster than ``plan``; otherwise ``plan`` itself.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> from jaxmem._src.planners.segments import segments
    >>> def f(w, x):
    ...   for _ in range(6):
    ...     x = jnp.tanh(x @ w)
    ...   return x.sum()
    >>> prog = jaxmem.analyze(jax.grad(f), jnp.ones((256, 256)), jnp.ones((1024, 256)))
    >>> budget = int(0.8 * prog.peak_bytes)
    >>> plan = segments(prog, budget, "h100-sxm")
    >>> pruned = prune(plan, budget, "h100-sxm")
    >>> pruned.estimated_peak_bytes <= budget, len(pruned.decisions) <= len(plan.decisions)
    (True, True)
  """
  if max_estimates is None:
    max_estimates = default_estimates(plan.program)
  if max_estimates < 0:
    raise ValueError(f"`prune`: `max_estimates` must be >= 0, got {max_estimates!r}.")
  budget_bytes = int(budget_bytes)
  if plan.estimated_peak_bytes > budget_bytes or not plan.decisions:
    return plan
  program = plan.program
  pricer = common.Pricer(program, device)
  current = list(plan.decisions)
  tries, removed = 0, 0
  # A removal refused stays refused: the plan only loses decisions, and
  # its estimated peak does not go down when it does.
  refused: set[tuple[int, int, int, Action]] = set()
  # Live bytes at each op of the plan so far: a removal that would hold its
  # value's bytes over a stretch already within that many bytes of the
  # budget is refused without an estimate (most refusals, at a tight budget).
  live = _live_near(plan.schedule())
  # Passes in order of each decision's saving in the plan so far, largest
  # first; a removal can raise the saving of the others restored at its
  # point (they no longer share its ops), so a pass that removed something
  # is followed by another. Removals are tried in batches (adaptive group
  # testing: a batch that fits is taken whole and the next batch is twice as
  # large; one that does not is retried in halves, and a removal refused
  # alone stays refused): on segment plans most removals fit (ResNet-50 at
  # half its peak: 158 of 240), and one estimate then settles several.
  # Once a screened pass removes nothing, the screened-out removals are
  # tried too (the screen counts a value's whole bytes, more than a
  # removal may add), while estimates last.
  screen, batch, streak = True, 4, 0
  while tries < max_estimates:
    savings = [_without(program, current, i, pricer)[1] for i in range(len(current))]
    order = sorted((i for i in range(len(current)) if savings[i] > 0),
                   key=lambda i: (-savings[i], i))
    pending = [key for key in (_key(current[i]) for i in order) if key not in refused]
    wanted = set(pending)
    held = {_key(d): _held(program, d, plan.pinned) for d in current if _key(d) in wanted}

    def screened(key: tuple[int, int, int, Action]) -> bool:
      _, start, end, _ = key
      return end - start > 1 and int(live[start + 1:end].max()) + held[key] > budget_bytes

    progress = False
    while pending and tries < max_estimates:
      if screen:
        # Screened with the live bytes of the plan as it is now: each
        # removal taken uses up some of the room under the budget.
        pending = [key for key in pending if not screened(key)]
        if not pending:
          break
      take, pending = pending[:batch], pending[batch:]
      trial = current
      for key in take:
        j = next((n for n, c in enumerate(trial) if _key(c) == key), None)
        if j is not None:
          trial, _ = _without(program, trial, j, pricer)
      if len(trial) == len(current):
        continue
      tries += 1
      candidate = common.finish(program, trial, budget_bytes, plan.planner, plan.pinned,
                                copies=plan.copies, window=plan.window)
      if candidate.estimated_peak_bytes <= budget_bytes:
        removed += len(current) - len(trial)
        current = trial
        live = _live_near(candidate.schedule())
        progress = True
        batch = min(2 * batch, 64)
        streak = 0
      elif len(take) == 1:
        refused.add(take[0])
        batch = 1
        streak += 1
        if not screen and streak >= MAX_REFUSED_IN_A_ROW:
          break
      else:
        half = len(take) // 2
        pending = take[:half] + take[half:] + pending
        batch = half
    if not screen and streak >= MAX_REFUSED_IN_A_ROW:
      break
    if progress:
      screen = True
    elif screen:
      screen, streak = False, 0
    else:
      break
  if not removed:
    return plan
  pruned = common.finish(program, current, budget_bytes, f"{plan.planner}/pruned", plan.pinned,
                         copies=plan.copies, window=plan.window)
  before, after = simulate(plan, device).step_time_s, simulate(pruned, device).step_time_s
  if after < before:
    return pruned.replace(diagnostics=(*plan.diagnostics, PruneDiagnostics(
        plan.planner, tries, removed, (before, after))))
  return plan


__all__ = ["MAX_ESTIMATES", "MAX_OPS_ESTIMATED", "MAX_REFUSED_IN_A_ROW", "MIN_ESTIMATES",
           "default_estimates", "PruneDiagnostics", "prune"]
