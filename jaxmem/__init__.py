"""jaxmem: make a JAX training step fit a memory budget.

Trace -> lifetimes -> plan -> rewrite -> verify:

>>> import jax.numpy as jnp, jaxmem
>>> prog = jaxmem.analyze(lambda x: (x @ x.T).sum(), jnp.ones((64, 32)))
>>> print(prog.report())                                  # doctest: +SKIP
>>> step = jaxmem.fit("512MiB")(lambda x: (x @ x.T).sum())
>>> float(step(jnp.ones((64, 32))))
65536.0
"""

from jaxmem import dsa
from jaxmem._src import native
from jaxmem._src.arena import ArenaStats, HostArena
from jaxmem._src.blocks import Block
from jaxmem._src.budget import BudgetSpec, parse_budget
from jaxmem._src.compare import Comparison, compare
from jaxmem._src.cost import DeviceProfile, device_profile
from jaxmem._src.errors import BudgetError, JaxmemError, format_bytes
from jaxmem._src.fit import FitResult, Fitted, fit
from jaxmem._src.lifetimes import Profile
from jaxmem._src.max_batch import MaxBatchResult, max_batch
from jaxmem._src.plan import Action, Decision, Plan
from jaxmem._src.planners import PLANNERS, get_planner
from jaxmem._src.schedule import Schedule
from jaxmem._src.simulate import Simulation, simulate
from jaxmem._src.trace import Op, Program, Role, VarInfo, analyze
from jaxmem._src.verify import CompiledMemory, compiled_memory


def plan(fun, *args, budget, planner="auto", device=None):  # noqa: ANN001, ANN201
  """Plans ``fun(*args)`` for an estimated peak of ``budget`` (no compile).

  Args:
    fun: the step.
    *args: example arguments.
    budget: int bytes or a string with units (fractions need a compile: use
      :func:`fit`).
    planner: planner name or callable.
    device: device profile name.

  Returns:
    A :class:`Plan`.
  """
  spec = parse_budget(budget)
  program = analyze(fun, *args)
  target = spec.resolve(program.peak_bytes)
  return get_planner(planner)(program, target, device)


__all__ = [
    "Action", "ArenaStats", "Block", "BudgetError", "BudgetSpec", "Comparison", "CompiledMemory",
    "Decision", "DeviceProfile", "compare",
    "FitResult", "Fitted", "HostArena", "JaxmemError", "Op", "PLANNERS", "Plan", "Profile",
    "Program",
    "Role", "Schedule", "VarInfo", "analyze", "compiled_memory", "device_profile", "fit",
    "MaxBatchResult", "max_batch",
    "dsa", "format_bytes", "get_planner", "native", "parse_budget", "plan", "Simulation",
    "simulate",
]

__version__ = "0.1.0"
