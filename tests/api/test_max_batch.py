"""``jaxmem.max_batch`` and ``python -m jaxmem max-batch``: the largest batch size whose
compiled step fits a budget, searched on compiled peaks, for plain ``jax.jit`` and a planner."""

from __future__ import annotations

import contextlib
import doctest
import functools
import io
import pathlib
import re

import jax
import numpy as np
import pytest

import jaxmem
from jaxmem.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.py") + ":build"
WIDTH, DEPTH = 32, 2
MLP_KW = ["--kw", f"width={WIDTH}", "--kw", f"depth={DEPTH}"]
# ~0.73 KiB per example on top of ~50 KiB of parameters and adam state: the
# unplanned max batch is in the thirties, a few bisection steps from a power of two.
BUDGET = "80KiB"


@functools.cache
def _mlp_base():
  import mlp
  return mlp.build(batch_size=1, width=WIDTH, depth=DEPTH)


def factory(batch: int):
  """``mlp.build(batch, width=32, depth=2)`` without its per-shape random batch (same shapes)."""
  step, (params, opt_state, _, _) = _mlp_base()
  x = jax.numpy.asarray(np.linspace(-1, 1, batch * WIDTH, dtype=np.float32).reshape(batch, WIDTH))
  y = jax.numpy.asarray(np.arange(batch, dtype=np.int32) % 10)
  return step, (params, opt_state, x, y)


def jit_peak(batch: int) -> int:
  step, args = factory(batch)
  return jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes


@pytest.fixture(scope="module")
def unplanned():
  return jaxmem.max_batch(factory, BUDGET, planner=None, lo=4)


def test_unplanned_max_batch_is_the_boundary(unplanned):
  budget = jaxmem.parse_budget(BUDGET).bytes
  b0 = unplanned.batch
  assert unplanned.planner == "jit" and unplanned.budget_bytes == budget
  assert 4 <= b0 < 64 and not unplanned.capped
  peak = jit_peak(b0)
  assert peak == unplanned.peak_bytes <= budget       # a fresh compile agrees
  assert jit_peak(b0 + 1) > budget                    # and one more example does not fit
  # the search: doubling from lo, then bisection; every batch size compiled once
  batches = [b for b, _, _ in unplanned.tried]
  assert batches[:4] == [4, 8, 16, 32] and len(set(batches)) == len(batches)
  assert all(ok == (p is not None and p <= budget) for _, p, ok in unplanned.tried)
  assert (b0 + 1, jit_peak(b0 + 1), False) in unplanned.tried
  text = unplanned.summary()
  assert f"max batch:      {b0} (planner jit)" in text and f"{b0 + 1} does not fit" in text


def test_auto_fits_at_least_the_unplanned_batch(unplanned):
  b0 = unplanned.batch
  res = jaxmem.max_batch(factory, BUDGET, "auto", lo=b0, hi=2 * b0)
  assert res.planner == "auto" and res.tried[0] == (b0, unplanned.peak_bytes, True)
  assert res.batch >= b0
  assert res.peak_bytes <= res.budget_bytes
  step, args = factory(res.batch)
  fresh = jaxmem.fit(BUDGET, planner="auto")(step)
  assert jaxmem.compiled_memory(fresh.lower(*args).compile()).peak_bytes == res.peak_bytes
  assert res.capped or any(b == res.batch + 1 and not ok for b, _, ok in res.tried)


@pytest.mark.parametrize("budget, match", [
    (0.5, r"`budget`=0\.5 is a fraction .* absolute budget: int bytes .* \"800MiB\""),
    ("12 parsecs", r"`budget`='12 parsecs' is not a size"),
    (-5, r"`budget` must be a positive number of bytes"),
    (2.5, r"`budget` as a float is a fraction .* must be in \(0, 1\]"),
])
def test_bad_budget_is_a_clear_value_error(budget, match):
  with pytest.raises(ValueError, match=match):
    jaxmem.max_batch(factory, budget)


def test_bad_arguments():
  with pytest.raises(TypeError, match="must be a budget"):
    jaxmem.max_batch(factory, None)
  with pytest.raises(ValueError, match="`lo` must be a positive int"):
    jaxmem.max_batch(factory, "1MiB", lo=0)
  with pytest.raises(ValueError, match="`hi`=2 must be >= `lo`=4"):
    jaxmem.max_batch(factory, "1MiB", lo=4, hi=2)
  with pytest.raises(ValueError, match="not a known planner"):
    jaxmem.max_batch(factory, "1MiB", "nope")
  with pytest.raises(ValueError, match=r"plain `jax.jit`, which takes none of \['max_rounds'\]"):
    jaxmem.max_batch(factory, "1MiB", None, max_rounds=2)
  with pytest.raises(TypeError):
    jaxmem.max_batch(factory, "1MiB", "auto", no_such_option=1)


def test_infeasible_lo_raises_budget_error():
  # the arguments alone are over the budget: decided without compiling
  with pytest.raises(jaxmem.BudgetError, match=r"lo=1, does not fit 1\.00 KiB with planner auto "
                                               r"\(its arguments alone take"):
    jaxmem.max_batch(factory, "1KiB", lo=1)
  # the compiled peak is over the budget
  peak = jit_peak(8)
  with pytest.raises(jaxmem.BudgetError, match=r"lo=8, does not fit .* plain jax.jit \(its compiled "
                                               r"peak is .*or a planner") as e:
    jaxmem.max_batch(factory, peak - 1, planner="jit", lo=8)
  assert e.value.budget_bytes == peak - 1 and e.value.smallest_bytes == peak


def test_docstring_example():
  from jaxmem._src.api import max_batch as module
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def run_cli(*argv: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(["max-batch", *argv])
  return rc, out.getvalue(), err.getvalue()


def test_cli_prints_the_summary(unplanned):
  b0 = unplanned.batch
  rc, out, err = run_cli(MLP, *MLP_KW, "--budget", BUDGET, "--planner", "jit",
                         "--lo", str(b0 - 1), "--hi", str(b0 + 1))
  assert rc == 0, err
  assert f"max batch:      {b0} (planner jit)" in out
  assert re.search(r"compiled peak: +[\d.]+ KiB", out) and f"{b0 + 1} does not fit" in out
  # one progress line per batch size on stderr, with the outcome
  assert f"[jaxmem] max_batch (jit): batch {b0} ... fits: compiled peak" in err
  assert "[jaxmem]" not in out


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0.5"], "--budget 0.5 is a fraction"),
    (["--budget", "lots"], "`--budget`='lots' is not a size"),
    (["--budget", "1MiB", "--planner", "nope"], "not a known planner"),
    (["--budget", "1MiB", "--kw", "batch_size=3"], "multiple values for argument 'batch_size'"),
    (["--budget", "1MiB", "--lo", "0"], "--lo must be >= 1"),
])
def test_cli_user_errors_are_one_line(argv, message):
  rc, out, err = run_cli(MLP, *argv, "-q")
  assert rc == 2 and out == ""
  assert err.startswith("jaxmem max-batch: error: ") and message in err and err.count("\n") == 1


def test_cli_infeasible_budget_exits_1():
  rc, out, err = run_cli(MLP, *MLP_KW, "--budget", "1KiB", "-q")
  assert rc == 1 and out == ""
  assert "jaxmem max-batch: `jaxmem.max_batch`: even the smallest batch size tried, lo=1" in err
