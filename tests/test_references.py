"""Every file the code, the tests and the docs cite exists in the repository."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A repository path as the sources cite it: ``ffi/copy_engine.h``, docs/design.md,
# bench/planners.py, jaxmem/_src/ir/primitives.py (a glob or a placeholder is skipped).
CITED = re.compile(r"(?<![\w/.])((?:jaxmem|ffi|docs|bench|tests|examples)/[\w./-]*\w\."
                   r"(?:py|md|h|cc|cu|json|txt))\b")
# Named on purpose although absent: a missing file a test asks for, a future schema version.
ABSENT_ON_PURPOSE = {"examples/no_such_file.py", "jaxmem/schema/program-2.json"}
SOURCES = ["jaxmem", "ffi", "tests", "bench", "examples", "docs"]


def _cited() -> dict[str, list[str]]:
  found: dict[str, list[str]] = {}
  files = [p for d in SOURCES for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".md", ".h", ".cc", ".cu") and "results" not in p.parts]
  for path in [*files, ROOT / "README.md", ROOT / "CMakeLists.txt"]:
    for m in CITED.finditer(path.read_text(encoding="utf-8", errors="replace")):
      found.setdefault(m.group(1), []).append(str(path.relative_to(ROOT)))
  return found


def test_every_cited_file_exists():
  cited = _cited()
  assert len(cited) > 30, "the pattern finds the citations"
  missing = {f: where[:3] for f, where in cited.items()
             if not (ROOT / f).exists() and f not in ABSENT_ON_PURPOSE}
  assert not missing, f"cited but not in the repository: {missing}"


def test_nothing_cites_notes_outside_the_repository():
  outside = re.compile(r"\bDESIGN\.md\b|\.\./shared|\bpapers? 00\d")
  for d in SOURCES:
    for path in (ROOT / d).rglob("*"):
      if (path.suffix in (".py", ".h", ".cc", ".cu", ".md") and path != pathlib.Path(__file__)
          and "results" not in path.parts):   # results files: what a bench run printed
        found = outside.findall(path.read_text(encoding="utf-8", errors="replace"))
        assert not found, f"{path}: {found} (cite docs/design.md, and papers by name)"
