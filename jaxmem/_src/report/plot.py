"""Plots: estimated live memory over program order, stacked by role.

``plot_program`` draws what :meth:`Program.report` prints as a picture: the
bytes live at every program position, split by :class:`~jaxmem._src.ir.program.Role`,
the peak and the op that makes it, the forward / backward / other phases, an
optional budget line and, given a plan, the planned estimate on the same axis.

matplotlib is an optional dependency (``pip install 'jaxmem[plot]'``); it is
imported only when a plot is drawn, with the Agg backend (no display needed).
The helpers here that need no matplotlib (role stacks, units, schedule
positions) are shared with :mod:`jaxmem._src.report.html_page`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType, ModuleType

import numpy as np

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.ir.program import Phase, Role
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import Schedule

# Stacking order (bottom to top) and colours, shared with the HTML report.
ROLES: tuple[Role, ...] = (Role.PARAMETER, Role.OPTIMIZER_STATE, Role.INPUT, Role.CONSTANT,
                           Role.ACTIVATION, Role.GRADIENT, Role.TEMPORARY, Role.OUTPUT)
ROLE_COLORS: Mapping[Role, str] = MappingProxyType({
    Role.PARAMETER: "#4C72B0",
    Role.OPTIMIZER_STATE: "#8172B3",
    Role.INPUT: "#937860",
    Role.CONSTANT: "#8C8C8C",
    Role.ACTIVATION: "#DD8452",
    Role.GRADIENT: "#55A868",
    Role.TEMPORARY: "#CCB974",
    Role.OUTPUT: "#64B5CD",
})
ROLE_LABELS: Mapping[Role, str] = MappingProxyType({
    Role.PARAMETER: "parameter",
    Role.OPTIMIZER_STATE: "optimizer_state",
    Role.INPUT: "input (batch, labels, rng)",
    Role.CONSTANT: "constant",
    Role.ACTIVATION: "activation (saved for backward)",
    Role.GRADIENT: "gradient",
    Role.TEMPORARY: "temporary",
    Role.OUTPUT: "output (new params, loss)",
})
# The stacked rows of :func:`role_stacks`: the roles, then what is not a jaxpr value.
HIDDEN_KEY = "xla_temporaries"
HIDDEN_COLOR = "#D98FB0"
HIDDEN_LABEL = "XLA temporaries (stored broadcasts, layout copies, loop bodies)"
STACK_KEYS: tuple[str, ...] = tuple(r.value for r in ROLES) + (HIDDEN_KEY,)
STACK_COLORS: tuple[str, ...] = tuple(ROLE_COLORS[r] for r in ROLES) + (HIDDEN_COLOR,)
STACK_LABELS: tuple[str, ...] = tuple(ROLE_LABELS[r] for r in ROLES) + (HIDDEN_LABEL,)
PHASE_COLORS: Mapping[Phase, str] = MappingProxyType({
    Phase.FORWARD: "#DCEBF7",
    Phase.BACKWARD: "#FBE3DC",
    Phase.OTHER: "#ECECEC",
})
PLAN_COLOR = "#111111"
BUDGET_COLOR = "#C0392B"
TARGET_COLOR = "#7F8C8D"

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _require_matplotlib() -> ModuleType:
  try:
    import matplotlib
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("jaxmem plots need matplotlib: pip install 'jaxmem[plot]'") from e
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt
  return plt


def axis_unit(max_bytes: float) -> tuple[str, int]:
  """The binary unit an axis reaching ``max_bytes`` reads best in."""
  for name, scale in _UNITS:
    if max_bytes >= scale:
      return name, scale
  return "B", 1


def role_stacks(program: AnalyzedProgram) -> np.ndarray:
  """Live bytes by category: array ``[len(ROLES) + 1, num_ops + 1]`` (last column: the exit).

  Rows follow :data:`ROLES`, using the profile's estimated intervals (a value
  XLA fuses away stores nothing; its inputs live until its last use). The last
  row holds what the estimate counts that is not a jaxpr value: XLA's own
  temporaries (layout copies, stored broadcasts, expansions) and opaque blocks' inner working
  sets. Columns sum to ``program.profile.live_bytes``.
  """
  prof = program.profile
  n = program.num_ops
  ivs = getattr(prof, "intervals", None)
  virtual = getattr(prof, "virtual", None)
  row = {r: i for i, r in enumerate(ROLES)}
  diff = np.zeros((len(ROLES), n + 2), dtype=np.int64)
  rows, starts, ends, sizes = [], [], [], []
  for v in program.vars:
    if not v.nbytes or (virtual is not None and virtual[v.id]):
      continue
    s, e = ivs[v.id] if ivs is not None else program.interval(v.id)
    if s < 0:
      continue
    rows.append(row[v.role])
    starts.append(min(s, n))
    ends.append(min(max(s, e), n))
    sizes.append(v.nbytes)
  if rows:
    r = np.asarray(rows)
    b = np.asarray(sizes, dtype=np.int64)
    np.add.at(diff, (r, np.asarray(starts)), b)
    np.add.at(diff, (r, np.asarray(ends) + 1), -b)
  stacks = np.cumsum(diff[:, :-1], axis=1)
  hidden = np.maximum(np.asarray(prof.live_bytes, dtype=np.int64) - stacks.sum(axis=0), 0)
  return np.vstack([stacks, hidden[None, :]])


def schedule_positions(schedule: Schedule) -> np.ndarray:
  """Program-order x positions of a schedule's steps plus its exit (``num_ops``).

  Steps inserted at the same anchor (a fetch, the fences and the recomputed
  chain before one op) are spread evenly over the room up to the next anchor
  (at most half a position), so a recomputation's own peak stays visible.
  """
  anchors = [float(st.anchor) for st in schedule.steps] + [float(schedule.program.num_ops)]
  xs = np.asarray(anchors, dtype=np.float64)
  i = 0
  n = len(anchors)
  while i < n - 1:
    j = i
    while j + 1 < n - 1 and anchors[j + 1] == anchors[i]:
      j += 1
    k = j - i + 1
    if k > 1:
      room = min(0.5, anchors[j + 1] - anchors[i]) if j + 1 < n else 0.5
      xs[i:j + 1] = anchors[i] + room * np.arange(k) / k
    i = j + 1
  return xs


def phase_runs(program: AnalyzedProgram) -> list[tuple[Phase, int, int]]:
  """Maximal runs ``(phase, first op, last op)`` of equal :attr:`Op.phase`."""
  runs: list[tuple[Phase, int, int]] = []
  for op in program.ops:
    if runs and runs[-1][0] is op.phase and runs[-1][2] == op.index - 1:
      runs[-1] = (op.phase, runs[-1][1], op.index)
    else:
      runs.append((op.phase, op.index, op.index))
  return runs


def short_source(source: str) -> str:
  """``/a/b/model.py:25`` -> ``model.py:25``."""
  return os.path.basename(source) if source else "?"


def describe_position(program: AnalyzedProgram, index: int) -> str:
  """``op 93 `select_n` (mlp.py:25, MLP)`` or ``the step's exit``."""
  if index >= program.num_ops:
    return "the step's exit"
  op = program.ops[index]
  where = short_source(op.source)
  mod = op.module_path
  return f"op {index} `{op.primitive}` ({where}{', ' + mod if mod else ''})"


def plot_program(program: AnalyzedProgram, path: str | os.PathLike[str], *, budget_bytes: int | None = None,
                 plan: Plan | None = None, title: str | None = None) -> str:
  """Writes a PNG of estimated live bytes over program order, stacked by role.

  Args:
    program: a :class:`jaxmem.Program` (``jaxmem.analyze(step, *args)``).
    path: where to write the PNG.
    budget_bytes: draws a horizontal budget line.
    plan: a :class:`jaxmem.Plan` for ``program``; its estimate
      (``plan.schedule().profile()``) is drawn as a line, with schedule steps
      placed at their program position (:attr:`Step.anchor`).
    title: figure title (default: ops, values and peak).

  Returns:
    ``path`` as a string.

  Raises:
    ImportError: matplotlib is not installed (``pip install 'jaxmem[plot]'``).
  """
  plt = _require_matplotlib()
  from matplotlib.patches import Patch
  from matplotlib.ticker import MaxNLocator
  from matplotlib.transforms import blended_transform_factory

  prof = program.profile
  n = program.num_ops
  stacks = role_stacks(program)
  planned = None
  if plan is not None:
    schedule = plan.schedule()
    planned = (schedule_positions(schedule), schedule.profile())

  top = max([prof.peak_bytes, budget_bytes or 0,
             planned[1].peak_bytes if planned else 0, 1])
  unit, scale = axis_unit(top)

  fig, ax = plt.subplots(figsize=(13, 6.5), dpi=110)
  try:
    # Phases: light background bands.
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    seen_phases: list[Phase] = []
    for phase, a, b in phase_runs(program):
      ax.axvspan(a, b + 1, color=PHASE_COLORS[phase], alpha=0.7, lw=0, zorder=0)
      if phase not in seen_phases:
        seen_phases.append(phase)
      if (b + 1 - a) >= 0.06 * max(1, n):
        ax.text((a + b + 1) / 2, 0.985, phase.value, transform=trans, ha="center", va="top",
                fontsize=9, color="#555555", style="italic", zorder=1)

    # Stacked roles (each position drawn as a unit-wide step; the exit too).
    x = np.arange(n + 2)
    keep = [i for i in range(len(STACK_KEYS)) if stacks[i].any()]
    ys = [np.append(stacks[i], stacks[i][-1]) / scale for i in keep]
    labels = []
    for i in keep:
      at_peak = stacks[i][prof.peak_index]
      labels.append(f"{STACK_LABELS[i]}: {format_bytes(at_peak)} at peak")
    if ys:
      polys = ax.stackplot(x, *ys, labels=labels, colors=[STACK_COLORS[i] for i in keep],
                           step="post", alpha=0.9, lw=0, zorder=2)
      for i, poly in zip(keep, polys):
        if STACK_KEYS[i] == HIDDEN_KEY:
          poly.set_hatch("///")
          poly.set_edgecolor("#8E4B6E")

    # Peak.
    p = prof.peak_index
    peak_y = prof.peak_bytes / scale
    ax.plot([p + 0.5], [peak_y], marker="v", color="black", ms=8, zorder=5)
    left = p > 0.6 * n
    ax.annotate(f"estimated peak {format_bytes(prof.peak_bytes)}\nat {describe_position(program, p)}",
                xy=(p + 0.5, peak_y), xytext=(-20 if left else 20, 28), textcoords="offset points",
                ha="right" if left else "left", va="bottom", fontsize=9.5, zorder=6,
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#333333", alpha=0.92),
                arrowprops=dict(arrowstyle="->", color="#333333"))

    # Budget and plan.
    if budget_bytes is not None:
      ax.axhline(budget_bytes / scale, color=BUDGET_COLOR, ls="--", lw=1.6, zorder=4,
                 label=f"budget: {format_bytes(budget_bytes)}")
    if planned is not None:
      px, pprof = planned
      py = np.append(pprof.live_bytes, pprof.live_bytes[-1]) / scale
      px = np.append(px, float(n + 1))
      ax.plot(px, py, drawstyle="steps-post", color=PLAN_COLOR, lw=1.3, zorder=4,
              label=(f"planned estimate ({plan.planner}: {plan.num_remat} remat, "
                     f"{plan.num_offload} offload): peak {format_bytes(pprof.peak_bytes)}"))
      ppos = float(px[pprof.peak_index])
      ax.plot([ppos], [pprof.peak_bytes / scale], marker="o", color=PLAN_COLOR, ms=5, zorder=5)
      ax.annotate(f"planned peak {format_bytes(pprof.peak_bytes)}",
                  xy=(ppos, pprof.peak_bytes / scale), xytext=(0, -30), textcoords="offset points",
                  ha="center", va="top", fontsize=9, zorder=6,
                  bbox=dict(boxstyle="round,pad=0.25", fc="white", ec=PLAN_COLOR, alpha=0.85),
                  arrowprops=dict(arrowstyle="->", color=PLAN_COLOR))
      target = getattr(plan, "target_bytes", None)
      if target and target != budget_bytes:
        ax.axhline(target / scale, color=TARGET_COLOR, ls=":", lw=1.4, zorder=3,
                   label=f"planner target: {format_bytes(target)}")

    ax.set_xlim(0, n + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.set_ylim(0, top / scale * 1.28)
    ax.set_xlabel(f"program position (op index in program order; {n} = step exit)")
    ax.set_ylabel(f"live bytes ({unit})")
    ax.grid(axis="y", color="white", lw=0.8, alpha=0.8, zorder=1)
    ax.set_axisbelow(False)
    if title is None:
      title = (f"Estimated live memory: {n} ops, {len(program.vars)} values, "
               f"peak {format_bytes(prof.peak_bytes)}")
    ax.set_title(title, fontsize=12.5)

    handles, hlabels = ax.get_legend_handles_labels()
    # Stack order top-down in the legend matches the picture.
    nroles = len(keep)
    role_h, role_l = handles[:nroles][::-1], hlabels[:nroles][::-1]
    other_h, other_l = handles[nroles:], hlabels[nroles:]
    phase_h = [Patch(color=PHASE_COLORS[ph], label=f"{ph.value} phase (background)")
               for ph in seen_phases]
    ax.legend(other_h + role_h + phase_h, other_l + role_l + [h.get_label() for h in phase_h],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False,
              title="live at each position, by role", title_fontsize=9.5, alignment="left")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
  finally:
    plt.close(fig)
  return os.fspath(path)


def program_plot_png(program: AnalyzedProgram, *, budget_bytes: int | None = None, plan: Plan | None = None,
                     title: str | None = None) -> bytes:
  """:func:`plot_program` into memory: the PNG bytes."""
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "plot.png")
    plot_program(program, out, budget_bytes=budget_bytes, plan=plan, title=title)
    with open(out, "rb") as f:
      return f.read()


__all__: Sequence[str] = ("plot_program",)
