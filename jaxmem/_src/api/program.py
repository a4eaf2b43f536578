"""``jaxmem.analyze``: a step's lifetimes, before anything is compiled; the public ``Program``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from jaxmem._src.base.gc_pause import gc_paused
from jaxmem._src.estimate.analysis import AnalyzedProgram, analyze_program
from jaxmem._src.estimate.targets import TargetLike, get_target
from jaxmem._src.ir.program import Program as TracedProgram
from jaxmem._src.ir.trace import check_array_args, trace
from jaxmem._src.plan.plan import Plan
from jaxmem._src.report import json_doc, text
from jaxmem._src.report.html_page import html_report
from jaxmem._src.report.plot import plot_program


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, repr=False)
class Program(AnalyzedProgram):
  """The flat program of a traced step with its estimate (from :func:`jaxmem.analyze`).

  Every stage of jaxmem reads this (the planners take it, plans refer to it);
  on top of the layers' :class:`~jaxmem._src.estimate.analysis.AnalyzedProgram`
  it adds the reports: :meth:`report`, :meth:`to_json`, :meth:`plot` and
  :meth:`to_html`.

  Attributes:
    ops: the equations in program order (:class:`jaxmem.Op`).
    vars: every variable, indexed by id (:class:`jaxmem.VarInfo`).
    profile: estimated live bytes at every position (:class:`jaxmem.Profile`).
    peak_bytes: the estimated peak.
    blocks: the control-flow and remat ops (:class:`jaxmem.Block`).
    num_devices: devices a sharded step is spread over (bytes are per device).
  """

  @classmethod
  def of(cls, program: AnalyzedProgram) -> Program:
    """The public program of an analyzed one (the same data)."""
    if isinstance(program, cls):
      return program
    return cls(**{f.name: getattr(program, f.name) for f in dataclasses.fields(AnalyzedProgram)})

  def report(self, top: int = 15) -> str:
    """A table of the peak and the largest holders there, with source lines."""
    return text.program_report(self, top=top)

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable summary (schema ``jaxmem.program/1``, ``docs/json_schema.md``)."""
    return json_doc.program_json(self)

  def plot(self, path: str | os.PathLike[str], *, budget_bytes: int | None = None,
           plan: Plan | None = None, title: str | None = None) -> str:
    """PNG of live bytes over program order, stacked by role (needs matplotlib)."""
    return plot_program(self, path, budget_bytes=budget_bytes, plan=plan, title=title)

  def to_html(self, path: str | os.PathLike[str] | None = None, *,
              budget_bytes: int | None = None, plan: Plan | None = None, top: int = 30) -> str:
    """A self-contained HTML report (chart, tables by role and module, top buffers)."""
    return html_report(self, path, budget_bytes=budget_bytes, plan=plan, top=top)


def analyze_step(fun: Callable[..., Any], args: Sequence[Any], *,
                 donate_argnums: Sequence[int] = (),
                 arg_names: Sequence[str] | None = None, target: TargetLike = None) -> Program:
  """Trace and estimate: the :class:`Program` of ``fun(*args)`` for ``target``.

  Runs without the cyclic garbage collector (:mod:`~jaxmem._src.base.gc_pause`):
  ResNet-50's analysis took 0.67 s instead of 0.9-1.0 s.
  """
  with gc_paused():
    return Program.of(analyze_program(trace_for(fun, args, target, donate_argnums=donate_argnums,
                                                arg_names=arg_names)))


def trace_for(fun: Callable[..., Any], args: Sequence[Any], target: TargetLike = None, *,
              donate_argnums: Sequence[int] = (),
              arg_names: Sequence[str] | None = None) -> TracedProgram:
  """The traced program of ``fun(*args)`` with its arguments on ``target``'s devices.

  The estimate made from it models that target's compiler (its ``backend``).
  """
  t = get_target(target)
  return trace(fun, t.place(tuple(args)), donate_argnums=donate_argnums, arg_names=arg_names,
               backend=t.platform, target=t.name)


def analyze(fun: Callable[..., Any], *args: Any, donate_argnums: int | Sequence[int] = (),
            target: TargetLike = None) -> Program:
  """Traces ``fun(*args)`` and measures every variable's lifetime. Nothing is compiled.

  Args:
    fun: a step function taking pytrees of arrays.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    donate_argnums: positions of arguments donated to the step, as in
      ``jax.jit``: their buffers die at their last use instead of living
      through the step.
    target: the device the estimate is for: ``None`` (the local devices) or
      an ahead-of-time target such as ``"tpu:v5e"``
      (:func:`jaxmem.get_target`): the estimate then models that compiler.

  Returns:
    A :class:`Program`; ``.report()``, ``.peak_bytes``, ``.profile``, ``.to_json()``.

  Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> prog = jaxmem.analyze(lambda x: jnp.sin(x).sum(), jnp.ones((1024,)))
    >>> prog.peak_bytes > 0
    True
  """
  if not callable(fun):
    raise TypeError(f"`jaxmem.analyze` takes the step function first, got {type(fun).__name__}.")
  check_array_args(args, "jaxmem.analyze")
  donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
  if not all(isinstance(i, int) and -len(args) <= i < len(args) for i in donate):
    raise ValueError(f"`jaxmem.analyze`: donate_argnums={donate_argnums!r} must be positions of "
                     f"the {len(args)} arguments passed.")
  return analyze_step(fun, args, donate_argnums=tuple(i % len(args) for i in donate),
                      target=target)


__all__ = ["Program", "analyze", "analyze_step", "trace_for"]
