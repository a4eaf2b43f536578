"""``jaxmem.max_batch``: the largest batch size whose compiled step fits a budget.

The search runs on compiled peaks (``memory_analysis()``), never on jaxmem's
estimate: exponential growth from ``lo`` until a batch size fails, then
bisection between the last one that fit and the first one that did not. Every
batch size is built, compiled (and, with a planner, fitted) at most once.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._src.api.fit import fit
from jaxmem._src.base import budget as budget_lib
from jaxmem._src.base.errors import BudgetError, format_bytes
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.estimate.targets import get_target
from jaxmem._src.planners.protocol import PlainPlanner, Planner
from jaxmem._src.planners.registry import get_planner
from jaxmem._src.verify.compiled import compiled_memory

Factory = Callable[[int], tuple[Callable[..., Any], tuple[Any, ...]]]

UNPLANNED = "jit"
# `jaxmem.fit` options that also mean something to plain `jax.jit`.
_JIT_KWARGS = ("static_argnums", "donate_argnums", "target")


@dataclasses.dataclass(frozen=True)
class MaxBatchResult:
  """The largest batch size that fits a budget.

  Attributes:
    batch: the largest batch size found whose compiled peak is within the budget.
    peak_bytes: the compiled peak at ``batch`` (arguments + outputs + temp - aliased).
    budget_bytes: the budget in bytes.
    planner: ``"jit"`` for plain ``jax.jit``, else the planner ``jaxmem.fit`` used.
    tried: ``(batch, peak_bytes, ok)`` for every batch size tried, in order;
      ``peak_bytes`` is None where no compiled peak is known (``jaxmem.fit``
      raised :class:`BudgetError`, or the arguments alone exceed the budget).
    seconds: wall time of the search.
    capped: True when ``batch`` is the ``hi`` the search was capped at (a larger
      batch size may fit too).
  """
  batch: int
  peak_bytes: int
  budget_bytes: int
  planner: str
  tried: tuple[tuple[int, int | None, bool], ...]
  seconds: float
  capped: bool = False

  @property
  def next_failure(self) -> tuple[int, int | None] | None:
    """``(batch, peak_bytes)`` of the smallest batch size tried that did not fit, if any."""
    fails = [(b, p) for b, p, ok in self.tried if not ok and b > self.batch]
    return min(fails) if fails else None

  def summary(self) -> str:
    """A few lines: the batch, its compiled peak against the budget, and the search."""
    lines = [
        f"max batch:      {self.batch} (planner {self.planner})",
        f"budget:         {format_bytes(self.budget_bytes)}",
        f"compiled peak:  {format_bytes(self.peak_bytes)} "
        f"({self.peak_bytes / max(1, self.budget_bytes):.1%} of the budget)",
    ]
    nxt = self.next_failure
    if self.capped:
      lines.append(f"next batch:     not tried (the search was capped at hi={self.batch})")
    elif nxt is not None:
      b, p = nxt
      why = (f"compiled peak {_size(p, self.budget_bytes)}" if p is not None else
             "jaxmem.fit found no plan within the budget, or the arguments alone exceed it")
      lines.append(f"next batch:     {b} does not fit ({why})")
    steps = ", ".join(f"{b}{'' if ok else 'x'}" for b, _, ok in self.tried)
    lines.append(f"search:         {len(self.tried)} batch sizes in {self.seconds:.1f} s "
                 f"({steps}; x: did not fit)")
    return "\n".join(lines)


def _size(n: int, budget_bytes: int) -> str:
  """``format_bytes(n)``, with the exact bytes where it would read the same as the budget."""
  text = format_bytes(n)
  return f"{text} ({n} bytes)" if text == format_bytes(budget_bytes) and n != budget_bytes else text


def _arg_bytes(args: Any) -> int:
  """Bytes of the array leaves of ``args`` (a lower bound on any compiled peak)."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(args) if hasattr(x, "shape") and hasattr(x, "dtype"))


def _planner_label(planner: str | Planner | PlainPlanner | None) -> str | None:
  """None for plain ``jax.jit``, else the planner's display name (validating it)."""
  if planner is None or planner == UNPLANNED:
    return None
  get_planner(planner)  # ValueError naming the known planners
  if isinstance(planner, str):
    return planner
  return getattr(planner, "__name__", None) or type(planner).__name__


def max_batch(factory: Factory, budget: int | str,
              planner: str | Planner | PlainPlanner | None = "auto", *,
              device: DeviceLike = None, lo: int = 1, hi: int | None = None,
              verbose: bool = False, **fit_kwargs: Any) -> MaxBatchResult:
  """The largest batch size whose step's *compiled* peak fits ``budget``.

  Each batch size tried is built with ``factory``, compiled (with a planner:
  fitted by :func:`jaxmem.fit` and verified) and judged by its compiled peak.
  The search grows the batch size from ``lo`` by doubling until one does not
  fit, then bisects between the last that fit and the first that did not, so
  the result ``batch`` fits and ``batch + 1`` was compiled and does not
  (unless ``hi`` was reached). It assumes that a batch size fitting implies
  every smaller one fits.

  Args:
    factory: ``factory(batch_size) -> (step, args)``, building the step and real
      arguments for a batch size (e.g. ``functools.partial(mlp.build, width=64)``
      with the examples' ``build`` functions).
    budget: int bytes or a string with units (``"12GiB"``, ``"800MB"``), per
      device. A fraction of the unplanned peak is not accepted: that peak
      changes with the batch size.
    planner: a planner name or callable for :func:`jaxmem.fit` (default
      ``"auto"``), or ``None`` / ``"jit"`` for plain ``jax.jit`` (the compiled
      peak of ``jax.jit(step).lower(*args).compile()``).
    device: device profile for the planner.
    lo: the smallest batch size to try, tried first; it must fit.
    hi: the largest batch size to try (default: no limit).
    verbose: print one progress line per batch size on stderr.
    **fit_kwargs: more keyword arguments for :func:`jaxmem.fit` (e.g.
      ``compiler_fallback=True``, ``donate_argnums=(0, 1)``, ``target="tpu:v5e"``:
      the budget is then that chip's, and every batch is compiled for it).
      With plain ``jax.jit`` only ``static_argnums``, ``donate_argnums`` and
      ``target`` apply.

  Returns:
    A :class:`MaxBatchResult`.

  Raises:
    ValueError: for a fraction budget, a bad ``lo``/``hi`` or an unknown planner.
    jaxmem.BudgetError: when even ``lo`` does not fit.

  Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> def factory(batch):
    ...   w = jnp.ones((64, 64))
    ...   return (lambda w, x: jnp.tanh(x @ w).sum()), (w, jnp.ones((batch, 64)))
    >>> res = jaxmem.max_batch(factory, "64KiB", planner=None, lo=8)
    >>> res.peak_bytes <= res.budget_bytes
    True
    >>> [b for b, peak, ok in res.tried if b == res.batch + 1 and not ok] == [res.batch + 1]
    True
    >>> print(res.summary())  # doctest: +ELLIPSIS
    max batch:      ... (planner jit)
    ...
  """
  t0 = time.perf_counter()
  spec = budget_lib.parse_budget(budget, argname="budget")
  if spec.fraction is not None:
    raise ValueError(
        f"`budget`={budget!r} is a fraction of the unplanned peak, which grows with the batch "
        "size, so `jaxmem.max_batch` cannot search against it. Pass an absolute budget: int "
        "bytes (e.g. 2**30) or a string with a unit (e.g. \"800MiB\", \"12GiB\").")
  budget_bytes = spec.resolve(0)
  if not callable(factory):
    raise TypeError("`factory` must be a callable `factory(batch_size) -> (step, args)`, got "
                    f"{type(factory).__name__}.")
  for name, value in (("lo", lo), ("hi", hi)):
    if value is None and name == "hi":
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be a positive int batch size, got {value!r}.")
  if hi is not None and hi < lo:
    raise ValueError(f"`hi`={hi} must be >= `lo`={lo}.")
  label = _planner_label(planner)
  if label is None:
    extra = sorted(set(fit_kwargs) - set(_JIT_KWARGS))
    if extra:
      raise ValueError(f"`jaxmem.max_batch` with planner={planner!r} compiles plain `jax.jit`, "
                       f"which takes none of {extra}; only {list(_JIT_KWARGS)} apply. Pass a "
                       "planner (e.g. \"auto\") to fit with them.")
  else:
    fit(budget_bytes, planner=planner, device=device, **fit_kwargs)  # validates the options
  shown = label or UNPLANNED

  cache: dict[int, tuple[int | None, bool]] = {}
  tried: list[tuple[int, int | None, bool]] = []
  errors: dict[int, BudgetError] = {}
  reasons: dict[int, str] = {}   # why a batch size without a compiled peak does not fit

  def measure(batch: int) -> tuple[int | None, bool]:
    out = factory(batch)
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not callable(out[0]):
      raise TypeError(f"`factory({batch})` must return (step, args), got {type(out).__name__}.")
    step, args = out[0], tuple(out[1])
    nbytes = _arg_bytes(args)
    if nbytes > budget_bytes:
      # A compiled peak counts every argument: no need to compile.
      reasons[batch] = f"its arguments alone take {format_bytes(nbytes)}"
      errors[batch] = BudgetError(
          f"`jaxmem.max_batch`: the arguments of batch {batch} alone take "
          f"{format_bytes(nbytes)}, over the budget.",
          budget_bytes=budget_bytes, smallest_bytes=nbytes)
      return None, False
    if label is None:
      jit_kw = {k: fit_kwargs[k] for k in _JIT_KWARGS if k in fit_kwargs and k != "target"}
      placed = get_target(fit_kwargs.get("target")).place(args)
      peak = compiled_memory(jax.jit(step, **jit_kw).lower(*placed).compile()).peak_bytes
      return peak, peak <= budget_bytes
    # Whether a batch fits is all the search needs: no looser-plan rounds
    # unless the caller asks for them.
    kwargs = {"relax": False, **fit_kwargs}
    fitted = fit(budget_bytes, planner=planner, device=device, **kwargs)(step)
    try:
      res = fitted.fit_result(*args)
    except BudgetError as e:
      errors[batch] = e.with_traceback(None)  # its frames would keep this batch's arrays alive
      reasons[batch] = (f"jaxmem.fit found no plan within it (smallest compiled peak "
                        f"{_size(e.smallest_bytes, budget_bytes)})")
      return None, False
    return res.peak_bytes, res.peak_bytes <= budget_bytes

  def ok(batch: int) -> bool:
    if batch not in cache:
      if verbose:   # like jaxmem._src.base.progress.stage, with the outcome on the same line
        print(f"[jaxmem] max_batch ({shown}): batch {batch} ...", end="", file=sys.stderr,
              flush=True)
      t = time.perf_counter()
      try:
        cache[batch] = measure(batch)
      except BaseException:
        if verbose:
          print(f" failed after {time.perf_counter() - t:.2f} s", file=sys.stderr, flush=True)
        raise
      peak, fits = cache[batch]
      tried.append((batch, peak, fits))
      if verbose:
        if peak is not None:
          what = (f"compiled peak {_size(peak, budget_bytes)} {'<=' if fits else '>'} budget "
                  f"{format_bytes(budget_bytes)}")
        else:
          what = f"budget {format_bytes(budget_bytes)}: {reasons[batch]}"
        print(f" {'fits' if fits else 'does not fit'}: {what}, {time.perf_counter() - t:.2f} s",
              file=sys.stderr, flush=True)
    return cache[batch][1]

  if not ok(lo):
    peak = cache[lo][0]
    err = errors.get(lo)
    smallest = peak if peak is not None else err.smallest_bytes if err is not None else 0
    how = (f"its compiled peak is {_size(peak, budget_bytes)}" if peak is not None else
           reasons.get(lo, "it does not fit"))
    raise BudgetError(
        f"`jaxmem.max_batch`: even the smallest batch size tried, lo={lo}, does not fit "
        f"{format_bytes(budget_bytes)} with {'plain jax.jit' if label is None else 'planner ' + label}"
        f" ({how}). Pass a smaller `lo`, a larger budget"
        + (", or a planner (e.g. planner=\"auto\")" if label is None else "") + ".",
        budget_bytes=budget_bytes, smallest_bytes=smallest,
        holders=err.holders if err is not None else ())

  good, bad = lo, None
  while bad is None and (hi is None or good < hi):
    nxt = good * 2 if hi is None else min(good * 2, hi)
    if ok(nxt):
      good = nxt
    else:
      bad = nxt
  if bad is not None:
    while bad - good > 1:
      mid = (good + bad) // 2
      if ok(mid):
        good = mid
      else:
        bad = mid
  peak = cache[good][0]
  assert peak is not None
  return MaxBatchResult(good, peak, budget_bytes, shown, tuple(tried),
                        time.perf_counter() - t0, capped=bad is None)
