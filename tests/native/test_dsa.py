"""Offline DSA solver (``jaxmem.dsa``, ``ffi/dsa.cc``): optimality on hand instances and against
brute force, validity on random instances, the checker, CSV, the CLI, errors and limits."""

from __future__ import annotations

import contextlib
import doctest
import io
import itertools
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmem
from jaxmem import dsa
from jaxmem.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[2]

from dsa_cases import ABOVE_MAX_LOAD, BF_SUBOPTIMAL, brute_force  # noqa: E402


def naive_valid(lower, upper, size, offsets) -> bool:
  """O(n²) reference for ``dsa.check``."""
  for i, j in itertools.combinations(range(len(size)), 2):
    if (lower[i] < upper[j] and lower[j] < upper[i] and size[i] and size[j]
        and offsets[i] < offsets[j] + size[j] and offsets[j] < offsets[i] + size[i]):
      return False
  return True


def random_instance(rng: np.random.Generator, n: int, horizon: int | None = None,
                    max_len: int | None = None, max_size: int = 1 << 12):
  horizon = horizon or max(2, n)
  max_len = max_len or max(2, horizon // 4)
  lower = rng.integers(0, horizon, n)
  upper = lower + rng.integers(1, max_len + 1, n)
  size = rng.integers(0, max_size, n)
  return lower, upper, size


def tight_instance(rng: np.random.Generator, n: int, width: int = 1 << 16, keep: float = 0.8):
  """Every time step has load exactly ``width``: hard, the optimum is usually above it."""
  lower: list[int] = []
  upper: list[int] = []
  size: list[int] = []
  live: list[int] = []
  t = 0
  while len(size) < n:
    live = [i for i in live if rng.random() < keep]
    for i in live:
      upper[i] = t + 1
    load = sum(size[i] for i in live)
    while load < width and len(size) < n:
      s = int(min(width - load, 2 ** rng.uniform(0, np.log2(width))))
      lower.append(t)
      upper.append(t + 1)
      size.append(s)
      live.append(len(size) - 1)
      load += s
    t += 1
  return np.array(lower), np.array(upper), np.array(size)


# -- hand instances ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", dsa.METHODS)
@pytest.mark.parametrize("lower,upper,size,optimum", [
    ([], [], [], 0),
    ([0], [1], [5], 5),
    ([0, 2, 4], [2, 4, 6], [8, 16, 4], 16),          # disjoint lifetimes share offset 0
    ([0, 0, 0], [5, 5, 5], [1, 2, 4], 7),            # all live at once: stacked
    ([0, 1, 2], [2, 3, 4], [4, 4, 4], 8),            # a chain: alternate two slots
    ([0, 0], [3, 3], [0, 7], 7),                     # an empty buffer takes no bytes
    ([-5, -3], [-2, 0], [3, 3], 6),                  # negative times are fine
    ([0, 2], [2, 4], [10, 10], 10),                  # half-open: [0, 2) and [2, 4) do not meet
])
def test_hand_instances(method, lower, upper, size, optimum):
  sol = dsa.solve(lower, upper, size, method=method)
  assert dsa.check(lower, upper, size, sol.offsets) == sol.footprint == optimum
  assert sol.max_load == dsa.max_load(lower, upper, size) == optimum
  assert sol.proven_optimal and sol.gap == 0.0 and sol.ratio == 1.0
  assert sol.offsets.dtype == np.int64 and sol.offsets.shape == (len(size),)


def test_best_fit_suboptimal_exact_optimal():
  bf = dsa.solve(**BF_SUBOPTIMAL, method="best-fit")
  assert (bf.footprint, bf.max_load, bf.proven_optimal) == (13, 11, False)
  assert bf.method == "best-fit" and bf.nodes == 0 and bf.lower_bound == 11
  assert bf.gap == pytest.approx(2 / 11) and bf.ratio == pytest.approx(13 / 11)
  assert brute_force(**BF_SUBOPTIMAL) == 11
  for method in ("exact", "auto"):
    ex = dsa.solve(**BF_SUBOPTIMAL, method=method)
    assert (ex.footprint, ex.proven_optimal, ex.method) == (11, True, "pack")
    assert dsa.check(**BF_SUBOPTIMAL, offsets=ex.offsets) == 11


def test_exhausted_search_proves_optimum_above_max_load():
  sol = dsa.solve(**ABOVE_MAX_LOAD, time_limit_s=None)
  assert (sol.footprint, sol.max_load) == (11, 10)
  assert sol.proven_optimal and not sol.timed_out and sol.lower_bound == 11 and sol.gap == 0.0
  assert sol.nodes > 0
  dsa.check(**ABOVE_MAX_LOAD, offsets=sol.offsets)
  assert brute_force(**ABOVE_MAX_LOAD) == 11
  # A search cut short cannot prove it.
  cut = dsa.solve(**ABOVE_MAX_LOAD, node_limit=1)
  assert cut.footprint >= 11 and not cut.proven_optimal and cut.timed_out
  assert cut.lower_bound == 10 and cut.gap > 0


# -- random instances -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6)),
                min_size=0, max_size=7))
def test_exact_matches_brute_force(rows):
  lower = [lo for lo, _, _ in rows]
  upper = [lo + ln for lo, ln, _ in rows]
  size = [s for _, _, s in rows]
  sol = dsa.solve(lower, upper, size, time_limit_s=None)
  assert sol.proven_optimal
  assert sol.footprint == brute_force(lower, upper, size)
  assert dsa.check(lower, upper, size, sol.offsets) == sol.footprint


@pytest.mark.parametrize("family", ["random", "tight"])
def test_random_instances_valid_and_ordered(family):
  rng = np.random.default_rng(1234)
  for trial in range(40):
    n = int(rng.integers(1, 60))
    if family == "random":
      lower, upper, size = random_instance(rng, n)
    else:
      lower, upper, size = tight_instance(rng, n, width=int(rng.integers(4, 64)))
    load = dsa.max_load(lower, upper, size)
    sols = {m: dsa.solve(lower, upper, size, method=m, time_limit_s=0.05)
            for m in ("best-fit", "first-fit", "exact")}
    for m, sol in sols.items():
      assert dsa.check(lower, upper, size, sol.offsets) == sol.footprint, (trial, m)
      assert sol.footprint >= load == sol.max_load
      assert sol.proven_optimal == (sol.footprint == load) or m == "exact"
    assert sols["exact"].footprint <= min(sols["best-fit"].footprint, sols["first-fit"].footprint)


def test_small_instances_proven_optimal():
  rng = np.random.default_rng(7)
  for family in ("random", "tight"):
    for _ in range(30):
      n = int(rng.integers(1, 13))
      inst = (random_instance(rng, n) if family == "random"
              else tight_instance(rng, n, width=int(rng.integers(4, 40))))
      sol = dsa.solve(*inst, time_limit_s=10.0)
      assert sol.proven_optimal, (family, [x.tolist() for x in inst])
      assert sol.seconds < 5.0


def test_max_load_matches_sweep():
  rng = np.random.default_rng(3)
  for _ in range(20):
    lower, upper, size = random_instance(rng, 30, horizon=20)
    live = [sum(int(s) for lo, up, s in zip(lower, upper, size) if lo <= t < up)
            for t in range(int(upper.max()) + 1)]
    assert dsa.max_load(lower, upper, size) == max(live)


# -- the checker ------------------------------------------------------------------------------


def test_check_rejects_corrupted_solution():
  rng = np.random.default_rng(11)
  lower, upper, size = random_instance(rng, 80, max_size=1000)
  size = size + 1                                   # no empty buffers
  sol = dsa.solve(lower, upper, size)
  off = sol.offsets.copy()
  i, j = next((i, j) for i, j in itertools.combinations(range(80), 2)
              if lower[i] < upper[j] and lower[j] < upper[i])
  off[j] = off[i]                                   # put j on top of a time neighbour
  with pytest.raises(ValueError, match=r"buffers \d+ and \d+ overlap: both are live at time"):
    dsa.check(lower, upper, size, off)
  ids = [f"v{k}" for k in range(80)]
  with pytest.raises(ValueError, match=r"buffers v\d+ and v\d+ overlap"):
    dsa.check(lower, upper, size, off, ids=ids)
  off = sol.offsets.copy()
  off[5] = -1
  with pytest.raises(ValueError, match="buffer 5: offset -1 is negative"):
    dsa.check(lower, upper, size, off)
  with pytest.raises(ValueError, match="one entry per buffer"):
    dsa.check(lower, upper, size, off[:-1])


def test_check_names_the_overlapping_pair():
  with pytest.raises(ValueError, match=r"^buffers 0 and 2 overlap: both are live at time 3 "
                     r"and their bytes \[0, 4\) and \[2, 6\) overlap$"):
    dsa.check([0, 0, 3], [5, 1, 6], [4, 9, 4], [0, 4, 2])


def test_check_agrees_with_naive_reference():
  rng = np.random.default_rng(5)
  outcomes = set()
  for _ in range(300):
    n = int(rng.integers(1, 10))
    lower, upper, size = random_instance(rng, n, horizon=8, max_size=6)
    offsets = rng.integers(0, 12, n)
    expected = naive_valid(lower, upper, size, offsets)
    outcomes.add(expected)
    if expected:
      dsa.check(lower, upper, size, offsets)
    else:
      with pytest.raises(ValueError, match="overlap"):
        dsa.check(lower, upper, size, offsets)
  assert outcomes == {True, False}


# -- bad input, limits, capacity ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(lower=[0, 1], upper=[1], size=[1, 1]), "same length"),
    (dict(lower=[0, 3], upper=[1, 3], size=[1, 1]),
     r"buffer 1: lower \(3\) must be < upper \(3\); intervals are half-open"),
    (dict(lower=[0], upper=[1], size=[-4]), r"buffer 0: size must be >= 0 \(got -4\)"),
    (dict(lower=[0.5], upper=[1], size=[1]), r"`lower`\[0\] = 0.5 is not an integer"),
    (dict(lower=[[0]], upper=[[1]], size=[[1]]), "1-D"),
    (dict(lower=["a"], upper=[1], size=[1]), "`lower` must contain integers"),
    (dict(lower=[0], upper=[1], size=[1], method="optimal"), "unknown method 'optimal'"),
    (dict(lower=[0], upper=[1], size=[1], time_limit_s=-1), "time_limit_s"),
    (dict(lower=[0, 0], upper=[1, 1], size=[2**62, 1]), r"sum to more than 2\*\*62 bytes"),
    (dict(lower=[2**70], upper=[1], size=[1]), "past 64-bit"),
])
def test_bad_input_raises_clear_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dsa.solve(**kwargs)


def test_time_limit_respected_on_large_instance():
  lower, upper, size = tight_instance(np.random.default_rng(0), 400)
  bf = dsa.solve(lower, upper, size, method="best-fit")
  t = time.perf_counter()
  sol = dsa.solve(lower, upper, size, time_limit_s=0.3)
  wall = time.perf_counter() - t
  assert wall < 0.3 + 1.0 and sol.seconds < 0.3 + 0.5
  assert sol.timed_out and not sol.proven_optimal and sol.nodes > 0
  assert sol.footprint <= bf.footprint
  dsa.check(lower, upper, size, sol.offsets)
  # The node limit stops it too.
  capped = dsa.solve(lower, upper, size, time_limit_s=None, node_limit=500)
  assert capped.nodes == 500 and capped.timed_out and not capped.proven_optimal


def test_time_limit_zero_returns_greedy():
  sol = dsa.solve(**BF_SUBOPTIMAL, time_limit_s=0)
  assert sol.footprint == 13 and not sol.proven_optimal and sol.timed_out and sol.nodes == 0


def test_capacity():
  sol = dsa.solve(**BF_SUBOPTIMAL, capacity=11)
  assert sol.footprint == 11
  assert dsa.solve(**BF_SUBOPTIMAL, capacity="1KiB").footprint == 11
  with pytest.raises(dsa.CapacityError, match=r"`capacity`=10 bytes .* max load .* is already 11 "
                     r"bytes") as e:
    dsa.solve(**BF_SUBOPTIMAL, capacity=10)
  assert (e.value.capacity, e.value.max_load) == (10, 11)
  assert isinstance(e.value, ValueError) and isinstance(e.value, jaxmem.JaxmemError)
  with pytest.raises(dsa.CapacityError, match=r"`capacity`=12 bytes .* smallest footprint found is "
                     r"13 bytes .*not proven optimal") as e:
    dsa.solve(**BF_SUBOPTIMAL, capacity=12, method="best-fit")
  assert e.value.footprint == 13 and e.value.solution.offsets.shape == (4,)
  with pytest.raises(TypeError, match="capacity"):
    dsa.solve(**BF_SUBOPTIMAL, capacity=1.5)


def test_capacity_between_max_load_and_optimum():
  # The max load (10) fits, the proven optimum (11) does not.
  with pytest.raises(dsa.CapacityError, match=r"smallest footprint is 11 bytes \(11 B, proven "
                     r"optimal\)\. Pass capacity >= 11"):
    dsa.solve(**ABOVE_MAX_LOAD, capacity=10, time_limit_s=None)


def test_releases_the_gil():
  lower, upper, size = tight_instance(np.random.default_rng(1), 300)
  done = threading.Event()

  def work():
    dsa.solve(lower, upper, size, time_limit_s=0.6)
    done.set()

  thread = threading.Thread(target=work)
  longest = 0.0
  last = time.perf_counter()
  thread.start()
  while not done.is_set():
    now = time.perf_counter()
    longest = max(longest, now - last)
    last = now
    time.sleep(0.001)
  thread.join()
  assert longest < 0.3, f"the main thread was blocked for {longest:.2f} s"


# -- CSV and the command line ----------------------------------------------------------------


def test_csv_round_trip(tmp_path):
  rng = np.random.default_rng(2)
  lower, upper, size = random_instance(rng, 50)
  ids = np.sort(rng.choice(10_000, 50, replace=False))[::-1]   # not contiguous, not sorted
  sol = dsa.solve(lower, upper, size)
  path = tmp_path / "out.csv"
  dsa.write_csv(path, lower, upper, size, sol.offsets, ids=ids)
  assert path.read_text().splitlines()[0] == "id,lower,upper,size,offset"
  back = dsa.read_csv(path)
  for got, want in zip(back, (ids, lower, upper, size, sol.offsets)):
    np.testing.assert_array_equal(got, want)
  dsa.write_csv(path, lower, upper, size)
  back = dsa.read_csv(path)
  assert back.offsets is None and back.ids.tolist() == list(range(50))


def test_read_csv_variants():
  headerless = dsa.read_csv(io.StringIO("# a comment\n3,0,2,10\n\n9,1,4,20\n"))
  assert headerless.ids.tolist() == [3, 9] and headerless.size.tolist() == [10, 20]
  reordered = dsa.read_csv(io.StringIO("size,upper,lower,id,offset,note\n10,2,0,3,0,x\n"))
  assert (reordered.ids.tolist(), reordered.lower.tolist(), reordered.offsets.tolist()) == (
      [3], [0], [0])
  empty = dsa.read_csv(io.StringIO("id,lower,upper,size\n"))
  assert len(empty.ids) == 0 and empty.offsets is None


@pytest.mark.parametrize("text,match", [
    ("id,lower,upper\n1,0,1\n", r"<csv>:1: header .* lacks column\(s\) size"),
    ("1,0,1\n", "<csv>:1: expected 4 or 5 columns"),
    ("1,0,1,x\n", "<csv>:1: size 'x' is not an integer"),
    ("1,0,1,4\n1,2,3,4\n", "<csv>:2: duplicate id 1 \\(first on line 1\\)"),
    ("1,0,1,4\n2,3,3,4\n", r"<csv>:2: buffer 2: lower \(3\) must be < upper \(3\)"),
    ("1,0,1,-4\n", "<csv>:1: buffer 1: size must be >= 0"),
    ("1,0,1,4,-2\n", "<csv>:1: buffer 1: offset must be >= 0"),
])
def test_read_csv_errors(text, match):
  with pytest.raises(ValueError, match=match):
    dsa.read_csv(io.StringIO(text))


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(argv)
  return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def hand_csv(tmp_path):
  path = tmp_path / "in.csv"
  dsa.write_csv(path, **BF_SUBOPTIMAL, ids=[10, 20, 30, 40])
  return path


def test_cli_subprocess(hand_csv, tmp_path):
  out_csv = tmp_path / "out.csv"
  r = subprocess.run([sys.executable, "-m", "jaxmem", "dsa", str(hand_csv), "-o", str(out_csv)],
                     capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  assert "footprint:  11 bytes" in r.stdout and "max load:   11 bytes" in r.stdout
  assert "ratio 1.0000" in r.stdout and "proven optimal" in r.stdout and "time:" in r.stdout
  back = dsa.read_csv(out_csv)
  assert back.ids.tolist() == [10, 20, 30, 40]
  assert dsa.check(back.lower, back.upper, back.size, back.offsets) == 11
  bad = tmp_path / "bad.csv"
  bad.write_text("1,5,5,8\n")
  r = subprocess.run([sys.executable, "-m", "jaxmem", "dsa", str(bad)], capture_output=True,
                     text=True, cwd=ROOT, timeout=120, check=False)
  assert r.returncode == 2 and r.stdout == ""
  assert r.stderr.count("\n") == 1 and "lower (5) must be < upper (5)" in r.stderr


def test_cli_in_process(hand_csv, tmp_path):
  rc, out, _ = _run_cli(["dsa", str(hand_csv), "--method", "best-fit"])
  assert rc == 0 and "footprint:  13 bytes" in out and "ratio 1.1818" in out
  assert "not proven" in out and "method:     best-fit" in out
  rc, out, _ = _run_cli(["dsa", str(hand_csv), "--time-limit", "none", "-o", "-"])
  assert rc == 0 and out.startswith("id,lower,upper,size,offset\n")
  rc, out, err = _run_cli(["dsa", str(hand_csv), "--capacity", "10"])
  assert rc == 1 and out == "" and err.count("\n") == 1 and "`capacity`=10 bytes" in err
  rc, out, _ = _run_cli(["dsa", str(hand_csv), "--capacity", "1KiB"])
  assert rc == 0 and "footprint:  11 bytes" in out
  # --fit stops at the first placement within the capacity: best-fit's 13 here.
  rc, out, _ = _run_cli(["dsa", str(hand_csv), "--capacity", "16", "--fit"])
  assert rc == 0 and "footprint:  13 bytes" in out
  rc, out, _ = _run_cli(["dsa", str(hand_csv), "--capacity", "11", "--fit"])
  assert rc == 0 and "footprint:  11 bytes" in out and "method:     pack" in out
  for argv, match in [
      (["--fit"], "--fit stops at the first placement within --capacity"),
      (["--method", "magic"], "--method 'magic'"),
      (["--time-limit", "soon"], "--time-limit 'soon' is not a number"),
      (["--time-limit", "-1"], "--time-limit must be >= 0"),
      (["--capacity", "lots"], "capacity"),
  ]:
    rc, out, err = _run_cli(["dsa", str(hand_csv), *argv])
    assert rc == 2 and out == "" and err.count("\n") == 1 and match in err, (argv, err)
  rc, _, err = _run_cli(["dsa", str(tmp_path / "missing.csv")])
  assert rc == 2 and "No such file" in err


# -- jaxmem programs ----------------------------------------------------------------------------


def test_from_program(mlp_small):
  step, args = mlp_small
  prog = jaxmem.analyze(step, *args)
  lower, upper, size, ids = dsa.from_program(prog, return_ids=True)
  assert len(lower) > 10 and (lower < upper).all() and (size > 0).all()
  virtual = prog.profile.virtual
  for v, lo, up, s in zip(ids.tolist(), lower.tolist(), upper.tolist(), size.tolist()):
    var = prog.vars[v]
    assert not var.is_input and not virtual[v] and var.nbytes == s
    assert (lo, up - 1) == tuple(prog.profile.intervals[v])
  sol = dsa.solve(lower, upper, size)
  assert dsa.check(lower, upper, size, sol.offsets, ids=ids.tolist()) == sol.footprint
  assert sol.max_load <= prog.peak_bytes
  assert sol.footprint <= dsa.solve(lower, upper, size, method="best-fit").footprint


def test_public_api_and_doctests():
  assert jaxmem.dsa.solve is dsa.solve and "dsa" in jaxmem.__all__
  from jaxmem._src.native import dsa as impl
  for module in (impl, dsa):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and (result.attempted > 0 or module is dsa)
