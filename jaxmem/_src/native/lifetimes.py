"""The native lifetime estimate (``_native.estimate_lifetimes``, ``ffi/lifetimes.cc``).

The estimate's XLA model (:func:`jaxmem._src.estimate.lifetimes._lifetimes`)
ported to C++: planners estimate hundreds of schedules per plan, each a pass
over every step. The Python function stays the reference, and
``tests/estimate/test_native_lifetimes.py`` checks that both give the same
lifetimes. This module only says whether the extension has it; the estimate
layer hands it a flow's columns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmem._src.native.extension import native_module

#: ``estimate_lifetimes(num_steps, columns)`` of the extension, or ``None`` for
#: an extension built before it existed (an installed older build).
estimate_lifetimes: Callable[[int, Mapping[str, np.ndarray]], tuple[Any, ...]] | None = getattr(
    native_module, "estimate_lifetimes", None)

__all__ = ["estimate_lifetimes"]
