"""Offline Dynamic Storage Allocation: static offsets for buffers with known lifetimes.

Public API of :mod:`jaxmem._src.native.dsa` (see there for the algorithms),
:func:`from_program`, the instance of a program's estimated lifetimes, and
generators of hard instances with a known placement at capacity
(:func:`tiling_instance`, :func:`program_instance`):

>>> import jaxmem
>>> sol = jaxmem.dsa.solve(lower=[0, 1], upper=[2, 3], size=[16, 8])
>>> sol.footprint, sol.max_load, sol.proven_optimal
(24, 24, True)
"""

from jaxmem._src.estimate.analysis import allocation_instance as from_program
from jaxmem._src.native.dsa import (
    GOALS,
    METHODS,
    CapacityError,
    CsvInstance,
    Solution,
    check,
    max_load,
    read_csv,
    solve,
    write_csv,
)
from jaxmem._src.native.dsa_instances import Instance, program_instance, tiling_instance

__all__ = [
    "GOALS", "METHODS", "CapacityError", "CsvInstance", "Instance", "Solution", "check",
    "from_program", "max_load", "program_instance", "read_csv", "solve", "tiling_instance",
    "write_csv",
]
