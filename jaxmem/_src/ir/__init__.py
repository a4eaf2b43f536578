"""Layer 1, the program: trace a step into a flat, immutable program (roles, sources, blocks, bytes per device).

The registry of primitive facts (:mod:`~jaxmem._src.ir.primitives`) and the
lowering substitutions (:mod:`~jaxmem._src.ir.substitutions`) live here too:
every layer above reads them.
"""
