"""``python -m jaxmem``: ``demo``, ``report MODULE:FACTORY``, ``max-batch MODULE:FACTORY``, ``dsa IN.csv``."""

from __future__ import annotations

import argparse

from jaxmem._src.cli.demo import add_demo_parser, main_demo
from jaxmem._src.cli.dsa import add_dsa_parser, main_dsa
from jaxmem._src.cli.max_batch import add_max_batch_parser, main_max_batch
from jaxmem._src.cli.report import add_report_parser, main_report


def main(argv: list[str] | None = None) -> int:
  """Parses ``argv`` (default: ``sys.argv[1:]``), runs the subcommand, returns its exit status."""
  parser = argparse.ArgumentParser(prog="jaxmem", description="Fit a JAX train step into a memory budget.")
  sub = parser.add_subparsers(dest="command", required=True)
  commands = {}
  for add, run, name in ((add_demo_parser, main_demo, "demo"),
                         (add_report_parser, main_report, "report"),
                         (add_max_batch_parser, main_max_batch, "max-batch"),
                         (add_dsa_parser, main_dsa, "dsa")):
    add(sub)
    commands[name] = run
  args = parser.parse_args(argv)
  return commands[args.command](args)


__all__ = ["main"]
