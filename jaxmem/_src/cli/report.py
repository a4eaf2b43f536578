"""``python -m jaxmem report MODULE:FACTORY``: the lifetime report of a step, from the shell.

``FACTORY`` is a callable in ``MODULE`` returning ``(step, args)`` (the
``build(...)`` functions of ``examples/``). The report needs no compile;
``--budget`` adds a plan against jaxmem's *estimate*, ``--compare`` compiles
the step once to put the estimate next to XLA's ``memory_analysis()``.

User errors print one line on stderr and exit with status 2
(:mod:`jaxmem._src.cli.common`); a requested output file that could not be
written makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from jaxmem._src.base.progress import stage
from jaxmem._src.cli.common import (EXIT_OUTPUT_FAILED, UserError, budget_arg, call_factory,
                                    load_factory, parse_kw, with_user_errors)


def add_report_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
  p.add_argument("--budget", type=budget_arg, default=None, metavar="B",
                 help="also plan for this budget: bytes, '800MiB', or a fraction in (0, 1] "
                      "of jaxmem's *estimated* peak; prints the plan summary")
  p.add_argument("--planner", default="auto", help="planner for --budget (default auto)")
  p.add_argument("--device", default=None, help="device profile for the planner (default: backend)")
  p.add_argument("--compare", action="store_true",
                 help="compile with jax.jit and print the estimated vs the compiled peak")
  p.add_argument("--target", dest="device_target", default=None, metavar="T",
                 help="the device the estimate and --compare are for: 'local' (default) or a "
                      "TPU compiled ahead of time here, e.g. 'tpu:v5e' (needs jax[tpu]), or a "
                      "GPU, 'gpu:h100' or 'gpu:a100' (needs jax[cuda12]; no GPU)")
  p.add_argument("--json", metavar="F", help="write prog.to_json() (schema jaxmem.program/1)")
  p.add_argument("--html", metavar="F", help="write an HTML report")
  p.add_argument("--png", metavar="F", help="write a memory-over-time plot")
  p.add_argument("--perfetto", metavar="F", help="write the plan's schedule as a Perfetto/Chrome "
                 "trace (needs --budget)")
  p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
  p.add_argument("--traceback", action="store_true",
                 help="show full tracebacks of errors raised by your module or factory")
  return p


def run_report(args: argparse.Namespace) -> int:
  """Runs ``report``; returns the exit status."""
  # Imported here: they pull in jax, and `python -m jaxmem --help` should not wait for it.
  import jax  # noqa: PLC0415

  from jaxmem._src.api.compare import compare_program  # noqa: PLC0415
  from jaxmem._src.api.program import Program, trace_for  # noqa: PLC0415
  from jaxmem._src.base.budget import parse_budget  # noqa: PLC0415
  from jaxmem._src.base.errors import format_bytes  # noqa: PLC0415
  from jaxmem._src.estimate.analysis import analyze_program  # noqa: PLC0415
  from jaxmem._src.estimate.devices import device_profile  # noqa: PLC0415
  from jaxmem._src.estimate.targets import get_target  # noqa: PLC0415
  from jaxmem._src.ir.trace import check_array_args  # noqa: PLC0415
  from jaxmem._src.plan.perfetto import schedule_trace  # noqa: PLC0415
  from jaxmem._src.planners.registry import get_planner  # noqa: PLC0415
  from jaxmem._src.report.html_page import html_report  # noqa: PLC0415
  from jaxmem._src.report.plot import plot_program  # noqa: PLC0415
  from jaxmem._src.verify.compiled import compiled_memory  # noqa: PLC0415

  quiet = args.quiet
  # Fail fast on everything that can be checked before tracing.
  spec = None
  if args.budget is not None:
    try:
      spec = parse_budget(args.budget, argname="--budget")
    except (TypeError, ValueError) as e:
      raise UserError(str(e)) from None
  if args.perfetto and spec is None:
    raise UserError("--perfetto writes the schedule of a plan and needs --budget "
                    "(e.g. --budget 0.5 --perfetto trace.json).")
  if args.top < 0:
    raise UserError(f"--top must be >= 0, got {args.top}.")
  try:
    target = get_target(args.device_target)
  except (TypeError, ValueError) as e:
    raise UserError(str(e).replace("`target`", "--target")) from None
  device = args.device if args.device is not None else target.profile
  planner = None
  if spec is not None:
    try:
      planner = get_planner(args.planner)
      if args.device is not None:
        device_profile(args.device)
    except ValueError as e:
      raise UserError(str(e)) from None

  with stage(f"importing {args.target}", quiet=quiet):
    factory, name = load_factory(args.target, show_traceback=args.traceback)
  kwargs = dict(args.kw)
  with stage(f"building the step ({name.split(':')[-1]})", quiet=quiet):
    step, step_args = call_factory(factory, name, kwargs, show_traceback=args.traceback)
  try:
    with stage("tracing and flattening (jaxmem.analyze)", quiet=quiet):
      check_array_args(step_args, "jaxmem.analyze")
      traced = trace_for(step, step_args, target)
      step_args = target.place(tuple(step_args))
  except TypeError as e:
    if args.traceback or "jaxmem.analyze" not in str(e):
      raise
    raise UserError(f"the args returned by {name}: {e}") from None
  with stage(f"computing lifetimes of {len(traced.vars)} values over {traced.num_ops} ops",
             quiet=quiet):
    prog = Program.of(analyze_program(traced))
  with stage("formatting the report", quiet=quiet):
    text = prog.report(top=args.top)
  print(text, flush=True)

  status = 0
  plan = None
  budget_bytes = None
  if spec is not None:
    assert planner is not None
    budget_bytes = spec.resolve(prog.peak_bytes)
    if spec.fraction is not None:
      how = (f"{spec.fraction:g} of the estimated peak {format_bytes(prog.peak_bytes)} (a fraction "
             "here is of jaxmem's estimate; `jaxmem.fit` resolves it against the compiled peak)")
    else:
      how = f"{budget_bytes} bytes"
    print(f"\nbudget: {format_bytes(budget_bytes)} = {how}", flush=True)
    with stage(f"planning ({args.planner}) for {format_bytes(budget_bytes)}", quiet=quiet):
      plan = planner(prog, budget_bytes, device)
    print(plan.summary(), flush=True)
    if plan.estimated_peak_bytes > budget_bytes:
      over = format_bytes(plan.estimated_peak_bytes - budget_bytes)
      print(f"  note: the plan's estimated peak stays {over} over the budget (the planner found "
            "nothing more to free at the peak)", flush=True)

  if args.compare:
    with stage(f"compiling with jax.jit for {target} (for --compare)", quiet=quiet):
      mem = compiled_memory(jax.jit(step).lower(*step_args).compile())
    print(f"\n{compare_program(prog, mem)}", flush=True)

  def write(flag: str, path: str, fn: Callable[[], Any]) -> None:
    nonlocal status
    try:
      with stage(f"writing {path}", quiet=quiet):
        fn()
    except OSError as e:
      print(f"jaxmem report: error: {flag} {path}: {e.strerror or e}", file=sys.stderr)
      status = EXIT_OUTPUT_FAILED
      return
    except ImportError as e:   # e.g. --png without matplotlib
      print(f"jaxmem report: error: {flag} {path}: {e}", file=sys.stderr)
      status = EXIT_OUTPUT_FAILED
      return
    print(f"wrote {path}", flush=True)

  def dump_json(path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(prog.to_json(), f, indent=1)

  writers: list[tuple[str, str | None, Callable[[str], Any]]] = [
      ("--json", args.json, dump_json),
      ("--html", args.html,
       lambda path: html_report(prog, path, budget_bytes=budget_bytes, plan=plan)),
      ("--png", args.png,
       lambda path: plot_program(prog, path, budget_bytes=budget_bytes, plan=plan)),
      ("--perfetto", args.perfetto, lambda path: schedule_trace(plan, path, device=device)),
  ]
  for flag, path, fn in writers:
    if path:
      write(flag, path, lambda fn=fn, path=path: fn(path))
  return status


def main_report(args: argparse.Namespace) -> int:
  """``run_report`` with user errors turned into one line on stderr and exit status 2."""
  return with_user_errors("report", run_report, args)




__all__ = ["add_report_parser", "main_report", "run_report"]
