"""Budget parsing: bytes, strings with units, or a fraction of the unplanned peak."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from types import MappingProxyType

_UNITS: Mapping[str, int] = MappingProxyType({
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
})
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

Budget = int | float | str


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
  """A parsed budget: either absolute ``bytes`` or a ``fraction`` of the unplanned peak."""
  bytes: int | None = None
  fraction: float | None = None

  def resolve(self, unplanned_peak_bytes: int) -> int:
    """Budget in bytes, given the unplanned step's compiled peak."""
    if self.bytes is not None:
      return self.bytes
    assert self.fraction is not None
    return int(math.floor(self.fraction * unplanned_peak_bytes))

  def __str__(self) -> str:
    if self.bytes is not None:
      return f"{self.bytes} bytes"
    return f"{self.fraction:g} of the unplanned peak"


def parse_budget(budget: Budget, *, argname: str = "budget") -> BudgetSpec:
  """Parses a budget.

  Args:
    budget: ``int`` bytes (> 0); a string with a decimal or binary unit
      (``"512MiB"``, ``"2GB"``, ``"1.5 GiB"``); or a ``float`` in (0, 1], the
      fraction of the unplanned step's compiled peak.
    argname: name used in error messages.

  Returns:
    A :class:`BudgetSpec`.

  Raises:
    TypeError, ValueError: naming the argument and what would work.

  Example:
    >>> parse_budget("1KiB").bytes
    1024
    >>> parse_budget(0.5).fraction
    0.5
  """
  hint = ("Use int bytes (e.g. 2**30), a string with a unit (e.g. \"12GiB\", \"800MB\"), "
          "or a float in (0, 1] for a fraction of the unplanned peak (e.g. 0.5).")
  if isinstance(budget, bool) or budget is None:
    raise TypeError(f"`{argname}` must be a budget, got {budget!r}. {hint}")
  if isinstance(budget, numbers.Integral):
    if budget <= 0:
      raise ValueError(f"`{argname}` must be a positive number of bytes, got {budget}. {hint}")
    return BudgetSpec(bytes=int(budget))
  if isinstance(budget, numbers.Real):
    value = float(budget)
    if not (0.0 < value <= 1.0) or math.isnan(value):
      raise ValueError(
          f"`{argname}` as a float is a fraction of the unplanned peak and must be in (0, 1], "
          f"got {value!r}. For an absolute budget pass int bytes or a string such as \"2GiB\".")
    return BudgetSpec(fraction=value)
  if isinstance(budget, str):
    m = _PATTERN.match(budget)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
      raise ValueError(
          f"`{argname}`={budget!r} is not a size: expected a number and one of the units "
          f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. \"512MiB\"). {hint}")
    n = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(n):
      raise ValueError(f"`{argname}`={budget!r} is too large to be a number of bytes. {hint}")
    if n < 1:
      raise ValueError(f"`{argname}`={budget!r} is less than one byte. {hint}")
    return BudgetSpec(bytes=int(n))
  raise TypeError(f"`{argname}` must be an int, float or str, got {type(budget).__name__}. {hint}")
