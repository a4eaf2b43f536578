"""The XLA model, rule by rule, on small traced programs (no compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

from jaxmem._src.estimate import xla_model
from jaxmem._src.estimate.analysis import analyze_program, refine_roles
from jaxmem._src.ir.primitives import Fusion
from jaxmem._src.ir.program import Phase, Role
from jaxmem._src.ir.trace import trace


def _ops(program, name):
  return [op for op in program.ops if op.primitive == name]


def test_concatenate_is_fused_into_one_reader_only_on_the_cpu():
  # XLA's fusion does not duplicate a concatenate or a pad (their code branches).
  prog = trace(lambda a, b: jnp.concatenate([a, b]).sum(), (jnp.ones(8), jnp.ones(8)))
  (cat,) = _ops(prog, "concatenate")
  assert xla_model.op_fusion_kind(prog, cat) is (Fusion.EXPENSIVE if prog.backend == "cpu"
                                                 else Fusion.VIEW)


def test_the_gradient_of_an_associative_scan_is_estimated_within_ten_percent():
  # Its backward pass is a lattice of slices, pads and sums: fused all the way
  # it would take a third of what XLA:CPU stores (XLA's code-duplication
  # limit, `xla_model.indexing_kinds`).
  def loss(a, b):
    def combine(left, right):
      return left[0] * right[0], right[0] * left[1] + right[1]
    _, h = jax.lax.associative_scan(combine, (a, b), axis=0)
    return jnp.sum(h ** 2)
  grad = jax.grad(loss, argnums=(0, 1))
  args = (jnp.full((256, 16, 64), 0.9), jnp.ones((256, 16, 64)))
  est = jaxmem.analyze(grad, *args).peak_bytes
  compiled = jaxmem.compiled_memory(jax.jit(grad).lower(*args).compile()).peak_bytes
  if jax.default_backend() == "cpu":
    assert abs(est - compiled) <= 0.1 * compiled, (est, compiled)


def test_a_broadcast_read_by_both_passes_is_stored():
  # b = broadcast(s) is read by the forward product and again by its transpose.
  def loss(x):
    s = jnp.sum(x, axis=-1, keepdims=True)
    b = jnp.broadcast_to(s, x.shape)
    return jnp.sum(b * x * x)
  prog = trace(jax.grad(loss), (jnp.ones((16, 32)),))
  kinds = [xla_model.op_fusion_kind(prog, op) for op in _ops(prog, "broadcast_in_dim")
           if op.phase is Phase.FORWARD and op.input_ids()
           and prog.vars[op.input_ids()[0]].shape == (16, 1)]
  assert kinds == ([Fusion.MATERIALIZED] if prog.backend == "cpu" else [Fusion.CHEAP])


def test_an_implicit_size_one_broadcast_read_by_both_passes_is_charged():
  # softmax: `e / s` broadcasts the [16, 1] denominator inside the divide, in the
  # forward pass and again in the backward pass: one stored [16, 32] broadcast.
  def loss(x):
    e = jnp.exp(x)
    return jnp.sum(e / jnp.sum(e, axis=-1, keepdims=True) * x)
  prog = trace(jax.grad(loss), (jnp.ones((16, 32)),))
  shared = [(op, sh) for op, sh in zip(prog.ops, xla_model.shared_broadcasts(prog)) if sh]
  if prog.backend != "cpu":
    assert not shared
    return
  assert shared
  for op, pairs in shared:
    for pos, nbytes in pairs:
      assert prog.vars[op.inputs[pos]].shape == (16, 1) and nbytes == 16 * 32 * 4


def test_conv_layout_copies_and_backend_independence():
  x = jnp.ones((2, 4, 8, 8))      # NCHW; the same bytes in NHWC
  w = jnp.ones((3, 3, 4, 4))
  nchw = jax.make_jaxpr(lambda x, w: jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "HWIO", "NCHW")))(x, w).eqns[0]
  nhwc = jax.make_jaxpr(lambda x, w: jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(
          x.transpose(0, 2, 3, 1), w).eqns[0]
  assert xla_model.hidden_bytes(nhwc, "cpu") == (0, 0)
  assert xla_model.early_layout_copies(nhwc, "cpu") == ()
  # The result is transposed into the NCHW layout while the convolution runs;
  # the input is copied into the native layout where it is made.
  assert xla_model.hidden_bytes(nchw, "cpu") == (x.nbytes, 0)
  assert xla_model.early_layout_copies(nchw, "cpu") == ((0, x.nbytes, 0),)
  assert xla_model.hidden_bytes(nchw, "gpu") == (0, 0)
  assert xla_model.early_layout_copies(nchw, "gpu") == ()


def test_a_weight_gradient_that_is_a_dot_has_no_layout_copies():
  """A 1x1 convolution's weight gradient has one output position and a window
  over the whole input: XLA computes it as a dot, which reads any layout."""
  def loss(w, x):
    return jnp.sum(jax.lax.conv_general_dilated(x, w, (1,), "VALID",
                                                dimension_numbers=("NWC", "WIO", "NWC")) ** 2)
  wide = jax.make_jaxpr(jax.grad(loss))(jnp.ones((1, 8, 16)), jnp.ones((4, 32, 8)))
  (grad_conv,) = [e for e in wide.eqns if e.primitive.name == "conv_general_dilated"
                  and e.outvars[0].aval.shape == (1, 8, 16)]
  assert xla_model.early_layout_copies(grad_conv, "cpu") == ()
  three = jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 8, 16)), jnp.ones((4, 32, 8)))
  (grad_conv,) = [e for e in three.eqns if e.primitive.name == "conv_general_dilated"
                  and e.outvars[0].aval.shape == (3, 8, 16)]
  assert xla_model.early_layout_copies(grad_conv, "cpu")


def test_cse_keys_hold_parameters_and_literal_positions():
  prog = trace(lambda x: (x - 1.0) * (1.0 - x) * (x - 1.0), (jnp.ones(4),))
  subs = _ops(prog, "sub")
  keys = xla_model.cse_keys(prog)
  a, b, c = (keys[op.index] for op in subs)
  assert a == c and a != b            # `x - 1` twice is one value; `1 - x` is another
  rng = trace(lambda k: jax.random.bits(k, (4,)) + jax.random.bits(k, (4,)),
              (jax.random.key(0),))
  assert all(keys is None for op, keys in zip(rng.ops, xla_model.cse_keys(rng))
             if op.primitive in ("random_bits", "threefry2x32"))


def test_constants_feeding_a_matmul_are_hoisted():
  def f(x):
    return (x @ jnp.ones((16, 16))).sum() + (x + jnp.zeros((8, 16))).sum()
  prog = trace(f, (jnp.ones((8, 16)),))
  hoisted = xla_model.hoisted_constants(prog)
  fed_to_dot = {x for op in _ops(prog, "dot_general") for x in op.input_ids()
                if prog.constant_like[x]}
  assert fed_to_dot and fed_to_dot <= hoisted
  assert all(not any(prog.ops[u].primitive == "add" for u in prog.vars[v].uses)
             or any(prog.ops[u].primitive == "dot_general" for u in prog.vars[v].uses)
             for v in hoisted)


def test_the_zeros_a_nearest_resize_gradient_scatters_into_are_hoisted_on_the_cpu():
  # Constant indices too: a GroupNorm UNet's resize gradients scatter into
  # zeros XLA:CPU makes at the start (its estimate -9.8% of the compiled peak
  # without them).
  def loss(x):
    return jnp.sum(jnp.sin(jax.image.resize(x, (2, 16, 16, 4), method="nearest")))
  prog = trace(jax.grad(loss), (jnp.ones((2, 8, 8, 4)),))
  scatters = _ops(prog, "scatter-add")
  assert scatters and all(prog.constant_like[op.inputs[1]] for op in scatters)
  hoisted = xla_model.hoisted_constants(prog)
  assert all((op.inputs[0] in hoisted) == (prog.backend == "cpu") for op in scatters)


def test_the_zeros_an_embedding_gradient_scatters_into_are_hoisted_on_the_cpu():
  # The gradient of a lookup is a scatter-add into a table of zeros, which
  # XLA:CPU creates in the forward pass (a DLRM step's ten tables: 19 MiB at
  # its peak): each table's zeros live from the start to their scatter.
  def loss(tables, ids):
    return sum(jnp.sum(jnp.tanh(t[ids[:, i]])) for i, t in enumerate(tables))
  tables = [jnp.ones((500, 8)), jnp.ones((300, 8))]
  prog = trace(jax.grad(loss), (tables, jnp.zeros((64, 2), jnp.int32)))
  scatters = _ops(prog, "scatter-add")
  zeros = {op.input_ids()[0] for op in scatters}
  assert len(scatters) == 2 and all(prog.constant_like[z] for z in zeros)
  hoisted = xla_model.hoisted_constants(prog)
  assert (zeros <= hoisted) == (prog.backend == "cpu")


def test_a_scatter_into_zeros_added_to_another_gradient_is_folded_into_it():
  # XLA's algebraic simplifier turns `x + scatter-add(zeros, i, u)` into
  # `scatter-add(x, i, u)`: no zeros. JAX writes that form for a tied
  # embedding (lookup and output projection share the table) and a
  # cross-entropy's `take_along_axis` beside its softmax (an MQA language
  # model: +12% of its compiled peak when the zeros were held from the
  # start). Two scatters into zeros that are only summed stay one scatter
  # into one table of zeros (`cse_keys` merges them), folded into nothing.
  def tied(table, ids):
    return jnp.sum(jnp.tanh(table[ids]) @ table.T)

  def two_lookups(table, ids):
    return jnp.sum(jnp.tanh(table[ids]) * jnp.tanh(table[ids + 1]))

  args = (jnp.ones((500, 8)), jnp.zeros(64, jnp.int32))
  for fn, folded in ((tied, 1), (two_lookups, 0)):
    prog = trace(jax.grad(fn), args)
    scatters = _ops(prog, "scatter-add")
    if prog.backend != "cpu":
      continue
    hoisted = xla_model.hoisted_constants(prog)
    kept = [op for op in scatters if op.input_ids()[0] in hoisted]
    assert len(scatters) - len(kept) == folded, fn.__name__


def test_the_update_after_the_backward_pass_is_movable():
  def step(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    return w - 0.1 * g
  prog = trace(step, (jnp.ones((8, 8)), jnp.ones((4, 8))))
  movable = xla_model.movable_ops(prog)
  last_backward = max(op.index for op in prog.ops if op.phase is Phase.BACKWARD)
  assert any(movable) and not any(movable[: last_backward + 1])
  assert all(prog.ops[k].phase is Phase.OTHER for k, m in enumerate(movable) if m)


def test_the_planned_model_prices_a_substituted_max_pool_gradient():
  def loss(x):
    y = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jnp.sum(y * y)
  x = jnp.ones((2, 8, 8, 4))
  prog = trace(jax.grad(loss), (x,))
  (k,) = [op.index for op in _ops(prog, "select_and_scatter_add")]
  plain = xla_model.op_memory_model(prog, planned=False)[k]
  planned = xla_model.op_memory_model(prog, planned=True)[k]
  if prog.backend == "cpu":
    assert plain.hoisted > 0 and planned.hoisted == 0        # no index arrays up front
    assert planned.transient == 2 * x.nbytes
  assert planned.kind is Fusion.MATERIALIZED


def _pool(h):
  return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _pooled(w, x):
  return jnp.sum(jnp.tanh(_pool(jax.nn.relu(x * w))) ** 2)


def _pooled_with_skip(w, x):
  h = jax.nn.relu(x * w)
  return jnp.sum(jnp.tanh(_pool(h)) ** 2) + jnp.sum(jnp.sin(h))


@pytest.mark.parametrize("loss", [_pooled, _pooled_with_skip])
def test_a_max_pool_gradient_is_priced_where_xla_cpu_runs_its_argmax(loss):
  """XLA:CPU runs a max pool's argmax in the forward pass, right after the forward pool: the
  iotas it reads die there, the index array it makes lives until the backward scatter, whose
  zeros are built at the start unless the gradient is added to another (the skip connection):
  see `xla_model.pool_argmax_expansions`. Charging the iotas until the scatter, as before, put
  a UNet's estimate +28% over its compiled peak."""
  w, x = jnp.ones((16,)), jnp.ones((16, 64, 64, 16))
  step = jax.grad(loss)
  prog = trace(step, (w, x))
  if prog.backend != "cpu":
    pytest.skip("XLA:CPU's expansion")
  memory = xla_model.op_memory_model(prog, planned=False)
  (k,) = [op.index for op in _ops(prog, "select_and_scatter_add")]
  (pool,) = [op.index for op in _ops(prog, "reduce_window_max")]
  assert memory[pool].hoisted == 4 * 4 * x.size             # s32 iotas, one per dimension
  assert memory[pool].transient == x.nbytes // 4             # the window maxima
  maker = prog.vars[prog.ops[k].inputs[1]].defined_by
  assert memory[maker].hoisted == 0
  assert memory[k].early == ((1, 4 * 4 * x.size // 4, 0),)  # s32[window maxima, 4]
  zeros = x.nbytes if loss is _pooled else 0
  assert memory[k].hoisted == zeros
  compiled = jaxmem.compiled_memory(jax.jit(step).lower(w, x).compile()).peak_bytes
  estimate = jaxmem.analyze(step, w, x).peak_bytes
  # Without the skip connection the estimate is 3 MiB (+9%) over before the
  # pool's result is counted beside the argmax, 4 MiB (+12%) with it: it
  # stores `x * w`, which XLA computes again in the backward `select` from
  # `x` and `w` (not modelled).
  assert -0.05 * compiled <= estimate - compiled <= 0.12 * compiled, (estimate, compiled)


def test_the_estimate_returns_new_values_and_leaves_the_program_as_it_was():
  def loss(w, x):
    return jnp.sum(jax.nn.relu(x @ w) @ w)
  prog = trace(jax.grad(loss), (jnp.ones((32, 32)), jnp.ones((256, 32))))
  roles = tuple(v.role for v in prog.vars)
  analyzed = analyze_program(prog)
  assert tuple(v.role for v in prog.vars) == roles            # unchanged
  refined = [v.id for v, a in zip(prog.vars, analyzed.vars) if v.role is not a.role]
  assert refined and all(analyzed.vars[i].role is Role.ACTIVATION for i in refined)
  assert refine_roles(prog, analyzed.profile) == analyzed.vars
  with pytest.raises(AttributeError):
    analyzed.profile = None   # frozen


def test_ops_xla_removes_are_not_in_the_program():
  def f(x):
    unused = jnp.sin(x) * 2.0   # noqa: F841 (dead: nothing reads it)
    return jnp.cos(x).sum()
  prog = analyze_program(trace(f, (jnp.ones(1024),)))
  assert [op.primitive for op in prog.ops] == ["cos", "reduce_sum"]
  assert not any(prog.dead) and (prog.op_seconds("h100-pcie") > 0).all()


def test_a_layernorm_over_points_before_a_max_is_not_under_estimated():
  # Dense, LayerNorm and a max over the points (PointNet's shared MLP):
  # XLA:CPU stores the LayerNorm input for its statistics' reductions, the
  # scale and `rsqrt` broadcasts and their product for the backward sums,
  # and the product both backward sums read (`lifetimes._closed_readers`);
  # the estimate was 16-31% below the compiled peak without them.
  flax_linen = pytest.importorskip("flax.linen")

  class Shared(flax_linen.Module):
    @flax_linen.compact
    def __call__(self, x):
      x = flax_linen.relu(flax_linen.LayerNorm()(flax_linen.Dense(128)(x)))
      return x.max(axis=1).sum()

  est, compiled = _sgd_step_estimate_and_peak(Shared(), jnp.ones((4, 128, 32)))
  if jax.default_backend() == "cpu":
    assert -0.05 * compiled <= est - compiled <= 0.2 * compiled, (est, compiled)


def _sgd_step_estimate_and_peak(model, x):
  """``(estimate, compiled peak)`` of an SGD step of a flax ``model`` whose loss is its output."""
  params = model.init(jax.random.PRNGKey(0), x)

  def step(params, x):
    grads = jax.grad(lambda p: model.apply(p, x))(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)

  est = jaxmem.analyze(step, params, x, donate_argnums=(0,)).peak_bytes
  compiled = jaxmem.compiled_memory(
      jax.jit(step, donate_argnums=(0,)).lower(params, x).compile()).peak_bytes
  return est, compiled


def test_zeros_written_in_place_are_not_merged_unless_their_scatters_are_summed():
  # CSE merges equal zero tables, then copy insertion gives every in-place
  # scatter but one a copy of its own: each keeps its buffer. Two
  # scatter-adds whose results are only summed are one scatter to XLA.
  def two(ids, u):
    a = jnp.zeros((500, 8)).at[ids].add(u)
    b = jnp.zeros((500, 8)).at[ids + 1].add(u * 2)
    return a, b

  def summed(ids, u):
    return jnp.zeros((500, 8)).at[ids].add(u) + jnp.zeros((500, 8)).at[ids + 1].add(u * 2)

  args = (jnp.zeros(64, jnp.int32), jnp.ones((64, 8)))
  for fn, merged in ((two, False), (summed, True)):
    prog = trace(fn, args)
    keys = xla_model.cse_keys(prog)
    zeros = [prog.vars[op.input_ids()[0]].defined_by for op in _ops(prog, "scatter-add")]
    assert len(zeros) == 2
    assert all((keys[z] is not None) == merged for z in zeros), fn.__name__


@pytest.mark.parametrize("rows", [499, 500])
def test_summed_scatters_are_combined_only_while_their_updates_are_smaller_than_the_table(rows):
  # XLA's simplifier concatenates the indices and updates of two summed
  # scatter-adds into one scatter only when the concatenation has fewer
  # elements than the table (a skip-gram whose lookups gather more rows than
  # its table keeps two scatters, each on its own copy of the zeros: -9.2% of
  # the compiled peak when they were taken as one).
  def summed(i1, u1, i2, u2):
    return jnp.zeros((500, 8)).at[i1].add(u1) + jnp.zeros((500, 8)).at[i2].add(u2)

  n1 = 99
  args = (jnp.zeros(n1, jnp.int32), jnp.ones((n1, 8)),
          jnp.zeros(rows - n1, jnp.int32), jnp.ones((rows - n1, 8)))
  prog = trace(summed, args)
  keys = xla_model.cse_keys(prog)
  zeros = [prog.vars[op.input_ids()[0]].defined_by for op in _ops(prog, "scatter-add")]
  combined = rows < 500
  assert all((keys[z] is not None) == combined for z in zeros)
  if jax.default_backend() == "cpu":
    hlo = jax.jit(summed).lower(*args).compile().as_text()
    assert ("concatenate" in hlo) == combined


def test_an_operand_only_a_matmul_reads_is_fused_into_it_on_the_cpu():
  # K-means distances: XLA:CPU computes `2.0 * points` inside the matmul's
  # YNNPACK fusion (it has no other reader); `points * points`, read by a
  # reduction, is no matmul operand. The estimate was +25% with the scaled
  # points stored.
  def distances(points, centroids):
    d2 = (jnp.sum(points * points, axis=1, keepdims=True) - 2.0 * points @ centroids.T
          + jnp.sum(centroids * centroids, axis=1)[None, :])
    return jnp.argmin(d2, axis=1), jnp.min(d2, axis=1).sum()

  points, centroids = jnp.ones((6000, 24)), jnp.ones((61, 24))
  prog = jaxmem.analyze(distances, points, centroids)
  (mul,) = [op for op in prog.ops if op.primitive == "mul"
            and any(prog.ops[u].primitive == "dot_general" for u in prog.vars[op.outputs[0]].uses)]
  fusing = xla_model.operand_fusions(prog)
  assert fusing[prog.vars[mul.outputs[0]].uses[0]] == (
      xla_model.FUSES_SOLE if prog.backend == "cpu" else xla_model.FUSES_ANY)
  if jax.default_backend() == "cpu":
    assert prog.profile.virtual[mul.outputs[0]]
    compiled = jaxmem.compiled_memory(
        jax.jit(distances).lower(points, centroids).compile()).peak_bytes
    assert abs(prog.peak_bytes - compiled) <= 0.05 * compiled, (prog.peak_bytes, compiled)
    # A matmul operand the backward pass reads too stays stored.
    grad = jax.value_and_grad(lambda w, x: jnp.sum((2.0 * x) @ w))
    g = jaxmem.analyze(grad, jnp.ones((24, 61)), points)
    (mul,) = [op for op in g.ops if op.primitive == "mul" and op.outputs
              and len(g.vars[op.outputs[0]].uses) > 1]
    assert not g.profile.virtual[mul.outputs[0]]


def test_the_kernel_gradient_of_a_depthwise_convolution_is_expanded_on_the_cpu():
  # XLA:CPU expands a batch-grouped convolution (a depthwise kernel's
  # gradient) into a dense one over `groups` times the kernel, and a masked
  # copy of it: MobileNet-v2's estimate was 7.6% under the compiled peak
  # without them.
  def loss(w, x):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=64,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jnp.tanh(y))

  w, x = jnp.ones((3, 3, 1, 64)), jnp.ones((2, 8, 8, 64))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(w, x).jaxpr
  (kernel_grad,) = [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"
                    and e.params["batch_group_count"] > 1]
  transient, _ = xla_model.hidden_bytes(kernel_grad, "cpu")
  out = 3 * 3 * 1 * 64 * 4
  assert transient >= 2 * 64 * out
  assert xla_model.hidden_bytes(kernel_grad, "tpu") == (0, 0)


def _compiled_and_estimated(f, *args):
  compiled = jaxmem.compiled_memory(jax.jit(f).lower(*args).compile()).peak_bytes
  return compiled, jaxmem.analyze(f, *args).peak_bytes


def test_pads_whose_sum_is_read_in_several_fusions_are_stored_on_the_cpu():
  """A sum of pads read through slices, each slice in a fusion of its own: XLA
  duplicates the sum into every reader's fusion but not the pads (their code
  branches), so each pad is a buffer. Fusing the pads away put the estimate
  66% under the compiled peak."""
  steps = 8

  def f(a, w):
    out = 0.0
    for t in range(steps):
      x = jnp.tanh(a[:, t, :]) @ w
      out = out + jax.lax.pad(x[:, None, :], 0.0, [(0, 0, 0), (t, steps - 1 - t, 0), (0, 0, 0)])
    return [jnp.sin(out[:, t, :]) @ w for t in range(steps)]

  compiled, est = _compiled_and_estimated(f, jnp.ones((64, steps, 320)), jnp.ones((320, 320)))
  if jax.default_backend() == "cpu":
    assert abs(est - compiled) <= 0.05 * compiled, (est, compiled)


def test_a_value_emitted_too_often_in_one_fusion_is_still_duplicated_into_the_others():
  """Two unrolled recurrent layers, the second reading the first's stacked
  outputs by slices: the gradient of that stack is a sum of pads read by the
  first layer's backward, whose cell-state recurrence is one elementwise chain.
  XLA's limit on emitting a fused value is per fusion, so the sum is stored
  for the fusion that reaches all 16 slices and duplicated into the others,
  and the pads, emitted there several times each, are stored (estimate -22%
  of the compiled peak when the sum was only stored)."""
  steps, batch, width = 16, 32, 256

  def layer(w, xs):
    c, hs = jnp.zeros((batch, width)), []
    for x in xs:
      f, i = jnp.split(jnp.concatenate([x, c], 1) @ w, 2, axis=1)
      c = c * jax.nn.sigmoid(f) + jnp.tanh(i)
      hs.append(jnp.tanh(c))
    return jnp.stack(hs, axis=1)

  def loss(ws, x):
    y = layer(ws[0], [x[:, t] for t in range(steps)])
    return jnp.sum(layer(ws[1], [y[:, t] for t in range(steps)]) ** 2)

  ws = (jnp.full((2 * width, 2 * width), 0.01), jnp.full((2 * width, 2 * width), 0.01))
  compiled, est = _compiled_and_estimated(jax.grad(loss), ws, jnp.ones((batch, steps, width)))
  if jax.default_backend() == "cpu":
    assert abs(est - compiled) <= 0.1 * compiled, (est, compiled)


def test_a_loss_no_output_needs_is_not_in_the_program():
  """`jax.grad` of a cross-entropy keeps the log-softmax, the label gather and
  the mean of the loss in its jaxpr though no output reads them; XLA removes
  them, and so does the trace (they kept two logits-sized buffers alive: +92%
  of the compiled peak). What is left is stored as XLA:CPU stores it: the
  logits' `exp` and not the logits (one YNNPACK fusion with the row maximum:
  `lifetimes._ends_in_stored_epilogue`), and the softmax gradient written
  over the label scatter it adds to (`lifetimes._share_operand_buffers`;
  +31% of the compiled peak without the two)."""

  def loss(w, x, y):
    logits = jnp.tanh(x @ w) @ w.T @ w
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  args = (jnp.full((64, 2048), 0.01), jnp.ones((512, 64)), jnp.zeros((512,), jnp.int32))
  step = jax.grad(loss)
  prog = trace(step, args)
  assert not _ops(prog, "log")                       # the loss's log-sum-exp is gone
  compiled, est = _compiled_and_estimated(step, *args)
  if jax.default_backend() == "cpu":
    assert abs(est - compiled) <= 0.05 * compiled, (est, compiled)


def test_a_take_along_axis_index_array_is_made_explicit_on_the_cpu():
  """`take_along_axis` gathers with batching dimensions; XLA:CPU builds the full
  `s32[index rows, rank]` index array, shared by the gather and its gradient's
  scatter (`xla_model._batched_index_array`)."""
  def loss(x, i):
    return jnp.sum(jnp.take_along_axis(x, i, axis=3) ** 2)

  x, i = jnp.ones((8, 36, 36, 5)), jnp.zeros((8, 36, 36, 1), jnp.int32)
  prog = trace(jax.grad(loss), (x, i))
  (gather,) = _ops(prog, "gather")
  rows = 8 * 36 * 36
  assert xla_model.early_layout_copies(gather.eqn, "cpu") == ((1, rows * 4 * 4, 0),)
  assert xla_model.early_layout_copies(gather.eqn, "tpu") == ()


def test_a_reduction_over_size_one_axes_is_a_view_and_a_division_by_a_constant_is_cheap():
  # XLA's algebraic simplifier makes the first a reshape and the second a
  # multiply by the reciprocal (a LayerNorm's backward pass has both).
  def f(x, y):
    return jax.lax.reduce_sum(x[:, :1], axes=(1,)) / 4.0 + (x / y).sum(1)
  prog = trace(f, (jnp.ones((8, 16)), jnp.ones((8, 16))))
  (trivial,) = [op for op in _ops(prog, "reduce_sum") if op.eqn.params["axes"] == (1,)
                and op.eqn.invars[0].aval.shape == (8, 1)]
  assert xla_model.op_fusion_kind(prog, trivial) is Fusion.VIEW
  by_constant, by_array = sorted(_ops(prog, "div"), key=lambda op: isinstance(op.inputs[1], int))
  assert xla_model.op_fusion_kind(prog, by_constant) is Fusion.CHEAP
  assert xla_model.op_fusion_kind(prog, by_array) is Fusion.EXPENSIVE


def test_the_masked_copy_of_a_fill_or_drop_gather_is_a_stored_broadcast_candidate():
  # The transpose of a segment sum is a gather in FILL_OR_DROP mode, lowered
  # as a clamped gather and a `select` against the in-bounds mask.
  ids = jnp.arange(64) % 8

  def loss(x, w):
    g = jax.ops.segment_sum(x * w, ids, num_segments=8)
    return jnp.sum(g * g)
  prog = trace(jax.grad(loss), (jnp.ones((64, 32)), jnp.ones((64, 32))))
  masked = [(op, prog.vars[op.inputs[pos]]) for op, pairs in
            zip(prog.ops, xla_model.shared_broadcasts(prog)) for pos, _ in pairs]
  gathers = [v for _, v in masked if v.defined_by >= 0
             and prog.ops[v.defined_by].primitive == "gather"]
  assert bool(gathers) == (prog.backend == "cpu")


def test_stacked_layernorms_are_not_under_estimated():
  # Dense, LayerNorm and ReLU, three times (a message-passing step's edge
  # MLPs): XLA:CPU keeps `rsqrt * scale` from the forward pass for each
  # LayerNorm's backward pass, one YNNPACK fusion of the row sums and the
  # arithmetic on them (`lifetimes._reductions_come_back`, with the sums over
  # size-1 axes as views and the divisions by the width as multiplies).
  # Without these rules the estimate was 10.6% under the compiled peak.
  flax_linen = pytest.importorskip("flax.linen")

  class Stack(flax_linen.Module):
    @flax_linen.compact
    def __call__(self, x):
      for _ in range(3):
        x = flax_linen.relu(flax_linen.LayerNorm()(flax_linen.Dense(64)(x)))
      return jnp.sum(x ** 2)

  x = jnp.asarray(np.random.default_rng(0).normal(size=(4096, 32)), jnp.float32)
  est, compiled = _sgd_step_estimate_and_peak(Stack(), x)
  if jax.default_backend() == "cpu":
    assert -0.05 * compiled <= est - compiled <= 0.1 * compiled, (est, compiled)


def test_a_broadcast_is_kept_only_until_the_last_reduction_fusion_that_reads_it():
  # `h * a` summed over its last axis (an attention score) and `g * a` in the
  # backward pass: XLA:CPU stores the broadcast of `a` for the sum's YNNPACK
  # fusion only; the backward multiply, a loop fusion, broadcasts it again.
  def loss(h, a):
    score = jnp.sum(h * a, axis=-1)
    return jnp.sum(jnp.tanh(score))
  args = (jnp.ones((4096, 4, 32)), jnp.ones((1, 4, 32)))
  prog = jaxmem.analyze(jax.grad(loss), *args)
  if prog.backend != "cpu":
    assert not prog.profile.stored_broadcasts
    return
  (stored,) = [b for b in prog.profile.stored_broadcasts if b[1] == 4096 * 4 * 32 * 4]
  (forward_sum,) = [op for op in _ops(prog, "reduce_sum") if op.phase is Phase.FORWARD]
  assert stored[3] <= forward_sum.index + 1 < len(prog.ops) // 2


def test_a_dot_without_contracting_dimensions_is_a_fused_multiply():
  """XLA rewrites an outer product as a multiply of broadcasts: never stored."""
  def loss(c, u):
    return jnp.sum(jnp.einsum("bnj,bnjo->bjo", c, u) ** 2)
  prog = trace(jax.grad(loss, argnums=1), (jnp.ones((2, 6, 3)), jnp.ones((2, 6, 3, 4))))
  dots = _ops(prog, "dot_general")
  outer = [op for op in dots if not op.eqn.params["dimension_numbers"][0][0]]
  inner = [op for op in dots if op.eqn.params["dimension_numbers"][0][0]]
  assert outer and inner
  assert all(xla_model.op_fusion_kind(prog, op) is Fusion.CHEAP for op in outer)
  assert all(xla_model.op_fusion_kind(prog, op) is Fusion.MATERIALIZED for op in inner)
  assert all(xla_model.early_layout_copies(op.eqn, "cpu") == () for op in outer)


def test_a_dot_contracting_only_size_one_dimensions_is_a_fused_multiply_too():
  """``[b,1,m] x [b,1,n]`` contracted over the 1 (a per-example weight gradient) is a product.

  XLA:CPU compiles it to one ``broadcast_multiply`` loop fusion; a
  contraction over a dimension of size 2 stays a dot.
  """
  def f(a, b, c, d):
    dn = (((1,), (1,)), ((0,), (0,)))
    return jax.lax.dot_general(a, b, dn), jax.lax.dot_general(c, d, dn)
  args = tuple(jnp.ones(s) for s in ((4, 1, 8), (4, 1, 6), (4, 2, 8), (4, 2, 6)))
  prog = trace(f, args)
  size_one, size_two = _ops(prog, "dot_general")
  assert xla_model.op_fusion_kind(prog, size_one) is Fusion.CHEAP
  assert xla_model.op_fusion_kind(prog, size_two) is Fusion.MATERIALIZED
  text = jax.jit(f).lower(*args).compile().as_text()
  entry = text.split("\nENTRY")[1]
  assert entry.count(" dot(") == 1 and "multiply" in entry


def test_a_dot_reads_its_own_copy_of_a_product_xla_duplicates():
  """A per-example gradient (an outer product per example, which XLA duplicates
  into every fusion reading it) read by its norm and by the sum weighted by
  the clip factors is written twice by XLA:CPU, the weighted sum's copy from
  where the product is made (`xla_model.duplicated_product_copies`)."""
  def per_example_step(w1, w2, x):
    def loss(ws, xi):
      return jnp.sum((jnp.tanh(xi @ ws[0]) @ ws[1]) ** 2)
    g1, g2 = jax.vmap(jax.grad(loss), in_axes=(None, 0))((w1, w2), x)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(x.shape[0], -1) ** 2, 1) for g in (g1, g2)))
    scale = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
    return jnp.tensordot(scale, g1, axes=1), jnp.tensordot(scale, g2, axes=1)

  args = (jnp.full((128, 64), 0.01), jnp.full((64, 64), 0.01), jnp.ones((16, 128)))
  prog = trace(per_example_step, args)
  copies = xla_model.duplicated_product_copies(prog)
  weighted = [op for op in _ops(prog, "dot_general") if op.phase is Phase.OTHER]
  assert len(weighted) == 2
  memory = xla_model.op_memory_model(prog, planned=False)
  for op in weighted:
    # The gradient ([16, 128, 64] or [16, 64, 64]) is kept for the weighted
    # sum, its last reader; its norm's reader gets the early copy.
    grad = op.inputs[1]
    assert op.index not in copies
    chain = xla_model._duplicated_operand(prog, op, 1)
    norm_readers = [r for r, cs in copies.items()
                    if any(prog.ops[r].inputs[i] in chain for i, _, _ in cs)]
    assert norm_readers and all(r < op.index for r in norm_readers)
    for r in norm_readers:
      assert (copies[r][0][1], copies[r][0][2]) == (prog.vars[grad].nbytes, xla_model.DUPLICATE)
      assert copies[r][0] in memory[r].early
  if jax.default_backend() == "cpu":
    est = jaxmem.analyze(per_example_step, *args).peak_bytes
    compiled = jaxmem.compiled_memory(
        jax.jit(per_example_step).lower(*args).compile()).peak_bytes
    assert abs(est - compiled) <= 0.05 * compiled, (est, compiled)   # -36% stored once
  # A product of two full-size values is stored once, whoever reads it.
  def full_product(a, b, w):
    y = a * b
    return y @ w, jnp.sum(y, axis=0)
  prog = trace(full_product, (jnp.ones((32, 16)), jnp.ones((32, 16)), jnp.ones((16, 8))))
  assert xla_model.duplicated_product_copies(prog) == {}


def test_batched_dots_read_non_canonical_operands_through_one_copy_per_layout():
  """XLA:CPU's DotDecomposer transposes an operand whose batch dimensions are
  not leading; dots reading one value in one layout share the copy, two
  layouts make two; a weight is copied just before its dot
  (`xla_model.dot_layout_copies`)."""
  def routing(c, u, v):
    return jnp.einsum("bnj,bnjo->bjo", c, u), jnp.einsum("bnjo,bjo->bnj", u, v)

  u = jnp.ones((2, 6, 3, 4))              # [b, n, j, o]
  c, v = jnp.ones((2, 6, 3)), jnp.ones((2, 3, 4))
  prog = trace(lambda c, u, v: routing(c, jnp.tanh(u), v), (c, u, v))
  copies = xla_model.dot_layout_copies(prog)
  a, b = _ops(prog, "dot_general")
  # jax makes `u` the right operand of both (contracting n, then o): both
  # copy all of it, into `[b, j, n, o]` and `[b, j, o, n]`.
  ((pos_a, nb_a, layout_a),), _ = copies[a.index]
  ((pos_b, nb_b, layout_b),), _ = copies[b.index]
  assert (pos_a, nb_a) == (1, u.nbytes) and (pos_b, nb_b) == (1, u.nbytes)
  assert layout_a != layout_b
  assert xla_model.op_memory_model(prog, planned=False)[a.index].early == copies[a.index][0]
  # Arguments are copied while their dot runs, not from the step's start
  # (`c` too: batch dimensions 0 and 2).
  prog = trace(routing, (c, u, v))
  a, _ = _ops(prog, "dot_general")
  assert xla_model.dot_layout_copies(prog)[a.index] == ((), u.nbytes + c.nbytes)
  # A canonical batched matmul, a plain one and a weight gradient over a
  # sequence read their operands as they are.
  for f, args in ((lambda x, y: jnp.einsum("bij,bjk->bik", x, y),
                   (jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)))),
                  (lambda x, y: x.T @ y, (jnp.ones((8, 3)), jnp.ones((8, 5)))),
                  (jax.grad(lambda w, x: jnp.sum(jnp.tanh(x) @ w)),
                   (jnp.ones((8, 5)), jnp.ones((2, 7, 8))))):
    assert xla_model.dot_layout_copies(trace(f, args)) == {}
  assert xla_model.dot_layout_copies(trace(routing, (c, u, v), backend="tpu")) == {}


def test_the_stacks_of_one_scan_write_into_their_zeros_without_a_copy_beside_them():
  """Scans' stacked outputs of one shape share XLA:CPU's broadcast of zeros; a
  buffer of zeros is live beside a scan's stacks only where another scan
  shares the shape too (`xla_model.scan_stack_zeros`)."""
  def body(carry, _):
    y = jnp.tanh(carry)
    return y, (y, jnp.sin(y))

  def one(x):
    return jax.lax.scan(body, x, None, length=5)[1]

  def two(x):
    ys = jax.lax.scan(body, x, None, length=5)[1]
    zs = jax.lax.scan(body, x * 2, None, length=5)[1]
    return ys, zs

  x = jnp.ones((16, 8))
  stack = 5 * x.nbytes
  assert xla_model.scan_stack_zeros(trace(one, (x,))) == {}
  prog = trace(two, (x,))
  scans = _ops(prog, "scan")
  assert xla_model.scan_stack_zeros(prog) == {op.index: stack for op in scans}


def test_half_precision_dots_read_float32_copies_and_write_float32_on_the_cpu():
  """XLA:CPU has no 16-bit float matmul: the operands are read through float32
  copies made where they are (CSE shares one per value), and the result is
  written in float32: kept so for a float16 result or a bfloat16 one read
  once, converted once into its own buffer for a bfloat16 one read more
  often, whose readers are then not duplicated (`xla_model.dot_layout_copies`,
  `xla_model.stored_var_bytes`)."""
  x, w = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
  prog = trace(lambda x, w: jnp.tanh(jnp.tanh(x) @ w), (x, w))
  (dot,) = _ops(prog, "dot_general")
  early, transient = xla_model.dot_layout_copies(prog)[dot.index]
  # Both operands in float32 (twice their bytes), flagged as converted.
  assert sorted((pos, nb) for pos, nb, _ in early) == [(0, 2 * x.nbytes), (1, 2 * w.nbytes)]
  assert all(code & xla_model.UPCAST for _, _, code in early)
  assert transient == 0 and xla_model.stored_var_bytes(prog)[dot.outputs[0]] == 64 * 16 * 4
  # Read twice: the float32 result lives while the dot runs, the bfloat16 one after it.
  twice = trace(lambda x, w: (lambda y: jnp.tanh(y + 1) * jnp.sin(y))(x @ w), (x, w))
  (dot,) = _ops(twice, "dot_general")
  assert xla_model.dot_layout_copies(twice)[dot.index][1] == 64 * 16 * 4
  assert xla_model.stored_var_bytes(twice)[dot.outputs[0]] == 64 * 16 * 2
  (add,) = _ops(twice, "add")
  assert xla_model.op_fusion_kind(twice, add) is Fusion.EXPENSIVE
  half = trace(lambda x, w: jnp.tanh(x @ w) + jnp.sin(x @ w), (x.astype(jnp.float16),
                                                              w.astype(jnp.float16)))
  assert all(xla_model.stored_var_bytes(half)[d.outputs[0]] == 64 * 16 * 4
             for d in _ops(half, "dot_general"))
  # float32 dots, and other compilers, are left as they are.
  single = trace(lambda x, w: jnp.tanh(x @ w), (x.astype(jnp.float32), w.astype(jnp.float32)))
  assert xla_model.dot_layout_copies(single) == {}
  assert xla_model.dot_layout_copies(trace(lambda x, w: x @ w, (x, w), backend="tpu")) == {}


@pytest.mark.parametrize("dtype,param_dtype,batch", [(jnp.bfloat16, jnp.float32, 2048),
                                                     (jnp.float16, jnp.float32, 1024)])
def test_a_half_precision_mlp_is_estimated_within_ten_percent(dtype, param_dtype, batch):
  # Six layers of 1024, computed in 16 bits from float32 parameters (flax's
  # `dtype`): without the float32 copies and results, 25% under the
  # compiled peak in bfloat16 (measured -0.1% with them) and 13% in float16
  # (-1.9%).
  import flax.linen as nn
  import optax

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(6):
        x = nn.relu(nn.Dense(1024, dtype=dtype, param_dtype=param_dtype)(x))
      return nn.Dense(10, dtype=dtype, param_dtype=param_dtype)(x).astype(jnp.float32)

  model, tx = MLP(), optax.adam(1e-3)
  x, y = jnp.ones((batch, 512)), jnp.zeros(batch, jnp.int32)
  params = model.init(jax.random.PRNGKey(0), x)

  def step(params, opt_state, x, y):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  args = (params, tx.init(params), x, y)
  est = jaxmem.analyze(step, *args, donate_argnums=(0, 1)).peak_bytes
  compiled = jaxmem.compiled_memory(
      jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()).peak_bytes
  assert abs(est / compiled - 1) <= 0.10, (est, compiled)


def _gru_layers_step(layers, steps=64, batch=32, hidden=128):
  """An SGD step of ``layers`` GRU layers, each a ``lax.scan`` over time (a model written here)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers)
  params = [dict(w=jax.random.normal(keys[2 * i], (hidden, 3 * hidden)) * 0.05,
                 u=jax.random.normal(keys[2 * i + 1], (hidden, 3 * hidden)) * 0.05)
            for i in range(layers)]
  xs = jnp.ones((steps, batch, hidden))
  h_ = hidden

  def gru(p, xs):
    proj = xs @ p["w"]

    def cell(h, xp):
      hu = h @ p["u"]
      r = jax.nn.sigmoid(xp[:, :h_] + hu[:, :h_])
      z = jax.nn.sigmoid(xp[:, h_:2 * h_] + hu[:, h_:2 * h_])
      n = jnp.tanh(xp[:, 2 * h_:] + r * hu[:, 2 * h_:])
      h = (1 - z) * n + z * h
      return h, h
    return jax.lax.scan(cell, jnp.zeros((batch, hidden)), proj)[1]

  def step(params, xs):
    def loss(params):
      h = xs
      for p in params:
        h = gru(p, h)
      return jnp.mean(h ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)
  return step, (params, xs)


def test_scan_stacks_are_allocated_at_the_program_start_on_the_cpu():
  # XLA:CPU's breadth-first scheduler makes every scan's stack buffers
  # before the first loop: with each stack born at its own scan, the
  # estimate of three stacked GRU layers was 12.9% under the compiled peak.
  step, args = _gru_layers_step(3)
  prog = trace(step, args, donate_argnums=(0,))
  scans = _ops(prog, "scan")
  stacks = {o for op in scans for o in op.outputs[op.eqn.params["num_carry"]:]}
  assert len(scans) == 6 and stacks       # three forward loops, three backward
  assert xla_model.scan_stacks_at_start(prog) == (stacks if prog.backend == "cpu" else set())
  if jax.default_backend() == "cpu":
    est = jaxmem.analyze(step, *args, donate_argnums=(0,)).peak_bytes
    compiled = jaxmem.compiled_memory(
        jax.jit(step, donate_argnums=(0,)).lower(*args).compile()).peak_bytes
    assert -0.05 * compiled <= est - compiled <= 0.1 * compiled, (est, compiled)


def test_a_slice_a_dot_reads_is_stored_on_the_cpu():
  # A matmul library reads a dense operand: XLA:CPU writes the slice out
  # (a NeRF step's skip connection, whose cotangent is sliced for the dot
  # before it: -12.5% -> -5.8% of the compiled peak).
  def f(x, w, v):
    h = x @ w
    return jnp.sum(h[:, :64] @ v) + jnp.sum(jnp.sin(h[:, 64:]))
  prog = trace(f, (jnp.ones((32, 16)), jnp.ones((16, 96)), jnp.ones((64, 8))))
  read_by_dot, read_by_sin = _ops(prog, "slice")
  kind = xla_model.op_fusion_kind(prog, read_by_dot)
  assert kind is (Fusion.CHEAP if prog.backend == "cpu" else Fusion.VIEW)
  assert xla_model.op_fusion_kind(prog, read_by_sin) is Fusion.VIEW


def _two_branch_gelu_step(layers=2, batch=4096, width=128):
  """An SGD step of GELU layers over the sum of two dense branches (a model written here)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers + 1)
  params = [dict(a=jax.random.normal(keys[2 * i], (width, width)) * 0.05,
                 b=jax.random.normal(keys[2 * i + 1], (width, width)) * 0.05,
                 ba=jnp.zeros(width), bb=jnp.zeros(width)) for i in range(layers)]
  x = jax.random.normal(keys[-1], (batch, width))

  def step(params, x):
    def loss(params):
      h = x
      for p in params:
        h = jax.nn.gelu((h @ p["a"] + p["ba"]) + (jnp.roll(h, 1, axis=0) @ p["b"] + p["bb"]))
      return jnp.mean(h ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)
  return step, (params, x)


def test_a_sum_of_two_branches_read_through_a_tanh_is_stored_on_the_cpu():
  # XLA fuses a producer of two full-size operands only where it can reach
  # every reader by fusion alone; a GELU reads its input directly and
  # through a stored `tanh`, so the branches' sum is stored and the branches
  # die (this step's estimate was 10.9% over its compiled peak with the sum
  # counted as fused; a Fourier neural operator's 11.4%).
  step, args = _two_branch_gelu_step()
  prog = trace(step, args, donate_argnums=(0,))
  kinds = [xla_model.op_fusion_kind(prog, op) for op in prog.ops]
  stored = xla_model.unduplicable_ops(prog, kinds)
  # (The sums of the two branches: adds of two bias adds.)
  sums = [op.index for op in _ops(prog, "add") if op.phase is Phase.FORWARD and all(
      prog.ops[prog.vars[x].defined_by].primitive == "add" for x in op.input_ids())]
  assert len(sums) == 2
  if prog.backend != "cpu":
    assert not stored
    return
  assert set(sums) <= stored
  assert all(prog.ops[k].phase is Phase.FORWARD for k in stored)
  est = jaxmem.analyze(step, *args, donate_argnums=(0,)).peak_bytes
  compiled = jaxmem.compiled_memory(
      jax.jit(step, donate_argnums=(0,)).lower(*args).compile()).peak_bytes
  assert -0.05 * compiled <= est - compiled <= 0.1 * compiled, (est, compiled)
