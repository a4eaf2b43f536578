"""``jaxmem.compare``: the estimate next to the compiled program's peak, differences explained."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

import jax

from jaxmem._src.api.program import analyze_step
from jaxmem._src.base.errors import format_bytes
from jaxmem._src.estimate import xla_model
from jaxmem._src.estimate.analysis import AnalyzedProgram
from jaxmem._src.estimate.targets import TargetLike, get_target
from jaxmem._src.estimate.lifetimes import Profile, profile_from_intervals
from jaxmem._src.ir.trace import check_array_args
from jaxmem._src.report.text import stored_broadcasts
from jaxmem._src.verify.compiled import CompiledMemory, compiled_memory


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Estimated vs compiled peak of one step.

  Attributes:
    estimated_peak_bytes: jaxmem's estimate (XLA model applied), before compiling.
    jaxpr_peak_bytes: the same without the XLA model (every jaxpr value stored).
    compiled: the compiled executable's memory (``memory_analysis()``).
    relative_error: ``estimated / compiled - 1``.
    notes: what explains the difference, largest effect first.
  """
  estimated_peak_bytes: int
  jaxpr_peak_bytes: int
  compiled: CompiledMemory
  relative_error: float
  notes: tuple[str, ...]

  def __str__(self) -> str:
    lines = [
        f"estimated peak (jaxmem):     {format_bytes(self.estimated_peak_bytes)}",
        f"compiled peak (XLA):         {self.compiled}",
        f"difference:                  {self.relative_error:+.1%}"
        f"{'  (within ±15%)' if abs(self.relative_error) <= 0.15 else '  (OUTSIDE ±15%)'}",
        f"jaxpr-only estimate:         {format_bytes(self.jaxpr_peak_bytes)} "
        "(every jaxpr value stored, no XLA model)",
        "explained by:",
    ]
    lines += [f"  - {n}" for n in self.notes]
    return "\n".join(lines)


def compare(fun: Callable[..., Any], *args: Any, verbose: bool = True,
            target: TargetLike = None) -> Comparison:
  """Compiles ``jax.jit(fun)`` and compares its peak with jaxmem's estimate.

  Args:
    fun: the step.
    *args: example arguments.
    verbose: print the comparison.
    target: the compiler compared with: ``None`` (local) or an ahead-of-time
      target such as ``"tpu:v5e"`` (the estimate is then made for it too).

  Returns:
    A :class:`Comparison`.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w))
    >>> c = jaxmem.compare(grad, jnp.ones((128, 128)), jnp.ones((1024, 128)), verbose=False)
    >>> abs(c.relative_error) < 0.15
    True
  """
  check_array_args(args, "jaxmem.compare")
  t = get_target(target)
  program = analyze_step(fun, args, target=t)
  compiled = compiled_memory(jax.jit(fun).lower(*t.place(args)).compile())
  cmp = compare_program(program, compiled)
  if verbose:
    print(cmp)
  return cmp


def compare_program(program: AnalyzedProgram, compiled: CompiledMemory) -> Comparison:
  """:func:`compare` for a traced program and its compiled memory."""
  prof = program.profile
  raw = profile_from_intervals(
      program.num_ops + 1, *zip(*[(*program.interval(v.id), v.nbytes) for v in program.vars]))
  notes = _explain(program, prof, raw.peak_bytes)
  est = prof.peak_bytes
  return Comparison(est, raw.peak_bytes, compiled, est / max(1, compiled.peak_bytes) - 1.0,
                    tuple(notes))


def _explain(program: AnalyzedProgram, prof: Profile, raw_peak: int) -> list[str]:
  notes: list[tuple[int, str]] = []
  virtual = prof.virtual if prof.virtual is not None else np.zeros(len(program.vars), bool)
  fused_bytes = sum(v.nbytes for v in program.vars if virtual[v.id])
  if fused_bytes:
    notes.append((fused_bytes, f"fusion: {int(virtual.sum())} values ({format_bytes(fused_bytes)}) "
                  "are fused into their consumers and never stored"))
  if prof.intervals is not None:
    extended = [v for v in program.vars
                if not virtual[v.id] and prof.intervals[v.id][1] > program.interval(v.id)[1]]
    at_peak = [v for v in extended if prof.intervals[v.id][0] <= prof.peak_index
               <= prof.intervals[v.id][1] and program.interval(v.id)[1] < prof.peak_index]
    if at_peak:
      b = sum(v.nbytes for v in at_peak)
      notes.append((b, f"fusion duplicates cheap ops into later consumers, so {len(at_peak)} of "
                    f"their inputs ({format_bytes(b)}) are still alive at the peak (e.g. a ReLU "
                    "mask is recomputed in the backward pass from its float input)"))
  hidden = prof.peak_bytes - sum(prof.holder_bytes)
  if hidden > 0:
    model = program.memory
    peak = prof.peak_index
    stored = [b for _, b, s, e in stored_broadcasts(program) if s <= peak <= e]
    if stored:
      notes.append((sum(stored), f"{format_bytes(sum(stored))} in {len(stored)} full-size "
                    "broadcasts read by a reduction's fusion and by another (e.g. softmax "
                    "denominators, LayerNorm scales): XLA:CPU's YNNPACK fusions cannot take "
                    "them, so one copy is stored"))
    hoisted = sum(m.hoisted for op, m in zip(program.ops, model) if op.index >= peak and m.hoisted)
    kinds = sorted({op.primitive for op, m in zip(program.ops, model)
                    if any(xla_model.hidden_bytes(op.eqn, program.backend)) or m.early})
    rest = hidden - sum(stored)
    if rest > prof.peak_bytes // 200:
      start = (f"; {format_bytes(hoisted)} of it built at the program start (index arrays, "
               "constant broadcasts for YNNPACK avg_pool fusions)" if hoisted else "")
      notes.append((rest, f"{format_bytes(rest)} of other XLA temporaries at the peak that are not "
                    f"jaxpr values (layout copies and expansions of: {', '.join(kinds) or '-'}; "
                    f"the working set inside control-flow blocks{start})"))
  if raw_peak != prof.peak_bytes:
    notes.append((0, f"net effect of the XLA model on the peak: "
                  f"{format_bytes(prof.peak_bytes - raw_peak)}"))
  notes.append((-1, "what remains is XLA's own scheduling and buffer sharing (outputs may share "
                "the temp arena; the compiled peak is argument + output + temp - alias bytes)"))
  notes.sort(key=lambda t: -t[0])
  return [n for _, n in notes]
