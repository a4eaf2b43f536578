"""``python -m jaxmem dsa IN.csv``: static offsets for the buffers of a CSV instance."""

from __future__ import annotations

import argparse
import math
import sys

from jaxmem._src.native.dsa import (METHODS, CapacityError, capacity_bytes, is_int, read_csv,
                                     solve, summary, write_csv)

EXIT_USER_ERROR = 2
EXIT_INFEASIBLE = 1


def add_dsa_parser(sub: argparse._SubParsersAction) -> None:
  """Adds ``dsa IN.csv [-o OUT.csv] [--method M] [--time-limit S] [--capacity BYTES] [--fit]``."""
  p = sub.add_parser(
      "dsa", help="offline DSA: static offsets for buffers in a CSV (id,lower,upper,size)",
      description="Place buffers live on half-open [lower, upper) at byte offsets so that no two "
      "buffers live at once overlap, minimising the footprint. Reads id,lower,upper,size[,offset] "
      "CSV; writes it back with offsets. Exit status 2 on bad input, 1 when --capacity is too "
      "small.")
  p.add_argument("input", help="CSV file (\"-\" for stdin)")
  p.add_argument("-o", "--output", help="write the CSV with an offset column here (\"-\": stdout)")
  p.add_argument("--method", default="auto", help="auto (default), exact, best-fit or first-fit")
  p.add_argument("--time-limit", default="1.0",
                 help="seconds for the exact search (default 1; \"none\" for no limit)")
  p.add_argument("--capacity", help="bytes available (e.g. 1073741824 or 1GiB); exit 1 if exceeded")
  p.add_argument("--fit", action="store_true",
                 help="stop at the first placement within --capacity (MiniMalloc's question) "
                 "instead of minimising the footprint")


def main_dsa(args: argparse.Namespace) -> int:
  """Runs ``python -m jaxmem dsa``; returns the exit status."""
  err = sys.stderr
  try:
    if args.method not in METHODS:
      raise ValueError(f"--method {args.method!r}: use one of {', '.join(METHODS)}")
    limit: float | None
    if str(args.time_limit).lower() in ("none", "inf", "infinity"):
      limit = None
    else:
      try:
        limit = float(args.time_limit)
      except ValueError:
        raise ValueError(f"--time-limit {args.time_limit!r} is not a number of seconds") from None
      if math.isnan(limit) or limit < 0:
        raise ValueError(f"--time-limit must be >= 0 seconds, got {args.time_limit}")
    cap = args.capacity
    if args.fit and cap is None:
      raise ValueError("--fit stops at the first placement within --capacity: pass --capacity too")
    if cap is not None:
      cap = int(cap) if is_int(cap) else cap
      cap = capacity_bytes(cap)
    inst = read_csv(args.input)
  except (ValueError, TypeError, OSError) as e:
    print(f"jaxmem dsa: error: {_one_line(e)}", file=err)
    return EXIT_USER_ERROR
  try:
    sol = solve(inst.lower, inst.upper, inst.size, capacity=cap, time_limit_s=limit,
                method=args.method, goal="fit" if args.fit else "minimize")
  except CapacityError as e:
    print(f"jaxmem dsa: {_one_line(e)}", file=err)
    return EXIT_INFEASIBLE
  except ValueError as e:
    print(f"jaxmem dsa: error: {_one_line(e)}", file=err)
    return EXIT_USER_ERROR
  out = sys.stdout if args.output != "-" else sys.stderr
  print(summary(sol, n=len(inst.ids), source=str(args.input), requested=args.method,
                time_limit_s=limit), file=out)
  if args.output:
    try:
      write_csv(args.output, inst.lower, inst.upper, inst.size, sol.offsets, ids=inst.ids)
    except OSError as e:
      print(f"jaxmem dsa: error: cannot write {args.output}: {_one_line(e)}", file=err)
      return EXIT_INFEASIBLE
    if args.output != "-":
      print(f"wrote {args.output}", file=out)
  return 0




def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split())
