"""Command line: ``python -m jaxmem demo``, ``python -m jaxmem report MODULE:FACTORY``,
``python -m jaxmem max-batch MODULE:FACTORY --budget B`` and ``python -m jaxmem dsa IN.csv``."""

from __future__ import annotations

import argparse
import sys


def _budget(s: str) -> float | int | str:
  try:
    return float(s) if "." in s else int(s)
  except ValueError:
    return s


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="jaxmem", description="Fit a JAX train step into a memory budget.")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="train a small flax MLP under half its compiled peak")
  demo.add_argument("--batch", type=int, default=8192, help="batch size (default 8192)")
  demo.add_argument("--steps", type=int, default=3, help="train steps (default 3)")
  demo.add_argument("--budget", type=_budget, default=0.5,
                    help="budget: bytes, '800MiB', or a fraction of the unplanned peak (default 0.5)")
  from jaxmem._src.cli import add_max_batch_parser, add_report_parser
  add_report_parser(sub)
  add_max_batch_parser(sub)
  from jaxmem._src.dsa import add_dsa_parser
  add_dsa_parser(sub)
  args = parser.parse_args(argv)
  if args.command == "demo":
    from jaxmem._src.demo import run_demo
    return run_demo(args.batch, args.steps, args.budget)
  if args.command == "report":
    from jaxmem._src.cli import main_report
    return main_report(args)
  if args.command == "max-batch":
    from jaxmem._src.cli import main_max_batch
    return main_max_batch(args)
  if args.command == "dsa":
    from jaxmem._src.dsa import main_dsa
    return main_dsa(args)
  return 2  # pragma: no cover


if __name__ == "__main__":
  sys.exit(main())
