"""Where the benches write: their results files, and the README excerpt each one owns.

Every figure in ``README.md`` comes from a results file: each bench writes a
short excerpt of its results to ``bench/results/readme/<name>.md`` and
``python bench/readme.py`` copies every excerpt, verbatim, between the
``<!-- results: <name> -->`` and ``<!-- /results: <name> -->`` markers of the
README (``tests/test_readme.py`` fails when the two differ).
"""

from __future__ import annotations

import pathlib

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
