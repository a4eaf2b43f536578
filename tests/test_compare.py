"""`jaxmem.compare`: estimate vs compiled peak on the example models."""

from __future__ import annotations

import pytest

import jaxmem


@pytest.mark.parametrize("name,kw", [("mlp", dict(batch_size=2048)), ("cnn", dict(batch_size=32))])
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
