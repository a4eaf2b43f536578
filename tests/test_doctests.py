"""The runnable examples in the docstrings of the cost model, simulator and planners run."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["jaxmem._src.estimate.cost", "jaxmem._src.plan.simulate", "jaxmem._src.planners.vdnn",
           "jaxmem._src.planners.segments", "jaxmem._src.planners.auto"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0, f"{name} has no examples"
  assert result.failed == 0
