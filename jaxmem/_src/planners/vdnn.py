"""vDNN (Rhu et al.): offload the feature maps saved for the backward pass.

Rhu et al., *Virtualizing Deep Neural Networks for Memory-Efficient Neural
Network Design*.

§3.1 (design principle): a layer's input X is read-only during its forward
computation, so it is copied to pinned host memory while that layer runs, and
released once the copy is done; the backward pass prefetches it back before
the layer's backward computation needs it. No recomputation; weights and the
classifier stay on the device. §3.3 (memory transfer policy):

* ``all`` (vDNN_all): offload the X of every layer;
* ``conv`` (vDNN_conv): offload only the X of the CONV layers (here: the
  inputs of forward matmuls and convolutions, the ops long enough to hide
  their copies);
* ``dyn`` (dynamic vDNN): use no offload if the step fits, else ``conv``,
  else ``all``, the first whose (estimated) peak fits the budget.

In a flat program a "layer input X" is a value saved for the backward pass:
it is offloaded after its last forward use and fetched before its first
backward use. vDNN's dynamic policy also downgrades cuDNN convolution
algorithms to memory-optimal ones; XLA does not expose that choice, so it
collapses to "first feasible of none / conv / all" (documented deviation).
Copies are asynchronous; vDNN synchronises each prefetch one layer ahead
(Fig. 8), which the window approximates: long enough to cover the copy with
computation on the device (:func:`common.device_window`).
"""

from __future__ import annotations


from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.planners import common

POLICIES = ("dyn", "conv", "all")


@without_gc
@common.never_worse_than_none
def vdnn(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
         copies: CopyMode = "async", window: Window = None, policy: str = "dyn",
         min_bytes: int | None = None) -> Plan:
  """vDNN's offload plan (``policy`` = ``"dyn"``, ``"conv"`` or ``"all"``).

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: target estimated peak (``dyn`` picks the first policy under it).
    device: device profile used for the copy window.
    policy: vDNN_dyn, vDNN_conv or vDNN_all (vDNN §3.3).
    copies, window: how copies are scheduled (default: asynchronous, with a
      window covering each copy on ``device``).
    min_bytes: ignore values smaller than this (default: 0.1% of the peak).

  Returns:
    A :class:`jaxmem.Plan` named ``vdnn-<policy>``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
    >>> prog = jaxmem.analyze(jax.grad(f), jnp.ones((256, 256)), jnp.ones((512, 256)))
    >>> vdnn(prog, prog.peak_bytes, "k40", policy="all").planner
    'vdnn-all'
  """
  if policy not in POLICIES:
    raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}.")
  if min_bytes is None:
    min_bytes = max(1, program.profile.peak_bytes // 1000)
  if window is None and copies == "async":
    window = common.device_window(device)
  residuals = common.residual_gaps(program, min_bytes)
  heavy_inputs = {x for k in common.forward_heavy_ops(program)
                  for x in program.ops[k].input_ids()}
  pricer = common.Pricer(program, device)
  conv = [common.offload_decision(program, g, pricer) for g in residuals if g.var in heavy_inputs]
  every = [common.offload_decision(program, g, pricer) for g in residuals]
  options = {"none": [], "conv": [d for d in conv if d], "all": [d for d in every if d]}

  def make(name: str) -> Plan:
    return common.finish(program, options[name], budget_bytes, f"vdnn-{name if name != 'none' else policy}",
                         copies=copies, window=window)

  if policy != "dyn":
    return make(policy)
  for name in ("none", "conv", "all"):
    plan = make(name)
    if plan.estimated_peak_bytes <= budget_bytes:
      break
  return plan.replace(planner=f"vdnn-dyn({plan.planner.split('-', 1)[1]})")
