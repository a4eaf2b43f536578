"""Where the benches write: their results files, and the README excerpt each one owns.

Every figure in ``README.md`` comes from a results file: each bench writes a
short excerpt of its results to ``bench/results/readme/<name>.md`` and
``python bench/readme.py`` copies every excerpt, verbatim, between the
``<!-- results: <name> -->`` and ``<!-- /results: <name> -->`` markers of the
README (``tests/test_readme.py`` fails when the two differ).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
EXCERPTS = RESULTS / "readme"


def write_excerpt(name: str, text: str, results: pathlib.Path = RESULTS) -> pathlib.Path:
  """Writes the README excerpt of bench ``name`` (markdown) and returns its path.

  Only a run that writes the bench's results files into ``bench/results`` also
  writes its excerpt: a run with ``--out`` elsewhere leaves the README's figures alone.
  """
  if results.resolve() != RESULTS.resolve():
    return results / "readme" / f"{name}.md"
  EXCERPTS.mkdir(parents=True, exist_ok=True)
  path = EXCERPTS / f"{name}.md"
  path.write_text(text.strip() + "\n", encoding="utf-8")
  return path


def write_report(name: str, lines: list[str], excerpt: str) -> None:
  """Writes ``bench/results/<name>.md`` (``lines``) and the README excerpt, and prints the report."""
  text = "\n".join(lines)
  (RESULTS / f"{name}.md").write_text(text + "\n", encoding="utf-8")
  write_excerpt(name, excerpt)
  print(text)


def _cost(compiled: Any) -> dict | None:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (a backend without a cost model)
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return cost or None


def flops_of(compiled: Any) -> float | None:
  """``compiled.cost_analysis()["flops"]`` (a dict, or a list of one dict per program)."""
  cost = _cost(compiled)
  return float(cost["flops"]) if cost and "flops" in cost else None


def bytes_accessed_of(compiled: Any) -> float | None:
  """``compiled.cost_analysis()["bytes accessed"]``: the compiled program's memory traffic.

  XLA:TPU counts every fusion's operands read and results written after its
  own fusion, so it is the compiler's figure for what the estimate's bytes
  model (``estimate/cost.py``) predicts. XLA:GPU compiled ahead of time has
  no cost analysis (``None``).
  """
  cost = _cost(compiled)
  return float(cost["bytes accessed"]) if cost and "bytes accessed" in cost else None


def commit(check_import: bool = True) -> str:
  """HEAD of the repository, with ``+dirty`` when jaxmem/ or examples/ have changes.

  ``check_import=False``: for a script that measures in subprocesses it
  checks itself (``bench/fit_times.py``), not with the jaxmem it imports.
  """
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "jaxmem",
                            "examples"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    # A copy of the tree without .git (the device machine): the caller says.
    return os.environ.get("JAXMEM_COMMIT", "?")
  return head + ("+dirty" if dirty else "") + (_stale_import() if check_import else "")


def _stale_import() -> str:
  """A warning for the commit when the jaxmem measured is not this checkout's.

  A bench script run from the checkout imports jaxmem from the installed
  package, which may predate the checkout (``pip install .`` again, or run
  with ``PYTHONPATH=.``): its figures would be labelled with a commit whose
  code was never measured.
  """
  module = sys.modules.get("jaxmem")
  where = getattr(module, "__file__", None)
  if not where:
    return ""
  installed = pathlib.Path(where).resolve().parent
  if installed == (ROOT / "jaxmem").resolve() or _sources(installed) == _sources(ROOT / "jaxmem"):
    return ""
  print(f"warning: measuring jaxmem installed at {pathlib.Path(where).parent}, not this "
        f"checkout ({ROOT}); run `pip install .` or set PYTHONPATH=.", file=sys.stderr)
  return " (NOT this checkout: an installed jaxmem)"


def _sources(package: pathlib.Path) -> dict[str, bytes]:
  """The package's Python sources by relative path (what a stale install differs in)."""
  return {str(p.relative_to(package)): p.read_bytes() for p in sorted(package.rglob("*.py"))}
