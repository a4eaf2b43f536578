"""Bytes per device of sharded steps (`jax.jit` over sharded arguments, `jax.shard_map`).

Several CPU devices exist only if ``XLA_FLAGS`` says so before JAX starts, so
each case runs in a fresh interpreter and prints its measurements as JSON.
Every expected byte count below is worked out from the shapes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem._src import _compat
from jaxmem._src.ir import sharding

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"

_PRELUDE = """
import json, os
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jaxmem

def by_shape(program, shape):
  # (bytes per device, global bytes) of every value of this shape
  return sorted({(v.nbytes, v.global_nbytes) for v in program.vars if v.shape == shape})
"""


def _run(body: str) -> dict:
  """Runs ``body`` on 4 CPU devices in a fresh interpreter; returns its last printed JSON."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu"}
  code = _PRELUDE + textwrap.dedent(body)
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# A two-layer MLP SGD step; x: [64, 32], w1: [32, 64], w2: [64, 8] (float32).
_MLP = """
def step(params, x, y):
  def loss(p):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)
  l, g = jax.value_and_grad(loss)(params)
  return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), l

params = {"w1": jnp.ones((32, 64)) * 0.01, "w2": jnp.ones((64, 8)) * 0.01}
x, y = jnp.ones((64, 32)), jnp.zeros((64, 8))
"""


def test_data_parallel_jit_activations_are_a_quarter_params_whole():
  out = _run(_MLP + """
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
batch = NamedSharding(mesh, P("data"))
xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
prog = jaxmem.analyze(step, params, xs, ys)
abstract = jaxmem.analyze(step, params, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch),
                          jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=batch))
c = jaxmem.compare(step, params, xs, ys, verbose=False)
print(json.dumps({
    "devices": prog.num_devices,
    "args": [prog.vars[i].nbytes for i in prog.invars],
    "abstract_args": [abstract.vars[i].nbytes for i in abstract.invars],
    "act": by_shape(prog, (64, 64)), "w1": by_shape(prog, (32, 64)),
    "compiled_args": c.compiled.argument_bytes,
    "report": prog.report().splitlines()[:2],
}))
""")
  assert out["devices"] == 4
  # The report says whose bytes it shows.
  assert "spread over 4 devices" in out["report"][0] and "per device" in out["report"][1]
  # Flat arguments: w1, w2 whole (replicated); x [64,32] and y [64,8] split 4 ways.
  assert out["args"] == [32 * 64 * 4, 64 * 8 * 4, 16 * 32 * 4, 16 * 8 * 4]
  assert out["abstract_args"] == out["args"]          # ShapeDtypeStruct(sharding=...) too
  assert out["compiled_args"] == sum(out["args"])     # XLA's per-device argument bytes
  # Every [64,64] activation (and its gradient): a quarter of 16 KiB on each device.
  assert out["act"] == [[64 * 64 * 4 // 4, 64 * 64 * 4]]
  # w1's gradient contracts the split batch: all-reduced, whole on every device.
  assert out["w1"] == [[32 * 64 * 4, 32 * 64 * 4]]


def test_weight_split_along_output_dim():
  out = _run(_MLP + """
mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
sharded = {"w1": jax.device_put(params["w1"], NamedSharding(mesh, P(None, "model"))),
           "w2": jax.device_put(params["w2"], NamedSharding(mesh, P()))}
prog = jaxmem.analyze(step, sharded, x, y)
c = jaxmem.compare(step, sharded, x, y, verbose=False)
dots = [(prog.vars[o].shape, prog.vars[o].nbytes)
        for op in prog.ops if op.primitive == "dot_general" for o in op.outputs]
print(json.dumps({"devices": prog.num_devices, "w1": by_shape(prog, (32, 64)), "dots": dots,
                  "args": [prog.vars[i].nbytes for i in prog.invars],
                  "compiled_args": c.compiled.argument_bytes}))
""")
  assert out["devices"] == 4
  assert out["args"] == [32 * 16 * 4, 64 * 8 * 4, 64 * 32 * 4, 64 * 8 * 4]
  assert out["compiled_args"] == sum(out["args"])
  # w1, its gradient and its update: columns split 4 ways.
  assert out["w1"] == [[32 * 16 * 4, 32 * 64 * 4]]
  assert out["dots"] == [
      [[64, 64], 64 * 16 * 4],   # h = x @ w1 keeps w1's split columns
      [[64, 8], 64 * 8 * 4],     # h @ w2 contracts the split dim: all-reduced, whole
      [[8, 64], 8 * 16 * 4],     # dw2 = g.T @ h: h's split dim is free in the result
      [[64, 64], 64 * 16 * 4],   # dh = g @ w2.T: whole operands, split as its user wants
      [[64, 32], 16 * 32 * 4],   # dw1.T = dh.T @ x: dh's split dim is free
  ]


def test_sharding_constraint_and_explicit_axes():
  out = _run("""
auto = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
def f(x):
  y = jax.lax.with_sharding_constraint(x * 2, NamedSharding(auto, P()))
  return y + 1
prog = jaxmem.analyze(f, jax.device_put(jnp.ones((64, 16)), NamedSharding(auto, P("d"))))

# Explicit axes: JAX types the values (f32[64@d,16]); reshard gathers.
explicit = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
def g(x):
  return jax.sharding.reshard(jnp.sin(x), NamedSharding(explicit, P())) * 3
prog2 = jaxmem.analyze(g, jax.device_put(jnp.ones((64, 16)), NamedSharding(explicit, P("d"))))
print(json.dumps({"auto": [v.nbytes for v in prog.vars],
                  "explicit": [v.nbytes for v in prog2.vars]}))
""")
  whole = 64 * 16 * 4
  # x (split), x*2 (split), y (constrained whole), y+1 (whole, from y).
  assert out["auto"] == [whole // 4, whole // 4, whole, whole]
  # x, sin(x) split; reshard and its product whole.
  assert out["explicit"] == [whole // 4, whole // 4, whole, whole]


def test_shard_map_outputs_per_device_from_out_specs():
  out = _run("""
mesh = jax.make_mesh((4,), ("d",))
def step(w, x):
  def body(w, x):                      # local shapes: x [256, 64]
    h = jnp.tanh(x @ w)
    return jax.lax.psum(h.sum(), "d"), h * 2
  return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P("d")))(w, x)
w = jnp.ones((64, 128))
x = jax.device_put(jnp.ones((1024, 64)), NamedSharding(mesh, P("d")))
prog = jaxmem.analyze(step, w, x)
[op] = [op for op in prog.ops if op.primitive == "shard_map"]
print(json.dumps({"devices": prog.num_devices, "bytes": [v.nbytes for v in prog.vars],
                  "transient": op.transient_bytes}))
""")
  assert out["devices"] == 4
  # w whole; x split; psum'd scalar (P()); h*2 [1024,128] split along P("d").
  assert out["bytes"] == [64 * 128 * 4, 1024 * 64 * 4 // 4, 4, 1024 * 128 * 4 // 4]
  # The body works on local shapes: its working set is at most a few local
  # [256,128] values, never the global [1024,128] (512 KiB).
  assert 0 < out["transient"] < 1024 * 128 * 4


def test_unsharded_program_unchanged_with_several_devices():
  out = _run(_MLP + """
prog = jaxmem.analyze(step, params, x, y)
print(json.dumps({"devices": prog.num_devices, "layout": prog.device_layout is None,
                  "same": all(v.nbytes == v.global_nbytes for v in prog.vars),
                  "x": prog.vars[prog.invars[2]].nbytes}))
""")
  assert out == {"devices": 1, "layout": True, "same": True, "x": 64 * 32 * 4}


def test_unsharded_program_bytes_are_global_bytes():
  prog = jaxmem.analyze(lambda x: jnp.sin(x) @ x.T, jnp.ones((32, 16)))
  assert prog.num_devices == 1 and prog.device_layout is None
  assert all(v.nbytes == v.global_nbytes == _compat.aval_nbytes(v.aval) for v in prog.vars)
  # x, sin(x), x.T, the product.
  assert [v.nbytes for v in prog.vars] == [32 * 16 * 4, 32 * 16 * 4, 16 * 32 * 4, 32 * 32 * 4]


def test_per_device_bytes_rounds_uneven_splits_up():
  assert sharding.per_device_bytes(10 * 100 * 4, (10, 100), (4, 1)) == 3 * 100 * 4
  assert sharding.per_device_bytes(8 * 8 * 2, (8, 8), (2, 4)) == 4 * 2 * 2
  assert sharding.per_device_bytes(4000, (10, 100), (1, 1)) == 4000
  assert sharding.counts_from_shard_shape((10, 100), (3, 100)) == (4, 1)


def test_compare_sharded_mlp_within_15_percent():
  """Estimate per device vs ``memory_analysis()`` of the 4-device executable."""
  out = _run(f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import mlp
mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
whole = NamedSharding(mesh, P())
step, (params, opt, x, y) = mlp.build(batch_size=4096, width=256, depth=3)
# Data parallel: batch split, parameters and optimizer state replicated.
dp = (jax.device_put(params, whole), jax.device_put(opt, whole),
      jax.device_put(x, NamedSharding(mesh, P("d"))), jax.device_put(y, NamedSharding(mesh, P("d"))))
# The first kernel (and its adam moments) split along its output dimension.
def put(path, a):
  split = a.ndim == 2 and "Dense_0" in jax.tree_util.keystr(path)
  return jax.device_put(a, NamedSharding(mesh, P(None, "d") if split else P()))
mp = (jax.tree_util.tree_map_with_path(put, params), jax.tree_util.tree_map_with_path(put, opt),
      jax.device_put(x, whole), jax.device_put(y, whole))
res = {{}}
for name, args in (("dp", dp), ("mp", mp)):
  c = jaxmem.compare(step, *args, verbose=False)
  res[name] = [c.estimated_peak_bytes, c.compiled.peak_bytes, c.relative_error]
print(json.dumps(res))
""")
  for name, (est, compiled, err) in out.items():
    assert abs(err) <= 0.15, (name, est, compiled)


def test_convolutions_and_pooling_keep_the_batch_split():
  """A data-parallel conv step: activations a quarter per device, as XLA's executable holds them."""
  out = _run("""
from jax import lax
mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

def step(w, x):
  def loss(w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    z = lax.reduce_window(jnp.tanh(y), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jnp.sum(z * z)
  return w - 0.1 * jax.grad(loss)(w)

w = jnp.ones((3, 3, 8, 16)) * 0.01
x = jax.device_put(jnp.ones((32, 16, 16, 8)), NamedSharding(mesh, P("d")))
prog = jaxmem.analyze(step, w, x)
c = jaxmem.compare(step, w, x, verbose=False)
print(json.dumps({"conv": by_shape(prog, (32, 16, 16, 16)), "pool": by_shape(prog, (32, 8, 8, 16)),
                  "wgrad": by_shape(prog, (3, 3, 8, 16)), "err": c.relative_error}))
""")
  quarter = lambda shape: [[int(np.prod(shape)) * 4 // 4, int(np.prod(shape)) * 4]]
  assert out["conv"] == quarter((32, 16, 16, 16))
  assert out["pool"] == quarter((32, 8, 8, 16))
  # The kernel's gradient contracts the split batch: all-reduced, whole.
  assert [3 * 3 * 8 * 16 * 4] * 2 in out["wgrad"]
  assert abs(out["err"]) <= 0.25


# Megatron MLP blocks on a 2 x 2 mesh (batch over "data", hidden units over
# "model"), written two ways (bench/tp_blocks.py): constraints on the
# activations with unplaced weights, or shard_map with placed ones.
_TP_BLOCKS = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
import tp_blocks
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
size = dict(blocks=4, batch_size=2048, width=128, hidden=512)
constrained, (ws, x) = tp_blocks.build(mesh, "constraints", **size)
mapped, (placed, _) = tp_blocks.build(mesh, "shard_map", **size)

def measure(step, ws):
  prog = jaxmem.analyze(step, ws, x)
  c = jaxmem.compare(step, ws, x, verbose=False)
  return dict(err=c.relative_error, args=c.compiled.argument_bytes,
              est_args=sum(prog.vars[i].nbytes for i in prog.invars))
"""


def test_constraint_tensor_parallel_estimate_with_weights_jit_places():
  # Weights nobody placed: jax.jit lets the partitioner choose their split,
  # and it splits them as the constrained matmuls need (w1 by columns, w2 by
  # rows over "model"). The estimate follows; the constraint itself is no
  # buffer of its own (its operand already has the split it asks for).
  out = _run(_TP_BLOCKS + """
whole = jax.device_put(ws, NamedSharding(mesh, P()))
print(json.dumps({"unplaced": measure(constrained, ws), "replicated": measure(constrained, whole)}))
""")
  for case in ("unplaced", "replicated"):
    assert out[case]["est_args"] == out[case]["args"], out
    assert abs(out[case]["err"]) <= 0.10, out
  # x split 2 ways; the 8 weights split 2 ways (the "model" axis) when unplaced.
  assert out["unplaced"]["args"] == 2048 * 128 * 4 // 2 + 8 * 128 * 512 * 4 // 2


def test_shard_map_tensor_parallel_estimate_counts_residuals_xla_stores():
  # The forward shard_map's residuals are its input (through pvary, the same
  # buffer), tanh's output, and 1 - tanh (fused into the backward body): XLA
  # stores one of the three. Counted as three stored outputs, the estimate was
  # about twice the compiled peak.
  out = _run(_TP_BLOCKS + """
print(json.dumps(measure(mapped, placed)))
""")
  assert out["est_args"] == out["args"], out
  assert abs(out["err"]) <= 0.25, out


def test_broadcasting_product_keeps_the_split_of_its_full_size_dimensions():
  # LayerNorm's `rsqrt(var)[B, L, 1] * scale[1, 1, D]`: no operand has the
  # result's shape; jax broadcasts size-1 dimensions. The batch dimension is
  # split as `var`'s is, so the [B, L, D] product is a quarter per device.
  out = _run("""
mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

def step(scale, x):
  def loss(scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    y = (x - mean) * (jax.lax.rsqrt(var + 1e-6) * scale[None, None, :])
    return jnp.sum(y * y)
  return scale - 0.1 * jax.grad(loss)(scale)

x = jax.device_put(jnp.ones((64, 16, 32)), NamedSharding(mesh, P("d")))
prog = jaxmem.analyze(step, jnp.ones((32,)), x)
print(json.dumps({"full": by_shape(prog, (64, 16, 32))}))
""")
  assert out["full"] == [[64 * 16 * 32 * 4 // 4, 64 * 16 * 32 * 4]], out
