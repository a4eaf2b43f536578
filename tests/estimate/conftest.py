"""Every estimate made by the tests of this folder runs both lifetime models and compares them.

The native port of the estimate's XLA model (``ffi/lifetimes.cc``) and its
Python reference (``lifetimes._lifetimes``) must agree on every flow: here
each flow, however small (the native path normally starts at
``_NATIVE_MIN_STEPS`` steps), goes through both, and the test fails on the
first difference. The hand-built flows of ``test_lifetimes.py`` each exercise
one rule, so each rule of the port is checked by the test written for it.
"""

from __future__ import annotations

import pytest

from jaxmem._src.estimate import lifetimes


def assert_same_lifetimes(flow: lifetimes.Flow, merged) -> lifetimes._Lifetimes:
  """Both models' lifetimes of ``flow`` (CSE merged), asserted equal; the native ones."""
  want = lifetimes._lifetimes(flow, merged)
  got = lifetimes._lifetimes_native(flow, merged)
  for name in ("pos", "start", "end", "virtual", "copy_last", "stored_broadcasts"):
    a, b = list(getattr(want, name)), list(getattr(got, name))
    if a != b:
      at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      raise AssertionError(f"native `{name}` differs from the Python reference at {at}: "
                           f"{a[at:at + 3]} != {b[at:at + 3]} (lengths {len(a)}, {len(b)})")
  return got


@pytest.fixture(autouse=True)
def _both_lifetime_models(monkeypatch):
  if lifetimes._native_lifetimes() is None:
    yield           # (an extension without the port: the reference runs alone)
    return
  monkeypatch.setattr(lifetimes, "_NATIVE_MIN_STEPS", 0)
  monkeypatch.setattr(lifetimes, "_native_lifetimes", lambda: assert_same_lifetimes)
  yield
