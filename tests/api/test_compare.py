"""`jaxmem.compare`: estimate vs compiled peak on the example models."""

from __future__ import annotations

import json

import pytest

import jaxmem


@pytest.mark.parametrize("name,kw", [("mlp", dict(batch_size=2048)), ("cnn", dict(batch_size=32)),
                                     ("transformer", dict(batch_size=8, layers=2))])
def test_estimate_within_15_percent_of_compiled(name, kw, capsys):
  step, args = __import__(name).build(**kw)
  cmp = jaxmem.compare(step, *args)
  out = capsys.readouterr().out
  assert abs(cmp.relative_error) <= 0.15, str(cmp)
  assert "compiled peak (XLA)" in out and "explained by" in out and "within ±15%" in out
  assert cmp.notes


def test_cnn_explanations_name_the_xla_effects():
  import cnn
  step, args = cnn.build(batch_size=16)
  cmp = jaxmem.compare(step, *args, verbose=False)
  text = "\n".join(cmp.notes)
  assert "select_and_scatter_add" in text and "conv_general_dilated" in text
  assert "fused" in text
  # Without the XLA model the jaxpr-level estimate is far below the compiled peak.
  assert cmp.jaxpr_peak_bytes < 0.6 * cmp.compiled.peak_bytes


def test_scan_over_layers_estimate_and_report():
  """`nn.scan` over layers: the scan is one block with its inner working set."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.relu(nn.Dense(128)(x)) + x, None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=6)
      x, _ = scanned()(x, None)
      return nn.Dense(10)(x)

  model = Net()
  x, y = jnp.ones((2048, 128)), jnp.zeros((2048,), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), x[:1])
  tx = optax.adam(1e-3)

  def step(params, opt, x, y):
    def loss(p):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    l, g = jax.value_and_grad(loss)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), opt, l

  args = (params, tx.init(params), x, y)
  prog = jaxmem.analyze(step, *args)
  scans = [op for op in prog.ops if op.primitive == "scan"]
  assert len(scans) == 2 and all(op.transient_bytes > 0 for op in scans)  # forward, backward
  # The stacked per-layer residuals leave the forward scan as [6, 2048, 128] values.
  assert any(v.shape == (6, 2048, 128) and v.role is jaxmem.Role.ACTIVATION for v in prog.vars)
  assert "scan" in prog.report()
  cmp = jaxmem.compare(step, *args, verbose=False)
  assert abs(cmp.relative_error) <= 0.15, str(cmp)


def test_stored_broadcasts_are_attributed_in_report_and_json():
  """XLA:CPU stores one full-size broadcast of the softmax denominator per attention
  layer (read by the forward and the backward pass): the report charges it to the
  attention module's line, the JSON lists it, and it is counted in the peak."""
  import importlib.resources

  jsonschema = pytest.importorskip("jsonschema")
  step, args = __import__("transformer").build(batch_size=4, layers=2, seq_len=64)
  prog = jaxmem.analyze(step, *args)
  data = prog.to_json()
  schema = json.loads((importlib.resources.files("jaxmem") / "schema" / "program-1.json").read_text())
  jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)
  # [B, H, L, L] float32 per layer, from a [B, H, L, 1] denominator
  full = 4 * 4 * 64 * 64 * 4
  softmax = [b for b in data["xla_broadcasts"]
             if b["bytes"] == full and data["values"][b["value"]]["shape"] == [4, 4, 64, 1]]
  assert len(softmax) == 2
  for b in softmax:
    s, e = b["interval"]
    assert data["ops"][s]["phase"] == "forward" and data["ops"][e]["phase"] == "backward"
    assert data["values"][b["value"]]["name"].endswith("MultiHeadDotProductAttention_0")
  text = prog.report(top=200)
  assert "XLA broadcast" in text and "float32[4,4,64,1]" in text
