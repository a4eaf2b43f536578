"""Command line: ``python -m jaxmem demo``, ``python -m jaxmem report MODULE:FACTORY``,
``python -m jaxmem max-batch MODULE:FACTORY --budget B`` and ``python -m jaxmem dsa IN.csv``."""

from __future__ import annotations

import sys

from jaxmem._src.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
