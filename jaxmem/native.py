"""jaxmem's native extension: the XLA FFI ops, the host store and the copy engine.

Public API of :mod:`jaxmem._src.native` (see :mod:`~jaxmem._src.native.ops`,
:mod:`~jaxmem._src.native.store` and :mod:`~jaxmem._src.native.extension`).

>>> import jax, jax.numpy as jnp
>>> from jaxmem import native
>>> x = jnp.arange(4.0)
>>> round_trip = jax.jit(lambda x: native.fetch(native.offload(x), x, shape=x.shape,
...                                                   dtype=x.dtype))
>>> round_trip(x).tolist()
[0.0, 1.0, 2.0, 3.0]
"""

from jaxmem._src.native.extension import (
    CUDA_STATUS,
    HANDLE_DTYPE,
    HANDLE_SHAPE,
    TARGET_PREFIX,
    WITH_CUDA,
    register,
)
from jaxmem._src.native.ops import (
    fence,
    fetch,
    fetch_done,
    fetch_start,
    handle_id,
    offload,
    offload_done,
    offload_start,
)
from jaxmem._src.native.store import (
    STORE_MODES,
    CopyStats,
    StoreStats,
    copy_drain,
    copy_stats,
    set_copy_cpus,
    set_copy_threads,
    store_clear,
    store_config,
    store_configure,
    store_plan_stats,
    store_register_plan,
    store_stats,
    store_unregister_plan,
)

__all__ = [
    "CUDA_STATUS", "HANDLE_DTYPE", "HANDLE_SHAPE", "STORE_MODES", "TARGET_PREFIX", "WITH_CUDA",
    "CopyStats", "StoreStats", "copy_drain", "copy_stats", "fence", "fetch", "fetch_done",
    "fetch_start", "handle_id", "offload", "offload_done", "offload_start", "register",
    "set_copy_cpus", "set_copy_threads", "store_clear", "store_config", "store_configure",
    "store_plan_stats", "store_register_plan", "store_stats", "store_unregister_plan",
]
