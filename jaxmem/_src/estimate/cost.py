"""Cost model: per-equation FLOPs and bytes, and a roofline time per op on a device.

FLOPs come from the primitive registry (:mod:`jaxmem._src.ir.primitives`: a
rule per primitive, one FLOP per result element by default); an op with a
body costs its body's equations, times the trip count of a loop. Bytes are
operands read plus results written. :func:`eqn_seconds` turns both into a
roofline time on a :class:`~jaxmem._src.estimate.devices.DeviceProfile`;
:class:`OpCosts` holds the device-independent part for a whole program, so
that its per-op times on any device are one vectorized expression.

Each op is priced at what its class achieves on the device, not at the
datasheet's peak (:class:`~jaxmem._src.estimate.devices.Efficiency`): matmuls
and convolutions at ``efficiency.matmul`` of the matrix rate, other
arithmetic at ``efficiency.vector``, the bytes of reductions at
``efficiency.reduction`` and of everything else at ``efficiency.memory`` of the
memory bandwidth; host copies (``DeviceProfile.copy_seconds``) at
``efficiency.copy`` of the link plus a latency. Recomputation and copies are
thus derated alike, so neither is favoured by the model's optimism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxmem._src import _compat
from jaxmem._src.estimate.devices import HALF_DTYPES, DeviceProfile
from jaxmem._src.ir import primitives
from jaxmem._src.ir.primitives import Body, Fusion


def eqn_flops(eqn: _compat.JaxprEqn, *, has_body: bool | None = None) -> float:
  """FLOPs of one equation (nested bodies: summed once, loops: times trip count).

  ``has_body``: whether the equation holds jaxprs, when the caller knows it
  (:attr:`~jaxmem._src.ir.program.Op.has_body`); None looks in its params.
  """
  facts = primitives.eqn_facts(eqn)
  if facts.flops is not None:
    return facts.flops(eqn)
  subs = (_compat.sub_jaxprs(eqn) if facts.body is not Body.COMBINER and has_body is not False
          else [])
  if subs:
    inner = sum(eqn_flops(e) for j in subs for e in j.eqns)
    trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    return float(inner) * trips
  return primitives.out_element_flops(eqn)


def _nbytes(atoms: Sequence[_compat.Atom]) -> int:
  return sum(_compat.aval_nbytes(getattr(a, "aval", None)) for a in atoms)


def eqn_bytes(eqn: _compat.JaxprEqn) -> float:
  """Device-memory bytes one equation moves if nothing is fused: operands read, results written."""
  return float(_nbytes(eqn.invars) + _nbytes(eqn.outvars))


_FUSED_IN_BODIES = (Fusion.CHEAP, Fusion.EXPENSIVE, Fusion.VIEW)


_CONVOLUTIONS = frozenset({"conv_general_dilated"})


def _body_fused(j: _compat.Jaxpr, conv_inputs_stored: bool = False) -> list[bool]:
  """Per equation of a body, whether it is priced as fused into its readers.

  An elementwise or view result read only inside the body is fused; the
  body's results are stored; a nested body (a ``jit`` call, a
  ``custom_jvp``) is priced as a body of its own. With
  ``conv_inputs_stored`` a result a convolution reads is stored too: XLA:GPU
  hands convolutions to cuDNN and XLA:CPU to its library, neither of which
  takes a fused producer (:attr:`DeviceProfile.fuses_into_convolutions` is
  False); XLA:TPU fuses them. This is more fusion than the estimate's
  top-level model grants the same equations (it stores an elementwise value
  that a reduction shares with other readers), and it is kept because the
  measurements favour it: on an H200 (``bench/cost_calibration.py``),
  per-block policies over plain ``jax.jit`` measured 1.25x/1.15x (GPT,
  ``nothing_saveable``/``dots_saveable``, busy time), priced 1.22x/1.22x
  by this rule and 1.04x/1.04x by the top-level rules. What a convolution
  reads is stored (unless it is a convolution's epilogue,
  :func:`_stored_convolution_inputs`) since XLA:GPU's compiled programs were
  priced kernel by kernel (``bench/results/gpu_cost.md``): over per-block
  ``nothing_saveable`` and ``dots_saveable`` on ResNet-18, ResNet-50, VGG-16,
  a UNet and DenseNet-121, this rule is within 10% of the compiled roofline's
  ratio to ``jax.jit`` on all 10 (mean |error| 6.1%), fusing convolution
  inputs on 7 (mean 6.2%, and up to 14% under on the BatchNorm ones)
  (``docs/design.md``, "The cost model every planner prices with").
  """
  outs = {id(v) for v in j.outvars}
  stored = _stored_convolution_inputs(j) if conv_inputs_stored else set()
  return [primitives.eqn_facts(e).fusion in _FUSED_IN_BODIES
          and not any(id(v) in outs or id(v) in stored for v in e.outvars) for e in j.eqns]


def _stored_convolution_inputs(j: _compat.Jaxpr) -> set[int]:
  """Ids of the elementwise results a convolution of ``j`` reads that are stored for it.

  A convolution's operand is computed by a kernel of its own and written to
  memory, unless it is an *epilogue* of an earlier convolution: an
  elementwise function of that convolution's output and of values that do
  not depend on it (a bias, a scale), which XLA:GPU computes inside the
  earlier convolution's cuDNN call (conv + bias + activation). A BatchNorm
  between two convolutions is not one: its mean and variance are reductions
  of the first convolution's output. Measured against XLA:GPU's compiled
  programs: per-block ``nothing_saveable``/``dots_saveable`` on VGG-16 and a
  UNet (convolution, bias, ReLU) were priced 1.25x/1.17x and 1.29x/1.19x with
  every convolution input stored, 1.25x/1.10x and 1.24x/1.13x with epilogues
  fused, against a compiled roofline of 1.14x/1.03x and 1.17x/1.03x.
  """
  depends: dict[int, frozenset[int]] = {}     # var -> the convolutions it depends on
  epilogue_of: dict[int, int] = {}            # var -> the convolution it is an epilogue of
  read: set[int] = set()
  for k, e in enumerate(j.eqns):
    ins = [v for v in e.invars if not isinstance(v, _compat.Literal)]
    deps = frozenset().union(*(depends.get(id(v), frozenset()) for v in ins))
    is_conv = e.primitive.name in _CONVOLUTIONS
    if is_conv:
      read.update(id(v) for v in ins)
      deps = deps | {k}
    for v in e.outvars:
      depends[id(v)] = deps
    if is_conv:
      epilogue_of.update((id(v), k) for v in e.outvars)
    elif primitives.eqn_facts(e).fusion in _FUSED_IN_BODIES:
      convs = {epilogue_of[id(v)] for v in ins if id(v) in epilogue_of}
      if len(convs) == 1:
        (c,) = convs
        if all(id(v) in epilogue_of or c not in depends.get(id(v), frozenset()) for v in ins):
          epilogue_of.update((id(v), c) for v in e.outvars)
  # (A convolution's own output read by another is in `epilogue_of` but is
  # never priced fused: a convolution is materialized.)
  return {v for v in read if v not in epilogue_of}


def _over_body(eqn: _compat.JaxprEqn, price: Callable[[_compat.JaxprEqn, bool], float],
               conv_inputs_stored: bool = False) -> float | None:
  """``price(e, fused)`` summed over the equations of ``eqn``'s body, fused as
  :func:`_body_fused` says (a loop body times its trip count, the slowest
  ``cond`` branch); ``None`` for an op without a body."""
  if primitives.eqn_facts(eqn).body is Body.COMBINER:
    return None
  subs = _compat.sub_jaxprs(eqn)
  if not subs:
    return None
  per_body = [sum(price(e, f) for e, f in zip(j.eqns, _body_fused(j, conv_inputs_stored)))
              for j in subs]
  name = eqn.primitive.name
  if name == "cond":
    return max(per_body)            # one branch runs; price the slowest
  trips = eqn.params.get("length", 1) if name == "scan" else 1
  return float(sum(per_body)) * trips


def _body_seconds(eqn: _compat.JaxprEqn, profile: DeviceProfile) -> float | None:
  """Time of an op with a body (scan, remat, cond...): its equations' times, ``None`` otherwise."""
  return _over_body(eqn, lambda e, f: eqn_seconds(e, profile, fused=f),
                    conv_inputs_stored=not profile.fuses_into_convolutions)


def eqn_accessed(eqn: _compat.JaxprEqn, *, fused: bool = False) -> float:
  """Device-memory bytes one equation reads and writes, as :func:`eqn_seconds` prices it.

  The model's counterpart of XLA's ``cost_analysis()["bytes accessed"]``:
  an op fused into its consumer moves nothing of its own; an op with a body
  moves what its unfused equations move (:func:`_body_fused`), a loop body
  times its trip count.
  """
  body = _over_body(eqn, lambda e, f: eqn_accessed(e, fused=f))
  if body is not None:
    return body
  return 0.0 if fused else eqn_bytes(eqn)


def _compute_rate(eqn: _compat.JaxprEqn, profile: DeviceProfile) -> float:
  if primitives.eqn_facts(eqn).matrix_unit:
    return profile.matmul_rate(str(getattr(eqn.invars[0].aval, "dtype", "")))
  return profile.vector_rate


def _is_reduction(eqn: _compat.JaxprEqn) -> bool:
  return primitives.eqn_facts(eqn).fusion is Fusion.REDUCE


def _bandwidth(eqn: _compat.JaxprEqn, profile: DeviceProfile) -> float | None:
  """Achieved memory bandwidth of ``eqn``'s class (``None``: the profile models none)."""
  return profile.reduction_bytes_per_s if _is_reduction(eqn) else profile.stream_bytes_per_s


def eqn_seconds(eqn: _compat.JaxprEqn, profile: DeviceProfile, *, fused: bool = False) -> float:
  """Roofline time of one equation: ``max(FLOPs / rate, bytes / bandwidth) + overhead``.

  ``fused``: XLA fuses the op into its consumer, so it moves no bytes of its
  own and costs no launch (only its arithmetic). An op with a body (``scan``,
  ``jax.checkpoint``, ``cond``...) costs the time of the equations inside it
  (a loop body times its trip count, the slowest ``cond`` branch), fused as
  :func:`_body_fused` says.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem._src.estimate.devices import device_profile
    >>> eqn = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((256, 256))).eqns[0]
    >>> eqn_seconds(eqn, device_profile("k40")) > eqn_seconds(eqn, device_profile("h100-sxm"))
    True
  """
  body = _body_seconds(eqn, profile)
  if body is not None:
    return body
  compute = eqn_flops(eqn) / _compute_rate(eqn, profile)
  if fused:
    return compute
  bandwidth = _bandwidth(eqn, profile)
  memory = eqn_bytes(eqn) / bandwidth if bandwidth else 0.0
  return max(compute, memory) + profile.op_overhead_s


@dataclasses.dataclass(frozen=True, eq=False)
class OpCosts:
  """The device-independent part of every op's roofline time, for one program.

  :meth:`seconds` gives each op's :func:`eqn_seconds` on a device in one
  vectorized expression (the same float operations, so the same values);
  ops with a body are priced equation by equation.

  Attributes:
    flops: per op, its FLOPs.
    nbytes: per op, the bytes it moves unfused.
    matrix: per op, runs on the matrix units.
    half: per op, a half-precision (bfloat16/float16) first operand.
    reduction: per op, a reduction (its bytes move at ``efficiency.reduction``).
    bodies: ``(op index, equation)`` of the ops with a body.
  """
  flops: np.ndarray
  nbytes: np.ndarray
  matrix: np.ndarray
  half: np.ndarray
  reduction: np.ndarray
  bodies: tuple[tuple[int, _compat.JaxprEqn], ...]

  def seconds(self, profile: DeviceProfile, *, fused: bool) -> np.ndarray:
    """Per op, its time on ``profile`` when fused into its consumer or not."""
    vector = np.full(len(self.flops), profile.vector_rate)
    matmul = np.where(self.half, profile.matmul_rate("bfloat16"), profile.matmul_rate("float32"))
    compute = self.flops / np.where(self.matrix, matmul, vector)
    if fused:
      out = compute
    else:
      stream, reduce = profile.stream_bytes_per_s, profile.reduction_bytes_per_s
      memory = (self.nbytes / np.where(self.reduction, reduce, stream) if stream
                else np.zeros_like(compute))
      out = np.maximum(compute, memory) + profile.op_overhead_s
    if self.bodies:
      # An op with a body is priced equation by equation, the same whether
      # it is fused or not: once per device profile (a planner asks for
      # these times on every plan it prices; a step of scans spent a sixth
      # of `fit`'s time here).
      memo = self.__dict__.setdefault("_body_seconds_memo", {})
      if profile not in memo:
        memo[profile] = [(k, eqn_seconds(eqn, profile)) for k, eqn in self.bodies]
      for k, t in memo[profile]:
        out[k] = t
    return out

  def accessed_bytes(self, *, fused: bool) -> np.ndarray:
    """Per op, the device-memory bytes it reads and writes when fused or not (:func:`eqn_accessed`)."""
    memo = self.__dict__.setdefault("_accessed_memo", {})
    if fused not in memo:
      out = np.zeros_like(self.nbytes) if fused else self.nbytes.copy()
      for k, eqn in self.bodies:
        out[k] = eqn_accessed(eqn, fused=fused)
      out.flags.writeable = False
      memo[fused] = out
    return memo[fused]


def op_costs(eqns: Sequence[tuple[_compat.JaxprEqn, bool]]) -> OpCosts:
  """The :class:`OpCosts` of a program's equations ``(eqn, has a body)``, in program order."""
  flops, nbytes, matrix, half, reduction, bodies = [], [], [], [], [], []
  for k, (eqn, has_body) in enumerate(eqns):
    facts = primitives.eqn_facts(eqn)
    if has_body and facts.body is not Body.COMBINER:
      bodies.append((k, eqn))
    flops.append(eqn_flops(eqn, has_body=has_body))
    nbytes.append(eqn_bytes(eqn))
    matrix.append(facts.matrix_unit)
    half.append(facts.matrix_unit
                and str(getattr(eqn.invars[0].aval, "dtype", "")) in HALF_DTYPES)
    reduction.append(_is_reduction(eqn))
  return OpCosts(np.asarray(flops, np.float64), np.asarray(nbytes, np.float64),
                 np.asarray(matrix, bool), np.asarray(half, bool), np.asarray(reduction, bool),
                 tuple(bodies))


__all__ = ["OpCosts", "eqn_accessed", "eqn_bytes", "eqn_flops", "eqn_seconds", "op_costs"]
