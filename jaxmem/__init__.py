"""jaxmem: make a JAX training step fit a memory budget.

Trace -> lifetimes -> plan -> rewrite -> verify:

>>> import jax.numpy as jnp, jaxmem
>>> prog = jaxmem.analyze(lambda x: (x @ x.T).sum(), jnp.ones((64, 32)))
>>> print(prog.report())                                  # doctest: +SKIP
>>> step = jaxmem.fit("512MiB")(lambda x: (x @ x.T).sum())
>>> float(step(jnp.ones((64, 32))))
131072.0
"""

from jaxmem import dsa, native
from jaxmem._src.api.compare import Comparison, compare
from jaxmem._src.api.fit import FitResult, Fitted, fit
from jaxmem._src.api.max_batch import MaxBatchResult, max_batch
from jaxmem._src.api.plan import plan
from jaxmem._src.api.policy import PolicyExport, policy, residual_actions
from jaxmem._src.api.program import Program, analyze
from jaxmem._src.base.budget import BudgetSpec, parse_budget
from jaxmem._src.base.errors import BudgetError, JaxmemError, format_bytes
from jaxmem._src.estimate.devices import DeviceProfile, Efficiency, device_profile
from jaxmem._src.estimate.lifetimes import Profile
from jaxmem._src.estimate.targets import Target, get_target
from jaxmem._src.ir.blocks import Block
from jaxmem._src.ir.program import Op, Role, VarInfo
from jaxmem._src.native.arena import ArenaStats, HostArena
from jaxmem._src.plan.decisions import Action, Decision
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import Schedule
from jaxmem._src.plan.simulate import Simulation, simulate
from jaxmem._src.planners.dqn import DqnDiagnostics, DqnWeights, train_dqn
from jaxmem._src.planners.protocol import Planner
from jaxmem._src.lower.backend import BACKENDS
from jaxmem._src.planners.registry import PLANNERS, get_planner
from jaxmem._src.verify.compiled import CompiledCost, CompiledMemory, compiled_cost, compiled_memory
from jaxmem._src.verify.hlo_cost import KernelCost

__all__ = [
    "Action", "ArenaStats", "BACKENDS", "Block", "BudgetError", "BudgetSpec", "Comparison", "CompiledCost", "CompiledMemory",
    "Decision", "DeviceProfile", "DqnDiagnostics", "DqnWeights", "Efficiency", "FitResult", "Fitted", "HostArena", "JaxmemError",
    "KernelCost", "MaxBatchResult", "Op", "PLANNERS", "Plan", "Planner", "PolicyExport", "Profile", "Program", "Role",
    "Schedule", "Simulation", "Target", "VarInfo", "analyze", "compare", "compiled_cost", "compiled_memory",
    "device_profile", "dsa", "fit", "format_bytes", "get_planner", "get_target", "max_batch", "native",
    "parse_budget", "plan", "policy", "residual_actions", "simulate", "train_dqn",
]

__version__ = "0.1.0"
