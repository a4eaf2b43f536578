"""Trace and lifetimes: program order, roles, sources, live bytes, the report."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import Role


def test_live_bytes_by_hand():
  def f(x):
    a = jnp.sin(x)
    b = jnp.cos(a)
    c = a * b
    return c.sum()

  x = jnp.ones((1000,), jnp.float32)
  prog = jaxmem.analyze(f, x)
  assert [op.primitive for op in prog.ops] == ["sin", "cos", "mul", "reduce_sum"]
  # jaxpr-level intervals: x lives throughout (caller-held); a: ops 0..2; b: 1..2;
  # c: 2..3; the sum is an output: reserved for the whole step, as
  # memory_analysis() counts output buffers.
  ids = [v.id for v in prog.vars]
  assert [prog.interval(i) for i in ids] == [(0, 4), (0, 2), (1, 2), (2, 3), (0, 4)]
  # XLA model: `a` (sin) has two consumers and is expensive, so it is stored;
  # cos (one consumer) and the product (feeding a reduction) are fused away.
  np.testing.assert_array_equal(prog.profile.live_bytes, [8004, 8004, 8004, 8004, 4004])
  assert prog.peak_bytes == 8004 and prog.profile.peak_index == 0
  compiled = jaxmem.compiled_memory(jax.jit(f).lower(x).compile()).peak_bytes
  assert abs(prog.peak_bytes - compiled) <= 0.05 * compiled


def test_fused_mask_keeps_its_float_source_alive():
  """A ReLU mask kept for backward is recomputed there by XLA from its float input.

  (With the loss returned, as a train step does. Under `jax.grad` alone the
  forward's last matmul is dead code, and XLA's scheduler then runs the
  weight gradient after the input gradient, keeping the ReLU output one
  buffer longer than the program's order: the estimate is 20% under.)
  """
  def f(w, x):
    def loss(w):
      return jnp.sum(jax.nn.relu(x @ w) @ w)
    return jax.value_and_grad(loss)(w)
  w, x = jnp.ones((64, 64)), jnp.ones((4096, 64))
  prog = jaxmem.analyze(f, w, x)
  floats = [v for v in prog.vars if v.role is Role.ACTIVATION and v.dtype == "float32"
            and v.shape == (4096, 64)]
  assert floats
  compiled = jaxmem.compiled_memory(jax.jit(f).lower(w, x).compile()).peak_bytes
  assert abs(prog.peak_bytes - compiled) <= 0.15 * compiled


def test_donated_argument_dies_at_last_use():
  def f(x):
    return jnp.sin(x).sum()
  x = jnp.ones((1000,), jnp.float32)
  kept = jaxmem.analyze(f, x)
  donated = jaxmem.analyze(f, x, donate_argnums=0)
  assert kept.interval(kept.invars[0]) == (0, 2)
  assert donated.interval(donated.invars[0]) == (0, 0)
  assert donated.profile.live_bytes[-1] < kept.profile.live_bytes[-1]


def test_nested_jit_and_custom_jvp_are_inlined():
  @jax.jit
  def inner(x):
    return jax.nn.relu(x) * 2.0

  def f(x):
    return jnp.sum(inner(x) ** 2)

  prog = jaxmem.analyze(jax.grad(f), jnp.ones((8, 8)))
  prims = {op.primitive for op in prog.ops}
  assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call"}
  assert "max" in prims or "select_n" in prims


def test_custom_vjp_is_inlined():
  @jax.custom_vjp
  def g(x):
    return jnp.sin(x)
  g.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, gr: (gr * c,))
  prog = jaxmem.analyze(jax.grad(lambda x: g(x).sum()), jnp.ones((4,)))
  assert "custom_vjp_call" not in {op.primitive for op in prog.ops}


def test_scan_is_an_opaque_block_with_inner_working_set():
  def f(x):
    def body(c, _):
      big = c[:, None] @ c[None, :]  # 64x64 inside the loop only (a dot: stored)
      return c + big.sum(0), None
    return jax.lax.scan(body, x, None, length=3)[0].sum()
  prog = jaxmem.analyze(f, jnp.ones((64,)))
  scans = [op for op in prog.ops if op.primitive == "scan"]
  assert len(scans) == 1 and scans[0].transient_bytes >= 64 * 64 * 4


def test_roles_sources_and_report(mlp_small):
  step, args = mlp_small
  prog = jaxmem.analyze(step, *args)
  by_role = {}
  for v in prog.vars:
    by_role.setdefault(v.role, []).append(v)
  params = {v.name for v in by_role[Role.PARAMETER]}
  assert "params['params']['Dense_0']['kernel']" in params
  assert all(".mu" in v.name or ".nu" in v.name or "count" in v.name
             for v in by_role[Role.OPTIMIZER_STATE])
  assert {v.name for v in by_role[Role.INPUT]} == {"inputs", "labels"}
  acts = by_role[Role.ACTIVATION]
  assert acts and all(v.defined_by >= 0 for v in acts)
  # The big activations are attributed to the model's file and flax module path.
  big = [v for v in acts if v.nbytes == 256 * 64 * 4]
  assert big and all(v.source.split(":")[0].endswith("mlp.py") for v in big)
  assert all(v.name.startswith("MLP") for v in big)
  assert by_role[Role.GRADIENT]
  # Outputs: new params/opt state are outputs, the loss too.
  assert sum(v.is_output for v in prog.vars) >= len(jax.tree_util.tree_leaves(args[:2]))
  text = prog.report(top=5)
  assert "estimated peak" in text and "activation" in text and "mlp.py:" in text
  doc = prog.to_json()
  json.dumps(doc)
  assert doc["schema"] == "jaxmem.program/1" and doc["peak_bytes"] == prog.peak_bytes
  assert len(doc["live_bytes"]) == prog.num_ops + 1


def test_analyze_rejects_non_arrays():
  with pytest.raises(TypeError, match="argument 1 is a str"):
    jaxmem.analyze(lambda x, s: x, jnp.ones(3), "hello")
  with pytest.raises(TypeError, match="step function first"):
    jaxmem.analyze(jnp.ones(3))


def test_estimate_tracks_compiled_peak_for_mlp(mlp_small):
  """The unplanned estimate is in the compiled peak's ballpark (issue 3 tightens this)."""
  step, args = mlp_small
  est = jaxmem.analyze(step, *args).peak_bytes
  compiled = jaxmem.compiled_memory(jax.jit(step).lower(*args).compile()).peak_bytes
  assert 0.5 * compiled <= est <= 1.5 * compiled


@pytest.mark.parametrize("system_install", [False, True])
def test_flax_nnx_modules_and_params_are_attributed(system_install):
  """nnx pushes no name stack: module paths come from the `__call__` frames, and
  `nnx.Param` leaves are parameters whatever the argument is called.

  ``system_install``: flax under the stdlib prefix (``pip install`` as root into
  ``/usr/local/lib/python3.11/site-packages``), where JAX's own user-frame
  filter drops every flax frame. CI runs that way.
  """
  from flax import nnx
  from jax._src import source_info_util as siu
  from jaxmem._src import _compat

  def clear_caches():
    siu._exclude_path_regex.cache_clear()
    siu.is_user_filename.cache_clear()
    _compat._class_path.cache_clear()

  if system_install:
    site = os.path.dirname(os.path.dirname(nnx.__file__))
    siu._exclude_paths.append(site)
    clear_caches()
  try:
    _check_nnx_attribution(nnx)
  finally:
    if system_install:
      siu._exclude_paths.remove(site)
      clear_caches()


def _check_nnx_attribution(nnx):

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(64, 64, rngs=rngs)
      self.bn = nnx.BatchNorm(64, rngs=rngs)

    def __call__(self, x):
      return nnx.relu(self.bn(self.lin(x)))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(2)])
      self.head = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return self.head(x)

  graphdef, state = nnx.split(Net(nnx.Rngs(0)))

  def loss(s, x):
    return nnx.merge(graphdef, s)(x).sum()

  prog = jaxmem.analyze(jax.grad(loss), state, jnp.ones((32, 64)))
  by_name = {v.name: v.role for v in prog.vars if v.is_input}
  assert by_name["s['blocks'][0]['lin']['kernel']"] is jaxmem.Role.PARAMETER
  assert by_name["s['blocks'][1]['bn']['scale']"] is jaxmem.Role.PARAMETER
  assert by_name["s['blocks'][0]['bn']['mean']"] is jaxmem.Role.INPUT   # a BatchStat
  modules = {op.module_path for op in prog.ops}
  assert {"Net/Block/Linear", "Net/Block/BatchNorm", "Net/Linear"} <= modules
  dots = [op for op in prog.ops if op.primitive == "dot_general" and op.phase.value == "forward"]
  assert dots and all(op.module_path.endswith("Linear") for op in dots)
  # relu's custom_jvp body has no frames of its own: it takes the calling module.
  # Nothing is outside every module: the loss's own `.sum()` is dead code under
  # `jax.grad` (XLA and the trace remove it).
  outside = {op.primitive for op in prog.ops if op.phase.value == "forward" and not op.module_path}
  assert outside == set()
  assert all(m.startswith("Net") for m in modules if m)
