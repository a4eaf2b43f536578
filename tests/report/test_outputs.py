"""Visual outputs: the PNG plot, the self-contained HTML report, the Perfetto trace."""

from __future__ import annotations

import html
import html.parser
import json
import sys

import numpy as np
import pytest

import jaxmem
import models
from jaxmem._src.report.html_page import html_report
from jaxmem._src.plan.perfetto import THREAD_NAMES, schedule_trace
from jaxmem._src.report.plot import plot_program, role_stacks
from jaxmem._src.plan.schedule import StepKind

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = jaxmem.DeviceProfile("fast", 1e15, 1e9)


@pytest.fixture(scope="module")
def program(mlp_small):
  step, args = mlp_small
  return jaxmem.analyze(step, *args)


@pytest.fixture(scope="module")
def plan(program):
  """Greedy at half the estimate on the default profile (offloads)."""
  return jaxmem.get_planner("greedy")(program, int(program.peak_bytes * 0.5), None)


@pytest.fixture(scope="module")
def remat_plan(program):
  """Greedy on a fast-compute, slow-link profile: recomputation wins."""
  p = jaxmem.get_planner("greedy")(program, int(program.peak_bytes * 0.5), FAST)
  assert p.num_remat > 0, p.summary()
  return p


# -- PNG ---------------------------------------------------------------------

def _check_png(path):
  data = path.read_bytes()
  assert data[:8] == PNG_MAGIC
  assert len(data) > 10 * 1024
  return data


def test_role_stacks_add_up_to_the_profile(program):
  stacks = role_stacks(program)
  assert stacks.shape[1] == program.num_ops + 1
  assert (stacks >= 0).all()
  np.testing.assert_array_equal(stacks.sum(axis=0), program.profile.live_bytes)


def test_plot_program_plain(program, tmp_path):
  out = tmp_path / "mem.png"
  assert plot_program(program, out) == str(out)
  _check_png(out)


def test_plot_program_with_plan_and_budget(program, plan, tmp_path):
  plain, planned = tmp_path / "plain.png", tmp_path / "planned.png"
  plot_program(program, plain)
  plot_program(program, planned, budget_bytes=int(program.peak_bytes * 0.7), plan=plan,
               title="MLP <& budget>")
  assert _check_png(planned) != _check_png(plain)


def test_plot_without_matplotlib_says_how_to_install(program, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ImportError, match=r"pip install 'jaxmem\[plot\]'"):
    plot_program(program, tmp_path / "x.png")
  # The HTML report falls back to its own SVG chart.
  page = html_report(program)
  assert "<svg" in page and "data:image/png" not in page


# -- HTML --------------------------------------------------------------------

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}


class _Checker(html.parser.HTMLParser):
  """Every non-void element closed, in order."""

  def __init__(self):
    super().__init__()
    self.stack: list[str] = []
    self.errors: list[str] = []
    self.counts: dict[str, int] = {}

  def handle_starttag(self, tag, attrs):
    self.counts[tag] = self.counts.get(tag, 0) + 1
    for name, value in attrs:
      if name in ("src", "href") and value and not value.startswith(("data:", "#")):
        self.errors.append(f"external resource {name}={value[:60]!r}")
    if tag not in _VOID:
      self.stack.append(tag)

  def handle_endtag(self, tag):
    if not self.stack or self.stack[-1] != tag:
      self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
      return
    self.stack.pop()


def _check_html(page):
  checker = _Checker()
  checker.feed(page)
  checker.close()
  assert not checker.errors, checker.errors[:5]
  assert not checker.stack, checker.stack
  assert "http://" not in page and "https://" not in page
  assert page.count("<table") == page.count("</table>") > 0
  return checker


@pytest.mark.parametrize("chart", ["auto", "svg"])
def test_html_report(program, plan, tmp_path, chart):
  out = tmp_path / "report.html"
  page = html_report(program, out, budget_bytes=int(program.peak_bytes * 0.7), plan=plan, top=20,
                     chart=chart)
  assert out.read_text(encoding="utf-8") == page
  checker = _check_html(page)
  prof = program.profile
  assert jaxmem.format_bytes(prof.peak_bytes) in page
  assert f"{prof.peak_bytes:,}" in page
  roles_at_peak = {program.vars[v].role.value for v in prof.holders}
  assert {"parameter", "optimizer_state", "activation"} <= roles_at_peak
  for role in roles_at_peak:
    assert f"</span>{role}</td>" in page, role
  top_source = next(program.vars[v].source for v in prof.holders
                    if not program.vars[v].is_input)
  assert html.escape(top_source) in page
  assert program.ops[prof.peak_index].primitive in page
  for heading in ("Live at the peak, by role", "Live at the peak, by module",
                  "buffers at the peak", "Plan decisions"):
    assert heading in page
  # summary + role + module + top buffers + decisions
  assert checker.counts["table"] == 5
  for d in plan.decisions:
    assert f"{d.start}→{d.end}" in page
  if chart == "auto":
    assert "data:image/png;base64," in page
  else:
    assert "<svg" in page and "data:image/png" not in page


def test_html_report_without_plan_or_path(program):
  page = html_report(program, top=5)
  checker = _check_html(page)
  assert checker.counts["table"] == 4
  assert "Plan decisions" not in page


def test_html_report_escapes_names():
  import jax.numpy as jnp

  def step(params, x):
    return (params["<script>alert(1)</script>"] * x).sum()

  prog = jaxmem.analyze(step, {"<script>alert(1)</script>": jnp.ones((64, 64))}, jnp.ones((64, 64)))
  page = html_report(prog, chart="svg")
  _check_html(page)
  assert "<script>alert" not in page
  assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


# -- Perfetto ----------------------------------------------------------------

def _slices(trace):
  """The X slices of a trace by thread, each thread's in time order and not overlapping."""
  events = trace["traceEvents"]
  names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
  assert names == set(THREAD_NAMES.values())
  by_tid: dict[int, list[dict]] = {}
  for e in events:
    if e["ph"] == "X":
      assert e["ts"] >= 0 and e["dur"] >= 0, e
      by_tid.setdefault(e["tid"], []).append(e)
  for tid, xs in by_tid.items():
    for a, b in zip(xs, xs[1:]):
      assert b["ts"] >= a["ts"] + a["dur"] - 1e-6, (THREAD_NAMES[tid], a, b)
  return by_tid


def _check_draws_the_simulation(trace, plan, device):
  """Every slice is a simulator event at the simulator's time: one clock."""
  sim = jaxmem.simulate(plan, device)
  by_tid = _slices(trace)
  tid = {"compute": 1, "d2h": 2, "h2d": 3}
  for stream in ("compute", "d2h", "h2d"):
    want = [e for e in sim.timeline if e.stream == stream]
    got = by_tid.get(tid[stream], [])
    assert len(got) == len(want), stream
    for g, w in zip(got, want):
      assert g["ts"] == pytest.approx(w.start_s * 1e6, abs=1e-9)
      assert g["dur"] == pytest.approx((w.end_s - w.start_s) * 1e6, abs=1e-9)
      assert g["cat"] == w.kind
  assert trace["otherData"]["step_time_s"] == sim.step_time_s
  last = max(e["ts"] + e["dur"] for xs in by_tid.values() for e in xs)
  assert last <= sim.step_time_s * 1e6 + 1e-6
  return sim, by_tid


def test_schedule_trace(plan, tmp_path):
  out = tmp_path / "trace.json"
  trace = schedule_trace(plan, out, device="cpu")
  assert json.loads(out.read_text()) == json.loads(json.dumps(trace))
  assert trace["displayTimeUnit"] == "ms"
  sim, by_tid = _check_draws_the_simulation(trace, plan, "cpu")
  steps = plan.schedule().steps
  assert plan.num_offload > 0
  assert len(by_tid[2]) == len(by_tid[3]) == plan.num_offload
  # Synchronous copies: the compute thread waits for each (a stall slice over the copy).
  assert "synchronous" in trace["otherData"]["copies"]
  assert all(e["args"]["synchronous"] for e in by_tid[2] + by_tid[3])
  stalls = [e for e in by_tid[1] if e["cat"] == "stall"]
  for copy in by_tid[2] + by_tid[3]:
    assert any(s["ts"] <= copy["ts"] + 1e-6 and copy["ts"] + copy["dur"] <= s["ts"] + s["dur"] + 1e-6
               for s in stalls), copy
  compute = [e for e in by_tid[1] if e["cat"] == "compute"]
  for e in compute[:20]:
    op = plan.program.ops[e["args"]["op index"]]
    assert e["name"] == op.primitive and e["args"]["source"] == op.source
  events = trace["traceEvents"]
  counters = [e for e in events if e["ph"] == "C"]
  assert len(counters) == len(steps) + 1
  assert max(e["args"]["live bytes"] for e in counters) == plan.schedule().profile().peak_bytes
  instants = [e for e in events if e["ph"] == "i"]
  assert len(instants) == sum(st.kind in (StepKind.FENCE, StepKind.PIN) for st in steps)
  starts = [e for e in events if e["ph"] == "s"]
  ends = [e for e in events if e["ph"] == "f"]
  assert len(starts) == len(ends) == plan.num_offload
  assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in ends)


def test_schedule_trace_of_async_copies_overlaps_compute():
  prog = models.mlp_program(1024, 128, 6)
  plan = jaxmem.get_planner("greedy")(prog, int(prog.peak_bytes * 0.6), "h100-pcie",
                                      allow_remat=False, copies="async", window=4.0)
  trace = schedule_trace(plan, device="h100-pcie")
  _, by_tid = _check_draws_the_simulation(trace, plan, "h100-pcie")
  assert "asynchronous" in trace["otherData"]["copies"]
  copies = by_tid[2] + by_tid[3]
  assert copies and not all(e["args"]["synchronous"] for e in copies)
  compute = [e for e in by_tid[1] if e["cat"] == "compute"]
  overlapping = [c for c in copies if any(e["ts"] < c["ts"] + c["dur"] and c["ts"] < e["ts"] + e["dur"]
                                          for e in compute)]
  assert overlapping, "no copy runs while the compute thread computes"


def test_schedule_trace_flags_recompute(remat_plan):
  trace = schedule_trace(remat_plan, device=FAST)
  _, by_tid = _check_draws_the_simulation(trace, remat_plan, FAST)
  flagged = [e for e in by_tid[1] if e["cat"] == "recompute"]
  assert flagged and all(e["args"]["recompute"] for e in flagged)
  assert len(flagged) >= remat_plan.num_remat > 0
  assert all(e["args"]["recomputes for"]["value"] is not None for e in flagged)
  assert len(by_tid.get(2, [])) == remat_plan.num_offload
  assert len(by_tid.get(3, [])) == remat_plan.num_offload


def test_program_and_plan_methods(mlp_small, tmp_path):
  import jaxmem
  step, args = mlp_small
  prog = jaxmem.analyze(step, *args)
  plan = jaxmem.get_planner("greedy")(prog, int(prog.peak_bytes * 0.6), "cpu")
  png = prog.plot(str(tmp_path / "m.png"), budget_bytes=int(prog.peak_bytes * 0.6), plan=plan)
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  html = prog.to_html(str(tmp_path / "m.html"), plan=plan)
  assert "<html" in html.lower() and (tmp_path / "m.html").exists()
  trace = plan.to_perfetto(str(tmp_path / "t.json"))
  assert trace["traceEvents"] and (tmp_path / "t.json").exists()
