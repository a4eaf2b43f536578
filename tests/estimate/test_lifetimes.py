"""Lifetimes, unit by unit: live bytes from intervals, and XLA's effects applied to a Flow.

Each test builds a small :class:`Flow` by hand, so the expected bytes are
worked out in the comments, not taken from the code under test.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem._src.estimate.lifetimes import (Flow, estimate, merge_common_subexpressions,
                                            profile_from_intervals)
from jaxmem._src.ir.primitives import Fusion

C, E, V, R, M = Fusion.CHEAP, Fusion.EXPENSIVE, Fusion.VIEW, Fusion.REDUCE, Fusion.MATERIALIZED


def test_profile_from_intervals_sums_closed_intervals():
  # value 0: [0, 2] 10 B; value 1: [1, 3] 5 B; value 2: [3, 3] 7 B
  prof = profile_from_intervals(5, [0, 1, 3], [2, 3, 3], [10, 5, 7])
  assert prof.live_bytes.tolist() == [10, 15, 15, 12, 0]
  assert prof.peak_bytes == 15 and prof.peak_index == 1
  assert prof.holders == (0, 1) and prof.holder_bytes == (10, 5)


def test_transient_bytes_count_at_their_position_only():
  prof = profile_from_intervals(3, [0], [2], [4], transient=[0, 100, 0])
  assert prof.live_bytes.tolist() == [4, 104, 4]
  assert prof.holders == (0,)          # transients hold no value


def _flow(kinds, ins, outs, nbytes, *, materialized=(), **kw):
  """A Flow whose values live from their defining step to their last reader."""
  n = len(kinds)
  start = [-1] * len(nbytes)
  end = [-1] * len(nbytes)
  for s, os_ in enumerate(outs):
    for o in os_:
      start[o] = end[o] = s
  for s, is_ in enumerate(ins):
    for x in is_:
      if start[x] < 0:
        start[x] = 0          # an argument
      end[x] = max(end[x], s)
  for x in materialized:
    if start[x] < 0:
      start[x] = 0
    end[x] = n
  fields = dict(num_steps=n, step_kind=kinds, step_inputs=ins, step_outputs=outs,
                transient=[0] * n, hoisted=[0] * n, start=start, end=end, nbytes=nbytes,
                materialized=frozenset(materialized), hoist_to_start=frozenset())
  fields.update(kw)
  return Flow(**fields)


def test_a_cheap_value_read_by_fusible_consumers_is_virtual():
  # x (arg, 0) -> a = cheap(x) (1) -> b = reduce(a) (2) -> c = matmul(b) (3)
  flow = _flow([C, R, M], [[0], [1], [2]], [[1], [2], [3]], [8, 8, 4, 4], materialized=[0, 3])
  prof, virtual = estimate(flow)
  assert virtual.tolist() == [False, True, False, False]   # `a` is fused into the reduce
  # Step 1 (the reduce) holds x (8) and b (4): 12 bytes, not 20 with `a` stored.
  assert prof.live_bytes[1] == 8 + 4
  assert prof.peak_bytes == 8 + 4 + 4        # step 2 also holds c


def test_an_expensive_value_with_two_consumers_is_stored():
  # a = exp(x) read by two cheap steps, which feed one reduction: XLA fuses an
  # expensive producer into a single consumer only, cheap ones into any fusible one.
  flow = _flow([E, C, C, R], [[0], [1], [1], [2, 3]], [[1], [2], [3], [4]], [8, 8, 8, 8, 8],
               materialized=[0, 4])
  _, virtual = estimate(flow)
  assert virtual.tolist() == [False, False, True, True, False]
  single = _flow([E, C, R], [[0], [1], [2]], [[1], [2], [3]], [8, 8, 8, 8], materialized=[0, 3])
  assert estimate(single)[1].tolist() == [False, True, True, False]


def test_a_fused_value_keeps_its_inputs_alive_until_its_last_use():
  # x = matmul(a) (step 0), m = gt(x) (step 1, a 1-byte ReLU mask), y = matmul(a)
  # (step 2), z = select(m, y) (step 3). x is last read at step 1, but XLA fuses m into
  # its consumer and recomputes it there from x: x (8 bytes) lives until step 3.
  flow = _flow([M, C, M, C], [[0], [1], [0], [2, 3]], [[1], [2], [3], [4]], [4, 8, 1, 8, 8],
               materialized=[0, 4])
  prof, virtual = estimate(flow)
  assert virtual[2] and not virtual[1]
  assert prof.intervals[1] == (0, 3)
  assert prof.live_bytes[2] == 4 + 8 + 8     # a, x and y; the mask itself takes nothing


def test_operand_fusing_consumers_recompute_a_cheap_value_instead_of_storing_it():
  # XLA:TPU's dot fusions: x = matmul(a) (step 0), p = cheap(x) (step 1)
  # read by two matmuls, one at step 2 and one at step 4 (the backward pass);
  # step 3 is an unrelated matmul whose 2-byte output is read at step 4.
  kinds = [M, C, M, M, M]
  ins, outs = [[0], [1], [2], [0], [2, 4]], [[1], [2], [3], [4], [5]]
  nbytes = [4, 8, 8, 2, 2, 2]
  stored = _flow(kinds, ins, outs, nbytes, materialized=[0, 3, 5])
  prof, virtual = estimate(stored)
  assert not virtual[2]                      # XLA:CPU: matmuls read a stored p
  # At step 3: a (4), p (8, read again at step 4), the output of step 2 (2) and step 3's (2).
  assert prof.live_bytes[3] == 4 + 8 + 2 + 2
  fusing = dataclasses.replace(stored, fuses_operands=[True] * 5)
  prof, virtual = estimate(fusing)
  assert virtual[2]                          # computed inside each matmul's fusion
  # p takes nothing, x (8) lives until step 4 instead: the same bytes at step 3,
  # but x's interval now covers p's readers.
  assert prof.intervals[1] == (0, 4)
  assert prof.live_bytes[3] == 4 + 8 + 2 + 2
  # Only the consumers that fuse operands count: one that does not keeps p stored.
  one = dataclasses.replace(stored, fuses_operands=[False, False, True, False, False])
  assert not estimate(one)[1][2]


def test_common_subexpressions_are_stored_once():
  key = ("concatenate", "params", (), ("f32[4]",))
  # Two identical steps on the same input: the second merges into the first.
  flow = _flow([M, M, M], [[0], [0], [1, 2]], [[1], [2], [3]], [4, 16, 16, 4],
               materialized=[0, 3], cse_keys=[key, key, None])
  merged, alias = merge_common_subexpressions(flow)
  assert alias == {2: 1}
  assert merged.step_outputs[1] == [] and merged.step_inputs[2] == [1, 1]
  prof, virtual = estimate(flow)
  assert virtual[2]                          # stored by the value it was merged into
  assert prof.peak_bytes == 4 + 16 + 4       # one 16-byte buffer, not two
  unmerged = dataclasses.replace(flow, cse_keys=[key, None, None])
  assert estimate(unmerged)[0].peak_bytes == 4 + 16 + 16 + 4


def test_a_movable_step_runs_as_soon_as_its_inputs_exist():
  # Step 1 (the optimizer update of a gradient made at step 0) is movable: it runs at
  # position 0, so the gradient (value 1) dies there instead of living until step 1.
  flow = _flow([M, C, M], [[0], [1], [0]], [[1], [2], [3]], [4, 100, 4, 4],
               materialized=[0, 2, 3], movable=[False, True, False])
  prof, _ = estimate(flow)
  assert prof.intervals[1] == (0, 0)
  fixed = estimate(dataclasses.replace(flow, movable=None))[0]
  assert fixed.intervals[1] == (0, 1)


def test_shared_broadcasts_live_from_their_first_reader_to_their_last():
  flow = _flow([C, C, C], [[0], [0], [0]], [[1], [2], [3]], [4, 4, 4, 4], materialized=[0, 1, 2, 3],
               shared_reads=[[(0, 64)], [], [(0, 64)]])
  prof, _ = estimate(flow)
  # The values (4 bytes each, live from their step) plus one 64-byte broadcast of
  # value 0, stored from its first reader (step 0) to its last (step 2).
  assert prof.live_bytes[:3].tolist() == [8 + 64, 12 + 64, 16 + 64]
  single = dataclasses.replace(flow, shared_reads=[[(0, 64)], [], []])
  assert estimate(single)[0].peak_bytes == 16        # one reader fuses it: nothing stored


def test_values_hoisted_to_the_start_live_from_position_zero():
  flow = _flow([M, M, M], [[], [0], [1, 2]], [[1], [2], [3]], [4, 4, 40, 4],
               materialized=[0, 3])
  base = estimate(flow)[0]
  hoisted = estimate(dataclasses.replace(flow, hoist_to_start=frozenset({2})))[0]
  assert base.intervals[2][0] == 1 and hoisted.intervals[2][0] == 0
  assert hoisted.live_bytes[0] == base.live_bytes[0] + 40


def test_estimate_is_a_pure_function_of_the_flow():
  flow = _flow([C, R, M], [[0], [1], [2]], [[1], [2], [3]], [8, 8, 4, 4], materialized=[0, 3])
  a, b = estimate(flow)[0], estimate(flow)[0]
  np.testing.assert_array_equal(a.live_bytes, b.live_bytes)
  assert a.intervals == b.intervals


def test_a_matmul_fused_into_its_stored_epilogue_stores_nothing_of_its_own():
  # x (arg 0) -> d = matmul(x) (1) -> e = cheap(d) (2) -> f = cheap(e) (3),
  # read by two reductions (4, 5): f is stored, e is fused into f. With the
  # matmul fusing into its epilogue, d is not written either: one [n, k]
  # buffer (8 B here), not two.
  kinds = [M, C, C, R, R]
  ins, outs = [[0], [1], [2], [3], [3]], [[1], [2], [3], [4], [5]]
  nbytes = [4, 8, 8, 8, 1, 1]
  plain = _flow(kinds, ins, outs, nbytes, materialized=[0, 4, 5])
  _, virtual = estimate(plain)
  assert virtual.tolist() == [False, False, True, False, False, False]
  fused = dataclasses.replace(plain, epilogues=[True] + [False] * 4)
  prof, virtual = estimate(fused)
  assert virtual.tolist() == [False, True, True, False, False, False]
  # Step 2 makes f from d (e fused): x, d and f live together without the
  # epilogue fusion; with it, the peak is at step 4: x, f and both results.
  assert estimate(plain)[0].peak_bytes == 4 + 8 + 8
  assert prof.peak_bytes == 4 + 8 + 1 + 1


def test_a_matmul_read_twice_or_by_a_fused_chain_keeps_its_result():
  # d read by a cheap step and by a second matmul: its result is stored.
  kinds = [M, C, M]
  flow = _flow(kinds, [[0], [1], [1]], [[1], [2], [3]], [4, 8, 8, 8], materialized=[0, 2, 3],
               epilogues=[True, False, False])
  assert not estimate(flow)[1][1]
  # d's only reader is fused further into a reduction (nothing stored at the
  # chain's end): d stays the stored buffer the chain reads.
  flow = _flow([M, C, R], [[0], [1], [2]], [[1], [2], [3]], [4, 8, 8, 1], materialized=[0, 3],
               epilogues=[True, False, False])
  assert estimate(flow)[1].tolist() == [False, False, True, False]


def test_a_forwarded_value_stores_nothing_and_keeps_its_sources_alive():
  # a shard_map (step 0) returns r (1), its argument x (0) passed through,
  # read at step 2: r stores nothing, and x lives until step 2.
  flow = _flow([M, M, M], [[0], [2], [1]], [[1, 2], [3], [4]], [4, 4, 2, 2, 2],
               materialized=[4], forwarded={1: (0,)})
  prof, virtual = estimate(flow)
  assert virtual[1] and not virtual[0]
  assert prof.intervals[0][1] >= 2


def test_a_layout_copy_made_early_lives_from_its_operand_to_its_reader():
  # x (arg) -> a = conv(x) (0) -> b = conv(a) (1) -> c = conv(b) (2)
  # -> d = conv(a, c) (3): the weight gradient, reading `a` through a 16-byte
  # layout copy XLA makes where `a` is made.
  kinds, ins, outs = [M, M, M, M], [[0], [1], [2], [1, 3]], [[1], [2], [3], [4]]
  plain = _flow(kinds, ins, outs, [8, 8, 8, 8, 8], materialized=[0, 4])
  end = list(plain.end)
  end[1] = 1                          # the flow's builder ends `a` at its last other reader
  early = dataclasses.replace(plain, end=end, early_copies=[[], [], [], [(1, 16, 0)]])
  prof, _ = estimate(early)
  assert prof.intervals[1] == (0, 1)              # `a` dies after the forward conv
  # Step 2: x, b and c (8 each) and the copy (16); `a` itself is gone.
  assert prof.live_bytes[2] == 3 * 8 + 16
  assert estimate(plain)[0].live_bytes[2] == 4 * 8     # x, a, b, c
  # Two readers of one copy (XLA merges the transposes): one buffer, to the last.
  twice = dataclasses.replace(early, early_copies=[[], [], [(1, 16, 0)], [(1, 16, 0)]])
  assert estimate(twice)[0].live_bytes[2] == 3 * 8 + 16
  # Two readers of `a` in two layouts (a batched dot's operand transposed two
  # ways): two copies.
  two = dataclasses.replace(early, early_copies=[[], [], [(1, 16, 1)], [(1, 16, 2)]])
  assert estimate(two)[0].live_bytes[2] == 3 * 8 + 2 * 16


def test_a_cheap_value_copied_early_is_recomputed_in_its_fusible_readers():
  # a = relu(x) (0), read by a forward conv (1), a backward elementwise step
  # (2) and, through an early copy, the weight-gradient conv (3): XLA stores
  # `a` only for the forward conv; the elementwise step recomputes it from x.
  kinds, ins, outs = [C, M, C, M], [[0], [1], [1, 2], [1, 3]], [[1], [2], [3], [4]]
  flow = _flow(kinds, ins, outs, [8, 8, 8, 8, 8], materialized=[0, 4])
  end = list(flow.end)
  end[1] = 2
  flow = dataclasses.replace(flow, end=end, early_copies=[[], [], [], [(1, 8, 0)]])
  prof, virtual = estimate(flow)
  assert not virtual[1] and prof.intervals[1] == (0, 1)
  assert prof.live_bytes[2] == 4 * 8       # x, the copy, b and c: not `a`


def _lattice(readers: int, *, shared_root: bool, producer_index: int = 0):
  """x (arg 0) -> a = cheap(x) (value 1) -> `readers` slices of a -> cheap each -> root(s).

  Steps: 0 makes a; 1..k slice it (new index); k+1..2k a cheap op per
  slice; then their elementwise sum, stored (``shared_root``: one fusion),
  or one reduce each (k fusions).
  """
  from jaxmem._src.estimate.xla_model import INDEX_NEW, INDEX_SAME
  k = readers
  kinds = [C] + [V] * k + [C] * k
  ins = [[0]] + [[1]] * k + [[2 + i] for i in range(k)]
  outs = [[1]] + [[2 + i] for i in range(k)] + [[2 + k + i] for i in range(k)]
  index = [producer_index] + [INDEX_NEW] * k + [INDEX_SAME] * k
  nb = [64, 64] + [4] * (2 * k)
  if shared_root:             # summed elementwise into one stored result
    acc = 2 + k
    for i in range(1, k):
      kinds.append(C)
      ins.append([acc, 2 + k + i])
      acc = len(nb)
      outs.append([acc])
      index.append(INDEX_SAME)
      nb.append(4)
    last = [acc]
  else:
    kinds += [R] * k
    ins += [[2 + k + i] for i in range(k)]
    outs += [[2 + 2 * k + i] for i in range(k)]
    index += [INDEX_NEW] * k
    nb += [4] * k
    last = list(range(2 + 2 * k, 2 + 3 * k))
  return _flow(kinds, ins, outs, nb, materialized=[0, *last], indexing=index)


def test_xla_stores_a_value_it_would_emit_more_than_fifteen_times_in_one_fusion():
  # `a` read by k slices inside one fusion is emitted k times: XLA's fusion
  # refuses more than 15 (`kAllowedCodeDuplication`) and stores it instead.
  assert estimate(_lattice(15, shared_root=True))[1][1]
  assert not estimate(_lattice(16, shared_root=True))[1][1]
  # In k fusions of their own (one reduce per slice): XLA:CPU's reduction
  # fusions take no operand another fusion reads, so it is stored for them
  # (`_closed_readers`); other compilers duplicate it, a copy per fusion.
  assert not estimate(_lattice(16, shared_root=False))[1][1]
  assert estimate(dataclasses.replace(_lattice(16, shared_root=False), indexing=None))[1][1]
  # Without the model (other compilers) it is always fused.
  assert estimate(dataclasses.replace(_lattice(16, shared_root=True), indexing=None))[1][1]


def test_xla_fuses_a_pad_or_concatenate_only_where_it_is_emitted_once():
  from jaxmem._src.estimate.xla_model import INDEX_BRANCHES
  # Its code branches (`OpInvalidatesCache`): two indexing users in one fusion store it.
  assert estimate(_lattice(1, shared_root=True, producer_index=INDEX_BRANCHES))[1][1]
  assert not estimate(_lattice(2, shared_root=True, producer_index=INDEX_BRANCHES))[1][1]


def _same(n):
  from jaxmem._src.estimate.xla_model import INDEX_SAME
  return [INDEX_SAME] * n


def test_a_value_a_reduction_and_another_fusion_read_is_stored_for_the_reduction_only():
  # x (arg 0) -> a = cheap(x) (step 0) read by r = reduce(a) (step 1) and by
  # b = cheap(a) (step 2), which a matmul reads (step 3). XLA:CPU stores `a`
  # for the reduction's fusion and, `a` being unary, recomputes it inside
  # b's fusion from x: `a` lives until the reduction, x until step 2.
  flow = _flow([C, R, C, M], [[0], [1], [1], [3]], [[1], [2], [3], [4]], [64, 64, 4, 64, 4],
               materialized=[0, 4], indexing=_same(4))
  prof, virtual = estimate(flow)
  assert not virtual[1] and not virtual[3]
  assert prof.intervals[1] == (0, 1) and prof.intervals[0][1] >= 2
  # Other compilers: the old rule (a producer is not duplicated into a
  # reduction among several readers) stores `a` until its last reader.
  other = estimate(dataclasses.replace(flow, indexing=None))[0]
  assert other.intervals[1] == (0, 2)


def test_a_value_two_reductions_read_through_cheap_steps_is_stored_on_the_cpu():
  # a = cheap(x, y) (step 0, two full-size operands: not unary) read by
  # b1 = cheap(a) -> reduce (steps 1, 2) and b2 = cheap(a) -> reduce (3, 4):
  # two reduction fusions, neither of which takes `a` (the product both
  # backward sums of a LayerNorm read, stored by XLA:CPU).
  flow = _flow([C, C, R, C, R], [[0, 1], [2], [3], [2], [5]], [[2], [3], [4], [5], [6]],
               [64, 64, 64, 64, 4, 64, 4], materialized=[0, 1, 4, 6], indexing=_same(5))
  _, virtual = estimate(flow)
  assert virtual.tolist() == [False, False, False, True, False, True, False]
  # One reduction reading it through both steps: one fusion takes it.
  one = _flow([C, C, C, C, R], [[0, 1], [2], [2], [3, 4], [5]], [[2], [3], [4], [5], [6]],
              [64, 64, 64, 64, 64, 64, 4], materialized=[0, 1, 6], indexing=_same(5))
  assert estimate(one)[1][2]
  # Other compilers duplicate it.
  assert estimate(dataclasses.replace(flow, indexing=None))[1][2]


def test_a_broadcast_is_stored_where_a_reduction_and_another_fusion_read_it():
  # Steps 0 and 2 read value 0 broadcast to 64 bytes; step 2's result feeds
  # a reduction (step 3), step 0's a matmul (step 1). On the CPU the
  # broadcast is an operand of the reduction's fusion and of another: stored
  # from step 0 to step 3, where the reduction's fusion reads it. Read only
  # by fusions without a reduction, it is recomputed in each.
  kinds = [C, M, C, R]
  ins, outs = [[0], [1], [0], [3]], [[1], [2], [3], [4]]
  nb = [4, 64, 4, 64, 4]
  reads = [[(0, 64)], [], [(0, 64)], []]
  flow = _flow(kinds, ins, outs, nb, materialized=[0, 2, 4], shared_reads=reads,
               indexing=_same(4))
  prof, _ = estimate(flow)
  assert prof.stored_broadcasts == ((0, 64, 0, 3),)
  plain = _flow([C, M, C, M], ins, outs, nb, materialized=[0, 2, 4], shared_reads=reads,
                indexing=_same(4))
  assert estimate(plain)[0].stored_broadcasts == ()


def test_an_in_place_update_shares_its_operand_buffer():
  # z = zeros (step 0, 64 B) written in place by a scatter (step 1, 64 B):
  # the two are never live together when the scatter is z's last reader.
  flow = _flow([M, M, M], [[], [1, 0], [2]], [[1], [2], [3]], [4, 64, 64, 4],
               materialized=[0, 3])
  apart = estimate(flow)[0]
  assert apart.live_bytes[1] == 4 + 64 + 64
  shared = estimate(dataclasses.replace(flow, in_place=[-1, 0, -1]))[0]
  assert shared.live_bytes[1] == 4 + 64 and shared.intervals[1] == (0, 0)
  # An addition that a scatter is folded into writes its second operand.
  add = _flow([M, M, M, M], [[], [1, 0], [0, 2], [3]], [[1], [2], [3], [4]], [4, 64, 64, 64, 4],
              materialized=[0, 4])
  assert estimate(add)[0].live_bytes[2] == 4 + 64 + 64
  folded = estimate(dataclasses.replace(add, in_place=[-1, 0, 1, -1]))[0]
  assert folded.live_bytes[2] == 4 + 64 and folded.intervals[2] == (1, 1)


def test_temporaries_take_the_buffer_of_a_donated_argument_xla_copies():
  # w (arg 0, 100 B, donated, copied at the start until step 4 writes its new
  # value) -> a = matmul(w) at 0 (60 B, read at 1) -> b = matmul(a) at 1
  # (80 B, read at 2) -> c = matmul(b) at 2 (120 B, read at 3) -> d =
  # matmul(c) at 3 (4 B, read at 4) -> w' = matmul(d) at 4 (100 B).
  # w's buffer is free from step 1 to step 3: b (the largest that fits) goes
  # there; a is made with the copy, at step 0; c does not fit; d lives
  # until the step that writes w's new value. Peak at step 3: w + its copy + c
  # + d = 324 B; without the copy, w + b + c = 300 B at step 2.
  kinds = [M, M, M, M, M]
  ins = [[0], [1], [2], [3], [4]]
  outs = [[1], [2], [3], [4], [5]]
  nbytes = [100, 60, 80, 120, 4, 100]
  flow = _flow(kinds, ins, outs, nbytes, materialized=[0, 5], copies={0: 4})
  flow = dataclasses.replace(flow, end=[4, 1, 2, 3, 4, 5])
  prof, _ = estimate(flow)
  assert prof.live_bytes.tolist() == [260, 260, 320, 324, 304, 100]   # b costs nothing
  assert prof.peak_bytes == 324
  no_copy = dataclasses.replace(flow, copies={})
  assert estimate(no_copy)[0].live_bytes.tolist() == [160, 240, 300, 224, 204, 100]


def test_an_elementwise_result_takes_the_buffer_of_an_operand_that_dies_there():
  # a = matmul (step 0, 64 B) read by b = cheap(a) (step 1, 64 B, stored: the
  # matmul at step 2 reads it). XLA writes b over a, whose last read it is:
  # 64 B at step 1, not 128. A reader of another size shares nothing.
  kinds = [M, C, M]
  flow = _flow(kinds, [[0], [1], [2]], [[1], [2], [3]], [4, 64, 64, 4], materialized=[0, 3],
               indexing=_same(3))
  prof = estimate(flow)[0]
  assert prof.live_bytes[1] == 4 + 64 and prof.intervals[1] == (0, 0)
  assert estimate(dataclasses.replace(flow, indexing=None))[0].live_bytes[1] == 4 + 64 + 64
  smaller = _flow(kinds, [[0], [1], [2]], [[1], [2], [3]], [4, 64, 32, 4], materialized=[0, 3],
                  indexing=_same(3))
  assert estimate(smaller)[0].live_bytes[1] == 4 + 64 + 32


def test_a_matmul_whose_row_maximum_comes_back_into_its_epilogue_is_not_stored():
  # l = matmul (0, 64 B); m = reduce_max(l) (1, 4 B); d = sub(l, m) (2,
  # cheap); e = exp(d) (3, expensive, stored: read by two matmuls at 4 and 5).
  # XLA:CPU fuses the matmul, the maximum, the subtraction and the exp: e is
  # the only full-size buffer, l is never written.
  kinds = [M, R, C, E, M, M]
  ins = [[0], [1], [1, 2], [3], [4], [4]]
  outs = [[1], [2], [3], [4], [5], [6]]
  nbytes = [4, 64, 4, 64, 64, 4, 4]
  flow = _flow(kinds, ins, outs, nbytes, materialized=[0, 5, 6], indexing=_same(6),
               epilogues=[True, False, False, False, False, False])
  prof, virtual = estimate(flow)
  assert virtual[1] and not virtual[4]
  assert prof.peak_bytes == 4 + 64 + 4 + 4      # x, e and the two results
  plain, plain_virtual = estimate(dataclasses.replace(flow, epilogues=None))
  assert not plain_virtual[1] and plain.live_bytes[1] == prof.live_bytes[1] + 64
