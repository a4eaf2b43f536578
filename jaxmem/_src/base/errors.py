"""Exceptions raised by jaxmem."""

from __future__ import annotations

from typing import Sequence


def format_bytes(n: float) -> str:
  """``1536 -> '1.50 KiB'``: binary units, three significant figures."""
  n = float(n)
  sign = "-" if n < 0 else ""
  n = abs(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
    n /= 1024
  raise AssertionError


class JaxmemError(Exception):
  """Base class of jaxmem's errors."""


class BudgetError(JaxmemError, ValueError):
  """The step cannot be made to fit the budget.

  Attributes:
    budget_bytes: the budget that was asked for.
    smallest_bytes: the smallest compiled peak jaxmem reached that asking
      for it reaches again: a budget of this many bytes fits. It is the
      smallest found, not proven the smallest possible. From
      `jaxmem.max_batch`, when the arguments alone exceed the budget: their
      bytes, a lower bound (nothing was compiled).
    holders: ``(description, bytes)`` of the largest buffers live at that peak
      (a value stacked by a ``scan`` names the scan and its iterations).
    floor: ``(kind, bytes)``: what holds that peak, by kind (parameters,
      optimizer state, activations kept, values stacked by scans, XLA's
      temporaries by kind, XLA's buffers beyond jaxmem's estimate), largest
      first; empty where nothing was compiled.
    advice: what would lower the floor, from its largest kinds.
    compiled_holders: ``(description, bytes)`` of the largest temporaries
      live at that peak in the compiled program itself, read from its
      schedule: the buffer's type, the HLO instruction that writes it and the
      jaxpr op XLA recorded for it (the model's line). The truth that
      ``holders``, an estimate, may miss. Empty where it could not be read
      or disagrees with the compiled peak by more than a tenth.
  """

  def __init__(self, message: str, *, budget_bytes: int, smallest_bytes: int,
               holders: Sequence[tuple[str, int]] = (),
               floor: Sequence[tuple[str, int]] = (), advice: str = "",
               compiled_holders: Sequence[tuple[str, int]] = ()):
    self.budget_bytes = int(budget_bytes)
    self.smallest_bytes = int(smallest_bytes)
    self.holders = tuple(holders)
    self.floor = tuple(floor)
    self.advice = advice
    self.compiled_holders = tuple(compiled_holders)
    lines = [message,
             f"  budget asked:            {format_bytes(budget_bytes)} ({budget_bytes} bytes)",
             f"  smallest peak reachable: {format_bytes(smallest_bytes)} ({smallest_bytes} bytes)"]
    if self.floor:
      lines.append("  what holds that peak, by kind (jaxmem's estimate of the plan at its "
                   f"peak, {format_bytes(sum(b for _, b in self.floor if b > 0))} in all):")
      lines += [f"    {format_bytes(b):>12}  {k}" for k, b in self.floor]
    if self.holders:
      lines.append("  largest holders at that peak (jaxmem's estimate of the plan):")
      lines += [f"    {format_bytes(b):>12}  {d}" for d, b in self.holders]
    if self.compiled_holders:
      lines.append("  largest temporaries live at that peak in the compiled program (read from "
                   "XLA's schedule):")
      lines += [f"    {format_bytes(b):>12}  {d}" for d, b in self.compiled_holders]
    lines.append(advice or (f"Pass a budget of at least {format_bytes(smallest_bytes)} to "
                            "`jaxmem.fit`, reduce the batch size, or donate arguments "
                            "(`donate_argnums`)."))
    super().__init__("\n".join(lines))
