"""Budget parsing: accepted forms and the errors for everything else."""

from __future__ import annotations

import pytest

import jaxmem
from jaxmem import parse_budget


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", int(1.5 * 2**30)),
    ("800mb", 800 * 10**6), ("1024", 1024), ("4KiB", 4096), ("12GiB", 12 * 2**30),
    ("3e3 B", 3000),
])
def test_strings(text, expected):
  assert parse_budget(text).bytes == expected


def test_int_and_fraction():
  assert parse_budget(12345).bytes == 12345
  assert parse_budget(0.5).fraction == 0.5
  assert parse_budget(1.0).fraction == 1.0
  assert parse_budget(0.25).resolve(1000) == 250
  assert parse_budget(4096).resolve(10) == 4096


@pytest.mark.parametrize("bad,exc,words", [
    ("12 parsecs", ValueError, "not a size"),
    ("", ValueError, "not a size"),
    ("GiB", ValueError, "not a size"),
    (-1, ValueError, "positive"),
    (0, ValueError, "positive"),
    (1.5, ValueError, "(0, 1]"),
    (0.0, ValueError, "(0, 1]"),
    (-0.5, ValueError, "(0, 1]"),
    (float("nan"), ValueError, "(0, 1]"),
    ("0.1B", ValueError, "less than one byte"),
    ("1e400", ValueError, "too large"),          # (an OverflowError from int(inf) before)
    ("1e400GiB", ValueError, "too large"),
    (float("inf"), ValueError, "(0, 1]"),
    (True, TypeError, "budget"),
    (None, TypeError, "budget"),
    ([1], TypeError, "int, float or str"),
])
def test_bad_budgets_name_the_argument(bad, exc, words):
  with pytest.raises(exc) as info:
    parse_budget(bad)
  msg = str(info.value)
  assert "`budget`" in msg and words in msg


@pytest.mark.parametrize("bad", ["12 parsecs", -1, 0, 1.5, "1e400"])
def test_fit_rejects_bad_budget_at_decoration(bad):
  with pytest.raises((ValueError, TypeError), match="`budget`"):
    jaxmem.fit(bad)


def test_fit_without_budget_is_explained():
  def step(x):
    return x
  with pytest.raises(TypeError, match="takes a budget first"):
    jaxmem.fit(step)


def test_unknown_planner():
  with pytest.raises(ValueError, match="`planner`"):
    jaxmem.fit(0.5, planner="magic")

