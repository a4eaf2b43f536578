"""``jaxmem.policy(plan)``: a plan as a ``jax.checkpoint`` policy over ``checkpoint_name`` tags.

For users who apply remat in their own model code (``jax.checkpoint``,
``nn.remat(policy=...)``, ``nnx.remat``, a remat-ed scan body), a plan is
exported as what such code understands: a policy function that JAX calls on
every primitive of the checkpointed forward pass, answering ``Saveable``,
``Recompute`` or ``Offloadable("device", "pinned_host")``. A policy sees a
primitive and its shapes, not which value it makes, so it decides by the
names the model gives its values with
``jax.ad_checkpoint.checkpoint_name(x, "name")`` -- the same contract as JAX's
``save_and_offload_only_these_names``.

The plan's decisions are per value of the traced step; the export groups them
by tag. Values the plan keeps are ``Saveable``, recomputed ones ``Recompute``,
offloaded ones ``Offloadable``; a tagged value the backward pass never reads
is no residual, and gets ``Recompute`` (nothing is saved for it either way). Where instances of one name got different
decisions (layer 1's activation kept, layer 7's recomputed), one name cannot
say both: the export takes the decision that covers the most bytes and lists
the conflict. Decisions on values that carry no name are listed with their
``file:line`` and a suggested name, so the model can be tagged and the plan
made again. :func:`residual_actions` reads back what a policy really made JAX
save, offload and recompute (from the ``jax.vjp`` jaxpr, as
``jax.ad_checkpoint.print_saved_residuals`` does) for the structural check.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import jax

from jaxmem._src import _compat
from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.ir.program import Op, Phase, Role
from jaxmem._src.plan.decisions import Action
from jaxmem._src.plan.plan import Plan

#: What a policy does with a named residual.
PolicyAction = Literal["save", "recompute", "offload"]
_FROM_PLAN: Mapping[Action, PolicyAction] = MappingProxyType(
    {Action.KEEP: "save", Action.REMAT: "recompute", Action.OFFLOAD: "offload"})
# When a name's instances disagree and cover equal bytes: the decision that
# holds the least device memory wins, so the budget is not given up.
_PREFERENCE = ("offload", "recompute", "save")
# What JAX wraps a saved residual in (``reduce_precision`` keeps XLA from
# fusing the forward value's precision away) -- the value is the same.
_IDENTITIES = frozenset({"reduce_precision", "copy", "copy_p"})


@dataclasses.dataclass(frozen=True)
class TaggedResidual:
  """The decision for one ``checkpoint_name`` tag.

  Attributes:
    name: the tag.
    action: what the policy does with it.
    instances: values of the step that carry the tag (one per layer).
    nbytes: their bytes.
    sources: ``file:line`` of the tagged values.
    planned: per action, how many instances the plan gave it (more than one
      key: a conflict, resolved to ``action``).
  """
  name: str
  action: PolicyAction
  instances: int
  nbytes: int
  sources: tuple[str, ...]
  planned: Mapping[str, int]

  @property
  def conflict(self) -> bool:
    return len(self.planned) > 1


@dataclasses.dataclass(frozen=True)
class UntaggedDecision:
  """A value with no ``checkpoint_name`` that the plan treats unlike the policy's default.

  ``action`` is the plan's (a recompute or offload when the default is
  "save"; a kept, stored residual when it is "recompute"): tag the value with
  ``suggested_name`` and plan again to export it.
  """
  action: PolicyAction
  source: str
  type_str: str
  nbytes: int
  suggested_name: str


@dataclasses.dataclass(frozen=True)
class PolicyExport:
  """A plan as a ``jax.checkpoint`` policy (from :func:`policy`).

  Attributes:
    policy: the function to pass as ``jax.checkpoint(f, policy=...)`` or
      ``nn.remat(..., policy=...)``.
    tagged: one entry per ``checkpoint_name`` tag of the planned step.
    untagged: values without a tag that the plan treats unlike ``default``
      (the policy cannot express them; tag them to export them).
    default: what the policy does with untagged values (``"recompute"``, as
      JAX's name policies do, or ``"save"``).
    offload_src, offload_dst: the memory kinds of ``Offloadable``.
  """
  policy: Callable[..., Any]
  tagged: tuple[TaggedResidual, ...]
  untagged: tuple[UntaggedDecision, ...]
  default: PolicyAction
  offload_src: str = "device"
  offload_dst: str = "pinned_host"

  @property
  def names(self) -> Mapping[str, PolicyAction]:
    """Tag -> what the policy does with it."""
    return MappingProxyType({t.name: t.action for t in self.tagged})

  def summary(self) -> str:
    lines = [f"jaxmem policy: {len(self.tagged)} tags, untagged values: {self.default}"]
    for t in self.tagged:
      note = (f"  (conflict: planned {dict(t.planned)})" if t.conflict else "")
      lines.append(f"  {t.action:<10} {t.name!r:<24} x{t.instances:<3} "
                   f"{format_bytes(t.nbytes):>11}{note}")
    if self.untagged:
      lines.append(f"  {len(self.untagged)} untagged values the plan treats otherwise "
                   "(add `checkpoint_name` there to export them):")
      for u in self.untagged[:10]:
        lines.append(f"    {u.action:<10} {u.type_str:<24} {format_bytes(u.nbytes):>11}  "
                     f"{u.source}  -> checkpoint_name(x, {u.suggested_name!r})")
    return "\n".join(lines)


def _tag_op(program: AnalyzedProgram, vid: int) -> Op | None:
  """The ``name`` op that tags a value: the one that made it, or one that reads it.

  A tagged value and its ``name`` alias are one instance of the tag, and this
  op identifies it.
  """
  v = program.vars[vid]
  ops = ([v.defined_by] if v.defined_by >= 0 else []) + list(v.uses)
  return next((program.ops[k] for k in ops if program.ops[k].primitive == "name"), None)


def _fused_from_tag(program: AnalyzedProgram, vid: int) -> bool:
  """Is ``vid`` a fused (virtual) value XLA computes from a tagged value in its consumers?"""
  virtual = program.profile.virtual
  if virtual is None or not virtual[vid]:
    return False
  stack, seen = [vid], set()
  while stack:
    x = stack.pop()
    if x in seen or program.vars[x].defined_by < 0:
      continue
    seen.add(x)
    for y in program.ops[program.vars[x].defined_by].input_ids():
      if _tag_op(program, y) is not None:
        return True
      if virtual[y]:
        stack.append(y)
  return False


def policy(plan: Plan, *, default: PolicyAction = "recompute", offload_src: str = "device",
           offload_dst: str = "pinned_host") -> PolicyExport:
  """Exports ``plan`` as a ``jax.checkpoint`` policy over the step's ``checkpoint_name`` tags.

  Args:
    plan: a plan of a step whose model tags its values with
      ``jax.ad_checkpoint.checkpoint_name``.
    default: what the policy does with untagged values: ``"recompute"`` (as
      ``jax.checkpoint_policies.save_only_these_names``) or ``"save"``.
    offload_src, offload_dst: memory kinds of ``Offloadable``.

  Returns:
    A :class:`PolicyExport`; ``.policy`` goes to ``jax.checkpoint`` / ``nn.remat``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> def loss(ws, x):
    ...   for i, w in enumerate(ws):
    ...     x = checkpoint_name(jnp.tanh(x @ w), f"act{i}")
    ...   return jnp.sum(x * x)
    >>> ws, x = [jnp.full((128, 128), 0.01)] * 4, jnp.ones((1024, 128))
    >>> plan = jaxmem.plan(jax.grad(loss), ws, x, budget=0.7, planner="greedy-remat",
    ...                    device="h100-pcie")
    >>> export = jaxmem.policy(plan)
    >>> sorted(export.names.items())[0]
    ('act0', 'recompute')
    >>> g = jax.grad(jax.checkpoint(loss, policy=export.policy))(ws, x)
  """
  if default not in ("recompute", "save"):
    raise ValueError(f"`default` must be 'recompute' or 'save', got {default!r}.")
  prog = plan.program
  virtual = prog.profile.virtual
  # A value dropped over several gaps may be recomputed over one and
  # offloaded over another; a policy says one thing per residual: the
  # decision over its longest gap (where it saves the most byte-time).
  longest: dict[int, tuple[int, PolicyAction]] = {}
  for d in plan.decisions:
    if d.action is not Action.KEEP and d.end - d.start > longest.get(d.var, (-1, ""))[0]:
      longest[d.var] = (d.end - d.start, _FROM_PLAN[d.action])
  decided = {v: a for v, (_, a) in longest.items()}
  by_name: dict[str, dict[int, PolicyAction]] = collections.defaultdict(dict)
  untagged: list[UntaggedDecision] = []
  for v in prog.vars:
    if v.is_input or v.defined_by < 0 or prog.ops[v.defined_by].phase is not Phase.FORWARD:
      continue
    tag_op = _tag_op(prog, v.id)
    action = decided.get(v.id)
    if tag_op is None and action is not None and _fused_from_tag(prog, v.id):
      # XLA stores no buffer for a fused value (`1 - t*t` of a tanh's JVP); the
      # buffer the plan's decision acts on is its tagged source's, whose tag
      # the policy decides (JAX recomputes the fused value from it).
      continue
    if tag_op is None:
      # Untagged values get `default`: listed where the plan wants otherwise --
      # a decision that is not the default, or (default "recompute") a
      # residual the plan keeps that XLA stores (a fused one is never saved).
      if action is None and default == "recompute" and v.role is Role.ACTIVATION and not (
          virtual is not None and virtual[v.id]):
        action = "save"
      if action is not None and action != default:
        op = prog.ops[v.defined_by]
        module = op.module.replace("/", ".") if op.module else op.primitive
        untagged.append(UntaggedDecision(action, v.source, v.type_str, v.nbytes,
                                         f"{module}.{op.primitive}" if op.module else module))
      continue
    name, key = str(tag_op.eqn.params["name"]), tag_op.index
    # Kept: saved if the backward pass reads it; a tag the backward never
    # reads (a value only summed into the next layer) is no residual, and
    # "recompute" costs nothing there (JAX saves nothing for it either way).
    residual = any(prog.vars[x].role is Role.ACTIVATION
                   for x in (*tag_op.outputs, *tag_op.input_ids()))
    prev = by_name[name].get(key)
    if action is not None:
      by_name[name][key] = action
    elif prev is None:
      by_name[name][key] = "save" if residual else "recompute"
  tagged = []
  for name, inst in sorted(by_name.items()):
    counts = collections.Counter(inst.values())
    nbytes_of = {k: prog.vars[prog.ops[k].outputs[0]].nbytes for k in inst}
    weight = collections.Counter()
    for k, a in inst.items():
      weight[a] += nbytes_of[k]
    action = max(weight, key=lambda a: (weight[a], -_PREFERENCE.index(a)))
    sources = tuple(sorted({prog.vars[prog.ops[k].outputs[0]].source for k in inst}))
    tagged.append(TaggedResidual(name, action, len(inst), sum(nbytes_of.values()), sources,
                                 MappingProxyType(dict(counts))))
  table = {t.name: t.action for t in tagged}
  offload = jax.ad_checkpoint.Offloadable(src=offload_src, dst=offload_dst)
  answers = {"save": jax.ad_checkpoint.Saveable, "recompute": jax.ad_checkpoint.Recompute,
             "offload": offload}
  fallback = answers[default]

  def checkpoint_policy(prim: Any, *avals: Any, **params: Any) -> Any:
    if getattr(prim, "name", None) == "name":
      return answers[table.get(params.get("name"), default)]
    return fallback

  checkpoint_policy.__name__ = f"jaxmem_policy_{plan.planner}"
  return PolicyExport(checkpoint_policy, tuple(tagged), tuple(untagged), default, offload_src,
                      offload_dst)


def residual_actions(fun: Callable[..., Any], *args: Any) -> dict[str, PolicyAction]:
  """What JAX does with each named value of ``fun`` when it is differentiated.

  Reads the residuals of ``jax.vjp(fun, *args)`` (``fun`` applies its own
  ``jax.checkpoint`` policies): a residual made by ``checkpoint_name`` is
  ``"save"``; one that is a ``device_put`` to host of a named value is
  ``"offload"``; a name whose value is no residual is ``"recompute"``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> f = lambda x: jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), "h")))
    >>> keep_h = jax.checkpoint_policies.save_only_these_names("h")
    >>> residual_actions(jax.checkpoint(f, policy=keep_h), jnp.ones(4))
    {'h': 'save'}
    >>> residual_actions(jax.checkpoint(f), jnp.ones(4))
    {'h': 'recompute'}
  """
  closed = jax.make_jaxpr(lambda *a: jax.vjp(fun, *a))(*args)
  jaxpr = closed.jaxpr
  definer = {}
  names: set[str] = set()

  def walk(jx: Any) -> None:
    for eqn in jx.eqns:
      if eqn.primitive.name == "name":
        names.add(str(eqn.params["name"]))
      for o in eqn.outvars:
        definer[o] = eqn
      for sub in _compat.sub_jaxprs(eqn):
        walk(sub)

  walk(jaxpr)
  n_out = len(jax.tree_util.tree_leaves(jax.eval_shape(fun, *args)))
  out: dict[str, PolicyAction] = {}
  def origin(var: Any) -> Any:
    """The equation behind ``var``, looking through the identities JAX puts on residuals
    and into the body of a ``scan`` whose stacked output it is (a residual of a remat-ed
    scan body is saved per iteration)."""
    eqn = definer.get(var)
    while eqn is not None:
      if eqn.primitive.name in _IDENTITIES:
        var = eqn.invars[0]
      elif eqn.primitive.name == "scan":
        var = eqn.params["jaxpr"].jaxpr.outvars[list(eqn.outvars).index(var)]
      else:
        return eqn
      eqn = definer.get(var)
    return eqn

  for var in jaxpr.outvars[n_out:]:
    eqn = origin(var)
    if eqn is None:
      continue
    if eqn.primitive.name == "name":
      out[str(eqn.params["name"])] = "save"
    elif eqn.primitive.name == "device_put":
      src = origin(eqn.invars[0])
      if src is not None and src.primitive.name == "name":
        out[str(src.params["name"])] = "offload"
  for name in names:
    out.setdefault(name, "recompute")
  return dict(sorted(out.items()))


__all__ = ["PolicyAction", "PolicyExport", "TaggedResidual", "UntaggedDecision", "policy",
           "residual_actions"]
