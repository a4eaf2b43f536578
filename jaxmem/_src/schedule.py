"""Schedule: a program with a plan applied, as a flat list of steps.

The planner prices a schedule with the same lifetime rule as the report, and
the rewrite executes exactly this list, so the estimate describes the program
that is compiled.

Placement (DESIGN.md, "Plan"): an offload is issued right after the last use
before the gap; its fetch, and a remat's fences and recomputation, are issued
just before the next use. Fetches and fences take a ``dep`` operand — the most
recently produced input of that next use — so XLA can neither hoist them (nor
CSE a recomputation with the forward pass) above the point where they are needed.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

from jaxmem._src import lifetimes
from jaxmem._src.plan import Action, Decision

HANDLE_BYTES = 8
# Ops computed from literals only that are at least this large get their
# literals fenced (see Step.literal_dep): XLA would hoist or CSE them.
DECORRELATE_MIN_BYTES = 64 * 1024


class StepKind(str, enum.Enum):
  COMPUTE = "compute"
  OFFLOAD = "offload"
  FETCH = "fetch"
  FENCE = "fence"
  PIN = "pin"


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of a schedule.

  Attributes:
    kind: compute / offload / fetch / fence / pin (a fence right after the
      definition that makes XLA materialize this value instead of fusing its
      producer into later consumers; see :func:`build_schedule`).
    anchor: position in the original program (half positions for inserted steps).
    inputs: value ids (or literals) read.
    outputs: value ids written.
    op: for compute steps, the original op index.
    var: the original variable moved, fenced or restored.
    recompute: a remat re-execution of ``op``.
    literal_dep: for a compute step of a large op computed from literals only
      (a zeros broadcast, an iota), a value its literal operands are fenced
      after. XLA would otherwise hoist it to the program start, or CSE it with
      an identical op far earlier, and keep the buffer alive until this use.
  """
  kind: StepKind
  anchor: float
  inputs: tuple[Any, ...]
  outputs: tuple[int, ...]
  op: int | None = None
  var: int | None = None
  recompute: bool = False
  literal_dep: int | None = None


@dataclasses.dataclass
class Schedule:
  """Steps plus the table of values they define.

  ``value_var[i]`` is the original variable a value is a version of (``None``
  for copy handles); values ``< len(program.vars)`` are the originals.
  """
  program: Any
  steps: list[Step]
  value_var: list[int | None]
  outputs: tuple[Any, ...]

  def value_bytes(self, vid: int) -> int:
    var = self.value_var[vid]
    return HANDLE_BYTES if var is None else self.program.vars[var].nbytes

  def profile(self) -> lifetimes.Profile:
    """Estimated live bytes per step (the last position is the exit), XLA model applied.

    Fences, pins, offloads and fetches are custom calls: XLA stores what they
    read and write, which is how a pin keeps a mask from being fused away.
    """
    from jaxmem._src import xla_model
    prog = self.program
    model = prog.op_memory_model(planned=True)
    n = len(self.steps)
    nvals = len(self.value_var)
    start = [-1] * nvals
    end = [-1] * nvals
    for vid in (*prog.invars, *prog.consts):
      start[vid] = 0
    kinds, inputs, outputs, transient, hoisted, shared = [], [], [], [], [], []
    hoist = lifetimes.hoisted_constants(prog)
    for i, st in enumerate(self.steps):
      ins = [x for x in st.inputs if isinstance(x, int)]
      for x in ins:
        end[x] = i
      for o in st.outputs:
        start[o] = i
        end[o] = max(end[o], i)
      t = h = 0
      reads: list[tuple[int, int]] = []
      if st.kind is StepKind.COMPUTE:
        kind, t, h, sh = model[st.op]
        reads = [(st.inputs[pos], b) for pos, b in sh]
        if st.literal_dep is not None:   # fenced literals: created where it stands
          hoist.difference_update(st.outputs)
      else:
        kind = xla_model.Fusion.MATERIALIZED
      kinds.append(kind)
      inputs.append(ins)
      outputs.append(list(st.outputs))
      transient.append(t)
      hoisted.append(h)
      shared.append(reads)
    for vid in prog.invars:
      if vid not in prog.donated or prog.vars[vid].is_output:
        end[vid] = n
    for vid in prog.consts:
      end[vid] = n
    outs = {x for x in self.outputs if isinstance(x, int)}
    for x in outs:
      start[x] = 0   # reserved for the whole step, as memory_analysis() counts them
      end[x] = n
    materialized = set(prog.invars) | set(prog.consts) | outs
    flow = lifetimes.Flow(n, kinds, inputs, outputs, transient, hoisted, start, end,
                          [self.value_bytes(v) for v in range(nvals)], materialized, hoist,
                          shared)
    return lifetimes.estimate(flow)[0]

  def anchor_of(self, index: int) -> float:
    return self.steps[index].anchor if index < len(self.steps) else float(self.program.num_ops)


def choose_dep(program: Any, before: int, exclude: set[int]) -> int | None:
  """The original variable that orders a restore before op ``before``.

  The most recently defined non-argument input of that op which is not itself
  being restored there (typically the incoming gradient); ``None`` means "the
  last value computed so far". Values computed from constants only are never
  chosen: XLA hoists them to the start, and the copy would follow.
  """
  best, best_def = None, -1
  for x in program.ops[before].input_ids():
    v = program.vars[x]
    if x in exclude or v.is_input or program.constant_like[x]:
      continue
    if v.defined_by > best_def:
      best, best_def = x, v.defined_by
  return best


def fence_points(program: Any, chain: Sequence[int]) -> list[int]:
  """Values to fence so that every op of a remat ``chain`` runs after ``dep``.

  Each op of the chain whose inputs all come from outside the chain gets one of
  them fenced: an activation if it has one (fencing renames it, so the alias
  costs no copy), else its smallest argument (XLA copies a fenced argument).
  Every recomputed op then depends on a fence, so XLA can neither hoist it nor
  CSE it with the forward pass. Ops with no array inputs (iota, constant
  broadcasts) are left alone: merging those is harmless.
  """
  made = {o for k in chain for o in program.ops[k].outputs}
  fenced: list[int] = []
  for k in chain:
    ins = program.ops[k].input_ids()
    if not ins or any(x in made for x in ins) or any(x in fenced for x in ins):
      continue
    acts = [x for x in ins if not program.vars[x].is_input]
    pick = (max(acts, key=lambda x: program.vars[x].nbytes) if acts else
            min(ins, key=lambda x: program.vars[x].nbytes))
    fenced.append(pick)
  return fenced


def build_schedule(program: Any, decisions: Sequence[Decision],
                   pinned: Sequence[int] = ()) -> Schedule:
  """Applies ``decisions`` to ``program`` (see the module docstring).

  ``pinned`` variables get a fence right after their definition and later uses
  read the fenced value. Without it XLA's fusion may duplicate a cheap producer
  into a backward consumer and keep the producer's (larger) inputs alive
  instead: a kept ``bool`` ReLU mask becomes its ``float32`` pre-activation, 4x
  the bytes (Layrub §4.2's memory-efficient ReLU, enforced on the compiled
  program).
  """
  pinned_set = set(pinned)
  value_var: list[int | None] = list(range(len(program.vars)))
  cur: list[Any] = list(range(len(program.vars)))
  steps: list[Step] = []
  after: dict[int, list[Decision]] = {}
  before: dict[int, list[Decision]] = {}
  for d in decisions:
    if d.action is Action.KEEP:
      continue
    before.setdefault(d.end, []).append(d)
    if d.action is Action.OFFLOAD:
      after.setdefault(d.start, []).append(d)
  handles: dict[int, int] = {}
  last_value: int | None = None

  def fresh(var: int | None) -> int:
    value_var.append(var)
    return len(value_var) - 1

  for op in program.ops:
    i = op.index
    restores = before.get(i, ())
    if restores:
      restored = {d.var for d in restores}
      dep_var = choose_dep(program, i, restored)
      anchor = i - 0.5
      # Fetches first: a remat chain never reads a value restored at the same
      # point (the planner forbids it), but a later-decided remat's restore may
      # be read by an earlier-decided remat's chain, hence the reverse order.
      ordered = ([d for d in restores if d.action is Action.OFFLOAD] +
                 [d for d in reversed(restores) if d.action is Action.REMAT])
      for d in ordered:
        dep = cur[dep_var] if dep_var is not None else (
            cur[last_value] if last_value is not None else None)
        if dep is None:
          dep = cur[program.ops[i].input_ids()[0]]
        if d.action is Action.OFFLOAD:
          new = fresh(d.var)
          steps.append(Step(StepKind.FETCH, anchor, (handles.pop(id(d)), dep), (new,), var=d.var))
          cur[d.var] = new
          continue
        chain = d.recompute
        fenced = fence_points(program, chain)
        local: dict[int, int] = {}
        for x in fenced:
          new = fresh(x)
          steps.append(Step(StepKind.FENCE, anchor, (cur[x], dep), (new,), var=x))
          if program.vars[x].is_input:
            local[x] = new   # a fenced argument is a copy: only the chain reads it
          else:
            cur[x] = new     # later uses read the fenced value, so the alias is free
        for k in chain:
          kop = program.ops[k]
          ins = tuple(local.get(x, cur[x]) if isinstance(x, int) else x for x in kop.inputs)
          outs = tuple(fresh(o) for o in kop.outputs)
          local.update(zip(kop.outputs, outs))
          steps.append(Step(StepKind.COMPUTE, anchor, ins, outs, op=k, var=d.var, recompute=True))
        cur[d.var] = local[d.var]
    ins = tuple(cur[x] if isinstance(x, int) else x for x in op.inputs)
    literal_dep = None
    if (op.outputs and program.constant_like[op.outputs[0]] and last_value is not None
        and not op.input_ids()
        and sum(program.vars[o].nbytes for o in op.outputs) >= DECORRELATE_MIN_BYTES):
      literal_dep = cur[last_value]
    steps.append(Step(StepKind.COMPUTE, float(i), ins, op.outputs, op=i, literal_dep=literal_dep))
    if op.outputs and not program.constant_like[op.outputs[0]]:
      last_value = op.outputs[0]
    for o in op.outputs:
      if o in pinned_set:
        new = fresh(o)
        steps.append(Step(StepKind.PIN, i + 0.25, (o,), (new,), var=o))
        cur[o] = new
    for d in after.get(i, ()):
      h = fresh(None)
      steps.append(Step(StepKind.OFFLOAD, i + 0.5, (cur[d.var],), (h,), var=d.var))
      handles[id(d)] = h
  outputs = tuple(cur[x] if isinstance(x, int) else x for x in program.outvars)
  return Schedule(program, steps, value_var, outputs)
