"""Segment recomputation (Chen et al. 2016, "Training deep nets with sublinear memory cost").

§3 (Algorithm 1, "memory optimized gradient graph"): split the forward pass
into segments at points where a single value flows from one part of the
network to the next (the *checkpoints*); drop every value a segment saves for
the backward pass and, when the backward pass reaches the segment, recompute
the whole segment once from its kept checkpoint. §4.1 splits at the
articulation points of a chain; a residual network still has one at each block
boundary (the block's output is the only large value crossing it), a
transformer at each residual add. That is what ``nn.remat`` on every block
does by hand; the difference here is that

* segments are found on the program, not on the model's code;
* only the segments needed to reach the budget are recomputed, the ones with
  the most bytes per second of recomputation first (§4.2 chooses the segment
  size from a budget; we choose which segments, since a segment's
  recomputation cost varies by orders of magnitude between an attention block
  and a ReLU/norm stretch);
* what recomputation cannot free is left to :func:`~.greedy.greedy` (remat or
  offload of single values).

A segment's residuals are restored at one point, just before the first
backward op that reads any of them, and
:func:`~jaxmem._src.plan.schedule.build_schedule` runs the union of their
recompute chains once there: the shared prefix is not repeated per value.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem._src import _compat
from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.ir.program import Phase
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.planners import common
from jaxmem._src.planners.chains import ChainState, find_chain
from jaxmem._src.planners.greedy import greedy

# A value crosses a cut "alone" when every other value crossing it is smaller
# than this fraction of the largest value in the program (masks, scalars,
# norms' statistics are carried along with the checkpoint instead).
SMALL_CROSSING = 1 / 64


@dataclasses.dataclass(frozen=True)
class Segment:
  """Forward ops ``(lo, hi]`` between two checkpoints.

  Attributes:
    lo, hi: program positions of the cuts (``lo`` may be -1: the step's start).
    restore: the position the residuals are rebuilt before.
    decisions: one remat per residual, all restored at ``restore``.
    nbytes: bytes of the residuals dropped.
    cost_s: time of one recomputation of the union of their chains.
    checkpoints: the stored values crossing the cut at ``lo`` that the
      recomputation starts from (kept until ``restore``; what
      ``offload_checkpoints`` may stage to host in between).
  """
  lo: int
  hi: int
  restore: int
  decisions: tuple[Decision, ...]
  nbytes: int
  cost_s: float
  checkpoints: tuple[int, ...] = ()


def forward_cuts(program: AnalyzedProgram) -> list[int]:
  """Forward positions after which one large value flows on to the rest of the forward pass.

  Chen et al. §4.1 cut a chain where a single value flows on; that rule stays
  (every large value crossing ``p`` counted). Networks with long skips (a
  UNet's encoder features, read again by its decoder) have no such point
  between a skip and its reader. A skip made before the previous cut is part
  of that cut's checkpoint set anyway (the segment keeps every value crossing
  its start, :func:`_segment`), so walking the forward pass from left to
  right, ``p`` is also a cut when exactly one large value made since the
  previous cut is still read by a later forward op and XLA stores that value
  (a checkpoint XLA fuses away or aliases would add a buffer the unplanned
  step lacks). On a chain this adds nothing; on a UNet it cuts at the block
  boundaries, as ``nothing_saveable`` on every block would, and ``group``
  coarsens it.
  """
  forward = [op.index for op in program.ops if op.phase is Phase.FORWARD]
  if not forward:
    return []
  last_fwd = forward[-1]
  big = max((v.nbytes for v in program.vars), default=0) * SMALL_CROSSING
  count = np.zeros(program.num_ops + 1, dtype=np.int64)
  born: dict[int, list[tuple[int, int]]] = {}   # position -> (value, last forward use)
  for v in program.vars:
    if v.is_input or program.constant_like[v.id] or v.nbytes < big:
      continue
    if program.ops[v.defined_by].phase is not Phase.FORWARD:
      continue
    last_use = max((u for u in v.uses if u <= last_fwd), default=None)
    if last_use is None:
      continue
    # crosses every cut after positions defined_by .. last forward use - 1
    count[v.defined_by] += 1
    count[last_use] -= 1
    if last_use > v.defined_by:
      born.setdefault(v.defined_by, []).append((v.id, last_use))
  crossing = np.cumsum(count)   # Chen et al.'s rule: every large value crossing p
  # A checkpoint XLA would not store (fused into its consumers, an alias) is
  # no place to cut: keeping it would add a buffer the unplanned step lacks.
  virtual = program.profile.virtual
  cuts: list[int] = []
  open_: dict[int, int] = {}   # values made since the previous cut -> their last forward use
  for p in forward:
    if p >= last_fwd:
      break
    open_.update(born.get(p, ()))
    for vid in [vid for vid, end in open_.items() if end <= p]:
      del open_[vid]
    if crossing[p] == 1 or (len(open_) == 1
                            and (virtual is None or not virtual[next(iter(open_))])):
      cuts.append(p)
      open_.clear()
  return cuts


def module_cuts(program: AnalyzedProgram, cuts: list[int], depth: int) -> list[int]:
  """The last of ``cuts`` inside each module at ``depth`` of the model's module path.

  ``GPT/DecoderBlock_3/LayerNorm_0`` at depth 2 is ``GPT/DecoderBlock_3``: a
  GPT's cuts inside each decoder block (after every layer norm, attention,
  residual add) reduce to the block's output, its boundary with the next
  block. Segments between those cuts are the model's own blocks, which is
  where a user puts ``nn.remat`` by hand. Chen et al. §4.1 cut at every
  articulation point; where the estimate over-counts a segment's own
  temporaries, the finer cuts look better than they compile (their
  checkpoints stay live through the backward pass), and the module-aligned
  cuts are the alternative a compiling caller tries.
  """
  def scope(k: int) -> str:
    return "/".join(program.ops[k].module.split("/")[:depth])

  return [c for c, nxt in zip(cuts, [*cuts[1:], None]) if nxt is None or scope(c) != scope(nxt)]


def find_segments(program: AnalyzedProgram, device: DeviceLike = None,
                  min_bytes: int | None = None, group: int = 1,
                  depth: int | None = None) -> list[Segment]:
  """The forward pass cut at :func:`forward_cuts`, each segment with its remat decisions.

  ``group`` consecutive segments make one (only every ``group``-th cut is
  kept as a checkpoint: Chen et al.'s segment size). ``depth``: keep only the
  cuts at module boundaries at that depth (:func:`module_cuts`) before
  grouping. A segment whose residuals are smaller than ``min_bytes`` is
  merged into the next one.
  """
  return _find_segments(program, common.Pricer(program, device), _residuals(program),
                        forward_cuts(program), min_bytes, group, depth)


def _residuals(program: AnalyzedProgram) -> dict[int, common.Gap]:
  return {g.var: g for g in common.residual_gaps(program, 1)}


def _find_segments(program: AnalyzedProgram, pricer: common.Pricer,
                   residual: dict[int, common.Gap], cuts: list[int], min_bytes: int | None,
                   group: int = 1, depth: int | None = None,
                   xla_lifetimes: bool = False) -> list[Segment]:
  """:func:`find_segments` from the program's residuals and cuts, computed once by the caller."""
  if min_bytes is None:
    min_bytes = max(1, program.profile.peak_bytes // 1000)
  if depth is not None:
    cuts = module_cuts(program, cuts, depth)
  first_fwd = next((op.index for op in program.ops if op.phase is Phase.FORWARD), 0)
  bounds = [first_fwd - 1, *cuts]
  last_fwd = max((op.index for op in program.ops if op.phase is Phase.FORWARD), default=-1)
  if not bounds or bounds[-1] < last_fwd:
    bounds.append(last_fwd)
  bounds = bounds[:-1][::group] + bounds[-1:]
  out: list[Segment] = []
  lo = bounds[0]
  for hi in bounds[1:]:
    gaps = [residual[o] for k in range(lo + 1, hi + 1) for o in program.ops[k].outputs
            if o in residual and residual[o].start <= hi]
    if sum(g.nbytes for g in gaps) < min_bytes and hi != bounds[-1]:
      continue   # too small to be worth a recomputation: merge into the next segment
    seg = _segment(program, lo, hi, gaps, pricer, xla_lifetimes)
    if seg is not None:
      out.append(seg)
    lo = hi
  return out


def _segment(program: AnalyzedProgram, lo: int, hi: int, gaps: list[common.Gap],
             pricer: common.Pricer, xla_lifetimes: bool = False) -> Segment | None:
  if not gaps:
    return None
  restore = min(g.end for g in gaps)
  state = ChainState(program, xla_lifetimes)
  # The checkpoint: every value crossing the cut at `lo` stays alive until the
  # restore point (the chains start from it instead of recomputing it).
  # (The segment's own inputs, not a scan of every value: `_segment` runs for
  # every segment of every grouping `segments` considers.)
  crossing = {x for k in range(lo + 1, hi + 1) for x in program.ops[k].inputs
              if isinstance(x, int)}
  for vid in sorted(crossing):
    v = program.vars[vid]
    if not v.is_input and v.defined_by <= lo:
      state.extra_uses.setdefault(vid, []).append(restore)
  checkpoint = set(state.extra_uses)
  for g in gaps:
    state.gaps.setdefault(g.var, []).append((g.start, restore))
  # Values XLA fuses into their consumers are never stored: a chain reading one
  # would force it into memory (a fence materializes it) and pay its store and
  # launch. Recompute them inside the chain instead, as the fused kernel would.
  virtual = program.profile.virtual
  if virtual is not None:
    for k in range(lo + 1, hi + 1):
      for o in program.ops[k].outputs:
        if virtual[o] and o not in checkpoint and not program.constant_like[o]:
          state.gaps.setdefault(o, []).append((k, restore))
  max_ops = (hi - lo) + 16
  decisions = []
  union: set[int] = set()
  for g in sorted(gaps, key=lambda g: -program.vars[g.var].defined_by):
    if g.start >= restore - 1:
      continue
    # Each decision carries the ops its chain adds to the segment's union (the
    # latest residual first, so most of the union is found in one walk).
    chain = find_chain(state, g.var, restore, max_ops, made=union)
    if chain is None:
      continue
    decisions.append(Decision(g.var, Action.REMAT, g.start, restore, chain, g.nbytes,
                              pricer.remat_seconds(chain)))
  if not decisions:
    return None
  # The checkpoints the chains read: stored values (a fused one has no buffer
  # to stage), plain arrays, made by the step (arguments stay where they are).
  read = {x for k in union for x in program.ops[k].input_ids()}
  stored = [c for c in sorted(checkpoint & read)
            if not program.vars[c].is_input and not program.constant_like[c]
            and (virtual is None or not virtual[c])
            and _compat.is_plain_array_aval(program.vars[c].aval)]
  return Segment(lo, hi, restore, tuple(decisions), sum(d.nbytes for d in decisions),
                 pricer.remat_seconds(sorted(union)), tuple(stored))


@without_gc
@common.never_worse_than_none
def segments(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
             copies: CopyMode = "sync", window: Window = None,
             min_bytes: int | None = None, fill: bool = True, max_tries: int = 3,
             group: int | str | None = None, offload_checkpoints: bool = False) -> Plan:
  """Recompute whole forward segments, the cheapest bytes first, until the estimate fits.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak.
    device: device profile pricing the recomputation (default: current backend).
    copies, window: how the offloads added by ``fill`` are scheduled.
    min_bytes: segments saving fewer bytes merge into the next (default: 0.1%
      of the peak).
    fill: when every segment recomputed is not enough, let
      :func:`~.greedy.greedy` remat or offload single values on top.
    max_tries: segment sizes evaluated once one fits (cheapest guess first).
    group: ``None`` searches segments of 1, 2, 4, ... cuts (Chen et al.'s
      segment size) and the module-aligned segments of :func:`module_cuts`;
      an int evaluates only segments of that many cuts; ``"modules"`` only
      the module-aligned ones. The search ranks options by the estimate;
      where the estimate over-counts a segment's own temporaries (XLA:TPU
      fuses what the model stores), finer segments look better than they
      compile, so a caller that compiles (``fit`` on a TPU target) also
      tries ``"modules"`` on its own.
    offload_checkpoints: when every segment recomputed is not enough, stage
      the segments' checkpoints to host from their last forward use to the
      segment's restore (the fewest that fit, largest first): what a
      transformer user does by hand with ``nn.remat`` on every block and the
      block inputs offloaded. The checkpoints are stored values by
      construction, so the copies free real buffers. Applied before ``fill``.

  Returns:
    A :class:`jaxmem.Plan` named ``segments`` (``segments+offload`` with
    checkpoints staged, ``segments+greedy`` when filled).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def f(w, x):
    ...   for _ in range(4):
    ...     x = jnp.tanh(x @ w)
    ...   return x.sum()
    >>> prog = jaxmem.analyze(jax.grad(f), jnp.ones((128, 128)), jnp.ones((512, 128)))
    >>> plan = segments(prog, int(0.8 * prog.peak_bytes), "h100-pcie")
    >>> plan.estimated_peak_bytes <= 0.8 * prog.peak_bytes
    True
  """
  plan = segments_within(program, budget_bytes, device, float("inf"), copies=copies,
                         window=window, min_bytes=min_bytes, fill=fill, max_tries=max_tries,
                         group=group, offload_checkpoints=offload_checkpoints)
  assert plan is not None
  return plan


#: How many of the lowest plans of :func:`segments_within` greedy fills when
#: none fits alone (the lowest one filled first).
FILL_CANDIDATES = 3


def segments_within(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike,
                    cap_s: float, *, copies: CopyMode = "sync", window: Window = None,
                    min_bytes: int | None = None, fill: bool = True, max_tries: int = 3,
                    group: int | str | None = None,
                    offload_checkpoints: bool = False, pinned: bool = True,
                    cut: list[list[Segment]] | None = None) -> Plan | None:
  """:func:`segments`, or ``None`` where its plan cannot cost less than ``cap_s`` seconds.

  ``pinned=False`` searches the prefixes without Layrub's pins (every plan
  of the search is estimated as it would compile without them); the plan
  is named ``segments/unpinned``. ``cut``: the :func:`segmentations` to
  search, when the caller has cut them already.

  Each segmentation's guess (the recomputation of its cheapest segments
  whose bytes cover the excess over the budget, priced per op of the
  unplanned program) bounds the cost of any of its plans from below, a
  filled one included (it recomputes every segment): a segmentation whose
  guess reaches ``cap_s`` is not estimated, and a prefix search stops at the
  longest prefix costing at most ``cap_s``. The simulator prices a plan's
  recomputation as the plan fuses it, which can be less (5% on ResNet-18 at
  0.6 of its peak), so ``auto`` passes twice the overhead of the fastest
  fitting plan it already has. Measured on ResNet-50 at half its peak with
  the ``cpu`` profile, where greedy offloading costs a seventh of the least
  recomputation, this skips the segment search (about 1 s) entirely.
  """
  pins = common.pins(program) if pinned else ()
  excess = program.profile.peak_bytes - budget_bytes
  # Segmentations of 1, 2, 4, ... cuts per segment, each with a guess of its
  # cost (the cheapest segments whose bytes cover the excess). Evaluated
  # cheapest guess first; one whose guess already costs more than a fitting
  # plan is skipped (the guess underestimates: a prefix never needs fewer
  # bytes), and the search stops after ``max_tries`` fitting sizes.
  options = [(cover_cost(segs, excess), segs)
             for segs in (segmentations(program, device, min_bytes=min_bytes, group=group)
                          if cut is None else cut)]
  options = options or [(0.0, [])]
  options.sort(key=lambda o: o[0])
  best: tuple[float, int, Plan, list[Segment]] | None = None
  # Every plan estimated, for the fill below when none fits.
  tried: list[Plan] = []
  fitting = 0
  for guess, segs in options:
    # The cost to beat: the best fitting plan's, or the caller's.
    cap = min(best[0], cap_s) if best is not None else cap_s
    if guess >= cap:
      continue
    if fitting >= max_tries:
      break
    found = _plan_for_segments(program, budget_bytes, segs, pins, copies, window, cap)
    if found is None:
      continue             # no prefix that fits costs less than the best plan
    plan, cost_s, k = found
    fits = plan.estimated_peak_bytes <= budget_bytes
    key = (cost_s if fits else float("inf"), plan.estimated_peak_bytes)
    fitting += fits
    tried.append(plan)
    if best is None or key < best[:2]:
      best = (*key, plan, segs[:k])
  if best is None:
    return None            # (only under a finite `cap_s`)
  plan = best[2]
  if plan.estimated_peak_bytes > budget_bytes and offload_checkpoints:
    plan = _offload_checkpoints(program, budget_bytes, plan, best[3], device)
  if plan.estimated_peak_bytes > budget_bytes and fill:
    filled = greedy(program, budget_bytes, device, copies=copies, window=window,
                    initial=plan.decisions)
    if filled.estimated_peak_bytes > budget_bytes and not offload_checkpoints:
      # No segmentation fits alone: the one estimated lowest before greedy
      # fills it need not be the lowest after (a conformer block's most
      # aggressive plan: 66.7 MiB filled from the lowest, 59.9 MiB from the
      # next, which compiled to 45.3 MiB). The next few are filled too.
      for other in sorted(tried, key=lambda p: p.estimated_peak_bytes)[:FILL_CANDIDATES]:
        if other is best[2]:
          continue
        again = greedy(program, budget_bytes, device, copies=copies, window=window,
                       initial=other.decisions)
        if again.estimated_peak_bytes < filled.estimated_peak_bytes:
          filled = again
    if filled.estimated_peak_bytes > budget_bytes:
      alone = greedy(program, budget_bytes, device, copies=copies, window=window)
      if alone.estimated_peak_bytes < filled.estimated_peak_bytes:
        return alone.replace(planner="segments(greedy)")
    return filled.replace(planner="segments+greedy")
  return plan if pinned else plan.replace(planner="segments(unpinned)")


def segmentations(program: AnalyzedProgram, device: DeviceLike, *, min_bytes: int | None = None,
                  group: int | str | None = None,
                  xla_lifetimes: bool = False) -> list[list[Segment]]:
  """The distinct segmentations :func:`segments_within` searches, each ranked by :func:`_ranked`.

  ``group`` as in :func:`segments`: ``None`` gives segments of 1, 2, 4, ...
  cuts and the module-aligned ones at every module depth. They do not depend
  on the budget, so callers that plan several budgets
  (:func:`~jaxmem._src.planners.selective.selective`) cut them once.
  ``xla_lifetimes``: the chains read values as long as the estimate keeps
  them alive, not only to their last use in the program
  (:class:`~jaxmem._src.planners.chains.ChainState`).
  """
  if group is not None and group != "modules" and (
      isinstance(group, bool) or not isinstance(group, int) or group < 1):
    raise ValueError(f"`group` must be a positive int (cuts per segment), 'modules' or None, "
                     f"got {group!r}.")
  # Cut once per program, device and options: `auto` searches them three
  # times (the pinned and unpinned segment searches, selective
  # recomputation), about 0.2 s each on ResNet-50. Segments are immutable
  # and callers only slice the lists.
  key = (device_profile(device), min_bytes, group, xla_lifetimes)
  memo = program.__dict__.setdefault("_segmentations", {})
  if key not in memo:
    memo[key] = _cut_segmentations(program, device, min_bytes, group, xla_lifetimes)
  return list(memo[key])


def _cut_segmentations(program: AnalyzedProgram, device: DeviceLike, min_bytes: int | None,
                       group: int | str | None,
                       xla_lifetimes: bool = False) -> tuple[list[Segment], ...]:
  """:func:`segmentations`, not cached."""
  out: list[list[Segment]] = []
  seen: set[tuple[int, ...]] = set()

  def consider(segs: list[Segment]) -> None:
    bounds = tuple(sorted(x.hi for x in segs))
    if segs and bounds not in seen:   # a grouping that changes nothing is skipped
      seen.add(bounds)
      out.append(segs)

  # What every segmentation is cut from, computed once.
  pricer = common.Pricer(program, device)
  residual = _residuals(program)
  cuts = forward_cuts(program)
  if group is None or isinstance(group, int):
    size = 1 if group is None else group
    while True:
      segs = _ranked(_find_segments(program, pricer, residual, cuts, min_bytes, size,
                                    xla_lifetimes=xla_lifetimes))
      consider(segs)
      if group is not None or len(segs) <= 2:
        break
      size *= 2
  if group is None or group == "modules":
    depths = max((op.module.count("/") + 1 for op in program.ops if op.module), default=0)
    for depth in range(1, depths + 1):
      consider(_ranked(_find_segments(program, pricer, residual, cuts, min_bytes, depth=depth,
                                      xla_lifetimes=xla_lifetimes)))
  if not out:
    consider(_ranked(_find_segments(program, pricer, residual, cuts, min_bytes,
                                    xla_lifetimes=xla_lifetimes)))
  return tuple(out)


def cover_cost(segs: list[Segment], excess: int) -> float:
  """Recomputation time of the shortest prefix of ranked ``segs`` whose bytes reach ``excess``."""
  return sum(x.cost_s for x in segs[:_cover(segs, excess)])


def _ranked(segs: list[Segment]) -> list[Segment]:
  """Most bytes per second of recomputation first."""
  return sorted(segs, key=lambda s: -s.nbytes / max(s.cost_s, 1e-12))


def _cover(segs: list[Segment], excess: int) -> int:
  """The shortest prefix of ``segs`` whose dropped bytes reach ``excess``."""
  if excess <= 0:
    return 0
  cum = np.cumsum([x.nbytes for x in segs])
  return min(len(segs), int(np.searchsorted(cum, excess)) + 1)


def _plan_for_segments(program: AnalyzedProgram, budget_bytes: int, segs: list[Segment],
                       pins: tuple[int, ...], copies: CopyMode, window: Window,
                       cap_s: float = float("inf")) -> tuple[Plan, float, int] | None:
  """The shortest fitting prefix of ``segs`` (ranked by :func:`_ranked`), its cost and length.

  ``cap_s``: the cost of the best fitting plan found so far. Prefixes cost
  more the longer they are, so only those costing at most ``cap_s`` are
  searched; ``None`` when the longest of them does not fit (one estimate
  instead of a search that can only find a costlier plan).

  The search assumes, as a bisection does, that a longer prefix peaks no
  higher. It probes where the peak, interpolated linearly in the bytes
  dropped between the two ends of its bracket, meets the budget (regula
  falsi), and halves the bracket where a probe did not. It takes what
  earlier searches of the same segments estimated (:func:`_prefix_peaks`,
  for any budget) as known: a prefix no longer than one over the budget is
  not estimated, nor one no shorter than one that fits. Where that
  inference picks a prefix whose own estimate is over the budget, the search
  runs again on estimates alone. Measured on ResNet-50 at half its peak
  under `auto`: the walk it replaces (up from the prefix whose dropped bytes
  cover the excess, galloping, then bisecting) took 5-12 estimates per
  search, since a third of the dropped bytes come off the peak there; this
  one takes 4-6, and `auto` 63 estimates instead of 77, with the same
  prefixes.
  """
  plans: dict[int, Plan] = {}
  known = _prefix_peaks(program, segs, pins)

  def plan_of(k: int) -> Plan:
    if k not in plans:
      chosen = segs[:k]
      # Layrub's pins keep small kept masks materialized; a value of a
      # recomputed segment is not kept, and pinning it would store it for nothing.
      inside = [(s.lo, s.hi) for s in chosen]
      pinned = [p for p in pins
                if not any(lo < program.vars[p].defined_by <= hi for lo, hi in inside)]
      plans[k] = common.finish(program, [d for s in chosen for d in s.decisions], budget_bytes,
                               "segments", pinned, copies=copies, window=window)
      known[k] = plans[k].estimated_peak_bytes
    return plans[k]

  dropped = np.concatenate([[0], np.cumsum([x.nbytes for x in segs])])
  unplanned = program.profile.peak_bytes

  def search(infer: bool) -> tuple[Plan, float, int] | None:
    def peak(k: int) -> int:
      return plan_of(k).estimated_peak_bytes

    def fits(k: int) -> bool:
      if infer and k not in plans:
        if any(j >= k and p > budget_bytes for j, p in known.items()):
          inferred.append(k)
          return False
        if any(j <= k and p <= budget_bytes for j, p in known.items()):
          inferred.append(k)
          return True
      return peak(k) <= budget_bytes

    n = len(segs)
    if cap_s < float("inf"):
      cum = np.cumsum([x.cost_s for x in segs])
      within = int(np.searchsorted(cum, cap_s, side="right"))   # prefixes costing <= cap_s
      if within < n:
        if within == 0 or not fits(within):
          return None
        n = within
    if not fits(n):
      return plan_of(n), sum(x.cost_s for x in segs), n
    if unplanned <= budget_bytes and fits(0):
      return plan_of(0), 0.0, 0
    # The shortest fitting prefix in (lo, hi]: fits(hi), not fits(lo). Each
    # probe interpolates the peak linearly in the bytes dropped between the
    # bracket's ends (regula falsi; the first from the unplanned peak, as if
    # every byte dropped came off the peak), with a bisection whenever a
    # probe leaves more than half the bracket: a prefix's peak falls with its
    # dropped bytes, though by less (ResNet-50: about a third of them).
    lo, hi = 0, n
    if infer:
      lo = max([j for j, p in known.items() if j < n and p > budget_bytes], default=0)
      hi = min([j for j, p in known.items() if lo < j <= n and p <= budget_bytes], default=n)
    # (A bound only inferred has no estimate: taken at the budget.)
    lo_peak = known.get(lo, unplanned if lo == 0 else budget_bytes + 1)
    hi_peak = known.get(hi, budget_bytes)
    halve = False
    while hi - lo > 1:
      if halve or lo_peak <= hi_peak:
        k = (lo + hi) // 2
      else:
        target = dropped[lo] + (lo_peak - budget_bytes) * (
            (dropped[hi] - dropped[lo]) / (lo_peak - hi_peak))
        k = int(np.searchsorted(dropped, target, side="left"))
      k = min(hi - 1, max(lo + 1, k))
      width = hi - lo
      if fits(k):
        hi, hi_peak = k, known.get(k, budget_bytes)
      else:
        lo, lo_peak = k, known.get(k, budget_bytes + 1)
      halve = hi - lo > width // 2       # the probe left most of the bracket
    k = hi
    return plan_of(k), sum(x.cost_s for x in segs[:k]), k

  inferred: list[int] = []
  found = search(infer=True)
  if found is not None and found[0].estimated_peak_bytes > budget_bytes and inferred:
    # (An inference was wrong: a prefix taken for fitting does not.)
    again = search(infer=False)
    if again is None or again[0].estimated_peak_bytes <= budget_bytes:
      found = again
  return found


def _prefix_peaks(program: AnalyzedProgram, segs: list[Segment],
                  pins: tuple[int, ...]) -> dict[int, int]:
  """Estimated peaks of the prefixes of ``segs`` with ``pins`` searched so far, by length.

  Kept per program: the peaks do not depend on the budget (segment plans
  only recompute), so the searches of one program for several budgets
  (selective recomputation's shares of the excess, `fit`'s targets) know
  what the earlier ones estimated.
  """
  memo = program.__dict__.setdefault("_prefix_peaks", {})
  return memo.setdefault((tuple((x.lo, x.hi) for x in segs), pins), {})


def checkpoint_offloads(program: AnalyzedProgram, chosen: list[Segment],
                        taken: set[int], pricer: common.Pricer) -> list[Decision]:
  """Offloads of the chosen segments' checkpoints over their idle stretch before each restore.

  A checkpoint is read by its segment's forward ops, then idle until the
  backward pass reaches the segment and recomputes it from there (its
  restore). The gap is from its last event before that restore (its
  definition, an original use, an earlier restore that read it) to the
  restore; the fetch lands just before the recomputation, which reads the
  fetched copy (:func:`~jaxmem._src.plan.schedule.build_schedule` issues
  fetches before a restore point's recomputation). Values with a remat
  decision of their own (``taken``) are left alone. Largest first, the
  longest gap first among equals.
  """
  restores: dict[int, set[int]] = {}
  for seg in chosen:
    for c in seg.checkpoints:
      restores.setdefault(c, set()).add(seg.restore)
  out = []
  for c, points in restores.items():
    if c in taken:
      continue
    v = program.vars[c]
    events = sorted({v.defined_by, *v.uses, *points})
    for a, b in zip(events, events[1:]):
      if b in points and b - a >= 2:
        out.append(Decision(c, Action.OFFLOAD, a, b, (), v.nbytes,
                            pricer.offload_seconds(v.nbytes)))
  out.sort(key=lambda d: (-d.nbytes, d.start - d.end))
  return out


def _offload_checkpoints(program: AnalyzedProgram, budget_bytes: int, plan: Plan,
                         chosen: list[Segment], device: DeviceLike) -> Plan:
  """``plan`` plus the shortest prefix of :func:`checkpoint_offloads` that fits (or all of it)."""
  cands = checkpoint_offloads(program, chosen, {d.var for d in plan.decisions},
                              common.Pricer(program, device))
  if not cands:
    return plan
  plans: dict[int, Plan] = {}

  def plan_of(k: int) -> Plan:
    if k not in plans:
      plans[k] = common.finish(program, (*plan.decisions, *cands[:k]), budget_bytes,
                               "segments+offload", plan.pinned, copies=plan.copies,
                               window=plan.window).replace(diagnostics=plan.diagnostics)
    return plans[k]

  lo, hi = 1, len(cands)
  if budget_bytes <= 0:
    # A target of nothing asks for the most aggressive plan: every checkpoint
    # staged, whatever the estimate says (`jaxmem.fit` compiles it as its last
    # attempt and keeps it only if the compiled peak is lower). On XLA:TPU the
    # estimate can see no gain where the compiled program has one: the GPT at
    # 0.3 of its peak on a v5e compiled to 373 MiB with its segments
    # recomputed and no offloads, above a plan with checkpoints staged.
    return plan_of(hi)
  if plan_of(hi).estimated_peak_bytes > budget_bytes:
    # Not enough: keep the prefix with the lowest estimate (more copies can
    # raise it, a fetch's buffer arriving next to the recomputation).
    return min((plan_of(hi), plan), key=lambda p: p.estimated_peak_bytes)
  while lo < hi:
    mid = (lo + hi) // 2
    if plan_of(mid).estimated_peak_bytes <= budget_bytes:
      hi = mid
    else:
      lo = mid + 1
  return plan_of(hi)
