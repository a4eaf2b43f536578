"""What XLA keeps live at the compiled peak, next to what jaxmem estimates.

The tool behind jaxmem's XLA memory model (``jaxmem/_src/estimate/xla_model.py``): it
compiles ``jax.jit(step)`` with ``--xla_dump_to``, reads the dumped buffer
assignment and live ranges, finds the point where the most temp bytes are live
and lists those buffers with the jaxpr op that made them (HLO ``op_name``
metadata), grouped by module and by kind of HLO value. Then it prints
jaxmem's holders at its estimated peak, grouped by module the same way, so a
missing or extra buffer in the model shows as a per-module difference.

Run: ``python bench/xla_live_at_peak.py examples/transformer.py:build --kw batch_size=16``

``--target tpu:v5e`` reads XLA:TPU's dump of the same step compiled ahead of time
(libtpu honours ``--xla_dump_to``; only buffers in HBM, memory color 0, count:
VMEM and SMEM are on chip). ``--planner P --budget F`` compiles the step
planned by ``P`` for ``F`` of the estimated peak (with the target's default
backend) instead of plain ``jax.jit``, to see what a plan leaves at the peak;
jaxmem's side is then the plan's schedule (``Plan.schedule().profile()``).

The dump format is XLA's debug output, not an API: this is a diagnosis tool
for developers, not part of the package.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

MiB = 2 ** 20


def parse_dump(directory: str, module: str = "jit_step", platform: str = "cpu") -> dict:
  """Buffers, live ranges and instructions of one dumped HLO module (XLA:CPU, :GPU or :TPU)."""
  stem = {"cpu": "cpu_after_optimizations", "gpu": "sm_*_gpu_after_optimizations"}.get(
      platform, "cl_*.after_optimizations")

  def one(suffix: str) -> str:
    found = sorted(glob.glob(f"{directory}/*{module}.{stem}{suffix}"))
    if not found:
      raise SystemExit(f"no dump of module {module!r} in {directory} (suffix {suffix})")
    return open(found[-1]).read()

  assignment, live_ranges, hlo = one("-buffer-assignment.txt"), one("-live-range.txt"), one(".txt")
  values, allocations, current = [], {}, None
  for line in assignment.splitlines():
    m = re.match(r"allocation (\d+): size (\d+), (.*)", line)
    if m:
      text = m.group(3)
      on_chip = re.search(r"color ([1-9])", text) is not None   # TPU VMEM/SMEM: not HBM
      kind = ("on-chip" if on_chip else
              "argument" if text.startswith("parameter") else "temp" if "preallocated-temp" in text
              else "output" if "maybe-live-out" in text else "constant" if text.startswith("constant")
              else "other")
      current = int(m.group(1))
      allocations[current] = (int(m.group(2)), kind)
      continue
    m = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)", line)
    if m and current is not None:
      values.append(dict(name=m.group(1), size=int(m.group(2)), offset=int(m.group(3)),
                         kind=allocations[current][1], shape=m.group(4)))
    if line.startswith(("Used values", "BufferAssignment stats")):
      current = None
  sections = live_ranges.split("BufferLiveRange:")
  sequence = [n for _, n in re.findall(r"^    (\d+):(\S+)$", sections[0], re.M)]
  ranges = {}
  for m in re.finditer(r"^    (\S+?)(\{[^}]*\}):(\d+)-(\d+)$", sections[1].split("Live ranges at")[0],
                       re.M):
    ranges[m.group(1) + ("" if m.group(2) == "{}" else m.group(2))] = (int(m.group(3)),
                                                                      int(m.group(4)))
  entry = hlo[hlo.index("\nENTRY"):]
  instructions = {}
  for m in re.finditer(r"^\s+(?:ROOT )?%(\S+) = (?:\(.*?\)|\S+) ([\w-]+?)\((.*)$", entry, re.M):
    meta = re.search(r'op_name="([^"]+)"', m.group(3))
    args = re.split(r"\), (?=[a-z_]+=)", m.group(3), maxsplit=1)[0]
    index = re.search(r"\bindex=(\d+)", m.group(3))
    instructions[m.group(1)] = dict(op=m.group(2), meta=meta.group(1) if meta else "",
                                    operands=re.findall(r"%([\w.\-]+)", args),
                                    index=int(index.group(1)) if index else None)
  return dict(values=values, allocations=allocations, sequence=sequence, ranges=ranges,
              instructions=instructions)


def module_of(op_name: str) -> str:
  """``jit(step)/transpose(jvp(GPT))/DecoderBlock_1/Dense_0/dot_general`` -> ``GPT/DecoderBlock_1/Dense_0``."""
  parts = [re.sub(r"[a-z_]+\(|\)", "", p) for p in op_name.split("/")[1:-1]]
  return "/".join(p for p in parts if p and not p.startswith("jit"))


def live_at_peak(dump: dict) -> tuple[int, list[dict], int]:
  """(peak position, temp values live there, total fixed bytes)."""
  temps = [v for v in dump["values"] if v["kind"] == "temp" and v["name"] in dump["ranges"]]
  n = len(dump["sequence"]) + 1
  delta = [0] * (n + 1)
  for v in temps:
    s, e = dump["ranges"][v["name"]]
    delta[s] += v["size"]
    delta[e + 1] -= v["size"]
  live, best, at = 0, -1, 0
  for t in range(n):
    live += delta[t]
    if live > best:
      best, at = live, t
  holders = [v for v in temps if dump["ranges"][v["name"]][0] <= at <= dump["ranges"][v["name"]][1]]
  fixed = sum(s for s, k in dump["allocations"].values() if k in ("argument", "output", "constant"))
  return at, holders, fixed


def working_sets(dump: dict) -> list[tuple[int, str]]:
  """(HBM temp bytes an instruction reads and writes, its name), largest first.

  An instruction's operands and results are live together while it runs, so
  the arguments and outputs plus the largest of these bound the peak of any
  schedule of this program from below (another program, with other fusions,
  may have other working sets). Aliases are followed: a ``get-tuple-element``
  reads its tuple's element, a ``bitcast`` its operand's buffer.
  """
  sizes = {v["name"]: v["size"] for v in dump["values"] if v["kind"] == "temp"}
  instructions = dump["instructions"]
  by_prefix: dict[str, list[str]] = collections.defaultdict(list)
  for b in sizes:
    by_prefix[b.split("{")[0]].append(b)
  found = []
  for name, ins in instructions.items():
    if ins["op"] in ("get-tuple-element", "bitcast", "tuple", "parameter"):
      continue
    live = set(by_prefix.get(name, ()))
    for operand in ins["operands"]:
      op_ins = instructions.get(operand, {})
      if op_ins.get("op") == "get-tuple-element" and op_ins["operands"]:
        live.add(f"{op_ins['operands'][0]}{{{op_ins['index']}}}")
      elif op_ins.get("op") == "bitcast" and op_ins["operands"]:
        live.update(by_prefix.get(op_ins["operands"][0], ()))
      else:
        live.update(by_prefix.get(operand, ()))
    found.append((sum(sizes.get(b, 0) for b in live), name))
  return sorted(found, reverse=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("target", help="MODULE:FACTORY returning (step, args), as for `jaxmem report`")
  parser.add_argument("--kw", action="append", default=[], help="factory keyword NAME=VALUE")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--dump", help="existing dump directory (skip compiling)")
  parser.add_argument("--target", dest="device_target", default=None,
                      help="e.g. tpu:v5e (compiled ahead of time)")
  parser.add_argument("--planner", default=None, help="compile the step planned by this planner")
  parser.add_argument("--budget", type=float, default=0.5,
                      help="with --planner: fraction of the estimated peak (default 0.5)")
  parser.add_argument("--donate", default="", metavar="I,J",
                      help="donate these argument positions (as `donate_argnums`), as a training "
                           "loop donates its state")
  parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                      help="compile with this XLA option (repeatable), e.g. the scheduler "
                           "limit `jaxmem.fit` sets for a TPU target (FitResult.compiler_options)")
  args = parser.parse_args()
  if args.dump is None and "XLA_FLAGS" not in os.environ:
    # The dump flag must be set before jax starts: re-run this script with it.
    directory = tempfile.mkdtemp(prefix="jaxmem-xla-dump-")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={directory} --xla_dump_hlo_as_text",
               JAXMEM_DUMP_DIR=directory)
    raise SystemExit(subprocess.call([sys.executable, *sys.argv], env=env))

  import jax  # noqa: F401  (after XLA_FLAGS is set)
  import jaxmem
  from jaxmem._src.cli import common as cli
  from jaxmem._src.base.errors import format_bytes
  from jaxmem._src.verify.compiled import compiled_memory

  from jaxmem._src.estimate.targets import get_target
  from jaxmem._src.lower.backend import jit_plan, resolve_backend
  target = get_target(args.device_target)
  factory, name = cli.load_factory(args.target)
  kwargs = dict(cli.parse_kw(k) for k in args.kw)
  step, step_args = cli.call_factory(factory, name, kwargs)
  directory = args.dump or os.environ["JAXMEM_DUMP_DIR"]
  donate = tuple(int(i) for i in args.donate.split(",") if i.strip())
  prog = jaxmem.analyze(step, *step_args, target=target, donate_argnums=donate)
  module = "jit_step"
  if args.planner is not None:
    plan = jaxmem.get_planner(args.planner)(prog, int(args.budget * prog.peak_bytes),
                                            target.profile)
    print(plan.summary())
    options = {}
    for item in args.xla_option:
      name, _, value = item.partition("=")
      options[name] = int(value) if value.lstrip("-").isdigit() else value
    jitted = jit_plan(plan, backend=resolve_backend("auto", target.platform),
                      compiler_options=options or None, donate_argnums=donate)
    module = "jit_planned"
  else:
    jitted = jax.jit(step, donate_argnums=donate)
    module = f"jit_{getattr(step, '__name__', 'step')}"   # XLA names the module after it
  if args.dump is None:
    compiled = jitted.lower(*target.place(tuple(step_args))).compile()
    print(f"compiled peak (memory_analysis): {format_bytes(compiled_memory(compiled).peak_bytes)}")
  dump = parse_dump(directory, module, target.platform)
  at, holders, fixed = live_at_peak(dump)
  temp = sum(v["size"] for v in holders)
  where = dump["sequence"][at] if at < len(dump["sequence"]) else "exit"
  print(f"XLA: arguments+outputs+constants {format_bytes(fixed)}, temp live at its peak "
        f"{format_bytes(temp)} (position {at}, {where})")
  by_module: dict[str, int] = collections.Counter()
  by_op: dict[str, int] = collections.Counter()
  for v in holders:
    meta = dump["instructions"].get(v["name"].split("{")[0], {}).get("meta", "")
    by_module[module_of(meta) or "(no metadata)"] += v["size"]
    by_op[meta.rsplit("/", 1)[-1] or "(no metadata)"] += v["size"]

  # jaxmem's side: the plan's schedule when a planner was given, else the
  # unplanned program's profile.
  ours: dict[str, int] = collections.Counter()
  if args.planner is not None:
    sched = plan.schedule()
    prof = sched.profile()
    for vid, b in zip(prof.holders, prof.holder_bytes):
      var = sched.value_var[vid]
      v = prog.vars[var] if var is not None else None
      if v is None:
        ours["(copy handles)"] += b
      elif not v.is_input and not v.is_output:
        ours[v.name or "(top level)"] += b
  else:
    prof = prog.profile
    for vid, b in zip(prof.holders, prof.holder_bytes):
      v = prog.vars[vid]
      if not v.is_input and not v.is_output:
        ours[v.name or "(top level)"] += b
  hidden = prof.peak_bytes - sum(prof.holder_bytes)
  print(f"jaxmem: estimated peak {format_bytes(prof.peak_bytes)} "
        f"(XLA temporaries outside the jaxpr: {format_bytes(max(hidden, 0))})")
  print(f"\n{'temp bytes at the peak, by module':48} {'XLA':>11} {'jaxmem':>11}")
  for mod in sorted(set(by_module) | set(ours), key=lambda m: -max(by_module[m], ours[m]))[:args.top]:
    print(f"  {mod[:46]:46} {format_bytes(by_module[mod]):>11} {format_bytes(ours[mod]):>11}")
  sets = working_sets(dump)
  if sets:
    print(f"\nLargest single-instruction working sets (HBM temporaries it reads and writes); "
          f"with the arguments and outputs, no schedule of this program peaks below "
          f"{format_bytes(fixed + sets[0][0])}:")
    for size, name in sets[:5]:
      print(f"  {format_bytes(size):>11}  {name[:40]:40} "
            f"{dump['instructions'][name].get('meta', '')[-70:]}")
  print("\nXLA temp bytes at its peak, by the jaxpr primitive that made them:")
  for op, b in by_op.most_common(args.top):
    print(f"  {op[:46]:46} {format_bytes(b):>11}")
  print("\nXLA's largest temp buffers at its peak:")
  for v in sorted(holders, key=lambda v: -v["size"])[:args.top]:
    ins = dump["instructions"].get(v["name"].split("{")[0], {})
    print(f"  {format_bytes(v['size']):>11}  {v['name'][:40]:40} {ins.get('op', '?'):14} "
          f"{v['shape'][:40]:40} {ins.get('meta', '')[-60:]}")


if __name__ == "__main__":
  main()
