"""``python -m jaxmem report MODULE:FACTORY``: report text, --json and its schema, --budget,
--compare, optional writers, and one-line errors (exit status 2) for bad input."""

from __future__ import annotations

import contextlib
import importlib.resources
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from jaxmem.__main__ import main
from jaxmem._src.cli import common as cli
from jaxmem._src.base.progress import stage

ROOT = pathlib.Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.py") + ":build"
CNN = str(ROOT / "examples" / "cnn.py") + ":build"
MLP_KW = ["--kw", "batch_size=256", "--kw", "width=64", "--kw", "depth=4"]
SCHEMA_NAME = "jaxmem.program/1"


def _schema() -> dict:
  return json.loads((importlib.resources.files("jaxmem") / "schema" / "program-1.json").read_text())


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
  """One in-process run with --budget, --compare and --json, shared by the checks below."""
  path = tmp_path_factory.mktemp("cli") / "mlp.json"
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(["report", MLP, *MLP_KW, "--top", "5", "--budget", "0.5", "--compare",
               "--json", str(path)])
  return rc, out.getvalue(), err.getvalue(), path


def test_mlp_report_text(mlp_run):
  rc, out, err, _ = mlp_run
  assert rc == 0, err
  assert re.search(r"jaxmem lifetime report: \d+ ops, \d+ values", out)
  assert "estimated peak:" in out and "live at the peak, by role:" in out
  assert "activation" in out and "parameter" in out and "optimizer_state" in out
  assert "top 5 buffers at the peak" in out
  assert "mlp.py:" in out                           # the user's own source lines
  # progress on stderr, with elapsed seconds, never on stdout
  assert "[jaxmem] tracing" in err and re.search(r"done in \d+\.\d+ s", err)
  assert "[jaxmem]" not in out


def test_mlp_budget_prints_plan(mlp_run):
  _, out, _, _ = mlp_run
  assert "budget:" in out and "of the estimated peak" in out
  assert "Plan (auto(" in out and "estimated peak:" in out and "planned (target" in out


def test_mlp_compare_prints_both_peaks(mlp_run):
  _, out, _, _ = mlp_run
  est = re.search(r"estimated peak \(jaxmem\): +([\d.]+) (KiB|MiB)", out)
  comp = re.search(r"compiled peak \(XLA\): +([\d.]+) (KiB|MiB)", out)
  assert est and comp, out
  assert float(est.group(1)) > 0 and float(comp.group(1)) > 0
  rel = re.search(r"difference: +([+-]\d+\.\d)%", out)
  assert rel
  scale = {"KiB": 1, "MiB": 1024}
  e = float(est.group(1)) * scale[est.group(2)]
  c = float(comp.group(1)) * scale[comp.group(2)]
  assert abs(float(rel.group(1)) - 100 * (e / c - 1)) < 1.0
  assert "explained by:" in out


def test_mlp_json(mlp_run):
  _, out, _, path = mlp_run
  assert f"wrote {path}" in out
  data = json.loads(path.read_text())
  assert data["schema"] == SCHEMA_NAME
  n = data["num_ops"]
  assert len(data["ops"]) == n and len(data["live_bytes"]) == n + 1
  assert max(data["live_bytes"]) == data["peak_bytes"] == data["live_bytes"][data["peak_index"]]
  assert [v["id"] for v in data["values"]] == list(range(len(data["values"])))
  assert [o["index"] for o in data["ops"]] == list(range(n))
  # the report's peak is the JSON's peak
  assert str(n) in out.splitlines()[0]


# -- the JSON schema ------------------------------------------------------------


def _validate(inst, schema, root=None, where="$"):  # noqa: C901 (a tiny draft 2020-12 subset)
  """Validates the keywords program-1.json uses; raises AssertionError naming the path."""
  root = root or schema
  if "$ref" in schema:
    ref = schema["$ref"]
    assert ref.startswith("#/"), ref
    target = root
    for part in ref[2:].split("/"):
      target = target[part]
    _validate(inst, target, root, where)
  types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
  if "type" in schema:
    allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]

    def is_type(t):
      if t == "integer":
        return isinstance(inst, int) and not isinstance(inst, bool)
      if t == "number":
        return isinstance(inst, (int, float)) and not isinstance(inst, bool)
      return isinstance(inst, types[t])
    assert any(is_type(t) for t in allowed), f"{where}: {inst!r:.60} is not {allowed}"
  if "const" in schema:
    assert inst == schema["const"], f"{where}: {inst!r} != {schema['const']!r}"
  if "enum" in schema:
    assert inst in schema["enum"], f"{where}: {inst!r} not in {schema['enum']}"
  if "minimum" in schema and isinstance(inst, (int, float)) and not isinstance(inst, bool):
    assert inst >= schema["minimum"], f"{where}: {inst} < {schema['minimum']}"
  if isinstance(inst, dict):
    for key in schema.get("required", ()):
      assert key in inst, f"{where}: missing {key!r}"
    props = schema.get("properties", {})
    for key, val in inst.items():
      if key in props:
        _validate(val, props[key], root, f"{where}.{key}")
      else:
        assert schema.get("additionalProperties", True) is not False, f"{where}: extra {key!r}"
  if isinstance(inst, list):
    assert len(inst) >= schema.get("minItems", 0), f"{where}: too short"
    assert len(inst) <= schema.get("maxItems", len(inst)), f"{where}: too long"
    if "items" in schema:
      for i, item in enumerate(inst):
        _validate(item, schema["items"], root, f"{where}[{i}]")


def test_schema_file_is_draft_2020_12():
  schema = _schema()
  assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
  assert schema["properties"]["schema"]["const"] == SCHEMA_NAME
  from jaxmem._src.report import json_doc
  assert json_doc.SCHEMA == SCHEMA_NAME


def test_json_matches_schema(mlp_run):
  data = json.loads(mlp_run[3].read_text())
  schema = _schema()
  _validate(data, schema)
  # and the validator does reject what the schema forbids
  bad = dict(data, values=[dict(data["values"][0], role="weights")])
  with pytest.raises(AssertionError, match="role"):
    _validate(bad, schema)
  with pytest.raises(AssertionError, match="schema"):
    _validate(dict(data, schema="jaxmem.program/2"), schema)
  # semantics the schema cannot express (docs/json_schema.md)
  n = data["num_ops"]
  for v in data["values"]:
    s, e = v["interval"]
    assert 0 <= s <= e <= n
    assert v["uses"] == sorted(set(v["uses"]))
    assert (v["defined_by"] < 0) == (v["role"] in ("parameter", "optimizer_state", "input",
                                                    "constant"))
    if v["is_output"]:
      assert e == n
    es, ee = v.get("estimated_interval", v["interval"])   # additive fields of version 1
    assert es <= s and ee <= n
    if ee < e:
      # Read later only by optimizer-update ops, which XLA runs as early as it
      # can; by a reader that takes over its buffer right after `ee` (an
      # in-place update, an elementwise result written over it); or by
      # readers that recompute it from its inputs, still live.
      late = [u for u in v["uses"] if u > ee] or [v["defined_by"]]

      def explained(u):
        if u < 0:
          return False
        op = data["ops"][u]
        if op["phase"] == "other":
          return True
        if u == ee + 1 and v["id"] in op["inputs"]:
          return True                             # its buffer taken by the reader
        if op["primitive"] in ("conv_general_dilated", "gather", "scatter", "scatter-add",
                               "select_and_scatter_add"):
          return True                             # read through a copy made early
        maker = data["ops"][v["defined_by"]] if v["defined_by"] >= 0 else None
        return maker is not None and any(
            data["values"][w].get("fused") or
            data["values"][w].get("estimated_interval", [0, n])[1] >= u
            for w in maker["inputs"] if isinstance(w, int))
      assert all(explained(u) for u in late), (v, ee)
  values = data["values"]
  held = [values[h]["bytes"] for h in data["holders_at_peak"]]
  assert held == sorted(held, reverse=True) and sum(held) <= data["peak_bytes"]
  p = data["peak_index"]
  for h in data["holders_at_peak"]:
    v = values[h]
    assert not v.get("fused", False) and v["bytes"] > 0
    es, ee = v.get("estimated_interval", v["interval"])
    assert es <= p <= ee


def test_json_matches_schema_jsonschema(mlp_run):
  jsonschema = pytest.importorskip("jsonschema")
  jsonschema.Draft202012Validator.check_schema(_schema())
  jsonschema.validate(json.loads(mlp_run[3].read_text()), _schema(),
                      cls=jsonschema.Draft202012Validator)


# -- other models and forms -----------------------------------------------------


def test_cnn_report_with_budget_bytes(capsys, tmp_path):
  path = tmp_path / "cnn.json"
  rc = main(["report", CNN, "--kw", "batch_size=8", "--budget", "4MiB", "--top", "3",
             "--json", str(path), "-q"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert "conv_general_dilated" in out or "cnn.py:" in out
  assert "top 3 buffers at the peak" in out
  assert "budget: 4.00 MiB = 4194304 bytes" in out and "Plan (auto(" in out
  assert err == ""                                  # -q: no progress lines
  assert json.loads(path.read_text())["schema"] == SCHEMA_NAME


def test_module_name_form(capsys):
  # `mlp` is importable: tests/conftest.py puts examples/ on sys.path
  rc = main(["report", "mlp:build", "--kw", "batch_size=32", "--kw", "width=16",
             "--kw", "depth=2", "-q", "--top", "2"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert "jaxmem lifetime report:" in out and "top 2 buffers" in out


def test_subprocess_mlp(tmp_path):
  path = tmp_path / "m.json"
  env = dict(os.environ)
  # Run outside the source tree: from the repository root, `python -m jaxmem`
  # would import the unbuilt source package instead of the installed one.
  target = f"{ROOT / 'examples' / 'mlp.py'}:build"
  r = subprocess.run([sys.executable, "-m", "jaxmem", "report", target, *MLP_KW,
                      "--json", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  assert "jaxmem lifetime report:" in r.stdout and "estimated peak:" in r.stdout
  assert f"[jaxmem] importing {target} ..." in r.stderr
  assert "Traceback" not in r.stderr
  assert json.loads(path.read_text())["schema"] == SCHEMA_NAME


def test_subprocess_bad_input_is_one_line(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxmem", "report",
                      f"{ROOT / 'examples' / 'mlp.py'}:bild"],
                     cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2
  assert "Traceback" not in r.stderr
  lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("[jaxmem]")]
  assert len(lines) == 1 and "has no attribute 'bild'" in lines[0] and "build" in lines[0]


# -- bad input: exit 2, one line saying what would work ------------------------


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
  (tmp_path / "factories.py").write_text(textwrap.dedent("""
      import jax.numpy as jnp
      WIDTH = 3
      def one():
          return lambda x: x
      def three():
          return (lambda x: x), (jnp.ones(2),), 1
      def not_callable_step():
          return 1, (jnp.ones(2),)
      def args_not_tuple():
          return (lambda x: x), jnp.ones(2)
      def raises():
          raise RuntimeError("boom in user code")
      def bad_args():
          return (lambda x: x), ("text",)
      def ok(n=4):
          return (lambda x: (x * 2).sum()), (jnp.ones(n),)
  """))
  (tmp_path / "broken.py").write_text("import jax\nraise ValueError('broken at import')\n")
  (tmp_path / "needs_dep.py").write_text("import surely_not_installed_pkg\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  return tmp_path


BAD = [
    (["examples/mlp.py"], "no ':FACTORY' part"),
    (["examples/no_such_file.py:build"], "does not exist"),
    (["no_such_module_xyz:build"], "no module named 'no_such_module_xyz'"),
    (["examples/mlp.py:bild"], "callables defined there: build"),
    (["{d}/factories.py:WIDTH"], "is not callable (it is int 3)"),
    (["factories:missing"], "has no attribute 'missing'"),
    (["factories:one"], "returned a function. FACTORY must return a 2-tuple (step, args)"),
    (["factories:three"], "of length 3"),
    (["factories:not_callable_step"], "first item is not callable"),
    (["factories:args_not_tuple"], "args is not a tuple or list"),
    (["factories:raises"], "raised RuntimeError: boom in user code"),
    (["factories:bad_args"], "not an array"),
    (["factories:ok", "--kw", "m=3"], "unexpected keyword argument 'm'; its signature is ok(n=4)"),
    (["broken:f"], "importing 'broken' raised ValueError: broken at import"),
    (["needs_dep:f"], "No module named 'surely_not_installed_pkg'"),
    (["factories:ok", "--budget", "2.0"], "must be in (0, 1]"),
    (["factories:ok", "--budget", "12XB"], "is not a size"),
    (["factories:ok", "--perfetto", "t.json"], "needs --budget"),
    (["factories:ok", "--budget", "1MiB", "--planner", "nope"], "not a known planner"),
    (["factories:ok", "--budget", "1MiB", "--device", "tpu-v99"], "not a known profile"),
    (["3rd-party:f"], "neither a .py file nor a module name"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[a[0].split("/")[-1] + "-" + m[:20]
                                                   for a, m in BAD])
def test_bad_input_exits_2(argv, message, user_modules, capsys):
  argv = [a.format(d=user_modules) for a in argv]
  rc = main(["report", *argv, "-q"])
  out, err = capsys.readouterr()
  assert rc == 2
  assert out == ""
  assert err.startswith("jaxmem report: error: ") and err.count("\n") == 1, err
  assert message in err, err
  assert "Traceback" not in err


def test_bad_kw_is_argparse_error(capsys):
  with pytest.raises(SystemExit) as e:
    main(["report", MLP, "--kw", "batch_size"])
  assert e.value.code == 2
  assert "is not key=value" in capsys.readouterr().err


def test_traceback_flag_reraises(user_modules):
  with pytest.raises(RuntimeError, match="boom"):
    main(["report", "factories:raises", "-q", "--traceback"])


def test_ok_user_factory(user_modules, capsys):
  rc = main(["report", "factories:ok", "--kw", "n=1024", "-q"])
  out, _ = capsys.readouterr()
  assert rc == 0 and "4.00 KiB" in out


def test_parse_kw():
  assert cli.parse_kw("batch_size=256") == ("batch_size", 256)
  assert cli.parse_kw("lr=1e-3") == ("lr", 1e-3)
  assert cli.parse_kw("flag=True") == ("flag", True)
  assert cli.parse_kw("flag=false") == ("flag", False)
  assert cli.parse_kw("x=none") == ("x", None)
  assert cli.parse_kw("name=bfloat16") == ("name", "bfloat16")
  assert cli.parse_kw("s='3'") == ("s", "3")
  assert cli.parse_kw("channels=(8,16)") == ("channels", (8, 16))
  assert cli.parse_kw("path=a=b") == ("path", "a=b")
  assert cli.budget_arg("0.5") == 0.5 and cli.budget_arg("1000") == 1000
  assert cli.budget_arg("2e9") == 2_000_000_000 and cli.budget_arg("12GiB") == "12GiB"


def test_stage(capsys):
  with stage("thinking") as st:
    pass
  with stage("hidden", quiet=True):
    pass
  with pytest.raises(ValueError), stage("failing"):
    raise ValueError
  out, err = capsys.readouterr()
  assert out == ""
  assert re.match(r"\[jaxmem\] thinking \.\.\. done in \d+\.\d\d s\n", err)
  assert "hidden" not in err and "[jaxmem] failing ... failed after" in err
  assert st.elapsed >= 0


# -- optional writers (other modules; skipped until they exist) ----------------


def _optional(tmp_path, capsys, flag, suffix, extra=()):
  path = tmp_path / f"out{suffix}"
  rc = main(["report", "factories:ok", "--kw", "n=4096", "-q", flag, str(path), *extra])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert path.exists() and path.stat().st_size > 0
  assert f"wrote {path}" in out
  return path


def test_html(tmp_path, capsys, user_modules):
  text = _optional(tmp_path, capsys, "--html", ".html", ["--budget", "0.5"]).read_text()
  assert "<html" in text.lower()


def test_png(tmp_path, capsys, user_modules):
  pytest.importorskip("matplotlib")
  data = _optional(tmp_path, capsys, "--png", ".png").read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_perfetto(tmp_path, capsys, user_modules):
  path = _optional(tmp_path, capsys, "--perfetto", ".json", ["--budget", "0.5"])
  json.loads(path.read_text())


def test_png_without_matplotlib_fails_that_flag_only(tmp_path, capsys, user_modules, monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` raises ImportError
  js = tmp_path / "p.json"
  rc = main(["report", "factories:ok", "-q", "--png", str(tmp_path / "r.png"),
             "--json", str(js)])
  out, err = capsys.readouterr()
  assert rc == 1
  assert "--png" in err and "matplotlib" in err and "wrote" not in err
  assert not (tmp_path / "r.png").exists()
  assert js.exists() and f"wrote {js}" in out        # the other flags still work


def test_unwritable_output_fails_that_flag_only(tmp_path, capsys, user_modules):
  js = tmp_path / "p.json"
  bad = tmp_path / "no such dir" / "r.html"
  rc = main(["report", "factories:ok", "-q", "--html", str(bad), "--json", str(js)])
  out, err = capsys.readouterr()
  assert rc == 1
  assert f"--html {bad}" in err and f"wrote {bad}" not in out
  assert js.exists() and f"wrote {js}" in out


def test_report_for_a_tpu_target(capsys):
  """`--target tpu:v5e`: the estimate models XLA:TPU and --compare compiles for it."""
  pytest.importorskip("libtpu")
  rc = main(["report", "mlp:build", "--kw", "batch_size=32", "--kw", "width=16",
             "--target", "tpu:v5e", "--compare", "--top", "2", "-q"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "compiled peak (XLA)" in out


def test_report_rejects_an_unknown_target(capsys):
  rc = main(["report", "mlp:build", "--target", "tpu:v9", "-q"])
  err = capsys.readouterr().err
  assert rc == 2 and "--target" in err and "tpu:<chip>" in err


def test_demo_fits_half_its_peak_here(capsys):
  from jaxmem._src.cli.demo import run_demo  # noqa: PLC0415
  assert run_demo(batch_size=4096, steps=1) == 0
  out = capsys.readouterr().out
  assert "not reachable" not in out
  assert re.search(r"verified compiled peak .* \(budget [^;)]*\): OK; largest difference from "
                   r"jax.jit over 1 steps: 0;", out)


def test_demo_goes_on_with_the_smallest_reachable_budget(capsys):
  # Out of reach (as half the peak is on a GPU): the demo fits the smallest
  # budget the `BudgetError` reports, as a user would, and says so.
  from jaxmem._src.cli.demo import run_demo  # noqa: PLC0415
  assert run_demo(batch_size=1024, steps=1, budget=0.02) == 0
  out = capsys.readouterr().out
  assert "cannot fit `step`" in out
  smallest = re.search(r"smallest peak reachable: +(\S+ \S+)", out).group(1)
  assert f"fitting the smallest reachable budget the error reports, {smallest}, instead" in out
  assert re.search(rf"\(budget {re.escape(smallest)}; the budget asked, .* is not reachable "
                   r"on this device\): OK; largest difference from jax.jit over 1 steps: 0;", out)


@pytest.mark.parametrize("argv,message", [
    (["--budget", "abc"], "`--budget`='abc' is not a size"),
    (["--budget", "1e400"], "is too large to be a number of bytes"),
    (["--budget", "2.0"], "must be in (0, 1]"),
    (["--batch", "0"], "`--batch` must be a positive batch size"),
])
def test_demo_bad_arguments_are_one_line_before_anything_runs(argv, message, capsys):
  # Before, a bad --budget printed the whole lifetime report, then a traceback.
  rc = main(["demo", *argv])
  out, err = capsys.readouterr()
  assert rc == 2 and out == ""
  assert err.startswith("jaxmem demo: error: ") and err.count("\n") == 1, err
  assert message in err and "Traceback" not in err
