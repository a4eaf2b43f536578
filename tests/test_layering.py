"""The package is layered: each folder of ``jaxmem/_src`` imports only the layers before it.

Every import counts: module level, inside functions, ``TYPE_CHECKING`` blocks and
``importlib.import_module("jaxmem...")`` calls with a literal name. Any upward
import fails, and so does any cycle between modules, even inside one layer.
The order is the data flow (``docs/design.md``, "Layers"):

    _compat -> base -> native -> ir -> estimate -> plan -> planners -> lower -> verify
      -> report -> api -> cli -> the public modules (jaxmem, jaxmem.dsa, jaxmem.native)
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxmem"

#: Lowest first. A module may import its own layer and the ones before it.
LAYERS = ("_compat", "base", "native", "ir", "estimate", "plan", "planners", "lower", "verify",
          "report", "api", "cli", "public")


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = path.relative_to(root.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
  """The layer of a ``jaxmem`` module (None: not one of ours)."""
  parts = module.split(".")
  if parts[0] != "jaxmem":
    return None
  if len(parts) == 1 or parts[1] in ("dsa", "native", "__main__"):
    return "public"
  if parts[1] == "_native":
    return "native"           # the C++ extension itself
  if parts[1] != "_src":
    return None
  if len(parts) == 2:
    return "_src"             # the package docstring: it imports nothing
  return parts[2]


def imports_of(path: pathlib.Path, module: str, modules: set[str]) -> Iterator[tuple[int, str]]:
  """``(line, imported jaxmem module)`` for every import in a file, wherever it sits."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      for alias in node.names:
        # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b
        full = f"{source}.{alias.name}"
        yield node.lineno, full if full in modules else source
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "import_module" and node.args
          and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      yield node.lineno, node.args[0].value


def import_graph(root: pathlib.Path) -> dict[str, list[tuple[int, str]]]:
  """Per module of the package at ``root``, the package modules it imports."""
  files = {module_name(p, root): p for p in root.rglob("*.py")}
  modules = set(files) | {"jaxmem._native"}
  graph: dict[str, list[tuple[int, str]]] = {}
  for module, path in files.items():
    graph[module] = [(line, target) for line, target in imports_of(path, module, modules)
                     if layer_of(target) is not None and target != module]
  return graph


def violations(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
  """Upward imports and unknown layers, one line each."""
  out = []
  for module, edges in sorted(graph.items()):
    layer = layer_of(module)
    if layer not in LAYERS and layer != "_src":
      out.append(f"{module}: folder {layer!r} is in no layer; add it to LAYERS in order")
      continue
    for line, target in edges:
      target_layer = layer_of(target)
      if layer == "_src" or target_layer not in LAYERS:
        out.append(f"{module}:{line} imports {target}, which is in no layer")
      elif LAYERS.index(target_layer) > LAYERS.index(layer):
        out.append(f"{module}:{line} imports {target}: layer {target_layer!r} is above "
                   f"{layer!r}")
  return out


def cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for _, w in graph.get(v, ()):
      if w not in graph:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_every_import_goes_down_the_layers():
  graph = import_graph(ROOT)
  assert len(graph) > 50, "the package was not found"
  problems = violations(graph)
  assert not problems, "upward imports:\n" + "\n".join(problems)


def test_no_import_cycles_counting_function_level_imports():
  found = cycles(import_graph(ROOT))
  assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_folders_are_the_layers():
  folders = {p.name for p in (ROOT / "_src").iterdir() if p.is_dir() and p.name != "__pycache__"}
  modules = {p.stem for p in (ROOT / "_src").glob("*.py") if p.stem != "__init__"}
  assert folders | modules == set(LAYERS) - {"public"}


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
  root = tmp_path / "jaxmem"
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root


@pytest.mark.parametrize("where", ["module level", "in a function", "importlib"])
def test_the_checker_finds_an_upward_import(tmp_path, where):
  line = {"module level": "from jaxmem._src.api import fit\n",
          "in a function": "def f():\n  from jaxmem._src.api.fit import fit\n",
          "importlib": "import importlib\nimportlib.import_module('jaxmem._src.api.fit')\n"}[where]
  root = _tree(tmp_path, {"__init__.py": "", "_src/__init__.py": "", "_src/ir/__init__.py": "",
                          "_src/ir/trace.py": line, "_src/api/__init__.py": "",
                          "_src/api/fit.py": ""})
  problems = violations(import_graph(root))
  assert problems and "jaxmem._src.ir.trace" in problems[0] and "'api' is above 'ir'" in problems[0]


def test_the_checker_finds_a_cycle_inside_a_layer(tmp_path):
  root = _tree(tmp_path, {"__init__.py": "", "_src/__init__.py": "", "_src/ir/__init__.py": "",
                          "_src/ir/a.py": "from jaxmem._src.ir import b\n",
                          "_src/ir/b.py": "def f():\n  from jaxmem._src.ir.a import x\n"})
  graph = import_graph(root)
  assert not violations(graph)
  assert cycles(graph) == [["jaxmem._src.ir.a", "jaxmem._src.ir.b"]]
