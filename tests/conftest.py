"""Shared fixtures: the shared models (tests/models.py), a clean native store.

Tests are grouped by the layer they test (``ir/``, ``estimate/``, ``plan/``,
``planners/``, ``lower/``, ``verify/``, ``report/``, ``api/``, ``cli/``,
``native/``), as ``jaxmem/_src`` is.
"""

from __future__ import annotations

import os
import pathlib
import sys

# libtpu (installed with the test extras, for the TPU targets compiled ahead
# of time) looks for TPU hosts when jax starts and prints warnings to stderr
# (which the CLI tests read); the tests run on the CPU and reach the TPU
# compiler through the targets only.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI runs a fixed set of examples (no flaky discoveries blocking a merge); set
# JAXMEM_EXAMPLES=200 to search wider (tests/lower/test_rewrite_properties.py).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
  settings.load_profile("ci")

TESTS = pathlib.Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
for path in (TESTS, EXAMPLES):   # `import models`, `import mlp` from any test folder
  if str(path) not in sys.path:
    sys.path.insert(0, str(path))


@pytest.fixture(autouse=True)
def _clean_store():
  from jaxmem import native
  native.store_clear()
  yield
  # A step is dispatched asynchronously: let the last one finish its copies
  # before counting what is left in the store.
  import jax
  jax.effects_barrier()
  stats = native.store_stats()
  native.store_clear()
  # Every offloaded value must have been fetched back: nothing leaks from a step.
  assert stats.live_entries == 0, f"host store leaked {stats.live_entries} entries"


@pytest.fixture
def restore_store_config():
  """The host store's configuration is process-wide: a test that changes it
  (store_configure) leaves it as it found it."""
  from jaxmem import native
  saved = native.store_config()
  native.store_clear()
  yield
  native.store_clear()
  if saved["source"] != "default" or native.store_config()["source"] != "default":
    native.store_configure(saved["mode"], chunk_bytes=saved["chunk_bytes"],
                           segment_bytes=saved["segment_bytes"],
                           capacity_bytes=saved["capacity_bytes"])


@pytest.fixture(scope="session")
def mlp_small():
  """The small flax MLP step, ``(step, args)`` (:func:`models.mlp` at its defaults)."""
  import models
  return models.mlp()
