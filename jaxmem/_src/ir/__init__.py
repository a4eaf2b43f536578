"""Layer 1, the program: a step traced into a flat, immutable program.

Roles, sources, blocks and bytes per device are known here.

The registry of primitive facts (:mod:`~jaxmem._src.ir.primitives`) and the
lowering substitutions (:mod:`~jaxmem._src.ir.substitutions`) live here too:
every layer above reads them.
"""
