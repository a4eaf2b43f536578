"""`jaxmem.fit` of steps spread over 8 CPU devices: a per-device budget, verified per device.

Data parallel + FSDP (batch and parameters split over one axis) and tensor
parallel (a 2 x 4 mesh: batch over ``data``, attention heads and MLP columns
over ``model``). Several CPU devices exist only if ``XLA_FLAGS`` says so
before JAX starts, so each case runs in a fresh interpreter and prints JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"

_PRELUDE = f"""
import json, sys
sys.path.insert(0, {str(EXAMPLES)!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jaxmem

def same(a, b):
  return [bool(np.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]

def close(a, b):
  return [bool(np.allclose(x, y, rtol=1e-5, atol=1e-6))
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]

def report(fitted, args, exact=True):
  res = fitted.fit_result(*args)
  out, ref = fitted(*args), jax.jit(fitted.fun)(*args)
  kinds = {{d.action.value for d in res.plan.decisions}}
  return dict(budget=res.budget_bytes, unplanned=res.unplanned_peak_bytes, peak=res.peak_bytes,
              kinds=sorted(kinds), same=same(out, ref), close=close(out, ref),
              worst=max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0))
                        for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref))),
              bad=[jax.tree_util.keystr(p) for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree.leaves(ref)) if not np.allclose(x, y, rtol=1e-5, atol=1e-6)],
              out_specs=[str(x.sharding.spec) for x in jax.tree.leaves(out)[:3]],
              ref_specs=[str(x.sharding.spec) for x in jax.tree.leaves(ref)[:3]])
"""


def _run(body: str) -> dict:
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)], env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# Tensor-parallel MLP blocks written with constraints or shard_map, 2 x 4 mesh.
_TP_BLOCKS = f"""
sys.path.insert(0, {str(BENCH)!r})
import tp_blocks
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
"""

# Data parallel + FSDP: the batch and every kernel (and its adam moments)
# split 8 ways over one axis, along its first dimension that divides evenly.
_FSDP = """
from _common import fsdp_spec

def shard(args, mesh):
  *state, x, y = args
  batch = NamedSharding(mesh, P("d"))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, fsdp_spec(a, 8, "d")))
  return (*jax.tree.map(put, tuple(state)), jax.device_put(x, batch), jax.device_put(y, batch))
"""


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_fsdp_mlp_fits_half_its_per_device_peak_bit_identical(axis_type):
  out = _run(_FSDP + f"""
import mlp
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.{axis_type},))
step, args = mlp.build(batch_size=8192, width=512, depth=8)
args = shard(args, mesh)
res = {{}}
# `auto` picks recomputation here; `layrub` offloads activations (per-device
# host copies: each device's shard goes to host memory and comes back).
for planner, budget in (("auto", 0.55), ("layrub", 0.55)):
  res[planner] = report(jaxmem.fit(budget, planner=planner)(step), args)
print(json.dumps(res))
""")
  assert "offload" in out["layrub"]["kinds"]
  for planner, r in out.items():
    assert r["peak"] <= r["budget"] < r["unplanned"], (planner, r)
    assert all(r["same"]), (planner, r)
    assert r["out_specs"] == r["ref_specs"], (planner, r)


def test_fsdp_resnet_fits_half_its_per_device_peak_bit_identical():
  out = _run(_FSDP + """
import resnet
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
step, args = resnet.build(batch_size=32, depth=18, image_size=16, width=8, classes=16,
                          stages=(1, 1))
args = shard(args, mesh)
print(json.dumps(report(jaxmem.fit(0.5)(step), args)))
""")
  assert out["peak"] <= out["budget"] < out["unplanned"], out
  assert all(out["same"]), out


def test_async_copies_per_device_are_bit_identical():
  out = _run(_FSDP + """
import mlp
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
step, args = mlp.build(batch_size=8192, width=512, depth=8)
args = shard(args, mesh)
print(json.dumps(report(jaxmem.fit(0.55, planner="layrub", copies="async")(step), args)))
""")
  assert "offload" in out["kinds"]
  assert out["peak"] <= out["budget"], out
  assert all(out["same"]), out


# Tensor parallel on a data x model mesh, Megatron-style: q/k/v and the MLP's
# first kernel split by output (heads, columns), the attention output and the
# MLP's second kernel by input; scanned blocks have a leading layer dimension.
_TP = """
import transformer
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
tp = lambda path, a: jax.device_put(a, NamedSharding(mesh, transformer.tensor_parallel_spec(path, a)))
"""


def test_tensor_parallel_transformer_fits_half_its_per_device_peak():
  out = _run(_TP + """
step, (params, opt, tokens) = transformer.build(batch_size=16, seq_len=128, vocab=64, dim=128,
                                                heads=4, layers=2)


args = (jax.tree_util.tree_map_with_path(tp, params), jax.tree_util.tree_map_with_path(tp, opt),
        jax.device_put(tokens, NamedSharding(mesh, P("data"))))
print(json.dumps(report(jaxmem.fit(0.5)(step), args)))
""")
  assert out["peak"] <= out["budget"] < out["unplanned"], out
  # Recomputed segments let XLA fuse (and so round) some ops differently, as
  # on one device (tests/api/test_examples.py, "transformer"): float noise.
  # The key projection's bias has a gradient of exactly zero in exact
  # arithmetic (softmax ignores a shift shared by all keys); adamw divides its
  # float noise (~1e-10) by its own square root, so those two leaves move by
  # up to lr either way and are not compared.
  assert all("['key']['bias']" in b for b in out["bad"]), (out["worst"], out["bad"])
  assert out["out_specs"] == out["ref_specs"], out


def test_shard_map_tensor_parallel_step_fits_bit_identical():
  # Megatron MLP blocks written with `jax.shard_map` (a psum over "model";
  # bench/tp_blocks.py): the plan's ops stay outside the shard_map bodies and
  # act on their results and residuals, each device on its shard.
  out = _run(_TP_BLOCKS + """
step, args = tp_blocks.build(mesh, "shard_map")
print(json.dumps(report(jaxmem.fit(0.55)(step), args)))
""")
  assert out["peak"] <= out["budget"] < out["unplanned"], out
  assert all(out["same"]), out


def test_scanned_tensor_parallel_transformer_recomputes_per_iteration():
  # `nn.scan` over the blocks, under the same tensor-parallel mesh: fit
  # rewrites the scan to recompute part of its residuals per iteration.
  out = _run(_TP + """
kw = dict(batch_size=16, seq_len=128, vocab=64, dim=256, heads=8, layers=6, scan_layers=True)
step, (params, opt, tokens) = transformer.build(**kw)
args = (jax.tree_util.tree_map_with_path(tp, params), jax.tree_util.tree_map_with_path(tp, opt),
        jax.device_put(tokens, NamedSharding(mesh, P("data"))))
fitted = jaxmem.fit(0.5)(step)
res = fitted.fit_result(*args)
out, ref = fitted(*args), jax.jit(step)(*args)
# Adam's first update is lr * sign(gradient): where a gradient is float32
# noise its sign is, so the gradients are compared, through the same rewrite.
from _common import cross_entropy
model = transformer.GPT(kw["vocab"], kw["dim"], kw["heads"], kw["layers"], kw["seq_len"], None,
                        True)
def grads(params, tokens):
  return jax.grad(lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(params)
fitted_grads = jaxmem.fit(0.5)(grads)
gres = fitted_grads.fit_result(args[0], args[2])
g, g_ref = fitted_grads(args[0], args[2]), jax.jit(grads)(args[0], args[2])
print(json.dumps(dict(budget=res.budget_bytes, unplanned=res.unplanned_peak_bytes,
                      peak=res.peak_bytes, scans=res.scans, grad_scans=gres.scans,
                      grads_close=[bool(np.allclose(x, y, rtol=1e-5, atol=1e-7))
                                   for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref))],
                      loss_close=bool(np.allclose(out[-1], ref[-1], rtol=1e-6)),
                      specs=[str(x.sharding.spec) == str(y.sharding.spec)
                             for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref))])))
""")
  assert out["peak"] <= out["budget"] < out["unplanned"], out
  assert out["scans"].startswith("recomputed"), out
  # Part of each block recomputed: XLA sums some gradients in another order
  # (as `nn.remat` on the scanned block does): the gradients equal jax.jit's
  # to float32 rounding, the loss too, and the results keep their shardings.
  assert out["grad_scans"].startswith("recomputed"), out
  assert all(out["grads_close"]) and out["loss_close"] and all(out["specs"]), out


def test_budget_error_under_a_mesh_names_the_collectives_buffers():
  out = _run(_FSDP + """
import mlp
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
step, args = mlp.build(batch_size=1024, width=512, depth=4)
args = shard(args, mesh)
try:
  jaxmem.fit(0.1)(step).fit_result(*args)
  print(json.dumps({"raised": False}))
except jaxmem.BudgetError as e:
  print(json.dumps({"raised": True, "message": str(e)}))
""")
  assert out["raised"]
  # FSDP: every kernel is gathered whole for its matmuls, by XLA, not by a jaxpr value.
  assert "8-device mesh XLA's collectives" in out["message"]
  assert "all-gather f32[512,512]" in out["message"], out["message"]


def test_with_sharding_constraint_tensor_parallel_step_fits_bit_identical():
  # Tensor parallelism written as constraints on the activations (the batch
  # over "data", the hidden units over "model"; bench/tp_blocks.py); the
  # partitioner splits the weights' uses to match. The estimate follows the
  # constraints backwards to the values they constrain (`ir/sharding.py`).
  out = _run(_TP_BLOCKS + """
step, args = tp_blocks.build(mesh, "constraints")
prog = jaxmem.analyze(step, *args)
r = report(jaxmem.fit(0.5)(step), args)
# Each [4096, 1024] hidden activation is an eighth of itself on a device.
r["hidden"] = sorted({(v.nbytes, v.global_nbytes) for v in prog.vars
                      if v.shape == (4096, 1024) and v.role.value == "activation"})
print(json.dumps(r))
""")
  assert out["peak"] <= out["budget"] < out["unplanned"], out
  assert all(out["same"]), out
  assert [4096 * 1024 * 4 // 8, 4096 * 1024 * 4] in out["hidden"], out["hidden"]
