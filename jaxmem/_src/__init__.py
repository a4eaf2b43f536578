"""jaxmem's implementation, one folder per layer; each imports only the layers before it.

``base`` -> ``ir`` -> ``estimate`` -> ``plan`` -> ``planners`` -> ``lower`` ->
``verify`` -> ``report`` -> ``api`` -> ``cli``, with ``native`` (the C++
extension's Python side) beside them above ``base``, and ``_compat`` (every
use of JAX internals) at the bottom. ``tests/test_layering.py`` enforces it;
``docs/design.md`` explains it.
"""
