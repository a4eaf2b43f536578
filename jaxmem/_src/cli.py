"""``python -m jaxmem report MODULE:FACTORY``: the lifetime report of a step, from the shell.

``FACTORY`` is a callable in ``MODULE`` returning ``(step, args)`` (the
``build(...)`` functions of ``examples/``). The report needs no compile;
``--budget`` adds a plan against jaxmem's *estimate*, ``--compare`` compiles
the step once to put the estimate next to XLA's ``memory_analysis()``.

User errors (a bad ``MODULE:FACTORY``, ``--kw`` or budget) print one line on
stderr saying what would work and exit with status 2; a requested output file
that could not be written makes the exit status 1.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import os
import sys
import traceback
from typing import Any, Callable

from jaxmem._src.progress import stage

USAGE_HINT = ("Pass MODULE:FACTORY where MODULE is a path to a .py file or an importable module "
              "and FACTORY a callable in it returning (step, args), e.g. "
              "`examples/mlp.py:build` or `mlp:build` with examples/ on PYTHONPATH.")

EXIT_USER_ERROR = 2
EXIT_OUTPUT_FAILED = 1


class UserError(Exception):
  """A mistake in the command line; printed as one line, exit status 2."""


# -- argument parsing --------------------------------------------------------


def parse_kw(text: str) -> tuple[str, Any]:
  """``'batch_size=256'`` -> ``('batch_size', 256)``.

  Values: ``true``/``false`` (any case) are bools, ``none`` is None, Python
  literals (ints, floats, ``1e-3``, tuples such as ``(32,64)``, quoted
  strings) are evaluated, anything else is a string.
  """
  key, sep, raw = text.partition("=")
  key = key.strip()
  if not sep or not key.isidentifier():
    raise argparse.ArgumentTypeError(
        f"{text!r} is not key=value; use e.g. --kw batch_size=256 --kw dtype=bfloat16")
  return key, parse_value(raw.strip())


def parse_value(raw: str) -> Any:
  low = raw.lower()
  if low in ("true", "false"):
    return low == "true"
  if low in ("none", "null"):
    return None
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return raw


def _budget_arg(s: str) -> float | int | str:
  """``'0.5'`` -> 0.5 (a fraction), ``'1000000'``/``'1e6'`` -> int bytes, ``'800MiB'`` stays a string."""
  try:
    return int(s)
  except ValueError:
    pass
  try:
    x = float(s)
  except ValueError:
    return s
  return int(x) if "." not in s and x.is_integer() else x


def add_report_parser(sub: Any) -> argparse.ArgumentParser:
  """Adds the ``report`` subcommand to an argparse subparsers object."""
  p = sub.add_parser(
      "report", help="print the lifetime report of a step built by MODULE:FACTORY",
      description="Trace the step returned by FACTORY and print its lifetime report "
                  "(peak, bytes by role and module, top buffers with source lines). "
                  "Nothing is compiled unless --compare is given.",
      epilog="examples:\n"
             "  python -m jaxmem report examples/mlp.py:build --kw batch_size=256\n"
             "  python -m jaxmem report examples/cnn.py:build --budget 0.5 --json cnn.json\n"
             "  python -m jaxmem report mymodels.lm:make_step --compare --top 25",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("target", metavar="MODULE:FACTORY",
                 help="a .py path or module name, a colon, and a callable returning (step, args)")
  p.add_argument("--kw", action="append", type=parse_kw, default=[], metavar="KEY=VALUE",
                 help="keyword argument for FACTORY (repeatable); ints, floats, bools, "
                      "tuples and strings are parsed")
  p.add_argument("--top", type=int, default=15, metavar="N", help="buffers listed (default 15)")
  p.add_argument("--budget", type=_budget_arg, default=None, metavar="B",
                 help="also plan for this budget: bytes, '800MiB', or a fraction in (0, 1] "
                      "of jaxmem's *estimated* peak; prints the plan summary")
  p.add_argument("--planner", default="auto", help="planner for --budget (default auto)")
  p.add_argument("--device", default=None, help="device profile for the planner (default: backend)")
  p.add_argument("--compare", action="store_true",
                 help="compile with jax.jit and print the estimated vs the compiled peak")
  p.add_argument("--json", metavar="F", help="write prog.to_json() (schema jaxmem.program/1)")
  p.add_argument("--html", metavar="F", help="write an HTML report")
  p.add_argument("--png", metavar="F", help="write a memory-over-time plot")
  p.add_argument("--perfetto", metavar="F", help="write the plan's schedule as a Perfetto/Chrome "
                 "trace (needs --budget)")
  p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
  p.add_argument("--traceback", action="store_true",
                 help="show full tracebacks of errors raised by your module or factory")
  return p


# -- loading MODULE:FACTORY --------------------------------------------------


def _looks_like_path(module: str) -> bool:
  return module.endswith(".py") or os.sep in module or "/" in module or os.path.isfile(module)


def _load_path(path: str) -> Any:
  if not os.path.isfile(path):
    hint = "" if path.endswith(".py") else " (a module name must not contain '/')"
    raise UserError(f"file {path!r} does not exist{hint}. {USAGE_HINT}")
  path = os.path.abspath(path)
  directory = os.path.dirname(path)
  # Examples import their siblings (`from _common import ...`), as under `python file.py`.
  if directory not in sys.path:
    sys.path.insert(0, directory)
  stem = os.path.splitext(os.path.basename(path))[0]
  existing = sys.modules.get(stem)
  if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == path:
    return existing
  name = stem if existing is None and stem.isidentifier() else f"_jaxmem_user_{abs(hash(path))}"
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise UserError(f"cannot import {path!r} as a Python module. {USAGE_HINT}")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  try:
    spec.loader.exec_module(mod)
  except BaseException:
    sys.modules.pop(name, None)
    raise
  return mod


def _import_name(module: str) -> Any:
  if not all(part.isidentifier() for part in module.split(".")):
    raise UserError(f"{module!r} is neither a .py file nor a module name. {USAGE_HINT}")
  if "" not in sys.path and os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())   # like `python -m`: modules in the working directory
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
      raise UserError(f"no module named {module!r} (searched the working directory and "
                      f"PYTHONPATH). {USAGE_HINT}") from None
    raise


def _callables_in(mod: Any) -> list[str]:
  names = [n for n, v in vars(mod).items()
           if not n.startswith("_") and callable(v) and not inspect.isclass(v)
           and getattr(v, "__module__", None) == mod.__name__]
  return sorted(names)


def _user_code_error(what: str, e: BaseException) -> UserError:
  tb = traceback.extract_tb(e.__traceback__)
  where = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
  msg = str(e).splitlines()[0] if str(e) else ""
  return UserError(f"{what} raised {type(e).__name__}: {msg}{where}. "
                   "Rerun with --traceback for the full traceback.")


def load_factory(target: str, *, show_traceback: bool = False) -> tuple[Callable[..., Any], str]:
  """``'examples/mlp.py:build'`` -> the ``build`` callable and a display name."""
  module, sep, attr = target.rpartition(":")
  if not sep or not module or not attr:
    raise UserError(f"{target!r} has no ':FACTORY' part. {USAGE_HINT}")
  try:
    mod = _load_path(module) if _looks_like_path(module) else _import_name(module)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 (errors in the user's module)
    if show_traceback:
      raise
    if isinstance(e, ModuleNotFoundError):
      raise UserError(f"importing {module!r} failed: {e} (install it, or put its "
                      "directory on PYTHONPATH)") from None
    raise _user_code_error(f"importing {module!r}", e) from None
  obj: Any = mod
  for part in attr.split("."):
    if not hasattr(obj, part):
      have = _callables_in(mod)
      raise UserError(f"{module!r} has no attribute {attr!r}"
                      + (f"; callables defined there: {', '.join(have)}" if have else "")
                      + f". {USAGE_HINT}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise UserError(f"{module}:{attr} is not callable (it is {type(obj).__name__} {obj!r:.40}); "
                    f"{USAGE_HINT}")
  return obj, f"{module}:{attr}"


def call_factory(factory: Callable[..., Any], name: str, kwargs: dict[str, Any], *,
                 show_traceback: bool = False) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """Calls the factory and checks it returned ``(step, args)``."""
  call = f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
  try:
    sig = inspect.signature(factory)
  except (TypeError, ValueError):
    sig = None
  if sig is not None:
    try:
      sig.bind(**kwargs)
    except TypeError as e:
      raise UserError(f"cannot call {call}: {e}; its signature is {name.split(':')[-1]}{sig}. "
                      "Pass keyword arguments with --kw KEY=VALUE.") from None
  try:
    out = factory(**kwargs)
  except Exception as e:  # noqa: BLE001 (errors in the user's factory)
    if show_traceback:
      raise
    raise _user_code_error(f"calling {call}", e) from None
  what = ("FACTORY must return a 2-tuple (step, args): a callable step and a tuple/list of "
          "its positional arguments, e.g. `return step, (params, opt_state, batch)`")
  if not isinstance(out, (tuple, list)) or len(out) != 2:
    got = (f"a {type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list))
           else f"a {type(out).__name__}")
    raise UserError(f"{call} returned {got}. {what}.")
  step, args = out
  if not callable(step):
    raise UserError(f"{call} returned ({type(step).__name__}, ...) whose first item is not "
                    f"callable. {what}.")
  if not isinstance(args, (tuple, list)):
    raise UserError(f"{call} returned (step, {type(args).__name__}): args is not a tuple or "
                    f"list. {what}.")
  return step, tuple(args)


# -- the command -------------------------------------------------------------


def _optional_writer(flag: str, module: str, func: str) -> Callable[..., Any] | str:
  """The writer function for an output flag, or a one-line reason it is unavailable."""
  try:
    mod = importlib.import_module(f"jaxmem._src.{module}")
  except ModuleNotFoundError as e:
    if e.name == f"jaxmem._src.{module}":
      return (f"{flag} is not available in this jaxmem (jaxmem/_src/{module}.py is missing); "
              "the other outputs are unaffected")
    return f"{flag} needs {e.name!r}: pip install {e.name.split('.')[0]}"
  fn = getattr(mod, func, None)
  if fn is None:
    return f"{flag} is not available: jaxmem._src.{module} has no {func}()"
  return fn


def run_report(args: argparse.Namespace) -> int:
  """Runs ``report``; returns the exit status."""
  import jaxmem  # noqa: PLC0415 (keeps `python -m jaxmem --help` fast)
  from jaxmem._src.errors import format_bytes

  quiet = args.quiet
  # Fail fast on everything that can be checked before tracing.
  spec = None
  if args.budget is not None:
    try:
      spec = jaxmem.parse_budget(args.budget, argname="--budget")
    except (TypeError, ValueError) as e:
      raise UserError(str(e)) from None
  if args.perfetto and spec is None:
    raise UserError("--perfetto writes the schedule of a plan and needs --budget "
                    "(e.g. --budget 0.5 --perfetto trace.json).")
  if args.top < 0:
    raise UserError(f"--top must be >= 0, got {args.top}.")
  planner = None
  if spec is not None:
    try:
      planner = jaxmem.get_planner(args.planner)
      if args.device is not None:
        jaxmem.device_profile(args.device)
    except ValueError as e:
      raise UserError(str(e)) from None

  with stage(f"importing {args.target}", quiet=quiet):
    factory, name = load_factory(args.target, show_traceback=args.traceback)
  kwargs = dict(args.kw)
  with stage(f"building the step ({name.split(':')[-1]})", quiet=quiet):
    step, step_args = call_factory(factory, name, kwargs, show_traceback=args.traceback)
  try:
    with stage("tracing and flattening (jaxmem.analyze)", quiet=quiet):
      prog = jaxmem.analyze(step, *step_args)
  except TypeError as e:
    if args.traceback or "jaxmem.analyze" not in str(e):
      raise
    raise UserError(f"the args returned by {name}: {e}") from None
  with stage(f"computing lifetimes of {len(prog.vars)} values over {prog.num_ops} ops",
             quiet=quiet):
    prog.profile  # noqa: B018 (computes and caches)
  with stage("formatting the report", quiet=quiet):
    text = prog.report(top=args.top)
  print(text, flush=True)

  status = 0
  plan = None
  budget_bytes = None
  if spec is not None:
    budget_bytes = spec.resolve(prog.peak_bytes)
    if spec.fraction is not None:
      how = (f"{spec.fraction:g} of the estimated peak {format_bytes(prog.peak_bytes)} (a fraction "
             "here is of jaxmem's estimate; `jaxmem.fit` resolves it against the compiled peak)")
    else:
      how = f"{budget_bytes} bytes"
    print(f"\nbudget: {format_bytes(budget_bytes)} = {how}", flush=True)
    with stage(f"planning ({args.planner}) for {format_bytes(budget_bytes)}", quiet=quiet):
      plan = planner(prog, budget_bytes, args.device)
    print(plan.summary(), flush=True)
    if plan.estimated_peak_bytes > budget_bytes:
      print(f"  note: the plan's estimated peak stays {format_bytes(plan.estimated_peak_bytes - budget_bytes)} "
            "over the budget (the planner found nothing more to free at the peak)", flush=True)

  if args.compare:
    import jax  # noqa: PLC0415
    with stage("compiling with jax.jit (for --compare)", quiet=quiet):
      compiled = jax.jit(step).lower(*step_args).compile()
      mem = jaxmem.compiled_memory(compiled)
    from jaxmem._src.compare import compare_program  # noqa: PLC0415
    print(f"\n{compare_program(prog, mem)}", flush=True)

  def write(flag: str, path: str, fn: Callable[[], Any]) -> None:
    nonlocal status
    try:
      with stage(f"writing {path}", quiet=quiet):
        fn()
    except OSError as e:
      print(f"jaxmem report: error: {flag} {path}: {e.strerror or e}", file=sys.stderr)
      status = EXIT_OUTPUT_FAILED
    except ImportError as e:   # e.g. --png without matplotlib
      print(f"jaxmem report: error: {flag} {path}: {e}", file=sys.stderr)
      status = EXIT_OUTPUT_FAILED
      return
    print(f"wrote {path}", flush=True)

  if args.json:
    def dump_json() -> None:
      data = prog.to_json()
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    write("--json", args.json, dump_json)

  optional = [("--html", args.html, "html_report", "html_report"),
              ("--png", args.png, "plot", "plot_program"),
              ("--perfetto", args.perfetto, "perfetto", "schedule_trace")]
  for flag, path, module, func in optional:
    if not path:
      continue
    fn = _optional_writer(flag, module, func)
    if isinstance(fn, str):
      print(f"jaxmem report: error: {fn}", file=sys.stderr)
      status = EXIT_OUTPUT_FAILED
      continue
    if flag == "--perfetto":
      write(flag, path, lambda fn=fn, path=path: fn(plan, path, device=args.device))
    else:
      write(flag, path, lambda fn=fn, path=path: fn(prog, path, budget_bytes=budget_bytes,
                                                    plan=plan))
  return status


def _with_user_errors(command: str, run: Any, args: argparse.Namespace) -> int:
  """``run(args)`` with user errors turned into one line on stderr and exit status 2."""
  try:
    return run(args)
  except UserError as e:
    print(f"jaxmem {command}: error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR


def main_report(args: argparse.Namespace) -> int:
  """``run_report`` with user errors turned into one line on stderr and exit status 2."""
  return _with_user_errors("report", run_report, args)


# -- max-batch ---------------------------------------------------------------

EXIT_DOES_NOT_FIT = 1   # max-batch: even --lo does not fit the budget


def add_max_batch_parser(sub: Any) -> argparse.ArgumentParser:
  """Adds the ``max-batch`` subcommand to an argparse subparsers object."""
  p = sub.add_parser(
      "max-batch", help="the largest batch size whose compiled step fits a budget",
      description="Search the largest batch size B for which FACTORY(B)'s step, fitted by "
                  "jaxmem.fit with --planner (or plain jax.jit with --planner jit), compiles "
                  "within --budget. FACTORY takes the batch size as its first positional "
                  "argument. Peaks are compiled, never estimated; exit status 1 when even "
                  "--lo does not fit.",
      epilog="examples:\n"
             "  python -m jaxmem max-batch examples/mlp.py:build --budget 800MiB\n"
             "  python -m jaxmem max-batch examples/cnn.py:build --budget 64MiB --planner jit\n"
             "  python -m jaxmem max-batch examples/vgg.py:build --budget 1GiB --kw width=0.25 "
             "--lo 8",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("target", metavar="MODULE:FACTORY",
                 help="a .py path or module name, a colon, and a callable FACTORY(batch_size) "
                      "returning (step, args)")
  p.add_argument("--budget", type=_budget_arg, required=True, metavar="B",
                 help="bytes or a size with a unit ('800MiB', '2GB'), per device")
  p.add_argument("--planner", default="auto",
                 help="planner for jaxmem.fit (default auto), or 'jit' for plain jax.jit")
  p.add_argument("--kw", action="append", type=parse_kw, default=[], metavar="KEY=VALUE",
                 help="other keyword argument for FACTORY (repeatable), as for `report`")
  p.add_argument("--lo", type=int, default=1, help="first batch size tried; must fit (default 1)")
  p.add_argument("--hi", type=int, default=None, help="largest batch size tried (default: none)")
  p.add_argument("--device", default=None, help="device profile for the planner (default: backend)")
  p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
  p.add_argument("--traceback", action="store_true",
                 help="show full tracebacks of errors raised by your module or factory")
  return p


def run_max_batch(args: argparse.Namespace) -> int:
  """Runs ``max-batch``; returns the exit status."""
  import functools  # noqa: PLC0415

  import jaxmem  # noqa: PLC0415 (keeps `python -m jaxmem --help` fast)

  try:
    spec = jaxmem.parse_budget(args.budget, argname="--budget")
  except (TypeError, ValueError) as e:
    raise UserError(str(e)) from None
  if spec.fraction is not None:
    raise UserError(f"--budget {args.budget} is a fraction of the unplanned peak, which grows "
                    "with the batch size; pass bytes or a size with a unit (e.g. --budget 800MiB).")
  planner = None if args.planner.lower() in ("jit", "none") else args.planner
  try:
    if planner is not None:
      jaxmem.get_planner(planner)
      if args.device is not None:
        jaxmem.device_profile(args.device)
  except ValueError as e:
    raise UserError(str(e)) from None
  if args.lo < 1 or (args.hi is not None and args.hi < args.lo):
    raise UserError(f"--lo must be >= 1 and --hi >= --lo, got --lo {args.lo} --hi {args.hi}.")

  with stage(f"importing {args.target}", quiet=args.quiet):
    factory, name = load_factory(args.target, show_traceback=args.traceback)
  kwargs = dict(args.kw)
  try:
    sig = inspect.signature(factory)
  except (TypeError, ValueError):
    sig = None
  if sig is not None:
    try:
      sig.bind(args.lo, **kwargs)
    except TypeError as e:
      raise UserError(f"cannot call {name}(BATCH, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): "
                      f"{e}; its signature is {name.split(':')[-1]}{sig}. FACTORY takes the batch "
                      "size as its first positional argument; pass the others with --kw.") from None

  params = list(sig.parameters.values()) if sig is not None else []
  batch_kw = (params[0].name if params and params[0].kind in (
      inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) else None)

  def build(batch: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if batch_kw is not None:   # shows as `build(batch_size=64, width=32)` in errors
      return call_factory(factory, name, {batch_kw: batch, **kwargs},
                          show_traceback=args.traceback)
    return call_factory(functools.partial(factory, batch), f"{name}({batch}, ...)", kwargs,
                        show_traceback=args.traceback)

  try:
    res = jaxmem.max_batch(build, spec.bytes, planner, device=args.device, lo=args.lo,
                           hi=args.hi, verbose=not args.quiet)
  except jaxmem.BudgetError as e:
    print(f"jaxmem max-batch: {e}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT
  print(res.summary(), flush=True)
  return 0


def main_max_batch(args: argparse.Namespace) -> int:
  """``run_max_batch`` with user errors turned into one line on stderr and exit status 2."""
  return _with_user_errors("max-batch", run_max_batch, args)
