"""The native lifetime model (``ffi/lifetimes.cc``) gives the Python reference's lifetimes.

Flows of the example models, as analysed for each compiler the estimate
models (XLA:CPU with its fusion limits, XLA:GPU, XLA:TPU) and as the planners
rewrite them (recomputation, pins, asynchronous copies), and of random
programs; every estimate of this folder is compared too (``conftest.py``).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxmem
from jaxmem._src.estimate import lifetimes
from jaxmem._src.estimate.analysis import analyze_program
from jaxmem._src.ir.trace import trace
from jaxmem._src.native import lifetimes as native_lifetimes
from jaxmem._src.plan.schedule import build_schedule

pytestmark = pytest.mark.skipif(native_lifetimes.estimate_lifetimes is None,
                                reason="the extension predates estimate_lifetimes")

EXAMPLES = int(os.environ.get("JAXMEM_EXAMPLES", "12"))


def _program(module: str, backend: str, **kw) -> jaxmem.Program:
  import importlib
  step, args = importlib.import_module(module).build(**kw)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  return jaxmem.Program.of(analyze_program(trace(step, shapes, backend=backend)))


MODELS = {
    "resnet18": ("resnet", dict(batch_size=8, depth=18, image_size=32, classes=10,
                                abstract=True)),
    "gpt": ("transformer", dict(batch_size=4, seq_len=32, dim=64, heads=2, layers=2)),
    # 32 characters, not the example's 128: the same cells unrolled; the
    # three compilers' tests take 66 s instead of 180 s (the Python
    # reference's lifetimes are the cost).
    "lstm": ("lstm", dict(batch_size=8, seq_len=32, abstract=True)),
    "unet": ("unet", dict(batch_size=2, abstract=True)),
}


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_planners_schedules_get_the_same_lifetimes(model, backend):
  """The unplanned flow and those of a recomputing, an offloading (copies in
  flight) and a pinned plan: the profiles (the estimate's every output) match."""
  from conftest import assert_same_lifetimes
  module, kw = MODELS[model]
  prog = _program(module, backend, **kw)
  budget = int(0.6 * prog.peak_bytes)
  plans = [jaxmem.get_planner("segments")(prog, budget, "h100-pcie"),
           jaxmem.get_planner("greedy")(prog, budget, "h100-pcie", copies="async"),
           jaxmem.get_planner("selective")(prog, budget, "h100-pcie")]
  flows = []
  original = lifetimes.merge_common_subexpressions
  try:
    lifetimes.merge_common_subexpressions = lambda flow: (flows.append(flow), original(flow))[1]
    for plan in plans:
      build_schedule(prog, plan.decisions, plan.pinned, copies=plan.copies,
                     window=plan.window, budget=plan.target_bytes)._profile()
  finally:
    lifetimes.merge_common_subexpressions = original
  assert len(flows) >= len(plans)
  for flow in flows:
    assert_same_lifetimes(*original(flow))


@st.composite
def _mlps(draw):
  depth = draw(st.integers(2, 5))
  width = draw(st.sampled_from([16, 32]))
  acts = [draw(st.sampled_from(["relu", "tanh", "gelu", "softmax"])) for _ in range(depth)]
  norm = [draw(st.booleans()) for _ in range(depth)]
  backend = draw(st.sampled_from(["cpu", "gpu", "tpu"]))
  fraction = draw(st.floats(0.4, 0.9))
  return depth, width, acts, norm, backend, fraction


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_mlps())
def test_random_programs_and_plans_get_the_same_lifetimes(spec):
  from conftest import assert_same_lifetimes
  depth, width, acts, norm, backend, fraction = spec
  fns = {"relu": jax.nn.relu, "tanh": jax.numpy.tanh, "gelu": jax.nn.gelu,
         "softmax": lambda z: jax.nn.softmax(z, axis=-1)}

  def loss(ws, x):
    for w, act, n in zip(ws, acts, norm):
      x = fns[act](x @ w)
      if n:
        x = (x - x.mean(-1, keepdims=True)) / (1 + x.std(-1, keepdims=True))
    return (x * x).mean()

  ws = [jax.ShapeDtypeStruct((width, width), np.float32)] * depth
  x = jax.ShapeDtypeStruct((64, width), np.float32)
  prog = jaxmem.Program.of(analyze_program(trace(jax.grad(loss), (ws, x), backend=backend)))
  plan = jaxmem.get_planner("greedy")(prog, int(fraction * prog.peak_bytes), "h100-pcie",
                                      copies="async")
  for sched in (build_schedule(prog, ()),
                build_schedule(prog, plan.decisions, plan.pinned, copies="async",
                               budget=plan.target_bytes)):
    flows = []
    original = lifetimes.merge_common_subexpressions
    try:
      lifetimes.merge_common_subexpressions = lambda flow: (flows.append(flow), original(flow))[1]
      sched._profile()
    finally:
      lifetimes.merge_common_subexpressions = original
    for flow in flows:
      assert_same_lifetimes(*original(flow))


def test_a_malformed_flow_is_refused_not_crashed_on():
  """Indices out of range or columns of the wrong length raise `ValueError`."""
  fn = native_lifetimes.estimate_lifetimes
  good = dict(kind=np.array([0], np.int64), in_ptr=np.array([0, 1], np.int64),
              in_idx=np.array([0], np.int64), out_ptr=np.array([0, 1], np.int64),
              out_idx=np.array([1], np.int64), start=np.array([0, 0], np.int64),
              end=np.array([1, 1], np.int64), nbytes=np.array([4, 4], np.int64),
              materialized=np.array([1, 1], np.int64), hoist=np.array([], np.int64),
              merged=np.array([0, 0], np.int64))
  pos, start, end, virtual, _, _ = fn(1, good)
  assert pos.tolist() == [0, 1] and virtual.tolist() == [0, 0]
  for name, bad in [("in_idx", np.array([7], np.int64)), ("kind", np.array([9], np.int64)),
                    ("start", np.array([0], np.int64)), ("in_ptr", np.array([0, 2], np.int64)),
                    ("hoist", np.array([-1], np.int64))]:
    with pytest.raises(ValueError, match="estimate_lifetimes"):
      fn(1, {**good, name: bad})
  with pytest.raises(ValueError, match="`kind` missing"):
    fn(1, {k: v for k, v in good.items() if k != "kind"})
  with pytest.raises(ValueError, match="forwarded"):
    fn(1, {**good, "fwd_mask": np.array([0, 1], np.int64)})


def test_the_python_reference_can_be_asked_for(monkeypatch):
  """`JAXMEM_NATIVE_ESTIMATE=0` runs the Python rules: the same profile."""
  monkeypatch.undo()                  # (this folder's fixture checks both anyway)
  prog = _program("transformer", "cpu", batch_size=4, seq_len=32, dim=64, heads=2, layers=2)
  plan = jaxmem.get_planner("segments")(prog, int(0.6 * prog.peak_bytes), "h100-pcie")
  native = build_schedule(prog, plan.decisions, plan.pinned)._profile()
  monkeypatch.setenv("JAXMEM_NATIVE_ESTIMATE", "0")
  assert lifetimes._native_lifetimes() is None
  python = build_schedule(prog, plan.decisions, plan.pinned)._profile()
  assert python.peak_bytes == native.peak_bytes
  assert python.live_bytes.tolist() == native.live_bytes.tolist()
  assert python.holders == native.holders and python.intervals == native.intervals
