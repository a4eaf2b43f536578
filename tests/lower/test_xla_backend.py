"""The ``xla`` backend: the same schedule as ``ffi``, in JAX's own primitives.

On the CPU its results are compared with plain ``jax.jit`` bit for bit (XLA:CPU
erases barriers and memory kinds, so the arithmetic is the unplanned step's),
and its program is checked structurally: exactly the plan's host transfers and
fences, nothing else. Its memory is verified on XLA:TPU in
``tests/verify/test_targets.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.lower.backend import get_backend, jit_plan, resolve_backend
from jaxmem._src.lower.xla import schedule_function
from jaxmem._src.plan.decisions import Action
from jaxmem._src.plan.schedule import StepKind
from jaxmem._src.planners.registry import get_planner
from models import mlp, mlp_program


def _assert_tree_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _plan(planner: str, frac: float, copies: str = "sync"):
  prog = mlp_program()
  return get_planner(planner)(prog, int(frac * prog.peak_bytes), "h100-pcie", copies=copies)


def _primitive_counts(closed) -> dict[str, int]:
  counts: dict[str, int] = {}
  for eqn in closed.jaxpr.eqns:
    name = eqn.primitive.name
    if name == "device_put":
      name = f"device_put->{eqn.params['devices'][0]}"
    counts[name] = counts.get(name, 0) + 1
  return counts


@pytest.mark.parametrize("planner,frac,copies", [
    ("greedy", 0.6, "sync"), ("segments", 0.6, "sync"), ("vdnn", 0.7, "sync"),
    ("vdnn", 0.7, "async"), ("layrub", 0.7, "async")])
def test_xla_backend_is_bit_identical_to_jit_on_cpu(planner, frac, copies):
  plan = _plan(planner, frac, copies)
  assert plan.decisions, "the test needs a plan that changes something"
  step, args = mlp()
  expected = jax.jit(step)(*args)
  got = jit_plan(plan, backend="xla")(*args)
  _assert_tree_equal(got, expected)


@pytest.mark.parametrize("planner,copies", [("vdnn", "sync"), ("vdnn", "async"),
                                            ("greedy", "sync"), ("segments", "sync")])
def test_xla_program_carries_exactly_the_planned_transfers(planner, copies):
  """One copy to host per offload, one back per fetch, one barrier per fence or pin."""
  plan = _plan(planner, 0.6 if planner != "vdnn" else 0.7, copies)
  sched = plan.schedule()
  kinds = [st.kind for st in sched.steps]
  offloads = sum(k in (StepKind.OFFLOAD, StepKind.OFFLOAD_START) for k in kinds)
  fetches = sum(k in (StepKind.FETCH, StepKind.FETCH_START) for k in kinds)
  barriers = (fetches + sum(k in (StepKind.FENCE, StepKind.PIN) for k in kinds)
              + sum(sum(not isinstance(x, int) for x in st.inputs)
                    for st in sched.steps if st.literal_dep is not None))
  assert offloads == sum(d.action is Action.OFFLOAD for d in plan.decisions)
  step, args = mlp()
  original = _primitive_counts(jax.make_jaxpr(step)(*args))
  closed = jax.make_jaxpr(schedule_function(sched))(*jax.tree_util.tree_leaves(args))
  counts = _primitive_counts(closed)
  assert counts.get("device_put->MemorySpace.Host", 0) == offloads
  assert counts.get("device_put->MemorySpace.Device", 0) == fetches
  assert counts.get("optimization_barrier", 0) - original.get("optimization_barrier", 0) == barriers
  # Nothing of jaxmem's own: no custom calls.
  assert not any("ffi" in k or "custom_call" in k for k in counts)


def test_resolve_backend():
  assert resolve_backend("auto", "cpu") == "ffi"
  assert resolve_backend("auto", "tpu") == "xla"
  assert resolve_backend("xla", "cpu") == "xla"
  with pytest.raises(ValueError, match="backend='xla'"):
    resolve_backend("ffi", "tpu")
  with pytest.raises(ValueError, match="not a known backend"):
    resolve_backend("nccl", "cpu")
  assert get_backend("xla").name == "xla"


def test_fit_with_xla_backend_on_cpu_reports_it_and_matches_jit():
  step, args = mlp()
  fitted = jaxmem.fit(1.0, backend="xla")(step)
  res = fitted.fit_result(*args)
  assert (res.backend, res.target, res.platform) == ("xla", "local", "cpu")
  assert "'xla' backend" in res.summary()
  _assert_tree_equal(fitted(*args), jax.jit(step)(*args))


def test_fit_with_xla_backend_on_cpu_says_why_it_cannot_lower_the_peak():
  step, args = mlp()
  with pytest.raises(jaxmem.BudgetError, match="XLA:CPU erases"):
    jaxmem.fit(0.6, backend="xla", planner="greedy")(step).fit_result(*args)


def test_fit_rejects_an_unknown_backend():
  with pytest.raises(ValueError, match="`backend`='cuda'"):
    jaxmem.fit(0.5, backend="cuda")


def test_literals_are_fenced_only_off_tpu():
  """A large zeros broadcast gets its literal fenced on the CPU, never on XLA:TPU.

  On XLA:TPU the fences broke fusions around them (an unplanned ResNet-18
  through the ``xla`` backend: 7.71 GB accessed against ``jax.jit``'s 6.79 GB),
  so a plan with no decision must lower to ``jax.jit``'s program there.
  """
  from jaxmem._src.estimate.analysis import analyze_program
  from jaxmem._src.ir.trace import trace
  from jaxmem._src.plan.schedule import build_schedule

  def step(w, x):
    def loss(w):
      h = jnp.tanh(x @ w)
      # A scatter into zeros: its zeros broadcast is built from literals only.
      return (h + jnp.zeros((512, 512)).at[0].add(h[0])).sum()
    return jax.grad(loss)(w)

  args = (jax.ShapeDtypeStruct((512, 512), jnp.float32),
          jax.ShapeDtypeStruct((512, 512), jnp.float32))
  fenced = {}
  for backend in ("cpu", "tpu"):
    prog = analyze_program(trace(step, args, backend=backend))
    fenced[backend] = sum(st.literal_dep is not None for st in build_schedule(prog, ()).steps)
  assert fenced["cpu"] > 0
  assert fenced["tpu"] == 0
