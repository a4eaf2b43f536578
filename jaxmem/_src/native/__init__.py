"""Beside the layers: jaxmem's native extension (loader, FFI ops, host store, arenas, DSA solver).

It depends only on :mod:`jaxmem._src.base`; the layers above use it (the
``ffi`` backend binds its ops, the CPU profile measures its copies).
"""
