"""DQN planner: deep Q-learning over the program's graph of memory operations.

*GPU Memory Management for Deep Neural Networks Using Deep Q-Network* (the DQN
paper of ``docs/design.md``'s bibliography). What it does, section by section:

* §4.2 **the graph**: every memory operation of a candidate value (its write
  at the definition, a read at each use, and a *free* after a read that starts
  an idle stretch) is a node; consecutive nodes in time, and consecutive
  operations of one value, are joined by an edge whose weight is the time lag
  between them (the simulator's op start times, as a fraction of the step).
* §4.4.1 **node states**, eq. (1), ``T = 4`` rounds of a structure2vec
  embedding: ``s_v <- ReLU(W1 x_v + W2 sum_{u in N(v)} s_u + W3 sum_{u in N(v)}
  ReLU(W4 w(u, v)))``, with ``N(v)`` including ``v``. The six features
  ``x_v``: the value's size, the time of its copy to host and back, the time of
  its recomputation, how soon it is read again, the node's action type and
  whether that action is valid in the current state.
* §4.4.2 **graph state**, eq. (2): ``g = [W5 sum_u s_u, W6 s_c]`` with ``c``
  the node under execution; §4.9 **Q values**, eq. (3):
  ``Q(g, s_a) = W7 ReLU([g, W8 s_a])`` for every action node ``a``.
* §4.5 **actions**: swap out (the read node before an idle stretch: the copy
  starts while it is read), remove for recomputation (the free node after
  it) or do nothing (node 0). An idle stretch takes at most one action
  (a value removed cannot be offloaded, and vice versa). Swap-in and
  recomputation timing are not actions: the schedule issues a fetch a window
  ahead of the next read, within the limit, and runs a recomputation just
  before the read.
* §4.6 **transitions**, §4.7 **rewards**, §4.8 **environment**: jaxmem's
  simulator applied one action at a time (:class:`MemoryEnv`). Each action
  moves the agent past its node; the live bytes per op position and the
  step time are those of the plan of the actions taken so far. The paper's
  timing rules are the simulator's (after AutoSwap's stall model): a
  swap-out's bytes are free once its copy is done and the compute stream
  waits for it there (§4.6: no allocation before the offload frees
  memory); a fetch is issued a window ahead of its read, within the limit
  (§4.5). The reward is minus the step time the action added (stalls,
  recomputation), as a fraction of the unplanned step.
* §4.10 **fitted Q-iteration** (Algorithm 1): ε-greedy episodes with
  ``ε = 1 - episode / l``, every transition into an experience-replay set,
  minibatch SGD steps (Adam, optax) on ``(y - Q)^2`` with the target
  ``y = r + γ max_a' Q(g', s_a')`` held constant, after each action.
* Figure 3: the planner returns the best strategy found over the episodes.

Where jaxmem departs from the paper, and why:

* The target of eq. (5) is computed with a copy of the weights renewed every
  50 updates (Mnih et al.'s target network), not with the weights being
  updated, and ``updates_per_step`` (default 4) minibatch steps follow each
  action, not one. With the live weights, the maximum over noisy Q values
  of the next state overestimated doing nothing until it ranked above every
  action on the 6-layer MLP of ``tests/planners/test_dqn.py``.

* An action node's cost features are those of its own action (the copy
  time on a swap-out's node, the recomputation time, companions included,
  on a removal's), the other is 0: with both, the two actions on one value
  differed in their action type alone, and the network priced them alike.
* ``valid`` is -1 on the node of an action taken in the episode (0 where
  an action is neither valid nor taken): with 0 for both, the states after
  removing a value and after swapping it out were the same, and the agent
  could not learn that a swap-out occupies the copy stream for the next one.
* A seventh node feature, ``load``: the estimated live bytes at the node's
  op position minus the limit, as a fraction of the unplanned peak
  (``paper_features=True`` leaves it 0). The paper's six features say
  nothing of where memory is over the limit, which changes with every
  action: the state after an action that fits and after one that does not
  differed only in which node was taken.
* The operation sequence is the analyzed program's (jaxpr ops in XLA's order,
  live bytes from jaxmem's estimate, times from jaxmem's simulator), not a
  trace of a running step: the paper traces one iteration on the GPU; jaxmem
  plans before anything runs, and every planner prices from the same model.
* Nodes with no action are skipped by the agent (their only choice is doing
  nothing, which changes nothing): episodes are as long as the number of
  decision points, not of memory operations.
* Only idle stretches of at least ``min_bytes`` become actions (default:
  0.1% of the estimated peak) that carry a value from the forward to the
  backward pass or last 0.5% of the step, at most ``max_actions`` of them by
  size: the graph and the episodes stay small on programs of thousands of
  ops.
* The paper defines the terminal state only for success (the peak is under
  the limit and nothing more needs to move). An episode that reaches the end
  of the step over the limit ends there too, with a reward of
  ``-fail_penalty * (1 + 10 * excess / peak)``: without it the agent would learn
  nothing from strategies that do not fit, and would not prefer the one
  closest to fitting when the limit cannot be met (each 10% of the peak
  over the limit costs another ``fail_penalty``).
* Mnih et al.'s reward clipping: one action's cost counts at most one step
  (``reward_clip``), so a swap-out over a slow link does not swamp the small
  differences between good plans in the regression.
* The environment recomputes the plan's schedule after each action (memoized
  per set of actions) rather than patching a running memory trace: actions do
  not add up (two recomputations sharing inputs free more together than
  apart, a value XLA fuses keeps its input alive), and a plan the agent is
  rewarded for is the plan :func:`jaxmem.fit` compiles.
* Values XLA fuses away (``1 - tanh(x)`` for tanh's derivative) are no
  buffers, and keep the buffer they read alive: they are not actions, and an
  action on a buffer also recomputes them (:func:`_companions`). Alone,
  removing ``tanh(x)`` of a 6-layer MLP left the peak where it was; with
  them it fits 0.9 of it. (Actions on fused values too, as AutoSwap takes
  them, gave the GPT example 218 actions instead of 66: 404 s instead of
  92 s for 30 episodes at 0.7 of its peak, and still no fitting plan.)
* The paper's ``W`` are untrained at the start of each planning call; here
  trained weights can be passed in (``weights=``), and :func:`train_dqn`
  trains one set of weights over several programs, so a call fine-tunes
  rather than starts from scratch (the transfer the paper claims for its
  graph embedding, §4.4.2).

Where it loses, and why (``bench/results/dqn.md``, ``bench/results/dqn_paper.md``):
the per-value action space itself, not the learning. With every swap-out
action taken, and with every remove action taken, the estimated peak of
ResNet-18 and ResNet-34 (CIFAR-sized, batch 32) stays at 1.04 to 1.06 of the
unplanned one, VGG-16's at 0.86 and 0.77, so budgets of 0.9 (ResNet) and
0.7 (VGG-16) are out of reach whatever the network learns; `auto` fits them
with `segments` (ResNet: whole stretches of the forward pass recomputed,
values XLA fuses included) and AutoSwap (VGG-16 at 0.7: its candidates are
every value live across the peak, fused ones included). Actions on fused
values too did not change that on the GPT example (above).

flax and optax are needed (``pip install "jaxmem[dqn]"``); they are imported
when the planner runs, not when jaxmem is.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.plan.simulate import op_start_times, simulate
from jaxmem._src.planners import common

#: The node features of §4.4.1, in order (``x_v``).
#: ``load`` is jaxmem's seventh (a departure, see the module docstring).
FEATURES = ("size", "copy_time", "recompute_time", "time_to_reuse", "action_type", "valid",
            "load")
#: Node kinds (§4.5): the do-nothing node, a read or write, a free.
NOTHING, ACCESS, FREE = 0, 1, 2
_VALID = FEATURES.index("valid")
_LOAD = FEATURES.index("load")


def _require_flax() -> tuple[Any, Any]:
  try:
    import flax.linen as nn
    import optax
  except ImportError as e:   # pragma: no cover - depends on the environment
    raise ImportError(
        "The `dqn` planner needs flax and optax: `pip install \"jaxmem[dqn]\"` (or "
        "`pip install flax optax`), or pick another planner (`jaxmem.PLANNERS`).") from e
  return nn, optax


# --------------------------------------------------------------------------
# The graph (§4.2) and its candidate actions (§4.5).


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One action of §4.5: swap out or remove one buffer over one idle stretch.

  Attributes:
    decision: what the plan does with the buffer if the action is taken.
    node: the action node that represents it in the graph.
    companions: recomputations of values XLA fuses away that would keep the
      buffer alive (:func:`_companions`), taken with it.
  """
  decision: Decision
  node: int
  companions: tuple[Decision, ...] = ()

  @property
  def decisions(self) -> tuple[Decision, ...]:
    return (self.decision, *self.companions)


@dataclasses.dataclass(frozen=True, eq=False)
class OpGraph:
  """The memory-operation graph of a program (§4.2), with its action nodes.

  Attributes:
    positions: per node, its program position (``-1`` for node 0, the
      do-nothing node).
    kinds: per node, ``NOTHING``, ``ACCESS`` or ``FREE``.
    variables: per node, its value id (``-1`` for node 0).
    features: ``(nodes, 7)`` float32, :data:`FEATURES` (the ``valid`` and
      ``load`` columns are set per state).
    senders, receivers, weights: the edges, both directions; ``weights`` the
      time lag as a fraction of the step time.
    candidates: the actions, in time order.
    action_of_node: per node, its index in ``candidates`` or ``-1``.
    step_seconds: the unplanned step time the times are fractions of.
  """
  positions: np.ndarray
  kinds: np.ndarray
  variables: np.ndarray
  features: np.ndarray
  senders: np.ndarray
  receivers: np.ndarray
  weights: np.ndarray
  candidates: tuple[Candidate, ...]
  action_of_node: np.ndarray
  step_seconds: float

  @property
  def num_nodes(self) -> int:
    return len(self.positions)

  @property
  def num_edges(self) -> int:
    return len(self.senders)


def _companions(program: AnalyzedProgram, gap: common.Gap, pricer: common.Pricer,
                ) -> tuple[Decision, ...] | None:
  """Recomputations of the values XLA fuses away that would keep ``gap.var`` alive over ``gap``.

  A value XLA fuses into its reader (``1 - tanh(x)`` for tanh's derivative)
  is no buffer: its stored input stays alive until that reader runs. The
  paper's variables are buffers, so an action on one covers these values
  too: each is recomputed for its next read after the stretch starts.
  ``None`` when one of them cannot be.
  """
  prof = program.profile
  if prof.virtual is None:
    return ()
  out = []
  for u in program.vars[gap.var].uses:
    for w in program.ops[u].outputs:
      if not prof.virtual[w] or w == gap.var:
        continue
      over = [h for h in common.gaps_of(program, w) if h.start < gap.end and h.end > gap.start]
      for h in over:
        d = common.remat_decision(program, h, pricer)
        if d is None:
          return None
        out.append(d)
  return tuple(out)


def _candidate_decisions(program: AnalyzedProgram, pricer: common.Pricer, min_bytes: int,
                         max_actions: int, times: np.ndarray,
                         ) -> list[tuple[Decision, tuple[Decision, ...]]]:
  """Swap-out and remove actions over the largest idle stretches of stored values.

  A stretch qualifies when it carries a feature map from the forward to the
  backward pass (what §4.5's actions are for) or lasts at least 0.5% of the
  step: shorter ones free their bytes for a few ops only. Values XLA fuses
  away are not buffers: they come with the action on the buffer they keep
  alive (:func:`_companions`).
  """
  min_s = 0.005 * float(times[-1])
  virtual = program.profile.virtual
  gaps = [g for g in common.candidate_gaps(program, min_bytes)
          if (g.forward_to_backward or times[g.end] - times[g.start + 1] >= min_s)
          and not (virtual is not None and virtual[g.var])]
  gaps.sort(key=lambda g: (-g.nbytes, -g.length, g.start, g.var))
  out: list[tuple[Decision, tuple[Decision, ...]]] = []
  for g in gaps:
    if len(out) >= max_actions:
      break
    companions = _companions(program, g, pricer)
    if companions is None:
      companions = ()        # the buffer alone (its fused readers keep it alive longer)
    for d in (common.offload_decision(program, g, pricer), common.remat_decision(program, g, pricer)):
      if d is not None and len(out) < max_actions:
        out.append((d, companions))
  return out


def build_graph(program: AnalyzedProgram, device: DeviceLike = None, *,
                min_bytes: int | None = None, max_actions: int = 256) -> OpGraph:
  """The graph of §4.2 for ``program``, priced on ``device``.

  Args:
    program: a :class:`jaxmem.Program`.
    device: device profile for copy and recompute times.
    min_bytes: smallest idle value that becomes an action (default 0.1% of
      the estimated peak).
    max_actions: most actions (the largest idle stretches first).

  Returns:
    An :class:`OpGraph`.
  """
  dev = device_profile(device)
  pricer = common.Pricer(program, dev)
  peak = max(1, program.profile.peak_bytes)
  if min_bytes is None:
    min_bytes = max(1, peak // 1000)
  times = op_start_times(program, dev)
  step_s = float(times[-1]) or 1.0
  decisions = _candidate_decisions(program, pricer, min_bytes, max_actions, times)
  variables = sorted({d.var for d, _ in decisions})
  recompute_s = {}
  for d, extra in decisions:
    if d.action is Action.REMAT:
      recompute_s.setdefault(d.var, d.cost_s + sum(e.cost_s for e in extra))
  # Nodes: (position, order within the position, kind, var). Reads/writes
  # come before the free that follows them at the same position.
  nodes: list[tuple[int, int, int, int]] = []
  for vid in variables:
    v = program.vars[vid]
    for p in sorted({v.defined_by, *v.uses}):
      nodes.append((p, 0, ACCESS, vid))
  frees = sorted({(d.start, d.var) for d, _ in decisions if d.action is Action.REMAT})
  nodes += [(p, 1, FREE, vid) for p, vid in frees]
  nodes.sort()
  index = {(p, k, vid): i + 1 for i, (p, _, k, vid) in enumerate(nodes)}
  n = len(nodes) + 1
  positions = np.array([-1] + [p for p, *_ in nodes], dtype=np.int64)
  kinds = np.array([NOTHING] + [k for _, _, k, _ in nodes], dtype=np.int32)
  var_of = np.array([-1] + [vid for *_, vid in nodes], dtype=np.int64)
  node_time = np.where(positions >= 0, times[np.maximum(positions, 0)], 0.0)

  candidates: list[Candidate] = []
  action_of_node = np.full(n, -1, dtype=np.int64)
  for d, extra in sorted(decisions, key=lambda de: (de[0].start, de[0].action is Action.REMAT,
                                                    de[0].var)):
    node = index[(d.start, ACCESS if d.action is Action.OFFLOAD else FREE, d.var)]
    action_of_node[node] = len(candidates)
    candidates.append(Candidate(d, node, extra))

  features = np.zeros((n, len(FEATURES)), dtype=np.float32)
  uses = {vid: sorted(program.vars[vid].uses) for vid in variables}
  for i in range(1, n):
    vid, p = int(var_of[i]), int(positions[i])
    v = program.vars[vid]
    later = [u for u in uses[vid] if u > p]
    features[i] = (v.nbytes / peak,
                   pricer.offload_seconds(v.nbytes) / step_s,
                   recompute_s.get(vid, 0.0) / step_s,
                   (times[later[0]] - times[p]) / step_s if later else 0.0,
                   0.0, 0.0, 0.0)
  for c in candidates:
    offload = c.decision.action is Action.OFFLOAD
    features[c.node, FEATURES.index("action_type")] = (1.0 if offload else 2.0) / 2.0
    # An action node carries the cost of its own action only (a departure:
    # with both, a swap-out and a removal of one value differed in their
    # action type alone, and the network priced them alike).
    features[c.node, FEATURES.index("recompute_time" if offload else "copy_time")] = 0.0
    if not offload:
      features[c.node, FEATURES.index("recompute_time")] = sum(
          d.cost_s for d in c.decisions) / step_s

  # Edges: consecutive nodes in time, consecutive operations of one value.
  pairs = [(i, i + 1) for i in range(1, n - 1)]
  last: dict[int, int] = {}
  for i in range(1, n):
    vid = int(var_of[i])
    if vid in last and last[vid] != i - 1:
      pairs.append((last[vid], i))
    last[vid] = i
  src = np.array([a for a, b in pairs] + [b for a, b in pairs], dtype=np.int32)
  dst = np.array([b for a, b in pairs] + [a for a, b in pairs], dtype=np.int32)
  lag = np.abs(node_time[src] - node_time[dst]) / step_s if len(src) else np.zeros(0)
  return OpGraph(positions, kinds, var_of, features, src, dst, lag.astype(np.float32),
                 tuple(candidates), action_of_node, step_s)


def _decisions(graph: OpGraph, chosen: Sequence[int]) -> tuple[Decision, ...]:
  """The plan's decisions for the candidates ``chosen`` (companions once each)."""
  out: dict[tuple[int, int], Decision] = {}
  for i in chosen:
    for d in graph.candidates[i].decisions:
      out.setdefault((d.var, d.start), d)
  return tuple(out.values())


# --------------------------------------------------------------------------
# The environment (§4.6-4.8): one action at a time.


@dataclasses.dataclass
class _State:
  live: np.ndarray            # estimated live bytes per op position
  step_s: float               # simulated step time of the actions taken
  cursor: int                 # the next op position the agent stands at
  used: set[tuple[int, int]]  # (value, gap start) of the stretches acted on
  chosen: list[int]           # candidate indices taken, in order


class MemoryEnv:
  """The environment the agent learns from (§4.6-4.8): jaxmem's simulator, one action at a time.

  The state is the estimated live bytes at every op position and the
  simulated step time of the plan of the actions taken so far, and the op
  position the agent stands at. :meth:`step` takes one action and moves the
  agent on: the schedule of the actions taken
  (:class:`~jaxmem._src.plan.schedule.Schedule`, with the planner's copy
  settings) gives the live bytes, and :func:`jaxmem.simulate` the step time;
  the reward is minus the step time the action added, as a fraction of the
  unplanned step. Both are memoized per set of actions (episodes share
  prefixes). The paper's two timing rules are the simulator's: a swap-out's
  bytes are free only once its copy is done, and the compute stream waits
  for it there (§4.6: no allocation before the offload frees memory); a
  fetch is issued a window ahead of its read, within the limit
  (:func:`~jaxmem._src.plan.schedule.async_copies`, §4.5).

  Args:
    program: the program.
    graph: its :func:`build_graph`.
    budget_bytes: the memory limit.
    device: device profile (op and copy times).
    copies, window: the copy scheduling the plan will have.
    fail_penalty: the reward of an episode that ends over the limit is
      ``-fail_penalty * (1 + 10 * excess / peak)``, ``peak`` the unplanned
      estimate (a departure, see the module).
  """

  def __init__(self, program: AnalyzedProgram, graph: OpGraph, budget_bytes: int,
               device: DeviceLike = None, *, copies: CopyMode = "async", window: Window = None,
               fail_penalty: float = 1.0, reward_clip: float = 1.0):
    self.graph = graph
    self.limit = float(max(0, budget_bytes))
    self.fail_penalty = fail_penalty
    self.reward_clip = reward_clip
    self._program = program
    self._device = device_profile(device)
    self._budget = int(max(0, budget_bytes))
    self._copies = copies
    self._window = common.device_window(device) if window is None and copies == "async" else window
    self._pinned = common.pins(program)
    self._scale = float(max(1, program.profile.peak_bytes))
    self.step_s = graph.step_seconds
    self._memo: dict[frozenset[int], tuple[np.ndarray, float, Plan]] = {}
    # Decision points: positions with an action node, in time order.
    self._points = np.array(sorted({int(graph.positions[c.node]) for c in graph.candidates}),
                            dtype=np.int64)
    self._node_positions = graph.positions[1:]
    self._at: dict[int, list[Candidate]] = {}          # the candidates at each decision point
    for c in graph.candidates:
      self._at.setdefault(int(graph.positions[c.node]), []).append(c)
    self.state = self.reset()

  def evaluate(self, chosen: Sequence[int]) -> tuple[np.ndarray, float, Plan]:
    """Live bytes per op position, simulated step time and plan of the candidates ``chosen``."""
    key = frozenset(chosen)
    found = self._memo.get(key)
    if found is None:
      plan = common.finish(self._program, _decisions(self.graph, sorted(key)), self._budget,
                           "dqn", self._pinned, copies=self._copies, window=self._window)
      live = common.live_by_position(plan.schedule()).astype(np.float64)
      found = self._memo[key] = (live, simulate(plan, self._device).step_time_s, plan)
    return found

  def reset(self) -> _State:
    live, step_s, _ = self.evaluate(())
    self.state = _State(live, step_s, 0, set(), [])
    self._advance()
    return self.state

  # -- what the agent sees

  def point(self) -> int | None:
    """The op position of the current decision, or None when the episode is over."""
    k = int(np.searchsorted(self._points, self.state.cursor))
    return int(self._points[k]) if k < len(self._points) else None

  def _open(self, p: int) -> list[Candidate]:
    used = self.state.used
    return [c for c in self._at.get(p, ()) if (c.decision.var, c.decision.start) not in used]

  def valid_nodes(self) -> np.ndarray:
    """Action nodes valid now (node 0, doing nothing, always is)."""
    p = self.point()
    return np.array([0] + ([c.node for c in self._open(p)] if p is not None else []),
                    dtype=np.int32)

  def current_node(self) -> int:
    """The node under execution (§4.4.2's ``c``): the first node at or after the cursor."""
    k = int(np.searchsorted(self._node_positions, self.state.cursor))
    return k + 1 if k < len(self._node_positions) else 0

  def node_load(self) -> np.ndarray:
    """Per node, live bytes at its position minus the limit, over the unplanned peak (0 for node 0)."""
    out = np.zeros(self.graph.num_nodes, dtype=np.float32)
    out[1:] = (self.state.live[self._node_positions] - self.limit) / self._scale
    return out

  def taken_nodes(self) -> np.ndarray:
    """The action nodes of the actions taken in this episode."""
    return np.array([self.graph.candidates[k].node for k in self.state.chosen], dtype=np.int32)

  def fits(self) -> bool:
    return float(self.state.live.max()) <= self.limit

  # -- transitions

  def _advance(self) -> None:
    """Skips op positions with no valid action (their only choice is doing nothing)."""
    while True:
      p = self.point()
      if p is None or self._open(p):
        return
      self.state.cursor = p + 1

  def step(self, node: int) -> tuple[float, bool]:
    """Takes the action of ``node`` at the current decision point; ``(reward, terminal)``."""
    st = self.state
    p = self.point()
    if p is None:
      return 0.0, True
    reward = 0.0
    if node == 0:
      st.cursor = p + 1
    else:
      k = int(self.graph.action_of_node[node])
      d = self.graph.candidates[k].decision if k >= 0 else None
      if d is None or (d.var, d.start) in st.used or self.graph.positions[node] != p:
        raise ValueError(f"node {node} is not a valid action at position {p}")
      st.used.add((d.var, d.start))
      st.chosen.append(k)
      st.cursor = d.start + 1
      live, step_s, _ = self.evaluate(st.chosen)
      # Mnih et al.'s reward clipping (a departure): one action's cost counts
      # at most one step, so a swap-out on a slow link does not swamp the
      # small differences between good plans in the regression.
      reward = max(-self.reward_clip, -(step_s - st.step_s) / self.step_s)
      st.live, st.step_s = live, step_s
    self._advance()
    if self.fits():
      return reward, True
    if self.point() is None:
      excess = float(st.live.max()) - self.limit
      return reward - self.fail_penalty * (1.0 + 10.0 * excess / self._scale), True
    return reward, False

  def decisions(self) -> tuple[Decision, ...]:
    return _decisions(self.graph, self.state.chosen)


# --------------------------------------------------------------------------
# The Q-network (eqs. 1-3) and its training (§4.10, Algorithm 1).


@dataclasses.dataclass(frozen=True)
class DqnWeights:
  """Trained weights of the Q-network, with its sizes.

  Attributes:
    params: the flax parameters (``W1`` ... ``W8``).
    embed_dim: ``p`` of eq. (1).
    rounds: ``T`` of eq. (1).
  """
  params: Any
  embed_dim: int = 32
  rounds: int = 4

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes the weights (flax msgpack) to ``path``."""
    from flax import serialization
    import jax
    blob = serialization.msgpack_serialize({
        "format": "jaxmem.dqn/1", "embed_dim": self.embed_dim, "rounds": self.rounds,
        "params": jax.tree_util.tree_map(np.asarray, self.params)})
    with open(path, "wb") as f:
      f.write(blob)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> DqnWeights:
    """Reads weights written by :meth:`save`."""
    from flax import serialization
    with open(path, "rb") as f:
      state = serialization.msgpack_restore(f.read())
    if not isinstance(state, dict) or state.get("format") != "jaxmem.dqn/1":
      raise ValueError(f"`DqnWeights.load`: {os.fspath(path)!r} is not a file written by "
                       "`DqnWeights.save` (format 'jaxmem.dqn/1').")
    return cls(state["params"], int(state["embed_dim"]), int(state["rounds"]))


def _q_network(embed_dim: int, rounds: int):
  nn, _ = _require_flax()
  import jax
  import jax.numpy as jnp

  class QNetwork(nn.Module):
    """Eqs. (1)-(3): structure2vec node states, graph state, Q per node."""

    @nn.compact
    def __call__(self, x, senders, receivers, weights, current):
      p = embed_dim
      n = x.shape[0]
      w1 = nn.Dense(p, use_bias=False, name="W1")
      w2 = nn.Dense(p, use_bias=False, name="W2")
      w3 = nn.Dense(p, use_bias=False, name="W3")
      w4 = nn.Dense(p, use_bias=False, name="W4")
      # sum_{u in N(v)} ReLU(W4 w(u, v)): the state does not enter it, so it
      # is the same in every round (u = v adds ReLU(W4 0) = 0).
      edge = jax.ops.segment_sum(jax.nn.relu(w4(weights[:, None])), receivers, n)
      local = w1(x) + w3(edge)
      s = jnp.zeros((n, p), x.dtype)
      for _ in range(rounds):
        neighbours = jax.ops.segment_sum(s[senders], receivers, n) + s
        s = jax.nn.relu(local + w2(neighbours))
      g = jnp.concatenate([nn.Dense(p, use_bias=False, name="W5")(s.sum(0)),
                           nn.Dense(p, use_bias=False, name="W6")(s[current])])
      sa = nn.Dense(p, use_bias=False, name="W8")(s)
      h = jax.nn.relu(jnp.concatenate([jnp.broadcast_to(g, (n, 2 * p)), sa], axis=1))
      return nn.Dense(1, use_bias=False, name="W7")(h)[:, 0]

  return QNetwork()


@dataclasses.dataclass(frozen=True)
class DqnDiagnostics:
  """What a :func:`dqn` call did (on its plan's ``diagnostics``).

  Attributes:
    nodes, edges, actions: the graph's size.
    episodes: episodes run (Algorithm 1's ``l``), plus the final greedy one.
    returns: each episode's return (sum of rewards).
    episode_fits: per episode, whether its plan's estimate fits the budget.
    episode_overheads: per episode, its plan's simulated overhead.
    best_episode: the episode whose plan is returned.
    sgd_steps: minibatch updates made.
    train_seconds: time spent in episodes and updates (planning included).
    pretrained: whether the call started from given weights.
  """
  nodes: int
  edges: int
  actions: int
  episodes: int
  returns: tuple[float, ...]
  episode_fits: tuple[bool, ...]
  episode_overheads: tuple[float, ...]
  best_episode: int
  sgd_steps: int
  train_seconds: float
  pretrained: bool
  weights: DqnWeights | None = dataclasses.field(default=None, repr=False)


class _Agent:
  """Q-network, its optimizer and the replay set, for one graph at a time."""

  def __init__(self, weights: DqnWeights | None, *, embed_dim: int, rounds: int, seed: int,
               learning_rate: float, gamma: float, batch_size: int, replay_size: int,
               use_load: bool = True, updates_per_step: int = 1, target_every: int = 50):
    _, optax = _require_flax()
    import jax
    import jax.numpy as jnp
    if weights is not None:
      embed_dim, rounds = weights.embed_dim, weights.rounds
    self.embed_dim, self.rounds = embed_dim, rounds
    self.use_load = use_load
    self.updates_per_step = updates_per_step
    self.net = _q_network(embed_dim, rounds)
    self.rng = np.random.default_rng(seed)
    self.gamma, self.batch_size = gamma, batch_size
    self.tx = optax.adam(learning_rate)
    dummy = (jnp.zeros((2, len(FEATURES))), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
             jnp.zeros(1), 0)
    if weights is None:
      self.params = self.net.init(jax.random.PRNGKey(seed), *dummy)
    else:
      self.params = jax.tree_util.tree_map(jnp.asarray, weights.params)
    self.opt_state = self.tx.init(self.params)
    # The target of eq. (5) is computed with a copy of the weights renewed
    # every `target_every` updates (a departure: see `dqn`).
    self.target = self.params
    self.target_every = target_every
    self.replay_size = replay_size
    self.sgd_steps = 0
    net, tx = self.net, self.tx

    def q_values(params, x, senders, receivers, weights, current):
      return net.apply(params, x, senders, receivers, weights, current)

    def loss(params, target, batch, senders, receivers, weights):
      x, cur, act, r, x2, cur2, mask2, done = batch

      def one(x, cur, act, r, x2, cur2, mask2, done):
        q = q_values(params, x, senders, receivers, weights, cur)[act]
        q2 = q_values(target, x2, senders, receivers, weights, cur2)
        best = jnp.max(jnp.where(mask2, q2, -jnp.inf))
        y = r + jnp.where(done, 0.0, gamma * best)     # eq. (5), terminal Q = 0
        return (jax.lax.stop_gradient(y) - q) ** 2      # eq. (4)
      return jnp.mean(jax.vmap(one)(x, cur, act, r, x2, cur2, mask2, done))

    def update(params, target, opt_state, batch, senders, receivers, weights):
      grads = jax.grad(loss)(params, target, batch, senders, receivers, weights)
      updates, opt_state = tx.update(grads, opt_state, params)
      return jax.tree_util.tree_map(lambda p, u: p + u, params, updates), opt_state

    self._q = jax.jit(q_values)
    self._update = jax.jit(update)

  def weights(self) -> DqnWeights:
    import jax
    return DqnWeights(jax.tree_util.tree_map(np.asarray, self.params), self.embed_dim,
                      self.rounds)

  def run(self, env: MemoryEnv, episodes: int, *, greedy_last: bool = True,
          on_episode: Any = None) -> None:
    """Algorithm 1 on one environment; ``on_episode(index, return)`` after each episode."""
    import jax.numpy as jnp
    g = env.graph
    senders, receivers = jnp.asarray(g.senders), jnp.asarray(g.receivers)
    weights = jnp.asarray(g.weights)
    n = g.num_nodes
    cap = self.replay_size
    # What changes in x: validity (1 valid, -1 taken, 0 neither) and load.
    xs = np.zeros((cap, n), dtype=np.int8)
    ld = np.zeros((cap, n), dtype=np.float32)
    ld2 = np.zeros((cap, n), dtype=np.float32)
    cur = np.zeros(cap, dtype=np.int32)
    act = np.zeros(cap, dtype=np.int32)
    rew = np.zeros(cap, dtype=np.float32)
    xs2 = np.zeros((cap, n), dtype=np.int8)
    cur2 = np.zeros(cap, dtype=np.int32)
    done = np.zeros(cap, dtype=bool)
    stored = 0
    base = g.features

    def validity(valid: np.ndarray) -> np.ndarray:
      out = np.zeros(n, dtype=np.int8)
      out[env.taken_nodes()] = -1
      out[valid] = 1
      return out

    def feats(mask: np.ndarray, load: np.ndarray) -> np.ndarray:
      x = np.broadcast_to(base, mask.shape + base.shape[1:]).copy()
      x[..., _VALID] = mask
      if self.use_load:
        x[..., _LOAD] = load
      return x

    total = episodes + (1 if greedy_last else 0)
    for episode in range(1, total + 1):
      env.reset()
      greedy = episode > episodes
      ret = 0.0
      while env.point() is not None:
        valid = env.valid_nodes()
        mask = validity(valid)
        c = env.current_node()
        load = env.node_load()
        # Algorithm 1 line 7: explore while e > episode / l.
        if not greedy and self.rng.random() > episode / episodes:
          a = int(self.rng.choice(valid))
        else:
          q = np.asarray(self._q(self.params, jnp.asarray(feats(mask, load)), senders,
                                 receivers, weights, c))
          a = int(valid[int(np.argmax(q[valid]))])
        r, terminal = env.step(a)
        ret += r
        if not greedy:
          k = stored % cap
          xs[k], ld[k], cur[k], act[k], rew[k] = mask, load, c, a, r
          ld2[k] = env.node_load()
          xs2[k] = validity(env.valid_nodes() if not terminal else np.array([0], np.int32))
          cur2[k], done[k] = env.current_node(), terminal
          stored += 1
          for _ in range(self.updates_per_step if stored >= self.batch_size else 0):
            pick = self.rng.integers(0, min(stored, cap), self.batch_size)
            batch = (jnp.asarray(feats(xs[pick], ld[pick])), jnp.asarray(cur[pick]),
                     jnp.asarray(act[pick]), jnp.asarray(rew[pick]),
                     jnp.asarray(feats(xs2[pick], ld2[pick])),
                     jnp.asarray(cur2[pick]), jnp.asarray(xs2[pick] > 0),
                     jnp.asarray(done[pick]))
            self.params, self.opt_state = self._update(self.params, self.target, self.opt_state,
                                                       batch, senders, receivers, weights)
            self.sgd_steps += 1
            if not self.target_every or self.sgd_steps % self.target_every == 0:
              self.target = self.params
        if terminal:
          break
      if on_episode is not None:
        on_episode(episode, ret, env)


@common.never_worse_than_none
def dqn(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
        copies: CopyMode = "async", window: Window = None, episodes: int = 30,
        weights: DqnWeights | str | os.PathLike[str] | None = None, seed: int = 0,
        embed_dim: int = 32, rounds: int = 4, learning_rate: float = 1e-3, gamma: float = 0.99,
        batch_size: int = 16, replay_size: int = 20000, min_bytes: int | None = None,
        max_actions: int = 256, updates_per_step: int = 4, fail_penalty: float = 1.0,
        reward_clip: float = 1.0,
        paper_features: bool = False,
        progress: bool = False) -> Plan:
  """The DQN paper's planner: swap-out and remove actions chosen by a deep Q-network.

  Trains the Q-network on ``program`` for ``episodes`` episodes (Algorithm 1;
  starting from ``weights`` when given: fine-tuning), then runs it greedily
  once, and returns the plan of the best episode: the fastest simulated one
  whose estimate fits ``budget_bytes``, else the one with the lowest estimated
  peak.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: the memory limit (target estimated peak).
    device: device profile for times (default: the backend's).
    copies, window: copy scheduling of the plan (default: asynchronous, the
      device's window), as for every planner.
    episodes: training episodes (Algorithm 1's ``l``); 0 with ``weights``
      runs the trained network once.
    weights: a :class:`DqnWeights` (or a path to one saved with
      :meth:`DqnWeights.save`) to start from, e.g. from :func:`train_dqn`.
    seed: seeds the initial weights, exploration and replay sampling.
    embed_dim, rounds: ``p`` and ``T`` of eq. (1) (ignored with ``weights``).
    learning_rate, gamma, batch_size, replay_size: fitted Q-iteration's
      Adam step, decay factor ``γ``, minibatch and replay-set sizes.
    min_bytes, max_actions: which idle stretches become actions
      (:func:`build_graph`).
    reward_clip: an action's reward is at least ``-reward_clip``.
    fail_penalty: an episode that ends over the limit is rewarded
      ``-fail_penalty * (1 + 10 * excess / peak)`` (:class:`MemoryEnv`).
    updates_per_step: minibatch updates after each action (Algorithm 1
      makes one; more learn more from the same episodes, for their time).
    paper_features: only the paper's six node features (the ``load``
      feature stays 0).
    progress: print a line per episode on stderr.

  Returns:
    A :class:`jaxmem.Plan` named ``dqn``; its diagnostics hold a
    :class:`DqnDiagnostics` (with the trained weights).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def loss(w, x):
    ...   for _ in range(4):
    ...     x = jnp.tanh(x @ w)
    ...   return x.sum()
    >>> prog = jaxmem.analyze(jax.grad(loss), jnp.eye(256), jnp.ones((512, 256)))
    >>> plan = jaxmem.get_planner("dqn")(prog, int(0.8 * prog.peak_bytes), "h100-pcie",
    ...                                   episodes=4)
    >>> plan.planner
    'dqn'
  """
  if episodes < 0:
    raise ValueError(f"`dqn`: `episodes`={episodes!r} must be >= 0.")
  if episodes == 0 and weights is None:
    raise ValueError("`dqn`: `episodes=0` runs a trained network, so it needs `weights=` "
                     "(a `DqnWeights` or a path written by `DqnWeights.save`).")
  if isinstance(weights, (str, os.PathLike)):
    weights = DqnWeights.load(weights)
  if window is None and copies == "async":
    window = common.device_window(device)
  t0 = time.perf_counter()
  graph = build_graph(program, device, min_bytes=min_bytes, max_actions=max_actions)
  env = MemoryEnv(program, graph, budget_bytes, device, copies=copies, window=window,
                  fail_penalty=fail_penalty, reward_clip=reward_clip)
  agent = _Agent(weights, embed_dim=embed_dim, rounds=rounds, seed=seed,
                 learning_rate=learning_rate, gamma=gamma, batch_size=batch_size,
                 replay_size=replay_size, use_load=not paper_features,
                 updates_per_step=updates_per_step)
  returns, fits, overheads = [], [], []
  plans: list[Plan] = []

  def on_episode(index: int, ret: float, env: MemoryEnv) -> None:
    _, step_s, plan = env.evaluate(env.state.chosen)
    plans.append(plan)
    returns.append(ret)
    fits.append(plan.estimated_peak_bytes <= budget_bytes)
    overheads.append(step_s / env.step_s - 1.0)   # env.step_s: the unplanned step
    if progress:
      print(f"[jaxmem] dqn: episode {index}/{episodes + 1}: return {ret:+.3f}, "
            f"{len(env.state.chosen)} actions, estimated peak "
            f"{plan.estimated_peak_bytes / 2**20:.1f} MiB ({'fits' if fits[-1] else 'over'}), "
            f"overhead {overheads[-1]:+.1%}", file=sys.stderr, flush=True)

  agent.run(env, episodes, on_episode=on_episode)
  # Figure 3: the best strategy found. Fitting plans by simulated overhead,
  # the others by estimated peak; ties to the earlier episode.
  best_index = min(range(len(plans)), key=lambda i: (
      not fits[i], overheads[i] if fits[i] else plans[i].estimated_peak_bytes, i))
  best = plans[best_index]
  diag = DqnDiagnostics(graph.num_nodes, graph.num_edges, len(graph.candidates), len(returns),
                        tuple(returns), tuple(fits), tuple(overheads), best_index + 1,
                        agent.sgd_steps, time.perf_counter() - t0, weights is not None,
                        agent.weights())
  return best.replace(planner="dqn", diagnostics=(diag,))


def train_dqn(programs: Sequence[AnalyzedProgram], budgets: Sequence[int | float],
              device: DeviceLike = None, *, episodes: int = 30,
              weights: DqnWeights | None = None, seed: int = 0, progress: bool = False,
              **options: Any) -> DqnWeights:
  """Trains one set of Q-network weights over several programs, in order.

  The paper's transfer (§4.4.2): the graph state sums over the nodes, so
  weights trained on small programs start the planning of larger ones
  (``dqn(..., weights=...)``, fewer episodes there).

  Args:
    programs: the programs to train on.
    budgets: per program, a budget in bytes (``int``) or a fraction of its
      estimated peak (``float``).
    device: device profile.
    episodes: episodes per program.
    weights: weights to start from.
    seed: seeds each program's run (``seed + index``).
    progress: a line per program on stderr.
    **options: further :func:`dqn` options.

  Returns:
    The trained :class:`DqnWeights` (save them with :meth:`DqnWeights.save`).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def loss(w, x):
    ...   for _ in range(3):
    ...     x = jnp.tanh(x @ w)
    ...   return x.sum()
    >>> prog = jaxmem.analyze(jax.grad(loss), jnp.eye(128), jnp.ones((256, 128)))
    >>> w = jaxmem.train_dqn([prog], [0.8], "h100-pcie", episodes=2)
    >>> w.embed_dim
    32
  """
  if len(programs) != len(budgets):
    raise ValueError(f"`train_dqn`: {len(programs)} programs but {len(budgets)} budgets; "
                     "pass one budget per program.")
  if episodes < 1:
    raise ValueError(f"`train_dqn`: `episodes`={episodes!r} must be >= 1.")
  for i, (program, budget) in enumerate(zip(programs, budgets)):
    nbytes = int(budget * program.peak_bytes) if isinstance(budget, float) else int(budget)
    t = time.perf_counter()
    plan = dqn(program, nbytes, device, episodes=episodes, weights=weights, seed=seed + i,
               **options)
    weights = plan.diagnostic(DqnDiagnostics).weights
    if progress:
      print(f"[jaxmem] train_dqn: program {i + 1}/{len(programs)} ({program.num_ops} ops): "
            f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
  assert weights is not None
  return weights


__all__ = ["Candidate", "DqnDiagnostics", "DqnWeights", "MemoryEnv", "OpGraph", "build_graph",
           "dqn", "train_dqn"]
