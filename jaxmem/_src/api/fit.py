"""``jaxmem.fit(budget)``: plan, rewrite, compile, verify, tighten.

Per input signature (static values + argument shapes/dtypes) the step is traced
once, compiled unplanned to learn its true peak, then planned and compiled until
the compiled peak is within the budget (``docs/design.md``, "Verify"): each
round lowers the planner's target by the overshoot of the previous one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem._src import _compat
from jaxmem._src.api.program import Program, analyze_step
from jaxmem._src.base import budget as budget_lib
from jaxmem._src.base.errors import BudgetError, format_bytes
from jaxmem._src.estimate.devices import DeviceLike, device_profile
from jaxmem._src.estimate.targets import Target, TargetLike, get_target
from jaxmem._src.ir.scan_remat import (MEMORY_KIND, NATIVE_STORE, RECOMPUTE, STAGE, traced_step,
                                       with_scan_residuals_recomputed)
from jaxmem._src.ir.program import Role
from jaxmem._src.ir.scan_bodies import body_function, body_scans, with_scan_bodies_replaced
from jaxmem._src.ir.trace import arg_names_of, check_array_args
from jaxmem._src.lower.backend import BackendChoice, get_backend, jit_plan, resolve_backend
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import COPY_MODES, CopyMode, Window, window_bytes
from jaxmem._src.plan.simulate import simulate
from jaxmem._src.planners.auto import auto
from jaxmem._src.planners.greedy import greedy
from jaxmem._src.planners.protocol import PlainPlanner, Planner
from jaxmem._src.planners.registry import PLANNERS, as_planner
from jaxmem._src.planners.scan_policy import scan_frontier
from jaxmem._src.planners.segments import segments
from jaxmem._src.verify.compiled import (CompiledCost, CompiledMemory, collective_buffers,
                                         compiled_cost, compiled_memory)
from jaxmem._src.verify.working_set import WorkingSet, live_at_peak, working_set_floor


@dataclasses.dataclass(frozen=True)
class FitResult:
  """The outcome of fitting one input signature.

  Attributes:
    budget_bytes: the budget in bytes (a fraction resolved against the unplanned peak).
    unplanned_peak_bytes: compiled peak of plain ``jax.jit``.
    peak_bytes: compiled peak of the fitted step (<= ``budget_bytes``).
    plan: the plan applied (no decisions when the step already fit).
    rounds: plan-compile rounds used (0 when the step already fit).
    memory: compiled memory breakdown of the fitted step.
    unplanned_memory: the same for plain ``jax.jit``.
    planning_s: seconds spent planning, rewriting and compiling.
    compiler_options: XLA options the fitted step is compiled with (empty:
      the defaults; see ``_compiler_option_sets``).
    backend: the rewrite that expressed the plan (``"ffi"``: jaxmem's own
      XLA FFI ops; ``"xla"``: optimization barriers and host memory kinds).
    target: the target whose compiled program verified the peaks
      (``"local"``: this machine's devices, ``"tpu:v5e"``: XLA:TPU ahead of time).
    platform: that compiler's backend (``cpu``, ``gpu``, ``tpu``).
    scans: how the step's scans were rewritten before planning: ``""`` (not
      rewritten), ``"recomputed by cost, N body values kept (...)"`` (each
      iteration stacks the body values a cost model ranks most worth
      keeping, the cheapest such choice whose compiled step fits:
      ``planners/scan_policy.py``), ``"recomputed, matmul outputs kept"`` or ``"recomputed"``
      (their stacked residuals recomputed per iteration in the backward scan,
      as ``nn.remat`` with ``dots_saveable`` or ``nothing_saveable`` would),
      either with ``", stacked in host memory"`` on an accelerator target
      or ``", stacked in jaxmem's host store"`` with the ``ffi`` backend
      (what the recomputation reads copied out of device memory one
      iteration at a time; ``"(N of M stacks; the others kept on the
      device)"`` when only some of them go out), or ``"staged, stacked in
      ..."`` (the residuals themselves copied out per iteration and back in
      the backward scan).
    cost: what the fitted step computes and moves in its compiled program
      (XLA's ``cost_analysis()``: FLOPs and bytes accessed), the price of the
      plan on that compiler; ``None`` where it reports none (XLA:GPU
      compiled ahead of time).
    unplanned_cost: the same for plain ``jax.jit``.
    compared: the fitting plans the kept one was chosen from, as
      ``(planner, compiled peak bytes, price in seconds)``: on a TPU target
      the whole-segment and the selective planners' plans compete, on a GPU
      target `auto`'s and the whole-segment planner's, and the one whose
      compiled program costs least is kept
      (:meth:`CompiledCost.seconds` on the device profile: XLA:TPU's counts
      on a TPU, the compiled kernels' roofline on a GPU; the simulated step
      time on the CPU). Empty when one plan fitted.
  """
  budget_bytes: int
  unplanned_peak_bytes: int
  peak_bytes: int
  plan: Plan
  rounds: int
  memory: CompiledMemory
  unplanned_memory: CompiledMemory
  planning_s: float = 0.0
  compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  backend: str = "ffi"
  target: str = "local"
  platform: str = "cpu"
  scans: str = ""
  cost: CompiledCost | None = None
  unplanned_cost: CompiledCost | None = None
  compared: tuple[tuple[str, int, float], ...] = ()

  def summary(self) -> str:
    saved = 1.0 - self.peak_bytes / max(1, self.unplanned_peak_bytes)
    return "\n".join([
        f"budget:          {format_bytes(self.budget_bytes)}",
        f"unplanned peak:  {self.unplanned_memory}",
        f"fitted peak:     {self.memory}  ({saved:.0%} less, "
        f"{'within' if self.peak_bytes <= self.budget_bytes else 'OVER'} budget)",
        f"verified on:     {self.target} ({self.platform}), plan expressed by the "
        f"{self.backend!r} backend",
        f"rounds:          {self.rounds}, planning+compile {self.planning_s:.1f} s"
        + (f"\ncompiled with:   {self.compiler_options}" if self.compiler_options else "")
        + (f"\nscans:           residuals {self.scans} per iteration" if self.scans else "")
        + (f"\ncompiled cost:   {self.cost.relative_to(self.unplanned_cost)} against jax.jit"
           + (" (the copies to jaxmem's host store are custom calls it does not count)"
              if self.backend == "ffi" and self.plan.num_offload else "")
           if self.cost is not None and self.unplanned_cost is not None else ""),
    ])


@dataclasses.dataclass(frozen=True)
class _Attempt:
  memory: CompiledMemory
  plan: Plan
  jitted: Any   # the jax.jit-wrapped step (jax's Wrapped type is private)
  compiled: jax.stages.Compiled
  options: dict[str, Any]
  limit: int | None = None   # the scheduler's limit on temporaries it was compiled with
  lowered: Any = None   # jax.stages.Lowered, compiled again when a probe compile found it
  cost: CompiledCost | None = None   # the compiled program's FLOPs and bytes
  # The fitting attempts it was chosen from (`Fitted._cheapest`; FitResult.compared).
  compared: tuple[tuple[str, int, float], ...] = ()


class _ProbeMismatch(Exception):
  """A plan's compile with the step's own options peaked above its probe compile's figure."""


def _compiler_option_sets(fallback: bool, platform: str) -> list[dict[str, Any]]:
  """XLA options tried in turn: the defaults, then (``fallback``) leaner lowerings.

  On the CPU, YNNPACK fusions (``reduce_window`` of ``avg_pool``, some
  elementwise ops) take materialized broadcasts of their constants that XLA
  hoists to the program start and keeps for the whole step (a small BatchNorm
  CNN: 10.8 MiB compiled peak with them, 6.8 MiB without). They are only turned
  off when asked for and no plan fits with them: the other kernels are slower
  and sum in another order, so results are no longer bit-identical to plain
  ``jax.jit`` (up to ~4e-8 absolute on a BatchNorm CNN's parameters, where
  the bias gradients are sums that cancel).
  """
  sets: list[dict[str, Any]] = [{}]
  if fallback and platform == "cpu":
    sets.append({"xla_cpu_experimental_ynn_fusion_type": ""})
  return sets


@dataclasses.dataclass(frozen=True)
class _Entry:
  result: FitResult
  jitted: Any   # the jax.jit-wrapped step, compiled for the target
  compiled: jax.stages.Compiled
  local: Any = None   # for an ahead-of-time target: the same step without its compiler options


class _FittedLowered:
  """``jax.stages.Lowered`` of a fitted step whose ``compile()`` is called with the step's arguments.

  The fitted program takes the dynamic arguments and a dict of keyword
  arguments (static arguments are baked in); this wrapper keeps that out of
  the user's way: ``fitted.lower(*args).compile()(*args)`` runs as it does for
  ``jax.jit``. Everything else (``as_text``, ``cost_analysis``, ...) is the
  wrapped object's.
  """

  def __init__(self, lowered: Any, fitted: Fitted):
    self._lowered, self._fitted = lowered, fitted

  def compile(self, *args: Any, **kwargs: Any) -> _FittedCompiled:
    return _FittedCompiled(self._lowered.compile(*args, **kwargs), self._fitted)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._lowered, name)


class _FittedCompiled:
  """``jax.stages.Compiled`` of a fitted step, called with the step's own arguments."""

  def __init__(self, compiled: Any, fitted: Fitted):
    self._compiled, self._fitted = compiled, fitted

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    _, dyn, _, _ = self._fitted._split(args, kwargs)
    return self._compiled(*dyn)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._compiled, name)


def _aval_key(leaf: Any) -> tuple[tuple[int, ...], str, bool]:
  aval = jax.typeof(leaf) if not isinstance(leaf, jax.ShapeDtypeStruct) else leaf
  return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


class Fitted:
  """A step fitted to a memory budget; call it like a jitted function.

  Created by :func:`fit`. Plans once per input signature and caches the
  compiled executable.
  """

  def __init__(self, fun: Callable[..., Any], spec: budget_lib.BudgetSpec, *,
               planner: str | Planner | PlainPlanner = "auto", device: DeviceLike = None,
               static_argnums: int | Sequence[int] = (),
               donate_argnums: int | Sequence[int] = (),
               max_rounds: int = 4, verbose: bool = False, compiler_fallback: bool = False,
               copies: CopyMode = "sync", window: Window = None, relax: bool = True,
               target: TargetLike = None, backend: BackendChoice = "auto"):
    if not callable(fun):
      raise TypeError(f"`jaxmem.fit(...)` decorates a callable step, got {type(fun).__name__}.")
    self.fun = fun
    self.spec = spec
    self.planner = as_planner(planner)
    self.planner_name = planner if isinstance(planner, str) else getattr(planner, "__name__", "custom")
    self.device = device
    self.static_argnums = _as_tuple(static_argnums, "static_argnums")
    self.donate_argnums = _as_tuple(donate_argnums, "donate_argnums")
    if set(self.static_argnums) & set(self.donate_argnums):
      raise ValueError("`jaxmem.fit`: an argument cannot be both static and donated "
                       f"(static_argnums={self.static_argnums}, donate_argnums={self.donate_argnums}).")
    if max_rounds < 1:
      raise ValueError(f"`max_rounds` must be >= 1, got {max_rounds}.")
    self.max_rounds = max_rounds
    self.copies, self.window = _check_copies(copies, window)
    self.verbose = verbose
    self.compiler_fallback = compiler_fallback
    self.relax = relax
    self.target: Target = get_target(target)
    self.backend = resolve_backend(backend, self.target.platform)
    if device is None and self.target.profile is not None:
      self.device = self.target.profile
    # XLA:TPU schedules host copies by its own memory model: plans for it are
    # compiled with a scheduler memory limit (`Target.memory_limit_options`),
    # and `auto` tries the planners whose plans compile best there in turn.
    # (Tried for XLA:GPU too. On an H100 a ResNet-18 step's smallest compiled
    # peak stayed at 0.93 of the unplanned one; on the `gpu:h100` target it
    # went from 0.91 to 0.94, and two MLP steps stayed at 0.93 and 0.98 either
    # way: bench/results/gpu_h100.md.)
    self.compiles_for_tpu = self.target.platform == "tpu"
    self._cache: dict[Any, _Entry] = {}
    functools.update_wrapper(self, fun)

  # -- public ---------------------------------------------------------------

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Runs the fitted step on the local devices.

    For a target compiled ahead of time (``target="tpu:v5e"``) this runs the
    same rewritten program compiled for the local backend, so its results can
    be compared with ``jax.jit`` here; the memory verified is the target's.
    """
    entry, dyn = self._entry(args, kwargs)
    if self.target.is_local:
      return entry.compiled(*dyn)
    return entry.local(*dyn)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """Lowers the fitted step for the target like ``jax.jit(f).lower``; ``.compile()`` follows.

    Takes concrete arrays or ``jax.ShapeDtypeStruct`` s; for an ahead-of-time
    target they are placed on its devices (:meth:`jaxmem.Target.place`).
    """
    entry, dyn = self._entry(args, kwargs)
    return _FittedLowered(entry.jitted.lower(*self.target.place(dyn)), self)

  def fit_result(self, *args: Any, **kwargs: Any) -> FitResult:
    """The :class:`FitResult` for these arguments (plans if needed)."""
    return self._entry(args, kwargs)[0].result

  def analyze(self, *args: Any, **kwargs: Any) -> Program:
    """The unplanned :class:`jaxmem.Program` for these arguments."""
    inner, dyn, names, _ = self._split(args, kwargs)
    return analyze_step(inner, dyn, donate_argnums=self._dyn_donate(len(args)), arg_names=names,
                        target=self.target)

  # -- internals --------------------------------------------------------------

  def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[Callable[..., Any], tuple[Any, ...], list[str], tuple[tuple[int, Any], ...]]:
    nargs = len(args)
    for i in self.static_argnums + self.donate_argnums:
      if not -nargs <= i < nargs:
        raise ValueError(f"`jaxmem.fit`: argnum {i} is out of range for a call with {nargs} "
                         "positional arguments.")
    static = {i % nargs for i in self.static_argnums}
    static_vals = tuple((i, args[i]) for i in sorted(static))
    for i, v in static_vals:
      try:
        hash(v)
      except TypeError:
        raise TypeError(f"`jaxmem.fit`: static argument {i} must be hashable, got "
                        f"{type(v).__name__}.") from None
    dyn_pos = [a for i, a in enumerate(args) if i not in static]
    check_array_args(dyn_pos + [kwargs], "jaxmem.fit", static_hint=True)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((dyn_pos, kwargs))):
      raise TypeError(
          "A `jaxmem.fit` step is planned, compiled and verified for concrete arguments: call it "
          "directly, not inside `jax.jit`, `jax.grad` or `jax.vmap` (it is compiled already). To "
          "fit a step that differentiates, put `jax.grad` inside the step.")
    fun = self.fun

    def inner(*dyn_and_kw: Any) -> Any:
      it = iter(dyn_and_kw[:-1])
      full = [args[i] if i in static else next(it) for i in range(nargs)]
      return fun(*full, **dyn_and_kw[-1])

    names = arg_names_of(fun, nargs)
    dyn_names = [n for i, n in enumerate(names) if i not in static] + ["kwargs"]
    return inner, (*dyn_pos, dict(kwargs)), dyn_names, static_vals

  def _dyn_donate(self, nargs: int) -> tuple[int, ...]:
    static = {i % nargs for i in self.static_argnums}
    donate = {i % nargs for i in self.donate_argnums}
    pos = [i for i in range(nargs) if i not in static]
    return tuple(j for j, i in enumerate(pos) if i in donate)

  def _entry(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Entry, tuple[Any, ...]]:
    inner, dyn, names, static_vals = self._split(args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    key = (static_vals, treedef, tuple(_aval_key(x) for x in leaves))
    entry = self._cache.get(key)
    if entry is None:
      try:
        entry = self._fit(inner, dyn, names, self._dyn_donate(len(args)))
      except _ProbeMismatch as e:
        # Never measured (`Target.probe_options`), but the budget is the
        # promise: search again with every compile made as it will run.
        self._log(f"{e}; searching again without probe compiles")
        entry = self._fit(inner, dyn, names, self._dyn_donate(len(args)), probing=False)
      self._cache[key] = entry
    return entry, dyn

  def _log(self, msg: str) -> None:
    if self.verbose:
      print(f"[jaxmem.fit] {msg}", file=sys.stderr, flush=True)

  def _fit(self, inner: Callable[..., Any], dyn: tuple[Any, ...], names: list[str],
           donate: tuple[int, ...], probing: bool = True) -> _Entry:
    t0 = time.perf_counter()
    self._log("tracing and compiling the unplanned step")
    target = self.target
    placed = target.place(dyn)
    # Compiles that only read a plan's memory skip what does not change it
    # (XLA:CPU's LLVM optimizations); the plan kept is compiled again as it runs.
    probe_options = target.probe_options if probing else {}
    base_jit = jax.jit(inner, donate_argnums=donate)
    base_lowered = base_jit.lower(*placed)
    base_compiled = base_lowered.compile(probe_options or None)
    base_mem = compiled_memory(base_compiled)
    budget = self.spec.resolve(base_mem.peak_bytes)
    program = analyze_step(inner, dyn, donate_argnums=donate, arg_names=names, target=target)
    where = dict(backend=self.backend, target=target.name, platform=target.platform)
    if base_mem.peak_bytes <= budget and probe_options:
      base_compiled = base_lowered.compile()
      base_mem = self._as_probed(compiled_memory(base_compiled), base_mem, budget)
    if base_mem.peak_bytes <= budget:
      plan = Plan(program, (), budget, program.peak_bytes, program.peak_bytes, "none")
      base_cost = self._compiled_cost(base_compiled)
      result = FitResult(budget, base_mem.peak_bytes, base_mem.peak_bytes, plan, 0, base_mem,
                         base_mem, time.perf_counter() - t0, **where, cost=base_cost,
                         unplanned_cost=base_cost)
      self._log(f"already fits: {base_mem} <= {format_bytes(budget)}")
      return _Entry(result, base_jit, base_compiled, base_jit)

    tried: list[_Attempt] = []
    plans: dict[tuple[int, int, int], Plan] = {}
    compiled_plans: dict[tuple[Any, ...], _Attempt] = {}
    # `auto`'s most aggressive plan (target 0) under the tightest scheduler
    # limit the target takes: an attempt that does not depend on the budget.
    # A search that fails always makes it, so its peak is reached whatever
    # budget asks for it (`floor_attempt`).
    tightest_limit = 1 if self.target.takes_memory_limit else None
    floors: list[_Attempt] = []
    # The attempts of the search under way (`search`), compiled or found again.
    searching: list[list[_Attempt]] = []
    # `worth_probing_under_floor`: the planners whose rounds ran down to their most
    # aggressive plan in some search, and the plans `out_of_reach` judged.
    completed: set[Planner | None] = set()
    judged_out: set[tuple[Any, ...]] = set()

    def compile_attempt(plan: Plan, options: dict[str, Any], limit: int | None) -> _Attempt:
      """``plan``'s step compiled as a probe (``probe_options``), appended to ``tried``."""
      jitted = jit_plan(plan, donate_argnums=donate, compiler_options=options,
                        backend=self.backend)
      lowered = jitted.lower(*placed)
      compiled = lowered.compile(probe_options or None)
      tried.append(_Attempt(compiled_memory(compiled), plan, jitted, compiled, options, limit,
                            lowered, self._compiled_cost(compiled)))
      return tried[-1]

    def plan_for(target: int, planner: Planner | None = None) -> Plan:
      """The planner's plan for ``target`` (each planned once)."""
      target = max(0, int(target))
      key = (id(program), target, id(planner))
      if key not in plans:
        plans[key] = self._plan(program, target, planner)
      return plans[key]

    def attempt(target: int, options: dict[str, Any], planner: Planner | None = None,
                limit: int | None = None) -> _Attempt:
      plan = plan_for(target, planner)
      if limit is not None:
        options = {**options, **self.target.memory_limit_options(limit, base_mem.peak_bytes)}
      # The fallback planners often return the plan `auto` already chose, and a
      # tighter target can return the same plan: compile each plan once.
      same = (id(plan.program), _plan_key(plan), repr(sorted(options.items())))
      if same in compiled_plans:
        self._log(f"target {format_bytes(target)}: same plan as an earlier round, not recompiled")
        if searching:
          searching[-1].append(compiled_plans[same])
        return compiled_plans[same]
      compile_attempt(plan, options, limit)
      self._log(f"round {len(tried)} ({plan.planner}): target {format_bytes(target)} -> estimate "
                f"{format_bytes(plan.estimated_peak_bytes)}, compiled "
                f"{format_bytes(tried[-1].memory.peak_bytes)} ({len(plan.decisions)} decisions"
                f"{', options ' + str(options) if options else ''})")
      compiled_plans[same] = tried[-1]
      if searching:
        searching[-1].append(tried[-1])
      return tried[-1]

    def floor_attempt(options: dict[str, Any], planner: Planner | None) -> _Attempt:
      floor = attempt(0, options, planner, tightest_limit)
      # `auto`'s floor is made by every search that fails, so a budget of its
      # peak reaches it. On XLA:CPU the single planners' are not
      # (`out_of_reach`, `within_reach`) and are reported only when a search
      # for their peak fits; elsewhere no planner's rounds are skipped, and
      # each planner's floor (its plan for target 0 under the tightest
      # scheduler limit, whatever the budget) is made by every search that
      # fails before it (a 12-layer MLP at 0.2 of its v5e peak: selective
      # recomputation's floor, 124.1 MiB, was checked by a search of six
      # compiles of 20 s that ended in that same compile).
      if planner is None or target.platform != "cpu":
        floors.append(floor)
      return floor

    def out_of_reach(planner: Planner, budget: int) -> bool:
      """Whether ``planner``'s plan for ``budget`` is estimated far above what this search compiled.

      Its estimate, scaled by the smallest ratio of compiled peak to estimate
      among this search's attempts and less ``OUT_OF_REACH_MARGIN``, is above
      the smallest compiled peak so far: neither fitting nor a lower floor is
      to be expected from its rounds, and they are not compiled (an unrolled
      2-layer LSTM at 0.3 of its peak: greedy's plan estimated at 48.7 MiB
      and the segment planner's at 41.8 MiB compiled to 53.4 and 46.4 MiB
      after `auto`'s compiled to 35.0 MiB, four compiles of 12 s). Only on
      XLA:CPU, the compiler the estimate is measured against
      (``bench/results/corpus.md``); elsewhere the planners' plans compile
      too differently from their estimates (a GPT on a v5e: 1.50x the
      unplanned peak under greedy-remat, 0.51x under segments-remat).
      """
      made = searching[-1] if searching else []
      if target.platform != "cpu" or not made:
        return False
      plan = plan_for(budget, planner)
      if not far_above(plan, made, "this search's", OUT_OF_REACH_MARGIN):
        return False
      judged_out.add((id(plan.program), _plan_key(plan)))
      return True

    def far_above(plan: Plan, made: Sequence[_Attempt], whose: str, margin: float) -> bool:
      """Whether ``plan``'s estimate, scaled as ``made`` compiled, is far above their lowest peak.

      The estimate times the smallest ratio of compiled peak to estimate
      among ``made``, less ``margin`` of it, is above the smallest peak
      ``made`` compiled to (``out_of_reach``, ``worth_probing_under_floor``).
      """
      ratio = min(a.memory.peak_bytes / max(1, a.plan.estimated_peak_bytes) for a in made)
      best = min(a.memory.peak_bytes for a in made)
      estimate = plan.estimated_peak_bytes
      if estimate * ratio * (1.0 - margin) <= best:
        return False
      self._log(f"{plan.planner}: estimate {format_bytes(estimate)}, compiled at {ratio:.2f}x "
                f"at best, above {whose} smallest compiled peak {format_bytes(best)}: "
                f"not compiled")
      return True

    def far_above_every_attempt(plan: Plan) -> bool:
      """``far_above`` against every attempt so far, less ``UNDER_FLOOR_MARGIN``.

      A probe under the floor (a planner's plan, or one of `auto`'s rungs)
      that is not worth its compile.
      """
      return far_above(plan, tried, "every attempt's", UNDER_FLOOR_MARGIN)

    def worth_probing_under_floor(planner: Planner | None, budget: int) -> bool:
      """Whether ``planner``'s plan for ``budget`` (just under the floor) is worth a compile.

      Not when the planner's rounds ran from the budget down to its most
      aggressive plan in some search: they compiled its plans around the
      floor already (MobileNetV2-s at 0.3: `auto`'s and greedy's plans
      under the floor compiled to 6.66 and 6.98 MiB after their rounds had
      reached 6.53 MiB). Nor when it is a plan `out_of_reach` judged far
      above what was compiled (the unrolled LSTM-s at 0.3: greedy's most
      aggressive plan, estimated at 10.8 MiB, compiled to 11.3 MiB after
      7.56 MiB).
      A planner whose rounds `within_reach` cut short, or that was never
      tried, is: the lower floors came from those (the bfloat16 LM at 0.3:
      greedy's plan, 73.32 MiB under `auto`'s 78.25; nnx/lm-m, 88.16 under
      106.08; skipgram-m at 0.5: `auto`'s own plan under the floor, 119.48
      under 123.48, although its estimate is 1.24x under what its rounds
      compiled to, so no estimate ratio separates it from MobileNetV2's).
      Nor, whatever its planner, a plan whose estimate is far above what
      was compiled at the most favourable ratio any attempt so far showed
      (``far_above_every_attempt``): the unrolled LSTM-m at
      0.3, greedy's plan estimated at 48.2 MiB compiled to 52.8 MiB after
      31.1 MiB. On the 71 `BudgetError`s of the corpus, no floor moved and
      69 of 511 compiles were not made
      (``bench/results/fit_times_under_floor_a.md``, ``_b.md``).
      """
      if planner in completed:
        return False
      plan = plan_for(budget, planner)
      if (id(plan.program), _plan_key(plan)) in judged_out:
        self._log(f"{getattr(planner, '__name__', 'auto')}: the plan judged out of reach: "
                  f"not compiled")
        return False
      return not far_above_every_attempt(plan)

    def search(budget: int, beat: int | None = None, loosen: bool = True) -> _Attempt | None:
      """Plan-compile rounds for ``budget``: the first attempt whose compiled peak fits, or ``None``.

      When `auto`'s first round and its most aggressive plan both compile far
      above the budget, or (``beat``: the smallest peak compiled before this
      search) not ``BEAT_MARGIN`` under ``beat``, no other round is compiled
      (``within_reach``). ``loosen=False``: a plan that fits is returned as
      it is (``relax`` is not tried: a search that only checks a budget is
      reached).
      """
      # Arguments and outputs are the same whatever the plan: the budget's
      # share for temporaries is what the target's scheduler may be told to
      # keep to (`Target.memory_limit_options`; XLA:TPU only). Rounds tighten
      # it down to a quarter of that share; ``None`` where the target takes no
      # limit.
      temp_share = budget - (base_mem.peak_bytes - base_mem.temp_bytes)
      first_limit = temp_share if self.target.takes_memory_limit and temp_share > 0 else None
      floor_limit = None if first_limit is None else max(1, temp_share // 4)

      def relax(found: _Attempt, options: dict[str, Any], planner: Planner | None = None) -> _Attempt:
        """Loosen a fitting plan while its compiled peak leaves a good part of the budget unused.

        Estimates are conservative on some steps (a ResNet-18 plan estimated at
        517 MiB compiled to 342 MiB): the target is raised by the unused bytes,
        and the looser plan is kept when it still fits and its simulated step
        is faster (less recomputation, fewer copies). The scheduler limit that
        fitted is kept.
        """
        if not self.relax:
          return found
        cost = simulate(found.plan, self.device).step_time_s
        for _ in range(RELAX_ROUNDS):
          unused = budget - found.memory.peak_bytes
          if not found.plan.decisions or unused < RELAX_MIN_UNUSED * budget:
            break
          loose_target = found.plan.estimated_peak_bytes + unused
          same = plan_for(loose_target, planner)
          if same.decisions == found.plan.decisions and same.pinned == found.plan.pinned:
            break          # nothing the planner would loosen: no compile for it
          looser = attempt(loose_target, options, planner, found.limit)
          if looser.memory.peak_bytes > budget:
            break
          looser_cost = simulate(looser.plan, self.device).step_time_s
          if looser_cost >= cost:
            break
          self._log(f"looser plan kept: simulated step {looser_cost / cost - 1:+.1%}")
          found, cost = looser, looser_cost
        return found

      def beyond_any_limit(last: _Attempt) -> bool:
        """Whether ``last`` compiled too far above the budget for a tighter scheduler limit to help.

        The same plan under the tightest limit compiled at best a quarter lower
        (141 -> 105 MiB, a GPT of 2 blocks on a v5e); above ``LIMIT_REACH``
        times the budget that compile is not made, and the rounds go on to
        the planner's floor (an MLP of 12 layers on a v5e at 0.2 of its peak:
        three plans at 2.1-5.0x the budget compiled to the same peak under
        both limits; one of them was not already its planner's floor).
        """
        if last.memory.peak_bytes <= LIMIT_REACH * budget:
          return False
        self._log(f"compiled {last.memory.peak_bytes / budget:.2f}x the budget: not compiled "
                  f"again under a tighter scheduler limit")
        return True

      def within_reach(first: _Attempt, options: dict[str, Any]) -> bool:
        """Whether ``first``, `auto`'s first round that missed the budget, leaves the budget in reach.

        When ``first``'s peak less ``FLOOR_REACH`` of it is still over the
        budget, `auto`'s most aggressive plan (``floor_attempt``, which a
        search that fails makes anyway) is compiled next; when the lower of
        the two compiled peaks, less ``FLOOR_REACH`` of it, is still over the
        budget, no other round of this search is expected to fit and none is
        compiled; so too when neither compiled ``BEAT_MARGIN`` under
        ``beat``, what the searches before this one reached (a rewrite of
        the step no better than what was compiled before it). Both are
        needed: the most aggressive plan may compile far above a milder one
        (a ConvNeXt at 0.3 of its peak: 98.9 MiB against the first round's
        57.4 MiB), and the first round above the floor (a
        diffusion UNet at 0.3: 45.1 MiB against 39.3 MiB). The margin is
        there because the compiled peak does not follow the planner's target
        everywhere: later rounds compiled up to 13% below the lower of the
        two in ``bench/corpus/`` (the CTC GRU with its scans recomputed:
        34.0 MiB under 38.9 MiB). Only on XLA:CPU, whose compiled peaks the
        estimate is measured against (``bench/results/corpus.md``): on a TPU
        `auto`'s whole segments are not the lowest plans of a search (an MLP
        of 12 layers at 0.2 of its v5e peak: 170.6 MiB, where selective
        recomputation's floor reached 124.1 MiB).
        """
        if target.platform != "cpu":
          return True
        near = first.memory.peak_bytes * (1.0 - FLOOR_REACH) <= budget
        beat_by = None if beat is None else beat * (1.0 - BEAT_MARGIN)
        if near and (beat_by is None or first.memory.peak_bytes < beat_by):
          return True
        floor = floor_attempt(options, None)
        lowest = min(first.memory.peak_bytes, floor.memory.peak_bytes)
        if lowest * (1.0 - FLOOR_REACH) > budget:
          self._log(f"the first and the most aggressive plans compiled to {format_bytes(lowest)} "
                    f"at best, {lowest / budget:.2f}x the budget: no other round expected to fit")
          return False
        if beat_by is not None and lowest >= beat_by:
          # A rewrite of the step (``rewrites`` in `_fit`) that starts and
          # ends no lower than what was compiled before it: its rounds in
          # between are not expected to fit where the earlier searches'
          # did not (the CTC GRU at 0.3 of its peak: the three rewrites that
          # stage the scans' stacks out started at 32.5 MiB and ended at
          # 34.4 MiB after a policy compiled to 32.55 MiB; their 15 rounds in
          # between, 50 s, reached 31.97 MiB at best, under a budget of 30.55).
          self._log(f"the first and the most aggressive plans compiled to {format_bytes(lowest)} "
                    f"at best, not {BEAT_MARGIN:.0%} under {format_bytes(beat)} compiled before: "
                    f"no other round expected to fit")
          return False
        return True

      def rounds(options: dict[str, Any], planner: Planner | None = None,
                 reach_check: bool = False) -> _Attempt | None:
        """Plan-compile rounds, tightening the target (and the scheduler limit) by the overshoot.

        With ``reach_check``, a first round that does not fit is followed by
        ``within_reach``: out of reach, the rounds end there and
        ``search`` tries no other planner (``hopeless``).
        """
        nonlocal hopeless
        target, limit = budget, first_limit
        last = None
        best, best_target = None, target
        rounds_left, bisections_left = self.max_rounds, BISECTIONS
        while rounds_left > 0:
          rounds_left -= 1
          if last is not None and limit is None:
            upcoming = plan_for(target, planner)
            if (upcoming.estimated_peak_bytes > target and upcoming.estimated_peak_bytes
                >= last.plan.estimated_peak_bytes - budget // 256):
              # The planner misses this target with a plan no tighter than
              # the last one, which did not fit: compiling it would only
              # repeat that peak (MobileNetV2 at 0.3: plans estimated at
              # 5.79 MiB for targets of 6.3 and 4.7 MiB compiled to 7.45 and
              # 7.47 MiB). With a scheduler limit the same plan may still
              # compile lower, so those rounds go on.
              self._log(f"target {format_bytes(target)}: the plan is estimated at "
                        f"{format_bytes(upcoming.estimated_peak_bytes)}, no tighter than the "
                        f"last round's: not compiled")
              break
          previous, last = last, attempt(target, options, planner, limit)
          if last.memory.peak_bytes <= budget:
            return relax(last, options, planner) if loosen else last
          if reach_check and previous is None and not within_reach(last, options):
            hopeless = True
            return None
          if best is None or last.memory.peak_bytes < best.memory.peak_bytes:
            best, best_target = last, target
          if previous is not None and last.memory.peak_bytes >= previous.memory.peak_bytes:
            # (Only when the tighter target gave a tighter plan: a planner
            # that estimates the same peak at both targets has nothing in
            # between to offer. MobileNetV2 at 0.3 of its peak: `auto`'s
            # plans were estimated at 5.79 MiB for every target under 6.3 MiB
            # and compiled to 7.45-7.47 MiB in eight bisected rounds.)
            tighter_plan = (last.plan.estimated_peak_bytes
                            < best.plan.estimated_peak_bytes - budget // 256)
            if (bisections_left > 0 and tighter_plan
                and abs(best_target - target) > budget // 32):
              # The compiled peak does not follow the planner's target: a
              # target between this one and the best so far may compile
              # lower than both (ResNet-18 for `gpu:h100`, segments: targets
              # of 0.6, 0.65 and 0.75 of the estimate compiled to 1.07, 0.78
              # and 0.86 of the unplanned peak;
              # bench/results/plan_sweep_resnet18_gpu_h100.md). These rounds
              # come on top of `max_rounds`.
              bisections_left -= 1
              rounds_left += 1
              target = (best_target + target) // 2
              last = best
              continue
            # A tighter estimate did not lower the compiled peak: what XLA holds
            # at its peak is out of this planner's reach (measured: VGG-16 at
            # batch 35 compiled to 4.04 MiB in every one of 13 rounds), unless
            # the scheduler may still be held tighter (the GPT at 0.3 of its
            # peak on a v5e: the same plan compiled to 386 MiB at 13% of the
            # HBM for temporaries).
            if limit is None or limit <= floor_limit or beyond_any_limit(last):
              break
            limit = floor_limit
            continue
          over = last.memory.peak_bytes - budget
          tighter_limit = (None if limit is None or limit <= floor_limit
                           else max(floor_limit, limit - over))
          if last.plan.estimated_peak_bytes > target:
            # The planner could not reach its own target: a tighter target will
            # not help, the tightest schedule may (a GPT of 2 blocks on a v5e:
            # the same remat plan compiled to 141 MiB with the scheduler limited
            # to 107 MiB of temporaries, to 105 MiB with 62 MiB).
            if tighter_limit is None or beyond_any_limit(last):
              break
            limit = floor_limit
            continue
          target = min(target, last.plan.estimated_peak_bytes) - over
          limit = tighter_limit if tighter_limit is not None else limit
          if target <= 0:
            break
        # The most aggressive plan this planner has, also when it could not
        # reach its last target (its estimate is not the compiled program's).
        if floor_limit != tightest_limit:
          last = attempt(0, options, planner, floor_limit)
          if last.memory.peak_bytes <= budget:
            return last
        last = floor_attempt(options, planner)
        completed.add(planner)
        return last if last.memory.peak_bytes <= budget else None

      found = None
      searching.append([])
      if budget >= _hard_floor(program, donate):
        for options in _compiler_option_sets(self.compiler_fallback, target.platform):
          hopeless = False   # set by `rounds` (`within_reach`)
          # `auto` picks by simulated time; when its plans overshoot in the
          # compiled program, its single planners get their own rounds.
          # A group's planners compete: each one's rounds run, and of the
          # plans that fit, the cheapest in the compiled program is kept.
          for group in self._planner_groups():
            fitting = []
            for planner in group:
              if hopeless:
                break
              if planner is not None and out_of_reach(planner, budget):
                continue
              made = rounds(options, planner, reach_check=planner is None)
              if made is not None:
                fitting.append(made)
            if fitting or hopeless:
              found = self._cheapest(fitting) if fitting else None
              break
          if found is not None:
            break
      else:
        # No plan can fit: the most aggressive plan of each planner gives the
        # smallest peak the error reports.
        for planner in (None, *self._fallback_planners()):
          floor_attempt({}, planner)
      searching.pop()
      return found

    # Where a scan rewrite may put what the recomputation reads: host memory
    # kinds on an accelerator's compiler (XLA:CPU erases them), our host
    # store with the `ffi` backend (not yet under a mesh: those ops would need
    # the per-device wrapping of `lower/per_device.py` inside a scan body).
    out_of_device = ""
    if self.backend == "xla" and target.platform != "cpu":
      out_of_device = MEMORY_KIND
    elif self.backend == "ffi" and program.num_devices == 1:
      out_of_device = NATIVE_STORE

    # The step's jaxpr and scan pairs (``traced_step``), traced once for every scan rewrite.
    traced = functools.cache(lambda: traced_step(inner, dyn))

    def frontier_search() -> tuple[_Attempt, Program, str] | None:
      """The cheapest per-value scan policy of ``scan_frontier`` whose compiled step fits, as it is.

      The frontier's points stack more and recompute less one after the
      other, so their compiled peaks rise: a bisection compiles a handful of
      them (``1 + log2(points)``) and keeps the last that fits, with no plan
      on top. When even the point that stacks least does not fit, the stacks
      can leave device memory (``out_of_device``): then the point whose
      recomputation and copies (out and back, unoverlapped) take least time
      on the profile is compiled with its stacks out (then the next two).
      ``None`` when none of them fits either.
      """
      closed, pairs, _ = traced()
      if not pairs:
        return None
      profile = device_profile(self.device)
      points = scan_frontier(closed.jaxpr, pairs, profile)
      temp_share = budget - (base_mem.peak_bytes - base_mem.temp_bytes)
      limit = temp_share if self.target.takes_memory_limit and temp_share > 0 else None
      options = ({} if limit is None
                 else self.target.memory_limit_options(limit, base_mem.peak_bytes))
      probed: dict[tuple[int, str, Any], _Attempt] = {}

      def probe(k: int, offload: str = "", on_device: Any = None) -> _Attempt:
        if (k, offload, on_device) not in probed:
          fun = with_scan_residuals_recomputed(inner, saved=points[k].saved, offload=offload,
                                               on_device=on_device, traced=traced())
          prog = analyze_step(fun, dyn, donate_argnums=donate, arg_names=names, target=target)
          plan = Plan(prog, (), budget, prog.peak_bytes, prog.peak_bytes, "none")
          compile_attempt(plan, options, limit)
          probed[k, offload, on_device] = tried[-1]
          where = ""
          if offload:
            where = (f", {_stacks_out(points[k], on_device)} of them out of device memory"
                     if on_device else " out of device memory")
          self._log(f"scan policy {k + 1} of {len(points)}: {points[k].num_saved} body values "
                    f"kept, stacks {format_bytes(points[k].stacked_bytes)}{where}, recomputes "
                    f"{points[k].recompute_s * 1e3:.2f} ms simulated, compiled "
                    f"{format_bytes(tried[-1].memory.peak_bytes)}")
        return probed[k, offload, on_device]

      def fits(k: int, offload: str = "", on_device: Any = None) -> bool:
        return probe(k, offload, on_device).memory.peak_bytes <= budget
      if len(points) < 2:
        return None
      # Without a scheduler limit these compiles do not depend on the budget,
      # and a budget of their peak finds them again: a `BudgetError` may
      # report them (`floors`).
      budget_free = limit is None
      offload, on_device = "", None
      if fits(0):
        lo, hi = 0, len(points) - 1   # the last point recomputes nothing: the step as written
        while hi - lo > 1:
          mid = (lo + hi) // 2
          lo, hi = (mid, hi) if fits(mid) else (lo, mid)
      else:
        if budget_free:
          floors.append(probe(0))
        if not out_of_device:
          return None
        # Off the device, the stacks no longer follow the points' order: the
        # cheapest in time are compiled in turn, each point with all of its
        # stacks out or, on one device, with only the stacks that bring it
        # under the budget out (`_partial_offloads`): kept, staged and
        # recomputed values in one plan.
        offload = out_of_device
        excess = probe(0).memory.peak_bytes - budget
        whole = sorted(((points[k].recompute_s
                         + 2 * profile.copy_seconds(points[k].stacked_bytes), k, None)
                        for k in range(len(points))), key=lambda c: c[0])[:3]
        partial = (sorted(_partial_offloads(points, excess, profile), key=lambda c: c[0])[:2]
                   if program.num_devices == 1 else [])
        candidates = sorted(whole + partial, key=lambda c: c[0])
        chosen = next(((k, d) for _, k, d in candidates if fits(k, offload, d)), None)
        if chosen is None:
          if budget_free:
            # Only whole offloads: which stacks a partial one sends out
            # follows the budget, so a budget of its peak may not find it.
            floors.extend(probe(k, offload) for _, k, _ in whole)
          return None
        lo, on_device = chosen
      found = probe(lo, offload, on_device)
      num_values = sum(len(p.residuals) for p in pairs)
      # The body's shapes are global ones under a mesh: bytes only for one device.
      stacked = (f"{format_bytes(points[lo].stacked_bytes)} stacked, "
                 if program.num_devices == 1 else "")
      how = (f"recomputed by cost, {points[lo].num_saved} body values kept ({stacked}"
             f"{num_values} residuals before){_stacked_in(offload)}")
      if on_device:
        how += f" ({_stacks_out(points[lo], on_device)} stacks; the others kept on the device)"
      return found, found.plan.program, how

    def body_search() -> tuple[_Attempt, Program, str] | None:
      """The step with the body of its largest unpaired ``scan`` planned, when that fits.

      The body (:func:`~jaxmem._src.ir.scan_bodies.body_function`) is traced
      and planned like a step for what the budget leaves it: the budget less
      what the unplanned estimate holds beside the body's own peak. Rounds
      lower the body's target by the compiled overshoot, down to its
      planner's most aggressive plan (target 0), which does not depend on
      the budget and so may be reported as a floor (``floors``).
      """
      closed, pairs, _ = traced()
      candidates = body_scans(closed.jaxpr, pairs)
      if not candidates:
        return None
      bodies = {}
      for i in candidates:
        fun, avals = body_function(closed.jaxpr.eqns[i])
        bodies[i] = (fun, avals, analyze_step(fun, avals, target=target))
      i = max(bodies, key=lambda k: bodies[k][2].peak_bytes)
      fun, avals, body = bodies[i]
      beside = max(0, unplanned_program.peak_bytes - body.peak_bytes)
      if body.peak_bytes < 0.25 * unplanned_program.peak_bytes:
        return None
      run_backend = get_backend(self.backend)
      frame = _compat.user_frame(closed.jaxpr.eqns[i])
      source = f"{frame[0]}:{frame[1]}" if frame else "?"
      made: dict[tuple[Any, ...], tuple[_Attempt, Program, Plan]] = {}
      # On a target that takes a scheduler limit (XLA:TPU), the budget's share
      # for temporaries, as for the scan policies (`frontier_search`).
      temp_share = budget - (base_mem.peak_bytes - base_mem.temp_bytes)
      limit = temp_share if self.target.takes_memory_limit and temp_share > 0 else None
      options = ({} if limit is None
                 else self.target.memory_limit_options(limit, base_mem.peak_bytes))

      def body_attempt(body_target: int) -> tuple[_Attempt, Program, Plan]:
        body_plan = self._plan(body, max(0, body_target))
        key = _plan_key(body_plan)
        if key not in made:
          run = run_backend.step_function(body_plan.schedule())
          rewritten = analyze_step(with_scan_bodies_replaced(inner, {i: run}, traced=traced()),
                                   dyn, donate_argnums=donate, arg_names=names, target=target)
          compile_attempt(Plan(rewritten, (), budget, rewritten.peak_bytes,
                               rewritten.peak_bytes, "none"), options, limit)
          made[key] = (tried[-1], rewritten, body_plan)
          self._log(f"the body of the scan at {source} planned by {body_plan.planner} for "
                    f"{format_bytes(max(0, body_target))} ({len(body_plan.decisions)} decisions, "
                    f"body estimate {format_bytes(body.peak_bytes)} -> "
                    f"{format_bytes(body_plan.estimated_peak_bytes)}): compiled "
                    f"{format_bytes(tried[-1].memory.peak_bytes)}")
        return made[key]

      def fitted(made_: tuple[_Attempt, Program, Plan]) -> tuple[_Attempt, Program, str]:
        attempt_, rewritten, body_plan = made_
        return attempt_, rewritten, (
            f"body of the `scan` at {source} planned per iteration by {body_plan.planner} "
            f"({len(body_plan.decisions)} decisions: {body_plan.num_remat} remat, "
            f"{body_plan.num_offload} offload)")

      body_target = budget - beside
      for _ in range(self.max_rounds):
        before = len(made)
        found_ = body_attempt(body_target)
        if found_[0].memory.peak_bytes <= budget:
          return fitted(found_)
        if len(made) == before or body_target <= 0:
          break          # the planner has nothing tighter to offer
        body_target -= found_[0].memory.peak_bytes - budget
      # The most aggressive body plan (target 0) does not depend on the budget
      # (where no scheduler limit follows it): a budget of its peak reaches it
      # again, so it may be reported as a floor.
      floor_ = body_attempt(0)
      if floor_[0].memory.peak_bytes <= budget:
        return fitted(floor_)
      if limit is None:
        floors.append(floor_[0])
      return None

    unplanned_program = program
    scans = ""   # how the program planned last rewrote its scans (FitResult.scans)
    found = None
    if _stacking_scans(program):
      # Per iteration, by cost, before the step as written is planned: what a
      # scanned layer stacks is where its memory is (`planners/scan_policy.py`).
      self._log("choosing what the scans stack per iteration, by cost")
      chosen = frontier_search()
      if chosen is not None:
        found, program, scans = chosen
    if found is None:
      found = search(budget)
    # When neither a per-value scan policy alone nor the step as written
    # fits: whole-step rewrites with the planners on top of them. First
    # keeping the matmul outputs, as `dots_saveable` does, then recomputing
    # everything from each iteration's inputs, as `nothing_saveable` does;
    # then with what the recomputation reads, or the residuals themselves,
    # out of device memory one slice per iteration (`out_of_device`):
    # nnx_mlp's 12 scanned layers floor at 0.73 of their peak on a v5e with
    # recomputation alone, the carries stacked (bench/results/nnx_scan.md).
    rewrites = [(True, "", RECOMPUTE), (False, "", RECOMPUTE)]
    if out_of_device:
      rewrites += [(True, out_of_device, RECOMPUTE), (False, out_of_device, STAGE),
                   (False, out_of_device, RECOMPUTE)]
    # (Only where the step has a differentiated scan: the rewrites change nothing else.)
    paired = bool(_stacking_scans(unplanned_program)) and bool(traced()[1])
    for save_dots, offload, residuals in rewrites if paired else ():
      if found is not None:
        break
      rewritten = analyze_step(
          with_scan_residuals_recomputed(inner, save_dots=save_dots, offload=offload,
                                         residuals=residuals, traced=traced()), dyn,
          donate_argnums=donate, arg_names=names, target=target)
      # The estimate counts staged slices as device bytes: an offloading
      # rewrite is judged by its compiled peak only.
      if offload or rewritten.peak_bytes < program.peak_bytes:
        how = "staged" if residuals == STAGE else "recomputed"
        how += ", matmul outputs kept" if save_dots else ""
        how += _stacked_in(offload)
        self._log(f"planning the step with its scans' residuals {how} per iteration "
                  f"(estimate {format_bytes(unplanned_program.peak_bytes)} -> "
                  f"{format_bytes(rewritten.peak_bytes)})")
        program = rewritten
        scans = how
        found = search(budget, beat=min((t.memory.peak_bytes for t in tried), default=None))
    if found is None and program.num_devices == 1:
      # A scan that runs a whole pass per iteration (gradient accumulation
      # over micro-batches): its body, planned as a program of its own.
      chosen = body_search()
      if chosen is not None:
        found, program, scans = chosen
    if found is None:
      # The smallest peak reported is one that asking for it reaches: the
      # floors are; a smaller peak some round of this search reached is
      # reported only when a search for it fits (the rounds follow the budget:
      # the scheduler limit, the targets). Measured before this check: an
      # 8-layer MLP on a v5e reported 148, 164 and 196 MiB for budgets of 0.4,
      # 0.3 and 0.2 of its peak; VGG-16 7037 MiB at 0.5 and 5668 at 0.3.
      # The check is a whole search: made only when it may lower the figure
      # by more than ``CHECK_GAIN`` (a ConvNeXt at 0.3 of its peak: six
      # compiles to check 13.68 MiB against a floor of 13.92 MiB, and the
      # check failed).
      best = min(floors, key=lambda t: t.memory.peak_bytes)
      under = (1.0 - CHECK_GAIN) * min(best.memory.peak_bytes, base_mem.peak_bytes)
      reached_before = min(tried, key=lambda t: t.memory.peak_bytes)
      if target.platform == "cpu":
        # Under the floor: the compiled peak does not fall with the target,
        # and a plan looser than every round of the search may compile lower
        # than its most aggressive one (a bfloat16 LM at 0.3 of its peak:
        # `auto`'s plans for 0.3 and for 0 compiled to 78.25 MiB, greedy's for
        # 0.47 to 73.32 MiB). Each planner's plan for a budget just under the
        # floor is compiled once (the same plan as a round's is not compiled
        # again), and the check below reports the lowest of them when a
        # search for its peak fits, or else, as before, the lowest peak the
        # searches reached, when a search for it fits (an unrolled LSTM at
        # 0.3: the search for the lower peak a plan under the floor reached
        # failed, and without this the 7.56 MiB the searches had reached was
        # reported as 9.03 MiB). Only on XLA:CPU, where `within_reach` cut
        # the search short of the fallback planners; elsewhere every
        # planner's rounds ran down to its floor.
        # Not for a planner whose rounds ran down to its most aggressive plan,
        # nor a plan `out_of_reach` judged (`worth_probing_under_floor`).
        self._log(f"each planner's plan for a budget just under the floor, "
                  f"{format_bytes(int(under))}")
        for planner in (None, *self._fallback_planners()):
          if worth_probing_under_floor(planner, int(under)):
            attempt(int(under), {}, planner)
        # `auto` picks another planner at a looser target, and that plan may
        # compile lower still (a Mamba-style step at 0.3: the floor was 49.84
        # MiB while its plan for 0.5 of the peak, another planner's, compiled
        # to 48.00 MiB): its plans for a rung below and one above are
        # compiled too, once each, unless estimated far above what was
        # compiled (`far_above_every_attempt`).
        for rung in UNDER_FLOOR_RUNGS:
          if (int(under * rung) < program.peak_bytes
              and not far_above_every_attempt(plan_for(int(under * rung)))):
            attempt(int(under * rung), {}, None)
      reached = min(tried, key=lambda t: t.memory.peak_bytes)
      for candidate in (reached,) if reached is reached_before else (reached, reached_before):
        if candidate.memory.peak_bytes >= under:
          break
        self._log(f"checking that a budget of {format_bytes(candidate.memory.peak_bytes)} "
                  f"is reached")
        if search(candidate.memory.peak_bytes, loosen=False) is not None:
          best = candidate
          break
      # A round of that check may fit the budget asked for: the compiled peak
      # does not follow the planner's target monotonically (an unrolled LSTM
      # on XLA:CPU: a target of 5.9 MiB compiled to 10.6 MiB, one of 6.7 MiB
      # to 7.6 MiB, under a budget of 10.2 MiB that the first search missed).
      fitting = [t for t in tried if t.memory.peak_bytes <= budget]
      if fitting:
        found = self._cheapest(fitting)
        self._log(f"a round of that check fits the budget: {found.memory}")
    if found is None:
      # The unplanned program is a candidate too: a budget of its own peak
      # always works ("already fits"), so no smaller-looking plan may hide it.
      smallest, holders = best.memory.peak_bytes, _holders(best.plan)
      at_floor, floor_plan, floor_lowered = best.compiled, best.plan, best.lowered
      floor_memory = best.memory
      if base_mem.peak_bytes <= smallest:
        smallest, at_floor, floor_lowered = base_mem.peak_bytes, base_compiled, base_lowered
        floor_memory = base_mem
        floor_plan = Plan(unplanned_program, (), budget, unplanned_program.peak_bytes,
                          unplanned_program.peak_bytes, "none")
        holders = _holders(floor_plan)
      if probe_options:
        # The smallest peak reported is a promise too: read from the compile as it runs.
        as_runs = compiled_memory(floor_lowered.compile()).peak_bytes
        if as_runs != smallest:
          raise _ProbeMismatch(f"compiled as it runs, the smallest step peaks at "
                               f"{format_bytes(as_runs)}, its probe compile at "
                               f"{format_bytes(smallest)}")
      floor = floor_by_kind(floor_plan, smallest)
      if not scans and any(", stacked over " in d for d, _ in holders):
        # A scan's stacked outputs are one value to the planners: all of its
        # iterations are kept, recomputed or staged together.
        hint_scan = (" Values stacked by a `scan` hold this peak; jaxmem plans each of them as a "
                     "whole, not per iteration: `jax.checkpoint` on the scan body (`nn.remat` or "
                     "`nnx.remat` on a scanned layer) keeps only the carry of each iteration.")
      else:
        hint_scan = ""
      hint = ("" if self.compiler_fallback or target.platform != "cpu" else
              " `compiler_fallback=True` would also try XLA:CPU lowerings without YNNPACK "
              "fusions (not bit-identical to jax.jit).")
      if self.backend == "xla" and target.platform == "cpu":
        hint = (" XLA:CPU erases the `xla` backend's optimization barriers and memory kinds, so "
                "its plans cannot lower a CPU peak: use `backend='ffi'` (the CPU's default) or "
                "verify on the device you train on (`target='tpu:v5e'`, or run on the GPU).")
      raise BudgetError(
          f"`jaxmem.fit`: cannot fit `{getattr(self.fun, '__name__', 'step')}` into "
          f"{format_bytes(budget)} (budget {self.spec}; unplanned compiled peak "
          f"{format_bytes(base_mem.peak_bytes)}).{hint_scan}{hint}"
          f"{_collectives_hint(program, at_floor)}",
          budget_bytes=budget, smallest_bytes=smallest, holders=holders, floor=floor,
          advice=floor_advice(floor, smallest, donated=bool(donate),
                              cpu=target.platform == "cpu",
                              fallback=self.compiler_fallback,
                              breadth_first=cpu_schedules_breadth_first(),
                              working_set=_floor_working_set(at_floor, floor_memory)),
          compiled_holders=compiled_holders(at_floor, floor_memory))
    if probe_options:
      final = found.lowered.compile()
      memory = self._as_probed(compiled_memory(final), found.memory, budget)
      found = dataclasses.replace(found, compiled=final, memory=memory)
    result = FitResult(budget, base_mem.peak_bytes, found.memory.peak_bytes, found.plan, len(tried),
                       found.memory, base_mem, time.perf_counter() - t0, found.options, **where,
                       scans=scans, cost=self._compiled_cost(found.compiled),
                       unplanned_cost=self._compiled_cost(base_compiled),
                       compared=found.compared)
    self._log(f"fitted: {found.memory} <= {format_bytes(budget)}")
    local = found.jitted
    if not target.is_local:
      # The target's compiler options (XLA:TPU's scheduler limit) mean nothing
      # to the local compiler, which rejects unknown options.
      local = jit_plan(found.plan, donate_argnums=donate, backend=self.backend)
    return _Entry(result, found.jitted, found.compiled, local)

  def _as_probed(self, memory: CompiledMemory, probed: CompiledMemory, budget: int
                 ) -> CompiledMemory:
    """The memory of a compile with the step's options, checked against its probe compile's."""
    if memory.peak_bytes != probed.peak_bytes:
      self._log(f"compiled as it runs: {memory}, probe compile: {probed}")
      if memory.peak_bytes > budget:
        raise _ProbeMismatch(f"compiled as it runs, the step peaks at "
                             f"{format_bytes(memory.peak_bytes)}, above the budget of "
                             f"{format_bytes(budget)} its probe compile met")
    return memory

  def _planner_groups(self) -> tuple[tuple[Planner | None, ...], ...]:
    """The planners ``fit`` runs rounds for, in groups tried in turn (``None``: :attr:`planner`).

    Within a group every planner's rounds run and the fitting plan that costs
    least in the compiled program is kept (:meth:`_cheapest`). On a TPU
    target `auto`'s plans are the whole-segment planner's
    (:meth:`_plan`), and selective recomputation competes with them: it
    recomputes the cheap values of every block (softmax, norms, activations)
    where the segments recompute whole blocks, and which costs less is not
    known before both are compiled (the GPT of the examples at batch 128 and
    0.69 of its v5e peak: the segments' plan compiled to 0.63 of ``jax.jit``'s
    peak at 1.12x its FLOPs and 1.05x its bytes, the selective one, kept now,
    to 0.64 at 1.12x and 0.90x; ``bench/results/tpu.md``). On a GPU target
    (the ``xla`` backend) `auto`'s plans compete with whole segments', ranked
    by the compiled kernels' roofline.
    """
    first: tuple[Planner | None, ...] = (None,)
    if self.planner is auto and self.compiles_for_tpu:
      first = (None, PLANNERS["selective"])
    elif self.planner is auto and self.backend == "xla" and self.target.platform == "gpu":
      # The simulated time ranks `auto`'s plans; XLA:GPU's compiled kernels
      # rank them otherwise (bench/results/gpu_cost.md): on the GPT at 0.63
      # of its `gpu:h100` peak, `auto`'s plan compiled to 0.57 of the peak
      # at 1.31x `jax.jit`'s roofline time, whole segments to 0.57 at 1.19x;
      # on ResNet-50 at 0.5 `auto`'s, 1.18x, against whole segments' 1.21x.
      first = (None, segments)
    return (first, *((p,) for p in self._fallback_planners()))

  def _cheapest(self, attempts: list[_Attempt]) -> _Attempt:
    """The attempt whose compiled program costs least, with what it was compared with.

    On a TPU target the price is XLA:TPU's own FLOPs and bytes on the device
    profile (:meth:`CompiledCost.seconds`); on a GPU (the ``xla`` backend) the
    roofline of the compiled program's kernels, read from its HLO
    (:meth:`_compiled_cost`); on the CPU the simulated step time (the
    ``ffi`` backend's copies to jaxmem's host store are custom calls no
    compiled count sees). The comparison (``_Attempt.compared``, then
    ``FitResult.compared``) is empty for a single attempt.
    """
    if len(attempts) == 1:
      return attempts[0]
    profile = device_profile(self.device)
    if self._prices_compiled and all(a.cost is not None for a in attempts):
      prices = [a.cost.seconds(profile, a.memory.host_temp_bytes) for a in attempts]
      how = ("compiled kernels' roofline" if attempts[0].cost.kernels
             else "compiled FLOPs and bytes")
    else:
      prices = [simulate(a.plan, profile).step_time_s for a in attempts]
      how = "simulated step time"
    k = min(range(len(prices)), key=prices.__getitem__)
    self._log("fitting plans, " + how + ": " + ", ".join(
        f"{a.plan.planner} {s * 1e3:.2f} ms" for a, s in zip(attempts, prices))
        + f"; kept {attempts[k].plan.planner}")
    return dataclasses.replace(attempts[k], compared=tuple(
        (a.plan.planner, a.memory.peak_bytes, s) for a, s in zip(attempts, prices)))

  @property
  def _prices_compiled(self) -> bool:
    """Whether fitting plans are ranked by their compiled program's cost (:meth:`_cheapest`)."""
    return self.compiles_for_tpu or (self.backend == "xla" and self.target.platform == "gpu")

  def _compiled_cost(self, compiled: Any) -> CompiledCost | None:
    """What ``compiled`` computes and moves; on a GPU read kernel by kernel from its HLO.

    XLA:GPU compiled ahead of time has no cost analysis, and where it has
    one it counts a loop body once: the kernels' roofline
    (:func:`~jaxmem._src.verify.hlo_cost.hlo_kernels`) is what ranks plans
    there (``bench/results/gpu_cost.md``).
    """
    return compiled_cost(compiled, from_hlo=True if self.target.platform == "gpu" else None)

  def _fallback_planners(self) -> tuple[Planner, ...]:
    """``auto``'s single planners, tried in turn when ``auto``'s plans overshoot when compiled."""
    if self.planner is not auto:
      return ()
    if self.compiles_for_tpu:
      return (PLANNERS["segments-modules-offload"], greedy)
    if self.backend == "xla" and self.target.platform == "gpu":
      # XLA:GPU runs the readers of fetched values late (docs/design.md,
      # "Two XLA:GPU behaviours"): an MLP's offload plans compile above its
      # unplanned peak, so recomputation alone is tried last.
      return (greedy, segments, PLANNERS["segments-remat"])
    return (greedy, segments)

  def _plan(self, program: Program, target: int, planner: Planner | None = None) -> Plan:
    """The planner's plan for ``target``, with this step's copy mode."""
    use = self.planner if planner is None else planner
    if use is auto and self.compiles_for_tpu:
      # The estimate models XLA:TPU's fusion only in part (which convolution
      # inputs it stores is not known), so `auto`'s ranking by simulated time
      # does not carry over; whole segments first, their
      # checkpoints staged to host when recomputing them all is not enough
      # (single-value chains cut through XLA:TPU's fusions: a GPT of 2 blocks
      # at batch 64 compiled to 1.50x the unplanned peak under greedy-remat's
      # most aggressive plan, 0.51x under segments-remat's).
      use = PLANNERS["segments-offload"]
    # `auto` without its reverse delete (planners/prune.py): it spends the
    # estimate's slack under the target, which the search's rounds use to
    # absorb the estimate's errors. Measured on the unrolled LSTM of issue
    # 14's corpus at 0.3: 62 -> 90 s and a smallest reachable peak of
    # 31.1 -> 32.4 MiB with it.
    options = {"prune_estimates": 0} if use is auto else {}
    return use(program, target, self.device, copies=self.copies, window=self.window, **options)


# Rounds that bisect between the best target so far and a tighter one that
# compiled higher (`rounds` in `Fitted._fit`), on top of `max_rounds`.
BISECTIONS = 2

# `out_of_reach` in `Fitted._fit`: how far below its scaled estimate a single
# planner's plan may still compile before its rounds are skipped.
OUT_OF_REACH_MARGIN = 0.15

# `worth_probing_under_floor` in `Fitted._fit`: the same margin for the plans
# probed under a failed search's floor, scaled as every attempt so far compiled
# (1.0 probes them all).
UNDER_FLOOR_MARGIN = OUT_OF_REACH_MARGIN

# `within_reach` in `Fitted._fit`: how far above the budget `auto`'s most
# aggressive plan may compile (as a share of its peak) with rounds still made.
# Rounds have compiled up to 12-13% below that plan (a soft actor-critic
# update at 0.3 of its peak: 42.6 MiB under a floor of 48.6 MiB; a CTC GRU
# with its scans recomputed: 34.0 under 38.9 MiB).
FLOOR_REACH = 0.2

# `within_reach` with ``beat``: how much lower than what the searches before
# it compiled a rewrite of the step must start or end for its rounds to be
# made (the CTC GRU at 0.3 of its peak: its third out-of-device rewrite
# started at 32.53 MiB after 32.55 MiB, and its seven rounds reached 31.97).
BEAT_MARGIN = 0.01

# `beyond_any_limit`: above this multiple of the budget, a plan is not compiled
# again under a tighter scheduler limit (XLA:TPU).
LIMIT_REACH = 1.5

# A `BudgetError`'s smallest peak: a peak some round reached is checked by a
# search for it (and reported when reached) only when it is lower than the
# floors' by more than this share.
CHECK_GAIN = 0.03

# A failed search on XLA:CPU also compiles `auto`'s plans for these multiples
# of the target just under its floor: the planner `auto` picks, and the peak
# its plan compiles to, do not follow the target monotonically.
UNDER_FLOOR_RUNGS = (0.85, 1.25)

# `relax`: looser plans tried after a fit, and the unused share of the budget
# (of its compiled peak) below which the fitting plan is kept as it is.
RELAX_ROUNDS = 2
RELAX_MIN_UNUSED = 0.1


def _plan_key(plan: Plan) -> tuple[Any, ...]:
  """What makes two plans rewrite a step into the same program."""
  return (tuple((d.var, d.action, d.start, d.end, d.recompute) for d in plan.decisions),
          tuple(plan.pinned), plan.copies, plan.window)


def _as_tuple(x: int | Sequence[int], name: str) -> tuple[int, ...]:
  if isinstance(x, int):
    return (x,)
  try:
    out = tuple(x)
  except TypeError:
    raise TypeError(f"`{name}` must be an int or a sequence of ints, got {x!r}.") from None
  if not all(isinstance(i, int) for i in out):
    raise TypeError(f"`{name}` must be an int or a sequence of ints, got {x!r}.")
  return out


def _check_copies(copies: CopyMode, window: Window) -> tuple[CopyMode, Window]:
  if copies not in COPY_MODES:
    raise ValueError(f"`copies` must be one of {COPY_MODES}, got {copies!r}.")
  if window is not None:
    window_bytes(window, 1)   # raises a ValueError that says what a window is
  return copies, window


def _hard_floor(program: Program, donate: tuple[int, ...]) -> int:
  """Bytes no plan can remove: the arguments, plus the outputs when nothing is donated."""
  args = sum(program.vars[v].nbytes for v in set(program.invars))
  outs = sum(program.vars[v].nbytes for v in {x for x in program.outvars if isinstance(x, int)}
             if not program.vars[v].is_input)
  return args + (0 if donate else outs)


#: Kinds of :func:`floor_by_kind`, per role of a program value.
_ROLE_KINDS = {
    Role.PARAMETER: "parameters", Role.OPTIMIZER_STATE: "optimizer state",
    Role.INPUT: "step inputs (batch, labels, keys)", Role.CONSTANT: "constants",
    Role.ACTIVATION: "activations kept for the backward pass",
    Role.GRADIENT: "gradients and other backward values", Role.TEMPORARY: "temporaries",
    Role.OUTPUT: "outputs (new state, loss)"}
_ARGUMENT_KINDS = frozenset({"parameters", "optimizer state", "step inputs (batch, labels, keys)",
                             "constants"})
#: The prefix of XLA's own buffers' kinds (`Profile.hidden_at_peak`).
_XLA = "XLA: "
#: The kind of the compiled peak's bytes jaxmem's estimate of the plan misses.
UNMODELLED = "XLA buffers beyond jaxmem's estimate"


def floor_by_kind(plan: Plan, compiled_peak: int) -> tuple[tuple[str, int], ...]:
  """What holds ``plan``'s peak, by kind, largest first (``BudgetError.floor``).

  The plan's estimate at its peak, its values grouped by role (values a
  ``scan`` stacks apart), XLA's buffers that are no value of the program by
  kind, and what the compiled peak holds beyond the estimate.
  """
  sched = plan.schedule()
  prof = sched.profile()
  scans = _stacking_scans(plan.program)
  kinds: dict[str, int] = {}
  for vid, nbytes in zip(prof.holders, prof.holder_bytes):
    var = sched.value_var[vid]
    if var is None:
      kind = "buffers of the plan's copies"
    else:
      v = plan.program.vars[var]
      kind = ("values stacked by scans" if v.defined_by in scans and not v.is_output
              else _ROLE_KINDS.get(v.role, "temporaries"))
    kinds[kind] = kinds.get(kind, 0) + nbytes
  body = _body_at_peak(plan, sched, prof)
  for kind, nbytes in prof.hidden_at_peak:
    if body and kind == "working buffers of single ops":
      # A loop's or a branch's working set is charged to it as one op's:
      # say which body it is (gradient accumulation over micro-batches in
      # a `scan`: the whole forward and backward pass of one micro-batch).
      kinds[body] = nbytes
    else:
      kinds[_XLA + kind] = nbytes
  missed = compiled_peak - prof.peak_bytes
  if missed > 0:
    kinds[UNMODELLED] = missed
  return tuple(sorted(((k, b) for k, b in kinds.items() if b), key=lambda kb: -kb[1]))


#: The start of :func:`floor_by_kind`'s kind for the working set of a body at the peak.
BODY_KIND = "inside the body of "


def _body_at_peak(plan: Plan, sched: Any, prof: Any) -> str:
  """The kind naming the ``scan``/``while``/``cond`` body that runs at the peak, or ``""``."""
  if not 0 <= prof.peak_index < len(sched.steps):
    return ""
  step = sched.steps[prof.peak_index]
  if step.op is None:
    return ""
  op = plan.program.ops[step.op]
  if not op.has_body or op.primitive not in ("scan", "while", "cond"):
    return ""
  return f"{BODY_KIND}the `{op.primitive}` at {op.source} (its working set)"


#: XLA:CPU's scheduler option: on (the default), independent work runs breadth-first.
CPU_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"


def cpu_schedules_breadth_first() -> bool:
  """Whether XLA:CPU here schedules breadth-first: its default, unless ``XLA_FLAGS`` says no.

  The option is read from ``XLA_FLAGS`` only: a compile option of that name is
  accepted and ignored (``bench/xla_cpu_scheduler.py``), so a fit cannot ask for
  the memory scheduler itself.
  """
  flags = os.environ.get("XLA_FLAGS", "").split()
  return not any(f.replace("-", "_").lstrip("_").startswith(CPU_SCHEDULER_FLAG)
                 and f.rsplit("=", 1)[-1].lower() in ("false", "0") for f in flags)


def _floor_working_set(compiled: Any, memory: CompiledMemory) -> WorkingSet | None:
  """The instruction whose operands and result, with the arguments and outputs, make the floor."""
  try:
    text = compiled.as_text()
  except (AttributeError, NotImplementedError, RuntimeError):   # no HLO text on this backend
    return None
  if not text:
    return None
  try:
    return working_set_floor(text, memory.peak_bytes - memory.temp_bytes, memory.peak_bytes)
  except ValueError:                                             # no ENTRY computation
    return None


def compiled_holders(compiled: Any, memory: CompiledMemory,
                     top: int = 8) -> list[tuple[str, int]]:
  """The largest temporaries live at ``compiled``'s peak, read from its schedule.

  ``(description, bytes)``: ``f32[8,512,512] `wrapped_broadcast.5` (jvp(PointNet)/LayerNorm_2/mul)``.
  Empty when the program has no HLO text, or when the temporaries live at
  once in its schedule differ from its compiled temporaries
  (``memory.temp_bytes``) by more than a tenth: the heap's layout, or
  loop bodies this reading leaves out, hold the rest, and a list that
  explains less would mislead.
  """
  try:
    text = compiled.as_text()
    peak = live_at_peak(text) if text else None
  except (AttributeError, NotImplementedError, RuntimeError, ValueError):
    return []
  if peak is None or abs(peak.live_bytes - memory.temp_bytes) > 0.1 * memory.temp_bytes:
    return []
  out = []
  for b in peak.buffers[:top]:
    made = f" ({b.op_name})" if b.op_name else ""
    out.append((f"{b.shape} `{b.instruction}`{made}", b.nbytes))
  return out


def floor_advice(floor: Sequence[tuple[str, int]], smallest: int, *, donated: bool, cpu: bool,
                 fallback: bool, breadth_first: bool = False,
                 working_set: WorkingSet | None = None) -> str:
  """What would lower a floor of :func:`floor_by_kind`, from its largest kinds.

  ``breadth_first``: XLA:CPU schedules the step with its default,
  concurrency-optimized scheduler (:func:`cpu_schedules_breadth_first`).
  ``working_set``: the floor program's instruction whose operands and
  result, with the step's arguments and outputs, hold most of the floor
  (:func:`~jaxmem._src.verify.working_set.working_set_floor`).
  """
  total = max(1, sum(b for _, b in floor if b > 0))
  share = dict(floor)

  def part(kinds: Sequence[str]) -> float:
    return sum(max(0, share.get(k, 0)) for k in kinds) / total

  out = [f"Pass a budget of at least {format_bytes(smallest)} to `jaxmem.fit`, or lower the floor:"]
  args = part(sorted(_ARGUMENT_KINDS))
  if args >= 0.25:
    out.append(f"the step's arguments hold {args:.0%} of it and live through the whole step, "
               "so no plan moves them: shard them over a mesh, or train a smaller model or "
               "batch.")
  updates = part(["outputs (new state, loss)", "gradients and other backward values"])
  if updates >= 0.2 and not donated:
    out.append(f"new state and gradients hold {updates:.0%}: donate the state "
               "(`donate_argnums`) so XLA writes the update into its buffers.")
  if working_set is not None:
    what = f" (`{working_set.op_name}`)" if working_set.op_name else ""
    out.append(f"one instruction holds it: `{working_set.instruction}`{what} reads "
               f"{format_bytes(working_set.read_bytes)} and writes "
               f"{format_bytes(working_set.written_bytes)} at once, and with the step's "
               "arguments and outputs that is nearly all of the floor. No keep, recompute or offload "
               "decision splits one instruction: a smaller batch, the step over micro-batches, "
               "or that computation split into parts lowers it.")
  kept = part(["activations kept for the backward pass", "temporaries"])
  if kept >= 0.25 and working_set is None:
    out.append(f"activations and temporaries hold {kept:.0%}, more than the plans tried could "
               "drop: they scale with the batch (a smaller one, or the step over "
               "micro-batches).")
  if part(["values stacked by scans"]) >= 0.1:
    out.append("values a `scan` stacks hold "
               f"{part(['values stacked by scans']):.0%}: `jax.checkpoint` on the scan body "
               "keeps only each iteration's carry.")
  body = part([k for k, _ in floor if k.startswith(BODY_KIND)])
  if body >= 0.25:
    out.append(f"the working set of a loop body holds {body:.0%}: what one iteration holds at "
               "once (with gradient accumulation, one micro-batch's activations, which jaxmem "
               "plans as a step of its own where what is around the loop leaves room); less "
               "work per iteration (smaller micro-batches) lowers it.")
  xla = part([k for k, _ in floor if k.startswith(_XLA) or k == UNMODELLED])
  if xla >= 0.1:
    hint = " (see `compiler_fallback=True` above)" if cpu and not fallback else ""
    out.append(f"XLA's own buffers hold {xla:.0%}{hint}.")
  if cpu and breadth_first and kept + xla >= 0.25 and working_set is None:
    out.append("XLA:CPU runs independent work breadth-first by default, which holds more at "
               f"once: starting Python with `XLA_FLAGS=--{CPU_SCHEDULER_FLAG}=false` compiles "
               "with its memory scheduler instead, often to a much lower peak (jaxmem cannot "
               "choose it per step; bench/results/xla_cpu_scheduler.md).")
  if len(out) == 1:
    out.append("reduce the batch size, or donate arguments (`donate_argnums`).")
  return " ".join(out[:1]) + "\n  - " + "\n  - ".join(out[1:])


def _holders(plan: Plan, top: int = 8) -> list[tuple[str, int]]:
  sched = plan.schedule()
  prof = sched.profile()
  scans = _stacking_scans(plan.program)
  out = []
  for vid, nbytes in zip(prof.holders[:top], prof.holder_bytes[:top]):
    var = sched.value_var[vid]
    if var is None:
      out.append(("copy handle", nbytes))
      continue
    v = plan.program.vars[var]
    desc = f"{v.type_str} {v.role.value} {v.name} ({v.source})"
    if v.defined_by in scans and not v.is_output:
      desc += f", stacked over {scans[v.defined_by]}"
    out.append((desc, nbytes))
  return out


def _collectives_hint(program: Program, compiled: Any) -> str:
  """For a step under a mesh: the largest buffers XLA's collectives hold in ``compiled``.

  Gathered FSDP weights and all-reduced gradients are the partitioner's,
  not jaxpr values: no plan moves them, and the estimate's holders do not list them.
  """
  if program.num_devices <= 1:
    return ""
  try:
    found = collective_buffers(compiled)
  except Exception:  # noqa: BLE001 (a backend whose compiled text cannot be read)
    return ""
  if not found:
    return ""
  total = sum(c.nbytes * c.count for c in found)
  listed = "; ".join(str(c) for c in found[:4])
  return (f" Under the {program.num_devices}-device mesh XLA's collectives hold buffers no plan "
          f"moves ({format_bytes(total)} of results in all; whether they are live at the peak "
          f"is XLA's schedule): {listed}. Sharding what they gather or reduce more finely "
          "(FSDP over more devices, a reduce-scatter instead of an all-reduce) lowers them.")


def _stacked_in(offload: str) -> str:
  """What ``FitResult.scans`` adds for where a scan rewrite stacks out of device memory."""
  if not offload:
    return ""
  return ", stacked in host memory" if offload == MEMORY_KIND else ", stacked in jaxmem's host store"


def _stacks_out(point: Any, on_device: Any) -> str:
  """``"N of M"``: how many of ``point``'s stacks leave device memory when ``on_device`` stay."""
  total = sum(len(st) for st in point.stacks)
  kept = sum(1 for st, keep in zip(point.stacks, on_device) for sid, _ in st if sid in keep)
  return f"{total - kept} of {total}"


def _partial_offloads(points: Sequence[Any], excess: int, profile: Any
                      ) -> list[tuple[float, int, tuple[tuple[Any, ...], ...]]]:
  """Per frontier point, the cheapest set of its stacks to send out of device memory.

  ``excess``: how far the compiled peak of the point that stacks least (all
  on the device) is over the budget; point ``k`` is that much over plus what
  it stacks beyond it. The stacks sent out must cover that, with a tenth to
  spare for what the estimate misses; the fewest bytes that do (exactly for
  up to 12 stacks, largest first beyond) are moved. Returns ``(recompute +
  copy seconds, point, stacks kept on the device per pair)``, only where
  some stacks stay on the device (all of them out is the whole offload).
  """
  out = []
  for k, pt in enumerate(points):
    need = int(1.1 * (excess + pt.stacked_bytes - points[0].stacked_bytes))
    stacks = [(b, p, sid) for p, st in enumerate(pt.stacks) for sid, b in st]
    if need <= 0 or not stacks or sum(b for b, _, _ in stacks) < need:
      continue
    if len(stacks) <= 12:
      best = None
      for mask in range(1, 2 ** len(stacks)):
        moved = sum(b for i, (b, _, _) in enumerate(stacks) if mask >> i & 1)
        if moved >= need and (best is None or moved < best[0]):
          best = (moved, mask)
      moved, mask = best  # type: ignore[misc]
      sent = {(p, sid) for i, (_, p, sid) in enumerate(stacks) if mask >> i & 1}
    else:
      sent, moved = set(), 0
      for b, p, sid in sorted(stacks, key=lambda t: -t[0]):
        if moved >= need:
          break
        sent.add((p, sid))
        moved += b
    if len(sent) == len(stacks):
      continue
    keep = tuple(tuple(sid for sid, _ in st if (p, sid) not in sent)
                 for p, st in enumerate(pt.stacks))
    out.append((pt.recompute_s + 2 * profile.copy_seconds(moved), k, keep))
  return out


def _stacking_scans(program: Program) -> dict[int, str]:
  """``{op index: "N iterations by the `scan` at SOURCE"}`` for the program's top-level scans."""
  return {b.op_index: f"{b.length} iterations by the `scan` at {b.source}"
          for b in program.blocks if b.depth == 0 and b.primitive == "scan"}


def fit(budget: budget_lib.Budget, *, planner: str | Planner | PlainPlanner = "auto",
        device: DeviceLike = None, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (), max_rounds: int = 4, verbose: bool = False,
        compiler_fallback: bool = False, copies: CopyMode = "sync", window: Window = None,
        relax: bool = True, target: TargetLike = None,
        backend: BackendChoice = "auto") -> Callable[[Callable[..., Any]], Fitted]:
  """Decorator: make a step's compiled peak fit ``budget``.

  Args:
    budget: int bytes, a string with units (``"12GiB"``, ``"800MB"``) or a
      float in (0, 1]: the fraction of the unplanned step's compiled peak.
      Per device; covers arguments, outputs and temporaries.
    planner: planner name (``"auto"``, ``"greedy"``) or a callable
      ``planner(program, budget_bytes, device) -> Plan`` (its plan's copies
      are then scheduled as ``copies`` and ``window`` say). When ``auto``'s
      plans overshoot once compiled, single planners get rounds of their
      own: ``greedy`` and ``segments``, then on a GPU with the ``xla``
      backend recomputation alone (``segments-remat``); on TPU targets
      segments with their checkpoints staged to host first.
    device: device profile used to price remat against offload.
    static_argnums, donate_argnums: as in ``jax.jit``.
    max_rounds: plan-compile rounds before giving up.
    verbose: print progress to stderr.
    compiler_fallback: when no plan fits with XLA's default options, also try
      leaner lowerings (on the CPU: without YNNPACK fusions). Results then
      differ from plain ``jax.jit`` in the last bits; off by default.
    copies: ``"sync"`` (default): each offload/fetch is one custom call that
      copies while computation waits. ``"async"``: a start and a done per copy
      (a worker thread on the CPU, copy streams on CUDA builds); the copy
      overlaps the computation between them, and the window costs memory
      that the planner keeps within the budget (Hayakawa et al. §3). The copies
      are exact: the same plan gives the same values either way (up to the
      last-bit fusion differences any custom call boundary can cause).
      ``"sync"`` stays the default because on a CPU whose cores all compute,
      the worker only competes with the computation; with a core of its own
      (``taskset`` plus ``JAXMEM_COPY_CPUS``, as a GPU's copy engines are
      separate hardware) it overlaps (``bench/overlap.py`` measures both; its
      figures are in ``bench/results/overlap.md``).
    window: how far apart an asynchronous copy's start and done may be:
      ``int`` bytes computed in between (Hayakawa et al.'s schedule-window), or a
      ``float`` multiple of the bytes the copy moves; default 1.0.
    relax: when a fitting plan's compiled peak leaves at least 10% of the
      budget unused, try up to two looser plans (the target raised by the
      unused bytes) and keep one that still fits with a faster simulated
      step. Costs a compile each; ``False`` keeps the first plan that fits.
    target: the device whose compiled program must fit the budget: ``None``
      (the local devices) or a target compiled ahead of time on this machine,
      such as ``"tpu:v5e"`` (see :func:`jaxmem.get_target`; needs
      ``pip install "jax[tpu]"``). Fractions then refer to the target's
      unplanned compiled peak, the default ``device`` profile is the
      target's, and ``fitted(*args)`` runs the same rewritten program on the
      local devices.
    backend: how the plan is expressed: ``"ffi"`` (jaxmem's own XLA FFI
      fences and host copies; the CPU, and GPUs with jaxmem's CUDA handlers),
      ``"xla"`` (``optimization_barrier`` fences and host memory kinds, which
      XLA:TPU and XLA:GPU honour) or ``"auto"``: ``xla`` for TPU targets and
      for GPUs without jaxmem's CUDA handlers, ``ffi`` on the CPU.

  Returns:
    A decorator producing a :class:`Fitted` step.

  Raises:
    jaxmem.BudgetError: on the first call, when the budget cannot be reached.

  Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> @jaxmem.fit(1.0)
    ... def step(x):
    ...   return jnp.tanh(x).sum()
    >>> float(step(jnp.zeros(8)))
    0.0
  """
  if callable(budget) and not isinstance(budget, (int, float, str)):
    raise TypeError("`jaxmem.fit` takes a budget first: write `@jaxmem.fit(\"12GiB\")` or "
                    "`jaxmem.fit(0.5)(step)`, not `@jaxmem.fit`.")
  spec = budget_lib.parse_budget(budget)
  as_planner(planner)
  _check_copies(copies, window)
  resolve_backend(backend, get_target(target).platform)

  def deco(fun: Callable[..., Any]) -> Fitted:
    return Fitted(fun, spec, planner=planner, device=device, static_argnums=static_argnums,
                  donate_argnums=donate_argnums, max_rounds=max_rounds, verbose=verbose,
                  compiler_fallback=compiler_fallback, copies=copies, window=window,
                  relax=relax, target=target, backend=backend)

  return deco
