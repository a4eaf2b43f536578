"""Recompute chains: the ops that rebuild a value from values still live where it is needed.

A remat decision drops a value after one use and recomputes it just before
the next. :func:`find_chain` walks back from the value through its producers
until every input is *available* at the restore point (an argument, or a value
whose lifetime, with the decisions made so far, covers that point), the walk
the greedy planner, the segment planner and the MILP's columns share.
:class:`ChainState` records the decisions made so far and the uses they add.
With ``xla_lifetimes``, availability follows the estimate instead (XLA
keeps the inputs of a fused value as long as its readers, and stores no
fused value): see ``docs/design.md``, "Chains that read what XLA stores".
"""

from __future__ import annotations

import bisect

from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.plan.decisions import Action, Decision


class ChainState:
  """Decisions so far plus the events (def, uses) they add to each variable.

  ``xla_lifetimes``: a value is available while the estimate keeps it alive
  (``Profile.intervals``), not only to its last use in the program, and
  :func:`find_chain` rebuilds a value XLA fuses away from stored values
  instead of reading it. Selective recomputation can plan with it (``auto``
  runs it both ways); whole segments do not (a segment's restore ends the
  originals' lives early).
  """

  def __init__(self, program: AnalyzedProgram, xla_lifetimes: bool = False):
    self.program = program
    self.xla_lifetimes = xla_lifetimes
    self.decisions: list[Decision] = []
    self.extra_uses: dict[int, list[int]] = {}
    self.gaps: dict[int, list[tuple[int, int]]] = {}
    self.intervals = program.profile.intervals

  def events(self, vid: int) -> list[int]:
    v = self.program.vars[vid]
    ev = sorted({v.defined_by, *v.uses, *self.extra_uses.get(vid, ())})
    return ev

  def available(self, vid: int, pos: int) -> bool:
    """Can a value of ``vid`` be read just before op ``pos`` without extending its life?"""
    v = self.program.vars[vid]
    if v.is_input:
      return True
    ev = self.events(vid)
    last = ev[-1]
    if self.xla_lifetimes and self.intervals is not None:
      # XLA keeps the inputs of a fused value as long as its readers, past
      # their own last use in the program.
      last = max(last, self.intervals[vid][1])
    if not (v.defined_by < pos <= last or v.is_output and v.defined_by < pos):
      return False
    return not any(a < pos <= b for a, b in self.gaps.get(vid, ()))

  def add(self, d: Decision) -> None:
    self.decisions.append(d)
    self.gaps.setdefault(d.var, []).append((d.start, d.end))
    # A restore before the next use (a segment's shared restore point) is an
    # event of the value: it exists again from there.
    if d.end not in self.program.vars[d.var].uses:
      lst = self.extra_uses.setdefault(d.var, [])
      if d.end not in lst:
        bisect.insort(lst, d.end)
    if d.action is Action.REMAT:
      made = {o for k in d.recompute for o in self.program.ops[k].outputs}
      for k in d.recompute:
        for x in self.program.ops[k].input_ids():
          if x not in made:
            lst = self.extra_uses.setdefault(x, [])
            if d.end not in lst:
              bisect.insort(lst, d.end)


def find_chain(state: ChainState, vid: int, pos: int, max_ops: int = 8,
               made: set[int] | None = None) -> tuple[int, ...] | None:
  """Ops that rebuild ``vid`` just before ``pos`` from values available there.

  ``made``: ops another chain restored at ``pos`` runs already (they are not
  repeated; the union runs once, see ``schedule.build_schedule``). The ops
  this chain adds are added to it.
  """
  prog = state.program
  ok = prog.rematerializable
  virtual = prog.profile.virtual
  constant = prog.constant_like
  chain: list[int] = []
  seen: set[int] = set(made) if made else set()
  budget = len(seen) + max_ops

  def need(x: int, force: bool = False, fused: bool = False) -> bool:
    v = prog.vars[x]
    if not force and state.available(x, pos):
      # A value XLA fuses into its readers has no buffer: reading it where
      # it is restored would make XLA store it for the whole gap (a fence,
      # ``schedule.fence_points``, or a fusion that cannot take it), as many
      # bytes as the decision frees (ResNet-50: ``x - mean`` of every
      # BatchNorm, read to rebuild its ReLU). The chain rebuilds it from
      # stored values where it can (fused ops only, which cost no traffic);
      # where it cannot, it reads it.
      if (state.xla_lifetimes and virtual is not None and virtual[x] and not v.is_input
          and not constant[x] and v.defined_by not in seen):
        mark, before = len(chain), set(seen)
        if need(x, force=True, fused=True):
          return True
        del chain[mark:]
        seen.clear()
        seen.update(before)
      return True
    if v.is_input:
      return True
    if fused and not force and (virtual is None or not virtual[x]):
      return False      # a stored value gone by then: not rebuilt for a fused one
    k = v.defined_by
    if k in seen:
      return True
    if not ok[k]:
      return False
    if len(seen) >= budget:   # bound the ops entered, so the recursion is bounded too
      return False
    seen.add(k)
    for y in prog.ops[k].input_ids():
      if not need(y, fused=fused):
        return False
    chain.append(k)
    return True

  if not need(vid, force=True):
    return None
  if made is not None:
    made.update(chain)
  return tuple(chain)


__all__ = ["ChainState", "find_chain"]
