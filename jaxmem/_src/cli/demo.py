"""``python -m jaxmem demo``: train a small flax MLP with optax under half its compiled peak."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxmem._src.base.budget import parse_budget
from jaxmem._src.cli.common import EXIT_USER_ERROR, budget_arg


def build_mlp(batch_size: int = 8192, width: int = 512, depth: int = 8, classes: int = 10,
              seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """An adam train step ``step(params, opt_state, x, y)`` for a flax MLP, and its arguments."""
  try:
    import flax.linen as nn
    import optax
  except ImportError as e:  # pragma: no cover
    raise SystemExit("The demo needs flax and optax: pip install 'jaxmem[examples]'") from e
  import jax
  import jax.numpy as jnp

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(depth):
        x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(classes)(x)

  model = MLP()
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (batch_size, width), jnp.float32)
  y = jax.random.randint(ky, (batch_size,), 0, classes)
  params = model.init(kp, x[:1])
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)

  def step(params, opt_state, x, y):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, opt_state, x, y)


def add_demo_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
  """Adds the ``demo`` subcommand."""
  demo = sub.add_parser("demo", help="train a small flax MLP under half its compiled peak")
  demo.add_argument("--batch", type=int, default=8192, help="batch size (default 8192)")
  demo.add_argument("--steps", type=int, default=3, help="train steps (default 3)")
  demo.add_argument("--budget", type=budget_arg, default=0.5,
                    help="budget: bytes, '800MiB', or a fraction of the unplanned peak "
                         "(default 0.5)")
  return demo


def main_demo(args: argparse.Namespace) -> int:
  """Runs ``demo``; returns the exit status (2 with one line on stderr for bad arguments)."""
  # Checked before anything is traced, so a bad value is one line, not a
  # traceback after the report.
  problems = []
  if args.batch < 1:
    problems.append(f"`--batch` must be a positive batch size, got {args.batch}")
  if args.steps < 1:
    problems.append(f"`--steps` must be at least 1, got {args.steps}")
  try:
    parse_budget(args.budget, argname="--budget")
  except (TypeError, ValueError) as e:
    problems.append(str(e))
  if problems:
    print(f"jaxmem demo: error: {'; '.join(problems)}", file=sys.stderr)
    return EXIT_USER_ERROR
  return run_demo(args.batch, args.steps, args.budget)


def run_demo(batch_size: int = 8192, steps: int = 3, budget: float | int | str = 0.5) -> int:
  """Trains the demo MLP under ``budget`` next to plain ``jax.jit``; 0 when the budget holds.

  Where ``budget`` is out of reach (``BudgetError``), the demo goes on as a
  user would: with the smallest reachable budget the error reports, which
  ``fit`` promises to meet; 0 when that one holds, and the last line says the
  budget asked was not reachable.
  """
  # Imported here: they pull in jax, and `python -m jaxmem --help` should not wait for it.
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jaxmem._src.api.fit import fit  # noqa: PLC0415
  from jaxmem._src.api.program import analyze  # noqa: PLC0415
  from jaxmem._src.base.errors import BudgetError, format_bytes  # noqa: PLC0415

  step, args = build_mlp(batch_size)
  print(f"== jaxmem demo: 8-layer flax MLP (batch {batch_size}, width 512), optax adam, "
        f"budget {budget!r} ==\n")
  print(analyze(step, *args).report(top=10))
  t0 = time.perf_counter()
  fitted = fit(budget, verbose=True)(step)
  unreachable = None
  try:
    result = fitted.fit_result(*args)
  except BudgetError as e:
    # What a user does next: the error's smallest reachable budget, which
    # `fit` promises to meet (on a GPU the demo's half of the peak is out of
    # reach: XLA:GPU stores little per layer, bench/results/gpu.md).
    print(f"\n{e}")
    unreachable = e
    print(f"\nfitting the smallest reachable budget the error reports, "
          f"{format_bytes(e.smallest_bytes)}, instead:")
    fitted = fit(e.smallest_bytes, verbose=True)(step)
    try:
      result = fitted.fit_result(*args)
    except BudgetError as again:
      print(f"\n{again}\n\nthe smallest reachable budget was not reached: a jaxmem bug")
      return 1
  print(f"\n{result.plan.summary()}\n")
  print(result.summary())
  print(f"\ntraining {steps} steps (fitted vs plain jax.jit):")
  plain = jax.jit(step)
  a, b = args, args
  worst = 0.0
  for i in range(steps):
    a = fitted(*a[:2], *args[2:])
    b = plain(*b[:2], *args[2:])
    diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    worst = max(worst, diff)
    print(f"  step {i}: loss {float(a[2]):.6f} (jit {float(b[2]):.6f}), max |params/opt diff| {diff:.3g}")
  ok = result.peak_bytes <= result.budget_bytes
  asked = ("" if unreachable is None else
           f"; the budget asked, {format_bytes(unreachable.budget_bytes)}, is not reachable "
           "on this device")
  print(f"\nverified compiled peak {format_bytes(result.peak_bytes)} vs unplanned "
        f"{format_bytes(result.unplanned_peak_bytes)} (budget "
        f"{format_bytes(result.budget_bytes)}{asked}): {'OK' if ok else 'OVER BUDGET'}; "
        f"largest difference from jax.jit over {steps} steps: {worst:.3g}; "
        f"total {time.perf_counter() - t0:.1f} s")
  return 0 if ok else 1


__all__ = ["add_demo_parser", "build_mlp", "main_demo", "run_demo"]
