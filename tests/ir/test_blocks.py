"""Control-flow blocks (`Program.blocks`): scan, while, cond, checkpoint and their inner peak.

Sizes are asserted against numbers worked out by hand from the shapes: a body's
values live from the equation that makes them to their last use.
"""

from __future__ import annotations

import importlib.resources
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.report.html_page import html_report

L, B, D = 4, 32, 64          # layers, batch, width
F32 = 4
BD = B * D * F32             # one activation [B, D]: 8 KiB
DD = D * D * F32             # one layer's weight [D, D]: 16 KiB


def _schema() -> dict:
  return json.loads((importlib.resources.files("jaxmem") / "schema" / "program-1.json").read_text())


def _bytes_of(prog, vid):
  """Bytes of a value from its shape and dtype alone (not from `VarInfo.nbytes`)."""
  v = prog.vars[vid]
  return math.prod(v.shape) * np.dtype(v.aval.dtype).itemsize


def _layers(ws, x):
  """Forward-only scan over stacked weights with two stacked outputs."""
  def layer(c, w):
    h = jnp.tanh(c @ w)
    return h, (h * 2, h.sum(0))
  c, (ys, sums) = jax.lax.scan(layer, x, ws)
  return c.sum() + ys.sum() + sums.sum()


def _args():
  return jnp.ones((L, D, D)) * 0.01, jnp.ones((B, D))


@pytest.fixture(scope="module")
def scan_prog():
  return jaxmem.analyze(_layers, *_args())


def test_scan_forward_sizes(scan_prog):
  (blk,) = scan_prog.blocks
  op = scan_prog.ops[blk.op_index]
  assert op.primitive == blk.primitive == "scan"
  assert isinstance(blk, jaxmem.Block)
  assert (blk.length, blk.reverse, blk.depth, blk.region, blk.children) == (L, False, 0, "", ())
  assert blk.carry_bytes == BD
  assert blk.xs_bytes == L * DD
  assert blk.consts_bytes == 0
  # ys: [L, B, D] (h * 2) and [L, D] (h.sum(0)).
  assert blk.stacked_output_bytes == L * BD + L * D * F32
  # One iteration: carry + weight slice held; c @ w and its tanh live together,
  # then tanh, h * 2 and h.sum(0) (the body's results) at the end.
  assert blk.per_iteration_bytes == (BD + DD) + 2 * BD + D * F32
  # Beyond the body's inputs and outputs: c @ w and tanh at once.
  assert blk.inner_peak_bytes == 2 * BD == op.transient_bytes
  assert blk.branch_peaks is None and blk.cond_peak_bytes is None


def test_scan_over_layers_grad():
  prog = jaxmem.analyze(jax.grad(_layers), *_args())
  fwd, bwd = prog.blocks
  assert (fwd.primitive, bwd.primitive) == ("scan", "scan")
  assert (fwd.length, bwd.length) == (L, L)
  assert (fwd.reverse, bwd.reverse) == (False, True)
  assert fwd.carry_bytes == bwd.carry_bytes == BD
  assert fwd.xs_bytes == L * DD
  # The forward scan's stacked outputs: its ys plus the per-layer residuals,
  # every one [L, ...]; recomputed here from the values' shapes.
  fwd_op = prog.ops[fwd.op_index]
  stacked = fwd_op.outputs[1:]
  assert all(prog.vars[o].shape[0] == L for o in stacked)
  assert fwd.stacked_output_bytes == sum(_bytes_of(prog, o) for o in stacked)
  # at least the ys and the tanh outputs saved for the backward pass
  assert fwd.stacked_output_bytes >= 2 * L * BD + L * D * F32
  # The backward scan stacks the weight gradient, [L, D, D].
  assert bwd.stacked_output_bytes == L * DD
  for blk in (fwd, bwd):
    assert blk.inner_peak_bytes == prog.ops[blk.op_index].transient_bytes > 0
    assert blk.per_iteration_bytes >= blk.carry_bytes + blk.xs_bytes // blk.length
    assert blk.per_iteration_bytes < blk.xs_bytes + blk.stacked_output_bytes


def test_flax_scan_over_layers():
  nn = pytest.importorskip("flax.linen")

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.relu(nn.Dense(128)(x)) + x, None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      scanned = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=6)
      x, _ = scanned()(x, None)
      return x.sum()

  model, x = Net(), jnp.ones((256, 128))
  params = model.init(jax.random.PRNGKey(0), x)
  prog = jaxmem.analyze(jax.grad(lambda p, x: model.apply(p, x)), params, x)
  fwd, bwd = prog.blocks
  layer_params = 6 * (128 * 128 + 128) * F32   # stacked kernel and bias
  assert (fwd.length, bwd.length, fwd.reverse, bwd.reverse) == (6, 6, False, True)
  assert fwd.carry_bytes == bwd.carry_bytes == 256 * 128 * F32
  assert fwd.xs_bytes == layer_params            # the stacked parameters are the xs
  assert bwd.stacked_output_bytes == layer_params   # ... and their gradient the ys
  fwd_out = prog.ops[fwd.op_index].outputs[1:]
  assert fwd.stacked_output_bytes == sum(_bytes_of(prog, o) for o in fwd_out)
  assert fwd.module == "Net"
  # The body calls the layer through a nested jit: looked through, no child.
  assert fwd.children == () and bwd.children == ()
  for blk in (fwd, bwd):
    assert blk.inner_peak_bytes == prog.ops[blk.op_index].transient_bytes > 0
    assert blk.per_iteration_bytes >= blk.carry_bytes + blk.xs_bytes // blk.length


def test_cond_branch_peaks():
  n = 64
  nb = n * n * F32

  def f(x):
    # lax.cond branches are stored (false_fun, true_fun).
    return jax.lax.cond(x[0, 0] > 0, lambda y: y * 2, lambda y: jnp.sin(y) @ y, x).sum()

  prog = jaxmem.analyze(f, jnp.ones((n, n)))
  (blk,) = prog.blocks
  assert blk.primitive == "cond" and blk.length is None and blk.carry_bytes is None
  # false: sin(y) and the product live together; true: one product.
  assert blk.branch_peaks == (2 * nb, nb)
  assert blk.inner_peak_bytes == max(blk.branch_peaks) == prog.ops[blk.op_index].transient_bytes


def test_while_loop():
  def f(x):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 1.5, c[1] + 1), (x, 0))[0].sum()

  prog = jaxmem.analyze(f, jnp.ones((B, D)))
  (blk,) = prog.blocks
  assert blk.primitive == "while" and blk.length is None
  carry = BD + 4                                 # the array and an int32 counter
  assert blk.carry_bytes == carry
  assert blk.per_iteration_bytes == 2 * carry    # old and new carry
  assert blk.cond_peak_bytes == 1                # one bool
  assert blk.body_peak_bytes == BD
  assert blk.inner_peak_bytes == BD == prog.ops[blk.op_index].transient_bytes


def test_checkpoint():
  x = jnp.ones((B, D))
  remat = ("remat2", "checkpoint")

  def f(x):
    return jax.checkpoint(lambda y: jnp.sin(y) @ y.T)(x).sum()

  (blk,) = jaxmem.analyze(f, x).blocks
  assert blk.primitive in remat and blk.per_iteration_bytes is None
  # sin(y) [B, D] and the product [B, B] at once: y.T is folded into the dot
  # (XLA's TransposeFolding), so it stores nothing.
  assert blk.inner_peak_bytes == BD + B * B * F32
  # Under grad the forward is inlined and the backward recomputes in a remat block.
  prog = jaxmem.analyze(jax.grad(f), x)
  blocks = [b for b in prog.blocks if b.primitive in remat]
  assert len(blocks) == 1
  assert blocks[0].inner_peak_bytes == prog.ops[blocks[0].op_index].transient_bytes >= 2 * BD


def _nested(x):
  def outer(c, _):
    @jax.jit   # a call inside the body is looked through
    def inner_loop(d):
      return jax.lax.scan(lambda d, _: (jnp.tanh(d) * 2, None), d, None, length=5)[0]
    c = inner_loop(c)
    return c, c.sum()
  return jax.lax.scan(outer, x, None, length=3)[1].sum()


def test_nested_scan_gives_children():
  prog = jaxmem.analyze(_nested, jnp.ones((B, D)))
  (outer,) = prog.blocks
  (inner,) = outer.children
  assert (outer.length, inner.length) == (3, 5)
  assert (inner.primitive, inner.depth, inner.region) == ("scan", 1, "body")
  assert inner.op_index == outer.op_index
  assert list(outer.walk()) == [outer, inner]
  # inner body: carry, tanh, tanh * 2 (tanh dies at the multiply); XLA fuses
  # tanh into the multiply, so the body stores only its result
  assert inner.per_iteration_bytes == 3 * BD
  assert inner.inner_peak_bytes == BD
  assert inner.carry_bytes == BD and inner.stacked_output_bytes == 0
  # outer body: carry, the inner scan's result and its inner peak at once
  assert outer.per_iteration_bytes == BD + BD + inner.inner_peak_bytes
  assert outer.inner_peak_bytes == BD + inner.inner_peak_bytes
  assert outer.stacked_output_bytes == 3 * F32


def test_report_has_block_section(scan_prog):
  text = scan_prog.report(top=3)
  assert "control-flow blocks (1;" in text
  per_iter = jaxmem.format_bytes((BD + DD) + 2 * BD + D * F32)
  assert f"{L} × {per_iter}/iteration" in text
  assert f"carry {jaxmem.format_bytes(BD)}" in text
  assert f"stacked outputs {jaxmem.format_bytes(L * BD + L * D * F32)}" in text
  nested = jaxmem.analyze(_nested, jnp.ones((B, D))).report(top=3)
  assert "↳ scan" in nested and "in body" in nested
  plain = jaxmem.analyze(lambda x: jnp.sin(x).sum(), jnp.ones((8,)))
  assert plain.blocks == () and "control-flow blocks" not in plain.report()


def test_scalar_combiners_are_not_blocks():
  """scatter-add and reduce carry a scalar sub-jaxpr: not a body worth a block."""
  def f(x):
    y = x.at[jnp.arange(4)].add(1.0)
    return jax.lax.reduce(y, 0.0, lambda a, b: a + b * b, (0,)).sum()

  prog = jaxmem.analyze(f, jnp.ones((16,)))
  assert {op.primitive for op in prog.ops} >= {"scatter-add", "reduce"}
  assert prog.blocks == ()


def test_json_blocks_match_schema():
  jsonschema = pytest.importorskip("jsonschema")
  schema = _schema()
  jsonschema.Draft202012Validator.check_schema(schema)
  prog = jaxmem.analyze(_nested, jnp.ones((B, D)))
  data = json.loads(json.dumps(prog.to_json()))
  jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)
  (outer,) = data["blocks"]
  assert outer["primitive"] == "scan" and outer["length"] == 3
  assert outer["children"][0]["length"] == 5 and outer["children"][0]["children"] == []
  assert outer["branch_peaks"] is None
  cond = jaxmem.analyze(lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x).sum(),
                        jnp.ones((16,))).to_json()
  jsonschema.validate(cond, schema, cls=jsonschema.Draft202012Validator)
  assert len(cond["blocks"][0]["branch_peaks"]) == 2
  # the schema does constrain blocks
  bad = dict(data, blocks=[dict(outer, inner_peak_bytes=-1)])
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)


def test_html_blocks_table(scan_prog):
  page = html_report(scan_prog, chart="svg")
  assert "<h2>Control-flow blocks</h2>" in page
  assert jaxmem.format_bytes(L * BD + L * D * F32) in page
  plain = jaxmem.analyze(lambda x: jnp.sin(x).sum(), jnp.ones((8,)))
  assert "Control-flow blocks" not in html_report(plain, chart="svg")
