"""Progress lines for long work, on stderr: ``[jaxmem] tracing ... done in 1.2 s``.

>>> from jaxmem._src.base.progress import stage
>>> with stage("tracing", quiet=True):
...   pass
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import IO, Iterator


class Stage:
  """A running stage; ``elapsed`` is its duration so far (final once the block exits)."""

  def __init__(self, name: str):
    self.name = name
    self.start = time.perf_counter()
    self.end: float | None = None

  @property
  def elapsed(self) -> float:
    return (self.end if self.end is not None else time.perf_counter()) - self.start


@contextlib.contextmanager
def stage(name: str, *, quiet: bool = False, stream: IO[str] | None = None) -> Iterator[Stage]:
  """Prints ``[jaxmem] name ...`` on entry and ``done in X s`` (or ``failed after X s``) on exit.

  Args:
    name: what is being done ("tracing examples/mlp.py:build").
    quiet: print nothing (the elapsed time is still measured).
    stream: where to print; ``sys.stderr`` (looked up at call time) by default.

  Yields:
    A :class:`Stage` whose ``elapsed`` gives the seconds spent.
  """
  out = stream if stream is not None else sys.stderr
  st = Stage(name)
  if not quiet:
    print(f"[jaxmem] {name} ...", end="", file=out, flush=True)
  ok = False
  try:
    yield st
    ok = True
  finally:
    st.end = time.perf_counter()
    if not quiet:
      word = "done in" if ok else "failed after"
      print(f" {word} {st.elapsed:.2f} s", file=out, flush=True)
