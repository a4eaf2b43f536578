"""Window-based out-of-core scheduling (Hayakawa et al., §3).

Hayakawa et al., *Out-of-core training for extremely large-scale neural
networks with adaptive window-based scheduling*.

The program is a sequence of functions; flattening the variables each one
uses gives the *variable sequence*. At function ``f_i`` the variables of the
next ``window`` bytes of that sequence are swapped in ahead of time, the
variables ``f_i`` used that are not in the next window are scheduled for
swap-out, and the oldest swap-outs are completed only when the device memory
budget requires it. Everything that leaves the window is swapped, not only
feature maps saved for backward (the paper's fix for skip connections).

Mapped onto a jaxmem plan: every candidate value whose next use lies more
than ``window`` bytes further along the sequence (bytes of the values the ops
in between produce) is offloaded over that gap; the asynchronous schedule
(:func:`jaxmem._src.plan.schedule.async_copies`, which follows the same section)
issues each fetch ``window`` bytes ahead of its use and completes offloads no
later than the budget allows. The paper gives no default window; its
reference implementation uses 1.5x the memory budget, and we start from the
budget and halve it while the estimate is over budget. Arguments (parameters,
optimizer state) stay on the device: jaxmem offloads only values a step makes.
"""

from __future__ import annotations

import numpy as np

from jaxmem._src.base.gc_pause import without_gc
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.devices import DeviceLike
from jaxmem._src.plan.plan import Plan
from jaxmem._src.plan.schedule import CopyMode, Window
from jaxmem._src.planners import common


@without_gc
@common.never_worse_than_none
def window_planner(program: AnalyzedProgram, budget_bytes: int, device: DeviceLike = None, *,
                   copies: CopyMode = "async", window: Window = None,
                   window_fraction: float = 1.0, tries: int = 5,
                   min_bytes: int | None = None) -> Plan:
  """Paper 001's schedule: offload what leaves a byte window, fetch a window ahead.

  Args:
    program: a :class:`jaxmem.Program`.
    budget_bytes: the device memory budget (estimated peak).
    device: device profile (only for pricing the decisions).
    window_fraction: the first window, as a fraction of ``budget_bytes``.
    copies: ``"async"`` (the paper's) or ``"sync"``.
    tries: halvings of the window while the estimate is over budget.
    min_bytes: ignore values smaller than this (default: 0.1% of the peak).
    window: the first window in bytes (an ``int``; overrides ``window_fraction``).

  Returns:
    A :class:`jaxmem.Plan` named ``window``; its ``window`` is in bytes.
  """
  if min_bytes is None:
    min_bytes = max(1, program.profile.peak_bytes // 1000)
  made = np.zeros(program.num_ops + 1, dtype=np.int64)
  for op in program.ops:
    made[op.index + 1] = sum(program.vars[o].nbytes for o in op.outputs)
  seq = np.cumsum(made)                     # bytes of the variable sequence before op i
  pricer = common.Pricer(program, device)
  gaps = common.candidate_gaps(program, min_bytes)
  window = (int(window) if isinstance(window, int) and not isinstance(window, bool)
            else max(1, int(budget_bytes * window_fraction)))
  plan = None
  for _ in range(max(1, tries)):
    chosen = [g for g in gaps if seq[g.end] - seq[g.start + 1] > window]
    decisions = [d for d in (common.offload_decision(program, g, pricer) for g in chosen) if d]
    plan = common.finish(program, decisions, budget_bytes, "window", copies=copies,
                         window=int(window))
    if plan.estimated_peak_bytes <= budget_bytes:
      break
    window //= 2
  return plan
