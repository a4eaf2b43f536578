"""README.md's figures are copied from bench/results/, and it opens with the quickstart."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _readme_tool():
  spec = importlib.util.spec_from_file_location("bench_readme", ROOT / "bench" / "readme.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_results_block_is_the_excerpt_its_bench_wrote():
  tool = _readme_tool()
  text = README.read_text(encoding="utf-8")
  names = tool.blocks(text)
  assert names, "README.md has no results blocks"
  written = {p.stem for p in tool.EXCERPTS.glob("*.md")}
  assert set(names) == written, "each bench's excerpt is shown once, and only those"
  assert tool.synced(text) == text, "README.md is stale: run `python bench/readme.py`"


# A measured figure: a number with a unit of memory, time, share or ratio.
FIGURE = re.compile(r"[+-]?\d+(?:\.\d+)?\s?(?:%|[KMGT]i?B\b|ms\b|s\b|x\b|×)")


def _prose(text: str) -> str:
  """README.md without results blocks, code blocks and inline code."""
  text = re.sub(r"<!-- results: (\w+) -->.*?<!-- /results: \1 -->", "", text, flags=re.DOTALL)
  text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
  return re.sub(r"`[^`]*`", "", text)


def test_no_figure_outside_the_results_blocks():
  found = FIGURE.findall(_prose(README.read_text(encoding="utf-8")))
  assert not found, f"figures in README.md prose (move them into a bench's excerpt): {found}"


def test_the_checker_sees_a_figure_in_prose():
  assert FIGURE.findall(_prose("the peak went down by 42% to 1.5 GiB in 3 s\n"))
  assert not FIGURE.findall(_prose("`fit(0.5)` on 2 cores, jax 0.10.2\n"))


def test_the_quickstart_is_two_commands_at_the_top():
  text = README.read_text(encoding="utf-8")
  block = re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL)
  assert block and text.index("```bash") < text.index("\n## ")
  lines = [line for line in block.group(1).splitlines() if line.strip()]
  assert lines == ['pip install ".[examples]" && python -m jaxmem demo',
                   'pip install ".[test]" && pytest -q']
