"""Offline Dynamic Storage Allocation (DSA): static offsets for buffers with known lifetimes.

Each buffer ``i`` is live on the half-open interval ``[lower[i], upper[i])``
(any integer time unit, e.g. op indices) and takes ``size[i]`` bytes.
:func:`solve` gives every buffer a byte offset so that no two buffers live at
the same time share a byte, trying to minimise the *footprint*
``max(offset + size)``. The *max load* -- the most bytes live at any one time
-- is a lower bound on every footprint.

DSA is NP-hard (Zhang et al., *Efficient Memory Management for GPU-based Deep
Learning Systems*, §III-A). Two algorithms run in the native extension
(``ffi/dsa.cc``):

* ``"best-fit"`` / ``"first-fit"``: SmartPool's heuristic (§III-C):
  buffers by decreasing size, each into the smallest (best-fit, the paper's
  default) or lowest (first-fit) hole left between the already placed buffers
  that overlap it in time, or on top of them. O(n² log n).
* ``"exact"`` (alias ``"auto"``): starts from the better of the two greedy
  solutions. Then MiniMalloc's decision search (Moffitt, *MiniMalloc: A
  Lightweight Memory Allocator for Hardware-Accelerated Machine Learning*,
  ASPLOS 2023; ``ffi/dsa_pack.cc``: canonical bottom-up placements,
  cross-section inference, dominance, dynamic temporal decomposition,
  round-robin preorderings) looks for a placement within ``capacity`` (when
  given), then at the max load (which is then optimal) and in a bisection on
  the capacity, each probe with a third of the time left while more than a
  quarter of the limit remains; the rest goes to a branch-and-bound on the
  footprint over the same canonical placements, pruned with cross-section
  lower bounds. When a
  search finishes the footprint is proven optimal; when ``time_limit_s``
  runs out it returns the best solution found, never worse than best-fit.
  ``goal="fit"`` stops at the first placement within ``capacity``.

Example:
  >>> from jaxmem import dsa
  >>> sol = dsa.solve(lower=[0, 1, 3], upper=[2, 4, 5], size=[4, 4, 8])
  >>> sol.offsets.tolist(), sol.footprint, sol.max_load, sol.proven_optimal
  ([0, 8, 0], 12, 12, True)
  >>> dsa.check([0, 1, 3], [2, 4, 5], [4, 4, 8], sol.offsets)
  12

The CSV format (:func:`read_csv`, :func:`write_csv`, ``python -m jaxmem dsa``)
is that of the public static-allocation benchmarks: ``id,lower,upper,size``
with an optional ``offset`` column, one buffer per line, half-open intervals.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import numbers
import os
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxmem._src.base.budget import parse_budget
from jaxmem._src.base.errors import JaxmemError, format_bytes
from jaxmem._src.native.extension import native_module as _native

__all__ = [
    "GOALS", "METHODS", "CapacityError", "CsvInstance", "Solution", "capacity_bytes", "check", "max_load",
    "read_csv", "solve", "write_csv",
]

#: Accepted values of ``solve(method=...)``.
METHODS = ("auto", "best-fit", "first-fit", "exact")
#: Accepted values of ``solve(goal=...)``.
GOALS = ("minimize", "fit")

ArrayLike = Sequence[int] | np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Solution:
  """Offsets for every buffer of a DSA instance, and how good they are.

  Attributes:
    offsets: int64 byte offset of each buffer, in input order.
    footprint: ``max(offsets + size)`` over the non-empty buffers (0 if none).
    max_load: most bytes live at one time: a lower bound on any footprint.
    proven_optimal: no valid placement has a smaller footprint (the footprint
      reached ``max_load`` or the exact search finished).
    method: algorithm that produced ``offsets``: ``"best-fit"``,
      ``"first-fit"``, ``"pack"`` (the decision search) or ``"exact"`` (the
      branch-and-bound); an exact search whose greedy start was never
      improved reports the greedy method.
    seconds: wall-clock solve time.
    nodes: branch-and-bound nodes visited (0 for the greedy methods).
    lower_bound: the best proven lower bound: ``footprint`` when proven
      optimal, else ``max_load``, or one more than a capacity the decision
      search proved too small.
    timed_out: the exact search stopped at its time or node limit.

  Example:
    >>> sol = Solution(np.array([0, 4]), 10, 8, False, "best-fit", 0.0, 0, 8, False)
    >>> round(sol.gap, 3), round(sol.ratio, 3)
    (0.25, 1.25)
  """
  offsets: np.ndarray
  footprint: int
  max_load: int
  proven_optimal: bool
  method: str
  seconds: float
  nodes: int
  lower_bound: int = 0
  timed_out: bool = False

  @property
  def gap(self) -> float:
    """Relative optimality gap ``(footprint - lower_bound) / lower_bound``; 0 when proven."""
    if self.proven_optimal or self.lower_bound <= 0:
      return 0.0
    return (self.footprint - self.lower_bound) / self.lower_bound

  @property
  def ratio(self) -> float:
    """``footprint / max_load`` (1.0 for an empty instance)."""
    return self.footprint / self.max_load if self.max_load else 1.0


class CapacityError(JaxmemError, ValueError):
  """The buffers do not fit in ``capacity`` bytes.

  Attributes:
    capacity: the capacity asked for, in bytes.
    footprint: the smallest footprint found.
    max_load: the max load (no placement can be smaller).
    solution: the :class:`Solution` with that footprint.
  """

  def __init__(self, capacity: int, solution: Solution):
    self.capacity = int(capacity)
    self.footprint = solution.footprint
    self.max_load = solution.max_load
    self.solution = solution
    head = f"`capacity`={capacity} bytes ({format_bytes(capacity)}) is too small: "
    if solution.max_load > capacity:
      # No search is run then: the max load alone proves infeasibility.
      msg = (f"the max load (bytes live at one time) is already {solution.max_load} bytes "
             f"({format_bytes(solution.max_load)}), so no placement fits (best-fit needs "
             f"{solution.footprint} bytes). Pass capacity >= {solution.max_load} at least; solve "
             "without `capacity` for the smallest footprint.")
    elif solution.proven_optimal:
      msg = (f"the smallest footprint is {solution.footprint} bytes "
             f"({format_bytes(solution.footprint)}, proven optimal). "
             f"Pass capacity >= {solution.footprint}.")
    else:
      msg = (f"the smallest footprint found is {solution.footprint} bytes "
             f"({format_bytes(solution.footprint)}; not proven optimal: the max load, a lower "
             f"bound, is {solution.max_load} bytes). Pass capacity >= {solution.footprint}, or a "
             "longer search (method=\"exact\", a larger `time_limit_s`).")
    super().__init__(head + msg)


# -- input conversion ------------------------------------------------------------


def _int_array(name: str, values: Any) -> np.ndarray:
  """``values`` as a 1-D contiguous int64 array; ValueError naming ``name`` otherwise."""
  arr = np.asarray(values)
  if arr.ndim != 1:
    raise ValueError(f"`{name}` must be a 1-D sequence of integers, got shape {arr.shape}")
  if arr.size == 0:
    return np.zeros(0, dtype=np.int64)
  if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
    try:
      arr = np.asarray([int(v) for v in arr.tolist()], dtype=np.int64)
    except OverflowError:
      raise ValueError(f"`{name}` has values past 64-bit signed integers") from None
    except (TypeError, ValueError):
      raise ValueError(f"`{name}` must contain integers, got dtype {arr.dtype}") from None
  if arr.dtype.kind == "f":
    bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (np.abs(arr) >= 2.0**63)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(f"`{name}`[{i}] = {arr[i].item()!r} is not an integer")
  if arr.dtype == np.uint64 and (arr > np.iinfo(np.int64).max).any():
    raise ValueError(f"`{name}` has values past 2**63 - 1")
  return np.ascontiguousarray(arr, dtype=np.int64)


def _instance(lower: Any, upper: Any, size: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  lo, up, sz = _int_array("lower", lower), _int_array("upper", upper), _int_array("size", size)
  if not len(lo) == len(up) == len(sz):
    raise ValueError(f"`lower`, `upper` and `size` must have the same length "
                     f"(got {len(lo)}, {len(up)}, {len(sz)})")
  return lo, up, sz


def capacity_bytes(capacity: int | str | None) -> int | None:
  """``capacity`` in bytes: int bytes, or a string with a unit (``"2GiB"``); None: no limit."""
  if capacity is None:
    return None
  if isinstance(capacity, str):
    value = parse_budget(capacity, argname="capacity").bytes
    assert value is not None
    return value
  if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
    raise TypeError(f"`capacity` must be int bytes or a string with a unit such as \"2GiB\", "
                    f"got {capacity!r}")
  if capacity < 0:
    raise ValueError(f"`capacity` must be >= 0 bytes, got {capacity}")
  return int(capacity)


# -- solving and checking -----------------------------------------------------------


def solve(lower: ArrayLike, upper: ArrayLike, size: ArrayLike, *, capacity: int | str | None = None,
          time_limit_s: float | None = 1.0, method: str = "auto",
          node_limit: int | None = None, goal: str = "minimize") -> Solution:
  """Offsets for buffers live on ``[lower, upper)`` taking ``size`` bytes.

  The GIL is released while the native solver runs.

  Args:
    lower: first time step of each buffer (ints).
    upper: first time step it is no longer live (exclusive; ``> lower``).
    size: bytes of each buffer (``>= 0``; an empty buffer gets offset 0).
    capacity: bytes available (int, or a string with a unit such as
      ``"2GiB"``); when the footprint found exceeds it, :class:`CapacityError`
      is raised. None: no limit.
    time_limit_s: wall-clock budget of the exact search (the greedy starts
      always finish); None: search until proven optimal (may take
      exponential time).
    method: ``"auto"`` (= ``"exact"``: best-fit and first-fit, then the
      branch-and-bound within the time limit, keeping the best),
      ``"exact"``, ``"best-fit"`` or ``"first-fit"``.
    node_limit: stop the exact search after this many nodes (None: no limit).
    goal: ``"minimize"`` (the smallest footprint found within the limits)
      or ``"fit"`` (stop at the first placement within ``capacity``, which
      must be given: MiniMalloc's question, and much faster when the
      capacity is above the optimum).

  Returns:
    A :class:`Solution`.

  Raises:
    ValueError: bad input (lengths differ, ``lower >= upper``, negative size,
      non-integers, unknown method), naming the buffer.
    CapacityError: the footprint found exceeds ``capacity``.

  Example:
    >>> sol = solve([0, 0, 2], [2, 3, 3], [8, 4, 8], method="best-fit")
    >>> sol.offsets.tolist(), sol.footprint, sol.max_load
    ([0, 8, 0], 12, 12)
  """
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; use one of {', '.join(map(repr, METHODS))}")
  if goal not in GOALS:
    raise ValueError(f"`goal` must be one of {', '.join(map(repr, GOALS))}; got {goal!r}")
  if goal == "fit" and capacity is None:
    raise ValueError("`goal`='fit' stops at the first placement within `capacity`: pass "
                     "`capacity` too, or goal='minimize'.")
  if time_limit_s is not None:
    time_limit_s = float(time_limit_s)
    if math.isnan(time_limit_s) or time_limit_s < 0:
      raise ValueError(f"`time_limit_s` must be >= 0 seconds or None, got {time_limit_s}")
    if math.isinf(time_limit_s):
      time_limit_s = None
  if node_limit is not None and node_limit < 0:
    raise ValueError(f"`node_limit` must be >= 0 or None, got {node_limit}")
  cap = capacity_bytes(capacity)
  lo, up, sz = _instance(lower, upper, size)
  r = _native.dsa_solve(lo, up, sz, method, cap, time_limit_s, int(node_limit or 0),
                        goal == "fit")
  sol = Solution(offsets=np.asarray(r["offsets"], dtype=np.int64), footprint=int(r["footprint"]),
                 max_load=int(r["max_load"]), proven_optimal=bool(r["proven_optimal"]),
                 method=str(r["method"]), seconds=float(r["seconds"]), nodes=int(r["nodes"]),
                 lower_bound=int(r["lower_bound"]), timed_out=bool(r["timed_out"]))
  if cap is not None and not r["feasible"]:
    raise CapacityError(cap, sol)
  return sol


def check(lower: ArrayLike, upper: ArrayLike, size: ArrayLike, offsets: ArrayLike, *,
          ids: Sequence[Any] | None = None) -> int:
  """Validates a placement; returns its footprint.

  Args:
    lower, upper, size: the instance (see :func:`solve`).
    offsets: byte offset of each buffer.
    ids: names of the buffers for the error message (default: their indices).

  Returns:
    The footprint ``max(offsets + size)`` over the non-empty buffers.

  Raises:
    ValueError: two buffers live at the same time overlap in memory (both are
      named), an offset is negative, or the instance is malformed.

  Example:
    >>> check([0, 1], [2, 3], [4, 4], [0, 4])
    8
    >>> check([0, 1], [2, 3], [4, 4], [0, 2])
    Traceback (most recent call last):
    ...
    ValueError: buffers 0 and 1 overlap: both are live at time 1 and their bytes [0, 4) and [2, 6) overlap
  """
  lo, up, sz = _instance(lower, upper, size)
  off = _int_array("offsets", offsets)
  if ids is not None and len(ids) != len(lo):
    raise ValueError(f"`ids` must have one entry per buffer (got {len(ids)} for {len(lo)})")
  name = (lambda i: str(ids[i])) if ids is not None else str
  try:
    c = _native.dsa_check(lo, up, sz, off)
  except ValueError as e:
    raise ValueError(_rename(str(e), ids)) from None
  if not c["valid"]:
    if c["second"] < 0:
      raise ValueError(f"buffer {name(c['first'])}: {c['reason']}")
    raise ValueError(f"buffers {name(c['first'])} and {name(c['second'])} overlap: {c['reason']}")
  return int(c["footprint"])


def max_load(lower: ArrayLike, upper: ArrayLike, size: ArrayLike) -> int:
  """Most bytes live at one time (a lower bound on every footprint).

  Example:
    >>> max_load([0, 1, 2], [2, 3, 4], [1, 2, 4])
    6
  """
  return int(_native.dsa_max_load(*_instance(lower, upper, size)))


def _rename(message: str, ids: Sequence[Any] | None) -> str:
  """``"buffer 3: ..."`` from the native validator -> ``"buffer <ids[3]>: ..."``."""
  if ids is None or not message.startswith("buffer "):
    return message
  head, sep, rest = message[len("buffer "):].partition(":")
  if sep and head.isdigit() and int(head) < len(ids):
    return f"buffer {ids[int(head)]}:{rest}"
  return message


# -- jaxmem programs -------------------------------------------------------------------


# -- CSV ---------------------------------------------------------------------------------


class CsvInstance(NamedTuple):
  """A DSA instance read from CSV (:func:`read_csv`).

  Attributes:
    ids: int64 id of each buffer (unique, in file order, not necessarily
      contiguous).
    lower, upper, size: the instance.
    offsets: the ``offset`` column, or None when the file has none.
  """
  ids: np.ndarray
  lower: np.ndarray
  upper: np.ndarray
  size: np.ndarray
  offsets: np.ndarray | None


_COLUMNS = ("id", "lower", "upper", "size", "offset")
#: Other names of the columns in the public benchmark files (MiniMalloc's
#: converter reads these too): ``buffer`` for ``id``, ``begin``/``start`` and
#: ``end`` for ``lower`` and ``upper``.
_ALIASES = {"buffer": "id", "begin": "lower", "start": "lower", "end": "upper"}


def read_csv(path: str | os.PathLike[str] | io.TextIOBase) -> CsvInstance:
  """Reads ``id,lower,upper,size[,offset]`` rows (half-open ``[lower, upper)``).

  A header line is optional; with one, columns may come in any order and extra
  columns are ignored; ``buffer``, ``begin``/``start`` and ``end`` are read as
  ``id``, ``lower`` and ``upper`` (the public benchmark files use both). Blank lines and lines starting with ``#`` are skipped.

  Args:
    path: a file path, ``"-"`` for stdin, or an open text file.

  Returns:
    A :class:`CsvInstance`.

  Raises:
    ValueError: a malformed file, naming the line (and the buffer id).
    OSError: the file cannot be read.

  Example:
    >>> inst = read_csv(io.StringIO("id,lower,upper,size\\n7,0,2,16\\n9,1,3,8\\n"))
    >>> inst.ids.tolist(), inst.upper.tolist(), inst.offsets is None
    ([7, 9], [2, 3], True)
  """
  if isinstance(path, (str, os.PathLike)) and str(path) != "-":
    with open(path, newline="") as f:
      return _read_rows(f, str(path))
  if str(path) == "-":
    return _read_rows(sys.stdin, "<stdin>")
  return _read_rows(path, str(getattr(path, "name", "<csv>")))


def _read_rows(f: Iterable[str], where: str) -> CsvInstance:
  columns: dict[str, int] | None = None
  rows: list[tuple[int, ...]] = []
  has_offset = None
  seen: dict[int, int] = {}
  for lineno, fields in _csv_lines(f):
    if columns is None and not is_int(fields[0]):  # the header
      names = [_ALIASES.get(x.strip().lower(), x.strip().lower()) for x in fields]
      missing = [c for c in _COLUMNS[:4] if c not in names]
      if missing:
        raise ValueError(f"{where}:{lineno}: header {','.join(fields)!r} lacks column(s) "
                         f"{', '.join(missing)}; expected id,lower,upper,size[,offset]")
      columns = {c: names.index(c) for c in _COLUMNS if c in names}
      continue
    if columns is None:
      if len(fields) not in (4, 5):
        raise ValueError(f"{where}:{lineno}: expected 4 or 5 columns (id,lower,upper,size"
                         f"[,offset]), got {len(fields)}")
      columns = {c: i for i, c in enumerate(_COLUMNS[:len(fields)])}
    if has_offset is None:
      has_offset = "offset" in columns
    need = max(columns.values()) + 1
    if len(fields) < need:
      raise ValueError(f"{where}:{lineno}: expected {need} columns, got {len(fields)}")
    values = []
    for c in _COLUMNS[:5 if has_offset else 4]:
      text = fields[columns[c]].strip()
      if not is_int(text):
        raise ValueError(f"{where}:{lineno}: {c} {text!r} is not an integer")
      values.append(int(text))
    bid, lo, up, sz = values[:4]
    if bid in seen:
      raise ValueError(f"{where}:{lineno}: duplicate id {bid} (first on line {seen[bid]})")
    seen[bid] = lineno
    if lo >= up:
      raise ValueError(f"{where}:{lineno}: buffer {bid}: lower ({lo}) must be < upper ({up}); "
                       "intervals are half-open [lower, upper)")
    if sz < 0:
      raise ValueError(f"{where}:{lineno}: buffer {bid}: size must be >= 0, got {sz}")
    if has_offset and values[4] < 0:
      raise ValueError(f"{where}:{lineno}: buffer {bid}: offset must be >= 0, got {values[4]}")
    rows.append(tuple(values))
  try:
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 5 if has_offset else 4)
  except OverflowError:
    raise ValueError(f"{where}: values must fit in 64-bit signed integers") from None
  return CsvInstance(ids=table[:, 0].copy(), lower=table[:, 1].copy(), upper=table[:, 2].copy(),
                     size=table[:, 3].copy(), offsets=table[:, 4].copy() if has_offset else None)


def _csv_lines(f: Iterable[str]) -> Iterable[tuple[int, list[str]]]:
  for lineno, fields in enumerate(csv.reader(f), start=1):
    if not fields or all(not x.strip() for x in fields) or fields[0].lstrip().startswith("#"):
      continue
    yield lineno, fields


def is_int(text: str) -> bool:
  text = text.strip()
  return text.lstrip("+-").isdigit()


def write_csv(path: str | os.PathLike[str] | io.TextIOBase, lower: ArrayLike, upper: ArrayLike,
              size: ArrayLike, offsets: ArrayLike | None = None, *,
              ids: ArrayLike | None = None) -> None:
  """Writes ``id,lower,upper,size[,offset]`` with a header line.

  Args:
    path: a file path, ``"-"`` for stdout, or an open text file.
    lower, upper, size: the instance.
    offsets: adds the ``offset`` column when given.
    ids: buffer ids (default ``0..n-1``).

  Example:
    >>> out = io.StringIO()
    >>> write_csv(out, [0, 1], [2, 3], [16, 8], offsets=[0, 16], ids=[7, 9])
    >>> print(out.getvalue(), end="")
    id,lower,upper,size,offset
    7,0,2,16,0
    9,1,3,8,16
  """
  lo, up, sz = _instance(lower, upper, size)
  cols = [np.arange(len(lo), dtype=np.int64) if ids is None else _int_array("ids", ids), lo, up, sz]
  if offsets is not None:
    cols.append(_int_array("offsets", offsets))
  if any(len(c) != len(lo) for c in cols):
    raise ValueError("`ids` and `offsets` must have one entry per buffer")
  header = ",".join(_COLUMNS[:len(cols)])
  text = header + "\n" + "".join(",".join(map(str, row)) + "\n" for row in zip(*(c.tolist() for c in cols)))
  if isinstance(path, (str, os.PathLike)) and str(path) != "-":
    pathlib.Path(path).write_text(text)
  else:
    (sys.stdout if str(path) == "-" else path).write(text)


def summary(sol: Solution, *, n: int, source: str = "", requested: str = "",
            time_limit_s: float | None = None) -> str:
  """Human-readable lines: footprint, max load, ratio, proven or not, time."""
  if sol.proven_optimal:
    proof = "proven optimal" + (" (footprint = max load)" if sol.footprint == sol.max_load
                                else f" (search finished, {sol.nodes:,} nodes)")
  elif sol.timed_out:
    proof = (f"not proven (time limit {time_limit_s:g} s reached after {sol.nodes:,} nodes; "
             f"gap to max load <= {100 * sol.gap:.2f}%)")
  else:
    proof = f"not proven (gap to max load <= {100 * sol.gap:.2f}%)"
  lines = [
      f"dsa: {n} buffers" + (f" from {source}" if source else ""),
      f"  max load:   {sol.max_load:,} bytes ({format_bytes(sol.max_load)}), a lower bound",
      (f"  footprint:  {sol.footprint:,} bytes ({format_bytes(sol.footprint)}), "
       f"ratio {sol.ratio:.4f}"),
      f"  optimality: {proof}",
      f"  method:     {sol.method}" + (f" (requested {requested})"
                                       if requested and requested != sol.method else ""),
      f"  time:       {sol.seconds:.3f} s",
  ]
  return "\n".join(lines)
