"""``python -m jaxmem max-batch MODULE:FACTORY --budget B``: the largest batch that fits, compiled."""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from jaxmem._src.base.progress import stage
from jaxmem._src.cli.common import (UserError, budget_arg, call_factory, load_factory, parse_kw,
                                    signature, with_user_errors)

EXIT_DOES_NOT_FIT = 1   # max-batch: even --lo does not fit the budget


def add_max_batch_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
  p.add_argument("--budget", type=budget_arg, required=True, metavar="B",
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
  # Imported here: they pull in jax, and `python -m jaxmem --help` should not wait for it.
  from jaxmem._src.api.max_batch import max_batch  # noqa: PLC0415
  from jaxmem._src.base.budget import parse_budget  # noqa: PLC0415
  from jaxmem._src.base.errors import BudgetError  # noqa: PLC0415
  from jaxmem._src.estimate.devices import device_profile  # noqa: PLC0415
  from jaxmem._src.planners.registry import get_planner  # noqa: PLC0415

  try:
    spec = parse_budget(args.budget, argname="--budget")
  except (TypeError, ValueError) as e:
    raise UserError(str(e)) from None
  if spec.fraction is not None:
    raise UserError(f"--budget {args.budget} is a fraction of the unplanned peak, which grows "
                    "with the batch size; pass bytes or a size with a unit (e.g. --budget 800MiB).")
  planner = None if args.planner.lower() in ("jit", "none") else args.planner
  try:
    if planner is not None:
      get_planner(planner)
      if args.device is not None:
        device_profile(args.device)
  except ValueError as e:
    raise UserError(str(e)) from None
  if args.lo < 1 or (args.hi is not None and args.hi < args.lo):
    raise UserError(f"--lo must be >= 1 and --hi >= --lo, got --lo {args.lo} --hi {args.hi}.")

  with stage(f"importing {args.target}", quiet=args.quiet):
    factory, name = load_factory(args.target, show_traceback=args.traceback)
  kwargs = dict(args.kw)
  sig = signature(factory)
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
    res = max_batch(build, spec.bytes, planner, device=args.device, lo=args.lo,
                           hi=args.hi, verbose=not args.quiet)
  except BudgetError as e:
    print(f"jaxmem max-batch: {e}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT
  print(res.summary(), flush=True)
  return 0


def main_max_batch(args: argparse.Namespace) -> int:
  """``run_max_batch`` with user errors turned into one line on stderr and exit status 2."""
  return with_user_errors("max-batch", run_max_batch, args)


__all__ = ["EXIT_DOES_NOT_FIT", "add_max_batch_parser", "main_max_batch", "run_max_batch"]
