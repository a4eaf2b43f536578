"""MiniMalloc's decision search (`ffi/dsa_pack.cc`) and the instance generators (`dsa_instances.py`).

Every placement a test gets is validated with `dsa.check`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem import dsa
from jaxmem._src.native.extension import native_module

from dsa_cases import ABOVE_MAX_LOAD, BF_SUBOPTIMAL, brute_force


def _pack(inst, capacity, time_limit_s=5.0, node_limit=0):
  lower, upper, size = (np.asarray(inst[k], dtype=np.int64) for k in ("lower", "upper", "size"))
  r = native_module.dsa_pack(lower, upper, size, int(capacity), time_limit_s, node_limit)
  if r["status"] == "found":
    assert dsa.check(lower, upper, size, r["offsets"]) <= capacity
  return r


def _dict(inst: dsa.Instance) -> dict:
  return dict(lower=inst.lower, upper=inst.upper, size=inst.size)


def _grouped(seed, **kw):
  return dsa.program_instance(seed, grouped=True, **kw)


@pytest.mark.parametrize("make", [dsa.tiling_instance, dsa.program_instance, _grouped])
@pytest.mark.parametrize("seed", range(4))
def test_generated_instances_have_the_challenging_suites_character(make, seed):
  inst = make(seed)
  n = len(inst.size)
  assert 150 <= n <= 450
  assert inst.capacity == 1 << 20
  assert (inst.size % 1024 == 0).all() and inst.size.min() >= 1024
  assert inst.size.max() <= 0.85 * inst.capacity
  assert inst.lower.min() >= 0 and inst.upper.max() <= 1 << 20 and (inst.lower < inst.upper).all()
  assert 18 * 1024 <= np.median(inst.size) <= 90 * 1024
  assert 20_000 <= np.median(inst.upper - inst.lower) <= 240_000
  load = dsa.max_load(inst.lower, inst.upper, inst.size)
  assert 0.94 * inst.capacity <= load <= inst.capacity
  # The witness fits: a solver that fails has not met an infeasible instance.
  assert dsa.check(inst.lower, inst.upper, inst.size, inst.offsets) <= inst.capacity
  again = make(seed)
  assert all((a == b).all() for a, b in zip(inst[:3], again[:3]))


@pytest.mark.parametrize("seed", range(4))
def test_grouped_instances_share_times_as_compiled_programs_do(seed):
  # The public suite: 0.47 to 0.63 distinct times per buffer, 1.25 to 1.51
  # buffers per lifetime (bench/results/dsa.md); a plain program instance has
  # about 1.9 and exactly 1.
  for grouped in (False, True):
    inst = dsa.program_instance(seed, grouped=grouped)
    times = len(np.unique(np.concatenate([inst.lower, inst.upper]))) / len(inst.size)
    per_lifetime = len(inst.size) / len(set(zip(inst.lower.tolist(), inst.upper.tolist())))
    if grouped:
      assert times < 0.7 and per_lifetime > 1.15
    else:
      assert times > 1.5 and per_lifetime == 1.0


def test_generators_check_their_arguments():
  with pytest.raises(ValueError, match="capacity"):
    dsa.tiling_instance(0, capacity=1000)
  with pytest.raises(ValueError, match="num_buffers"):
    dsa.program_instance(0, num_buffers=0)
  with pytest.raises(ValueError, match="slack"):
    dsa.tiling_instance(0, slack=1.5)
  perfect = dsa.tiling_instance(3, num_buffers=200, slack=0.0)
  assert dsa.max_load(perfect.lower, perfect.upper, perfect.size) == perfect.capacity


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(5, 40), st.sampled_from(["tiling", "program", "grouped"]))
def test_small_generated_instances_are_packed_at_capacity(seed, n, family):
  make = {"tiling": dsa.tiling_instance, "program": dsa.program_instance, "grouped": _grouped}[family]
  inst = make(seed, num_buffers=n)
  r = _pack(_dict(inst), inst.capacity, time_limit_s=20.0)
  # Small instances finish: a complete search cannot call a feasible one infeasible.
  assert r["status"] == "found"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(1, 6)),
                min_size=1, max_size=7))
def test_pack_agrees_with_brute_force(buffers):
  lower = [b[0] for b in buffers]
  upper = [b[0] + b[1] for b in buffers]
  size = [b[2] for b in buffers]
  inst = dict(lower=lower, upper=upper, size=size)
  best = brute_force(lower, upper, size)
  assert _pack(inst, best, time_limit_s=None)["status"] == "found"
  assert _pack(inst, best - 1, time_limit_s=None)["status"] == "infeasible"


def test_pack_proves_a_capacity_too_small():
  # Max load 10, optimum 11 (tests/native/test_dsa.py).
  assert _pack(ABOVE_MAX_LOAD, 10, time_limit_s=None)["status"] == "infeasible"
  assert _pack(ABOVE_MAX_LOAD, 11, time_limit_s=None)["status"] == "found"
  # A buffer larger than the capacity, and an empty instance.
  assert _pack(BF_SUBOPTIMAL, 5)["status"] == "infeasible"
  assert _pack(dict(lower=[], upper=[], size=[]), 0)["status"] == "found"
  with pytest.raises(ValueError, match="capacity"):
    _pack(BF_SUBOPTIMAL, -1)


def test_the_exact_search_reports_what_the_decision_search_proved():
  sol = dsa.solve(**ABOVE_MAX_LOAD, time_limit_s=None)
  assert (sol.footprint, sol.max_load, sol.proven_optimal) == (11, 10, True)
  assert sol.lower_bound == 11


def test_goal_fit_stops_within_the_capacity():
  inst = dsa.tiling_instance(7, num_buffers=200)
  bf = dsa.solve(**_dict(inst), method="best-fit")
  assert bf.footprint > inst.capacity   # best-fit alone does not fit it
  sol = dsa.solve(**_dict(inst), capacity=inst.capacity, goal="fit", time_limit_s=20)
  assert sol.method == "pack" and sol.footprint <= inst.capacity
  assert dsa.check(**_dict(inst), offsets=sol.offsets) == sol.footprint
  with pytest.raises(ValueError, match="`goal`='fit' .* pass `capacity`"):
    dsa.solve(**_dict(inst), goal="fit")
  with pytest.raises(ValueError, match="`goal` must be one of"):
    dsa.solve(**_dict(inst), goal="best")


def test_limits_stop_the_decision_search():
  inst = dsa.tiling_instance(0)   # not packed within seconds (bench/results/dsa.md)
  r = _pack(_dict(inst), inst.capacity, time_limit_s=0.2)
  assert r["status"] == "limit" and r["nodes"] > 0 and r["seconds"] < 1.2
  r = _pack(_dict(inst), inst.capacity, time_limit_s=None, node_limit=300)
  assert r["status"] == "limit" and r["nodes"] == 300
