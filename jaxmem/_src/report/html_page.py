"""HTML report: one self-contained page with the lifetime report, a chart and the plan.

The page has no external resources (no scripts, styles, fonts or images from
the network): the chart is the PNG of :func:`jaxmem._src.report.plot.plot_program`
embedded as base64 when matplotlib is installed, otherwise an inline SVG drawn
here; the tables sort on a click through a few lines of inline JavaScript.
Every piece of text that comes from the program (names, sources, types) is
escaped.
"""

from __future__ import annotations

import base64
import html
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.ir.program import Role
from jaxmem._src.plan.plan import Plan
from jaxmem._src.report import plot as _plot
from jaxmem._src.report.text import stored_broadcasts_at

_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1280px;padding:0 16px;color:#222;line-height:1.4}
h1{font-size:1.5em;margin-bottom:4px}h2{font-size:1.15em;margin-top:28px;border-bottom:1px solid #ddd;
padding-bottom:3px}
.sub{color:#666;margin-top:0}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6;cursor:pointer;user-select:none;white-space:nowrap}
th[data-dir=asc]::after{content:" \\25B2"}th[data-dir=desc]::after{content:" \\25BC"}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.src{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;word-break:break-all}
td.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;white-space:nowrap}
tr:nth-child(even) td{background:#fafafa}
table.kv th{background:none;cursor:default;font-weight:600;border:none;padding:2px 14px 2px 0}
table.kv td{border:none;padding:2px 0;background:none!important}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;
vertical-align:-1px}
.legend span.item{margin-right:16px;white-space:nowrap;font-size:13px}
.chart img,.chart svg{max-width:100%;height:auto;border:1px solid #eee}
.over{color:#b03a2e;font-weight:600}.under{color:#1e8449;font-weight:600}
.note{color:#666;font-size:12px}
.bar{display:inline-block;height:9px;background:#9db4d3;vertical-align:middle;margin-left:6px}
"""

_JS = """
(function(){
  function val(c){var v=c.getAttribute('data-v');return v===null?c.textContent.trim():v;}
  document.querySelectorAll('table.sortable th').forEach(function(th){
    th.addEventListener('click',function(){
      var t=th.closest('table'),b=t.tBodies[0],i=Array.prototype.indexOf.call(th.parentNode.children,th);
      var asc=th.getAttribute('data-dir')!=='asc';
      t.querySelectorAll('th').forEach(function(h){h.removeAttribute('data-dir');});
      th.setAttribute('data-dir',asc?'asc':'desc');
      var rows=Array.prototype.slice.call(b.rows);
      rows.sort(function(a,c){
        var x=val(a.cells[i]),y=val(c.cells[i]),nx=parseFloat(x),ny=parseFloat(y);
        var r=(!isNaN(nx)&&!isNaN(ny)&&isFinite(x)&&isFinite(y))?nx-ny:x.localeCompare(y);
        return asc?r:-r;});
      rows.forEach(function(r){b.appendChild(r);});
    });
  });
})();
"""


def _e(x: object) -> str:
  return html.escape(str(x), quote=True)


def _td(text: object, cls: str = "", sort: float | str | None = None, raw: bool = False) -> str:
  attrs = f' class="{cls}"' if cls else ""
  if sort is not None:
    attrs += f' data-v="{_e(sort)}"'
  return f"<td{attrs}>{text if raw else _e(text)}</td>"


def _table(headers: Sequence[tuple[str, str]], rows: Iterable[str], sortable: bool = True) -> str:
  head = "".join(f'<th class="{c}">{_e(h)}</th>' if c else f"<th>{_e(h)}</th>" for h, c in headers)
  cls = ' class="sortable"' if sortable else ""
  return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _pct(part: float, whole: float) -> str:
  return f"{100.0 * part / max(1.0, whole):.1f}%"


def _swatch(role: Role) -> str:
  return f'<span class="sw" style="background:{_plot.ROLE_COLORS[role]}"></span>'


def _interval(program: AnalyzedProgram, vid: int) -> tuple[str, int]:
  """Estimated live interval (``*``: kept for a use XLA fuses into a later op), sort key."""
  s, e = program.interval(vid)
  mark = ""
  ivs = getattr(program.profile, "intervals", None)
  if ivs is not None:
    s2, e2 = ivs[vid]
    mark = "*" if e2 > e else ""
    s, e = s2, e2
  return f"{s}..{'exit' if e >= program.num_ops else e}{mark}", s


# -- SVG chart (used when matplotlib is not installed) ----------------------

_HALO = 'stroke="#fff" stroke-width="3" stroke-opacity="0.85" paint-order="stroke"'


def _nice_step(top: float, target_ticks: int = 5) -> float:
  raw = max(top, 1e-12) / target_ticks
  mag = 10 ** np.floor(np.log10(raw))
  for m in (1, 2, 2.5, 5, 10):
    if m * mag >= raw:
      return float(m * mag)
  return float(10 * mag)


def _columns(live: np.ndarray, limit: int) -> np.ndarray:
  """Column indices to draw: all, or per bucket the column with the most bytes."""
  n = len(live)
  if n <= limit:
    return np.arange(n)
  edges = np.linspace(0, n, limit + 1).astype(int)
  return np.asarray([a + int(np.argmax(live[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a])


def svg_chart(program: AnalyzedProgram, *, budget_bytes: int | None = None, plan: Plan | None = None,
              width: int = 1100, height: int = 440, max_columns: int = 2500) -> str:
  """Inline SVG (no namespace URL needed inside HTML) of live bytes by role."""
  prof = program.profile
  n = program.num_ops
  stacks = _plot.role_stacks(program)
  planned = None
  if plan is not None:
    sched = plan.schedule()
    planned = (_plot.schedule_positions(sched), sched.profile())
  top = max([prof.peak_bytes, budget_bytes or 0, planned[1].peak_bytes if planned else 0, 1])
  unit, scale = _plot.axis_unit(top)
  ml, mr, mt, mb = 70, 20, 30, 48
  pw, ph = width - ml - mr, height - mt - mb
  ymax = top * 1.22

  def X(pos: float) -> float:
    return ml + pw * pos / (n + 1)

  def Y(b: float) -> float:
    return mt + ph * (1 - b / ymax)

  out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
         f'aria-label="live bytes over program order by role" '
         f'style="font-family:Helvetica,Arial,sans-serif;font-size:12px;background:#fff">']
  # phases
  for phase, a, b in _plot.phase_runs(program):
    out.append(f'<rect x="{X(a):.1f}" y="{mt}" width="{X(b + 1) - X(a):.1f}" height="{ph}" '
               f'fill="{_plot.PHASE_COLORS[phase]}"><title>{_e(phase.value)} phase: ops {a}..{b}'
               f'</title></rect>')
    if (b + 1 - a) >= 0.06 * max(1, n):
      out.append(f'<text x="{(X(a) + X(b + 1)) / 2:.1f}" y="{mt + 14}" text-anchor="middle" '
                 f'fill="#666" font-style="italic">{_e(phase.value)}</text>')
  # stacked areas: draw cumulative tops from the top role down
  cols = _columns(prof.live_bytes, max_columns)
  cum = np.cumsum(stacks[:, cols], axis=0)
  xs_left = cols.astype(float)
  xs_right = np.append(cols[1:], n + 1).astype(float)
  for r in range(len(_plot.STACK_KEYS) - 1, -1, -1):
    if not stacks[r].any():
      continue
    pts = []
    for xl, xr, y in zip(xs_left, xs_right, cum[r]):
      pts.append(f"{X(xl):.1f},{Y(y):.1f} {X(xr):.1f},{Y(y):.1f}")
    path = f"M{X(0):.1f},{Y(0):.1f} L" + " ".join(pts) + f" L{X(n + 1):.1f},{Y(0):.1f} Z"
    out.append(f'<path d="{path}" fill="{_plot.STACK_COLORS[r]}" stroke="none">'
               f'<title>{_e(_plot.STACK_LABELS[r])}</title></path>')
  # axes and ticks
  step = _nice_step(ymax / scale)
  t = 0.0
  while t <= ymax / scale + 1e-9:
    y = Y(t * scale)
    out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#fff" '
               f'stroke-opacity="0.7"/>')
    out.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
    t += step
  xstep = max(1, int(_nice_step(n + 1, 10)))
  for xv in range(0, n + 1, xstep):
    out.append(f'<line x1="{X(xv):.1f}" x2="{X(xv):.1f}" y1="{mt + ph}" y2="{mt + ph + 4}" '
               f'stroke="#333"/>')
    out.append(f'<text x="{X(xv):.1f}" y="{mt + ph + 17}" text-anchor="middle">{xv}</text>')
  out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
  out.append(f'<text x="{ml + pw / 2}" y="{height - 8}" text-anchor="middle">program position '
             f'(op index in program order; {n} = step exit)</text>')
  out.append(f'<text transform="translate(16,{mt + ph / 2}) rotate(-90)" text-anchor="middle">'
             f'live bytes ({unit})</text>')
  # budget, plan, peak
  if budget_bytes is not None:
    y = Y(budget_bytes)
    out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" '
               f'stroke="{_plot.BUDGET_COLOR}" stroke-width="1.6" stroke-dasharray="7,4"/>')
    out.append(f'<text x="{ml + pw - 4}" y="{y - 5:.1f}" text-anchor="end" '
               f'fill="{_plot.BUDGET_COLOR}" {_HALO}>budget {_e(format_bytes(budget_bytes))}</text>')
  if planned is not None:
    px, pprof = planned
    pcols = _columns(pprof.live_bytes, max_columns * 2)
    pts = []
    xr_all = np.append(px[pcols[1:]], n + 1)
    for i, xr in zip(pcols, xr_all):
      pts.append(f"{X(px[i]):.1f},{Y(pprof.live_bytes[i]):.1f} {X(xr):.1f},{Y(pprof.live_bytes[i]):.1f}")
    out.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="{_plot.PLAN_COLOR}" '
               f'stroke-width="1.3"><title>planned estimate</title></polyline>')
    ppos = float(px[pprof.peak_index])
    out.append(f'<circle cx="{X(ppos):.1f}" cy="{Y(pprof.peak_bytes):.1f}" r="3.5" '
               f'fill="{_plot.PLAN_COLOR}"/>')
    out.append(f'<text x="{X(ppos):.1f}" y="{Y(pprof.peak_bytes) + 18:.1f}" text-anchor="middle" '
               f'fill="{_plot.PLAN_COLOR}" {_HALO}>planned peak {_e(format_bytes(pprof.peak_bytes))}</text>')
  p = prof.peak_index
  px0, py0 = X(p + 0.5), Y(prof.peak_bytes)
  out.append(f'<path d="M{px0 - 6:.1f},{py0 - 10:.1f} L{px0 + 6:.1f},{py0 - 10:.1f} '
             f'L{px0:.1f},{py0:.1f} Z" fill="#000"/>')
  anchor = "end" if p > 0.6 * n else "start"
  tx = px0 - 10 if anchor == "end" else px0 + 10
  out.append(f'<text x="{tx:.1f}" y="{py0 - 16:.1f}" text-anchor="{anchor}" font-weight="bold" {_HALO}>'
             f'estimated peak {_e(format_bytes(prof.peak_bytes))} at '
             f'{_e(_plot.describe_position(program, p))}</text>')
  out.append("</svg>")
  return "\n".join(out)


def _legend(program: AnalyzedProgram, budget_bytes: int | None, plan: Plan | None) -> str:
  stacks = _plot.role_stacks(program)
  items = [f'<span class="item"><span class="sw" style="background:{_plot.STACK_COLORS[i]}">'
           f'</span>{_e(_plot.STACK_LABELS[i])}</span>'
           for i in range(len(_plot.STACK_KEYS)) if stacks[i].any()]
  for ph, color in _plot.PHASE_COLORS.items():
    items.append(f'<span class="item"><span class="sw" style="background:{color};'
                 f'border:1px solid #ccc"></span>{_e(ph.value)} phase (background)</span>')
  if budget_bytes is not None:
    items.append(f'<span class="item"><span class="sw" style="background:{_plot.BUDGET_COLOR};'
                 f'height:3px"></span>budget</span>')
  if plan is not None:
    items.append(f'<span class="item"><span class="sw" style="background:{_plot.PLAN_COLOR};'
                 f'height:2px"></span>planned estimate</span>')
  return f'<div class="legend">{"".join(items)}</div>'


def _chart(program: AnalyzedProgram, budget_bytes: int | None, plan: Plan | None, chart: str) -> str:
  if chart not in ("auto", "png", "svg"):
    raise ValueError(f"`chart`={chart!r}: use 'auto', 'png' or 'svg'.")
  if chart in ("auto", "png"):
    try:
      png = _plot.program_plot_png(program, budget_bytes=budget_bytes, plan=plan)
    except ImportError:
      if chart == "png":
        raise
    else:
      data = base64.b64encode(png).decode("ascii")
      return (f'<div class="chart"><img alt="live bytes over program order, stacked by role" '
              f'src="data:image/png;base64,{data}"></div>')
  return (f'<div class="chart">{svg_chart(program, budget_bytes=budget_bytes, plan=plan)}</div>'
          + _legend(program, budget_bytes, plan))


# -- control-flow blocks ----------------------------------------------------

def _bytes_td(n: int | None) -> str:
  return _td("" if n is None else format_bytes(n), "num", -1 if n is None else n)


def _blocks_section(program: AnalyzedProgram) -> str:
  """Table of the scan/while/cond/checkpoint blocks; empty without any."""
  rows_b = [b for top in program.blocks for b in top.walk()]
  if not rows_b:
    return ""
  rows = []
  for b in rows_b:
    # Nested blocks follow their parent (the table is not sortable, to keep the tree).
    name = "&nbsp;&nbsp;" * b.depth + ("↳ " if b.depth else "") + _e(b.primitive)
    if b.branch_peaks is not None:
      other = "branches " + " / ".join(format_bytes(x) for x in b.branch_peaks)
    elif b.cond_peak_bytes is not None:
      other = f"cond {format_bytes(b.cond_peak_bytes)}, body {format_bytes(b.body_peak_bytes)}"
    else:
      other = ""
    rows.append("<tr>" + _td(b.op_index, "num", b.op_index) + _td(name, "mono", raw=True)
                + _td(b.region) + _bytes_td(b.inner_peak_bytes)
                + _td("" if b.length is None else b.length, "num")
                + _bytes_td(b.per_iteration_bytes) + _bytes_td(b.carry_bytes)
                + _bytes_td(b.stacked_output_bytes) + _bytes_td(b.xs_bytes) + _td(other)
                + _td(b.source, "src") + _td(b.module, "src") + "</tr>")
  return ("<h2>Control-flow blocks</h2>"
          '<p class="note">Ops that keep a body of their own (<code>scan</code>, '
          "<code>while</code>, <code>cond</code>, <code>remat2</code> = "
          "<code>jax.checkpoint</code>). inner peak: working set inside beyond the op's operands "
          "and results, charged to the op on the chart. per iteration: live bytes during one "
          "iteration of the body, its inputs (carry, one slice of each xs) and outputs "
          "included. stacked outputs / xs: the scan's stacked results and operands over all "
          "iterations. Nested blocks follow their parent, marked ↳.</p>"
          + _table([("op", "num"), ("block", ""), ("in", ""), ("inner peak", "num"),
                    ("length", "num"), ("per iteration", "num"), ("carry", "num"),
                    ("stacked outputs", "num"), ("xs", "num"), ("branches / cond, body", ""),
                    ("source", ""), ("module", "")], rows, sortable=False))


# -- the page ---------------------------------------------------------------

def html_report(program: AnalyzedProgram, path: str | os.PathLike[str] | None = None, *,
                budget_bytes: int | None = None, plan: Plan | None = None, top: int = 30,
                chart: str = "auto") -> str:
  """A self-contained HTML page: peak, chart, what is live at the peak, the plan.

  Args:
    program: a :class:`jaxmem.Program` (``jaxmem.analyze(step, *args)``).
    path: when given, the page is written there (UTF-8).
    budget_bytes: shown in the summary and as a line on the chart.
    plan: a :class:`jaxmem.Plan` for ``program``: its estimate goes on the
      chart and its decisions into a table.
    top: how many of the largest buffers at the peak to list.
    chart: ``"auto"`` (the matplotlib PNG, embedded, when matplotlib is
      installed, else an inline SVG), ``"png"`` or ``"svg"``.

  Returns:
    The HTML text.
  """
  prof = program.profile
  vars_ = program.vars
  peak = prof.peak_bytes
  p = prof.peak_index
  parts: list[str] = []

  # Summary.
  kv = [("estimated peak", f"<b>{_e(format_bytes(peak))}</b> ({peak:,} bytes)"),
        ("at", _e(_plot.describe_position(program, p)))]
  if p < program.num_ops:
    op = program.ops[p]
    kv += [("peak op source", f'<span class="mono">{_e(op.source)}</span>'),
           ("peak op phase / module", _e(f"{op.phase.value} / {op.module_path or '(top level)'}"))]
  kv += [("ops", f"{program.num_ops:,}"), ("values", f"{len(vars_):,}"),
         ("values live at the peak", f"{len(prof.holders):,}")]
  if budget_bytes is not None:
    over = peak - budget_bytes
    cls = "over" if over > 0 else "under"
    word = "over" if over > 0 else "under"
    kv.append(("budget", f"{_e(format_bytes(budget_bytes))} — estimated peak is "
                         f'<span class="{cls}">{_e(format_bytes(abs(over)))} {word}</span>'))
  if plan is not None:
    pprof = plan.schedule().profile()
    kv.append(("plan", _e(f"{plan.planner}: {len(plan.decisions)} decisions — {plan.num_remat} "
                          f"remat ({plan.recomputed_ops} ops recomputed), {plan.num_offload} offload "
                          f"({format_bytes(plan.offloaded_bytes)} staged to host), "
                          f"{len(plan.pinned)} pinned")))
    kv.append(("planned estimate", _e(f"peak {format_bytes(pprof.peak_bytes)} "
                                      f"(target {format_bytes(plan.target_bytes)}; "
                                      f"{format_bytes(peak - pprof.peak_bytes)} below unplanned)")))
  parts.append('<table class="kv">' + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>"
                                              for k, v in kv) + "</table>")

  parts.append("<h2>Live memory over program order, by role</h2>")
  parts.append(_chart(program, budget_bytes, plan, chart))
  parts.append('<p class="note">jaxmem\'s estimate: a value is live from the op that makes it '
               "through its last use (arguments and results for the whole step); values XLA fuses "
               "away store nothing and keep their inputs alive instead; XLA's own temporaries "
               "(layout copies, stored broadcasts, expansions) are added. The compiled program is the truth: "
               "<code>jaxmem.fit</code> verifies it against <code>memory_analysis()</code>.</p>")

  # By role.
  by_role: dict[Role, list[int]] = defaultdict(lambda: [0, 0])
  by_module: dict[str, list[int]] = defaultdict(lambda: [0, 0])
  for vid, nb in zip(prof.holders, prof.holder_bytes):
    v = vars_[vid]
    by_role[v.role][0] += nb
    by_role[v.role][1] += 1
    mod = "(arguments)" if v.is_input else (v.name or "(top level)")
    by_module[mod][0] += nb
    by_module[mod][1] += 1
  # Broadcasts XLA stores (no jaxpr value): charged to the value they broadcast.
  broadcasts = stored_broadcasts_at(program, prof.peak_index)
  bcast_bytes = sum(b for _, b, _, _ in broadcasts)
  for vid, nb, _, _ in broadcasts:
    v = vars_[vid]
    mod = "(arguments)" if v.is_input else (v.name or "(top level)")
    by_module[mod][0] += nb
    by_module[mod][1] += 1
  hidden = peak - sum(prof.holder_bytes) - bcast_bytes

  def bar(nb: int) -> str:
    return f'<span class="bar" style="width:{int(120 * nb / max(1, peak))}px"></span>'

  rows = []
  for role, (nb, cnt) in sorted(by_role.items(), key=lambda kv: -kv[1][0]):
    rows.append("<tr>" + _td(_swatch(role) + _e(role.value), raw=True, sort=role.value)
                + _td(format_bytes(nb), "num", nb) + _td(_pct(nb, peak) + bar(nb), "num",
                                                           nb, raw=True)
                + _td(cnt, "num", cnt) + "</tr>")
  if broadcasts:
    rows.append("<tr>" + _td(f'<span class="sw" style="background:{_plot.HIDDEN_COLOR}"></span>'
                             "XLA broadcast", raw=True, sort="XLA broadcast")
                + _td(format_bytes(bcast_bytes), "num", bcast_bytes)
                + _td(_pct(bcast_bytes, peak) + bar(bcast_bytes), "num", bcast_bytes, raw=True)
                + _td(len(broadcasts), "num", len(broadcasts)) + "</tr>")
  hidden_row = ("<tr>" + _td(f'<span class="sw" style="background:{_plot.HIDDEN_COLOR}"></span>'
                             + _e("XLA temporaries (layout copies, expansions, loop bodies)"),
                             raw=True, sort="~")
                + _td(format_bytes(hidden), "num", hidden)
                + _td(_pct(hidden, peak) + bar(hidden), "num", hidden, raw=True)
                + _td("", "num", 0) + "</tr>") if hidden > peak // 1000 else ""
  rows.append(hidden_row)
  parts.append("<h2>Live at the peak, by role</h2>")
  parts.append(_table([("role", ""), ("bytes", "num"), ("% of peak", "num"), ("buffers", "num")],
                      rows))

  rows = []
  for mod, (nb, cnt) in sorted(by_module.items(), key=lambda kv: -kv[1][0]):
    rows.append("<tr>" + _td(mod, "src") + _td(format_bytes(nb), "num", nb)
                + _td(_pct(nb, peak) + bar(nb), "num", nb, raw=True) + _td(cnt, "num", cnt) + "</tr>")
  rows.append(hidden_row)
  parts.append("<h2>Live at the peak, by module</h2>")
  parts.append('<p class="note">Flax module path of the op that made each value; step arguments '
               "(parameters, optimizer state, batch) are grouped as (arguments).</p>")
  parts.append(_table([("module", ""), ("bytes", "num"), ("% of peak", "num"), ("buffers", "num")],
                      rows))

  # Top buffers.
  entries = [(nb, vid, None) for vid, nb in zip(prof.holders, prof.holder_bytes)]
  entries += [(nb, vid, (s, e)) for vid, nb, s, e in broadcasts]
  entries.sort(key=lambda t: -t[0])
  ntop = min(top, len(entries))
  rows = []
  for rank, (nb, vid, span) in enumerate(entries[:ntop], 1):
    v = vars_[vid]
    if span is None:
      live, start = _interval(program, vid)
      role = _swatch(v.role) + _e(v.role.value)
      sort_role = v.role.value
    else:
      live, start = f"{span[0]}..{span[1]}", span[0]
      role = (f'<span class="sw" style="background:{_plot.HIDDEN_COLOR}"></span>'
              "XLA broadcast of")
      sort_role = "XLA broadcast"
    rows.append("<tr>" + _td(rank, "num", rank) + _td(format_bytes(nb), "num", nb)
                + _td(_pct(nb, peak), "num", nb) + _td(v.type_str, "mono")
                + _td(role, raw=True, sort=sort_role)
                + _td(live, "mono", start)
                + _td("(argument)" if v.is_input else v.source, "src")
                + _td(v.name, "src") + "</tr>")
  parts.append(f"<h2>Top {ntop} buffers at the peak (of {len(entries)})</h2>")
  parts.append('<p class="note">live: estimated program positions from definition to last use '
               "(exit = held until the step returns; * = kept alive for a use XLA fuses into a "
               "later op; outputs are reserved for the whole step). XLA broadcast of: a full-size "
               "broadcast of this value that XLA stores because the forward and the backward "
               "pass both read it. source: the line of user code that made "
               "the value (frames inside installed libraries are skipped).</p>")
  parts.append(_table([("#", "num"), ("bytes", "num"), ("% of peak", "num"), ("type", ""),
                       ("role", ""), ("live", ""), ("source", ""), ("name", "")], rows))

  blocks_html = _blocks_section(program)
  if blocks_html:
    parts.append(blocks_html)

  # Plan decisions.
  if plan is not None:
    decisions = sorted(plan.decisions, key=lambda d: -d.nbytes * (d.end - d.start))
    rows = []
    for d in decisions:
      v = vars_[d.var]
      rows.append("<tr>" + _td(d.action.value) + _td(format_bytes(d.nbytes), "num", d.nbytes)
                  + _td(f"{d.start}→{d.end}", "mono", d.start)
                  + _td(d.end - d.start, "num", d.end - d.start)
                  + _td(v.type_str, "mono") + _td(v.role.value)
                  + _td(len(d.recompute), "num", len(d.recompute))
                  + _td(f"{d.cost_s * 1e6:.3g}", "num", d.cost_s)
                  + _td(v.name if v.is_input else v.source, "src") + _td(v.name, "src") + "</tr>")
    parts.append(f"<h2>Plan decisions ({len(decisions)})</h2>")
    parts.append('<p class="note">remat: dropped after <i>start</i>, recomputed just before '
                 "<i>end</i>; offload: copied to host after <i>start</i>, fetched back just "
                 "before <i>end</i>. Every other value is kept. Cost: extra time estimated on the "
                 "planning device profile.</p>")
    parts.append(_table([("action", ""), ("bytes", "num"), ("gap", ""), ("gap length", "num"),
                         ("value", ""), ("role", ""), ("ops recomputed", "num"),
                         ("est. cost (µs)", "num"), ("source", ""), ("name", "")], rows))

  title = f"jaxmem memory report — peak {format_bytes(peak)}"
  page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
          f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
          f"<h1>{_e(title)}</h1>"
          f'<p class="sub">Estimated live memory of a traced step, {program.num_ops:,} ops. '
          "Click a column header to sort.</p>"
          + "\n".join(parts) + f"<script>{_JS}</script></body></html>\n")
  if path is not None:
    with open(os.fspath(path), "w", encoding="utf-8") as f:
      f.write(page)
  return page


__all__: Sequence[str] = ("html_report", "svg_chart")
