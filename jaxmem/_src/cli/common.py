"""What the subcommands share: loading ``MODULE:FACTORY``, parsing ``--kw``, user errors.

User errors (a bad ``MODULE:FACTORY``, ``--kw`` or budget) print one line on
stderr saying what would work and exit with status 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

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


def budget_arg(s: str) -> float | int | str:
  """``'0.5'`` -> 0.5 (a fraction), ``'1000000'``/``'1e6'`` -> int bytes, ``'800MiB'`` stays a string."""
  try:
    return int(s)
  except ValueError:
    pass
  try:
    x = float(s)
  except ValueError:
    return s
  if not math.isfinite(x):
    return s      # (`parse_budget` says why: too large, or not a number)
  return int(x) if "." not in s and x.is_integer() else x


# -- loading MODULE:FACTORY --------------------------------------------------


def _looks_like_path(module: str) -> bool:
  return module.endswith(".py") or os.sep in module or "/" in module or os.path.isfile(module)


def _load_path(path: str) -> ModuleType:
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


def _import_name(module: str) -> ModuleType:
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


def _callables_in(mod: ModuleType) -> list[str]:
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


def signature(fn: Callable[..., Any]) -> inspect.Signature | None:
  """``fn``'s signature, or None for a callable without one (some builtins)."""
  try:
    return inspect.signature(fn)
  except (TypeError, ValueError):
    return None


def call_factory(factory: Callable[..., Any], name: str, kwargs: dict[str, Any], *,
                 show_traceback: bool = False) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """Calls the factory and checks it returned ``(step, args)``."""
  call = f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
  sig = signature(factory)
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


def with_user_errors(command: str, run: Callable[[argparse.Namespace], int],
                     args: argparse.Namespace) -> int:
  """``run(args)`` with user errors turned into one line on stderr and exit status 2."""
  try:
    return run(args)
  except UserError as e:
    print(f"jaxmem {command}: error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR



__all__ = ["EXIT_OUTPUT_FAILED", "EXIT_USER_ERROR", "USAGE_HINT", "UserError", "budget_arg",
           "call_factory", "load_factory", "parse_kw", "parse_value", "signature",
           "with_user_errors"]
