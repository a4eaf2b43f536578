"""``jaxmem.plan``: a plan for an estimated budget, without compiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxmem._src.api.program import analyze
from jaxmem._src.base.budget import Budget, parse_budget
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.estimate.targets import TargetLike, get_target
from jaxmem._src.plan.plan import Plan
from jaxmem._src.planners.protocol import PlainPlanner, Planner
from jaxmem._src.planners.registry import get_planner


def plan(fun: Callable[..., Any], *args: Any, budget: Budget,
         planner: str | Planner | PlainPlanner = "auto", device: DeviceLike = None,
         target: TargetLike = None) -> Plan:
  """Plans ``fun(*args)`` for an estimated peak of ``budget`` (no compile).

  Args:
    fun: the step.
    *args: example arguments.
    budget: int bytes, a string with units, or a fraction of the *estimated*
      peak (``jaxmem.fit`` resolves a fraction against the compiled peak).
    planner: planner name or callable.
    device: device profile name (default: the target's).
    target: the device planned for: ``None`` (local) or an ahead-of-time
      target such as ``"tpu:v5e"``; the estimate models its compiler.

  Returns:
    A :class:`jaxmem.Plan`.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def loss(w, x):
    ...   h = jnp.sin(x @ w)
    ...   return jnp.sum((h * h) @ w)
    >>> p = jaxmem.plan(jax.grad(loss), jnp.ones((64, 64)), jnp.ones((1024, 64)), budget=0.9,
    ...                 planner="greedy", device="h100-pcie")
    >>> p.estimated_peak_bytes <= p.target_bytes
    True
  """
  spec = parse_budget(budget)
  t = get_target(target)
  program = analyze(fun, *args, target=t)
  if device is None:
    device = t.profile
  return get_planner(planner)(program, spec.resolve(program.peak_bytes), device)


__all__ = ["plan"]
