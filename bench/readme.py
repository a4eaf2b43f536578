"""Copies the benches' README excerpts (``bench/results/readme/*.md``) into ``README.md``.

Run: ``python bench/readme.py`` after a bench run; ``python bench/readme.py --check``
exits with status 1 when the README's figures differ from the results files (CI
runs the same check through ``tests/test_readme.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXCERPTS = ROOT / "bench" / "results" / "readme"
BLOCK = re.compile(r"(<!-- results: (?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /results: (?P=name) -->)",
                   re.DOTALL)


def synced(text: str, excerpts: pathlib.Path = EXCERPTS) -> str:
  """``text`` with every results block replaced by its excerpt file."""
  def fill(m: re.Match[str]) -> str:
    path = excerpts / f"{m['name']}.md"
    if not path.exists():
      raise FileNotFoundError(f"README.md has a results block '{m['name']}' but {path} does not "
                              f"exist: run bench/{m['name']}.py (or fix the block's name).")
    return m.group(1) + path.read_text(encoding="utf-8") + m.group(4)
  return BLOCK.sub(fill, text)


def blocks(text: str) -> list[str]:
  """The names of the results blocks in ``text``, in order."""
  return [m["name"] for m in BLOCK.finditer(text)]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--check", action="store_true", help="report, do not write")
  a = ap.parse_args()
  text = README.read_text(encoding="utf-8")
  new = synced(text)
  unused = sorted({p.stem for p in EXCERPTS.glob("*.md")} - set(blocks(text)))
  if unused:
    print(f"excerpts not shown in README.md: {', '.join(unused)}", file=sys.stderr)
  if new == text:
    print("README.md figures match bench/results/readme/")
    return 0
  if a.check:
    print("README.md differs from bench/results/readme/: run `python bench/readme.py`",
          file=sys.stderr)
    return 1
  README.write_text(new, encoding="utf-8")
  print(f"updated {', '.join(blocks(text))} in README.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
