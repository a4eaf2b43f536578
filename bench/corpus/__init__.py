"""A corpus of train steps jaxmem was not tuned to (issue 14).

Each family module defines ``entries() -> list[Entry]``: hand-written train
steps of one model family at several sizes, written the way their users write
them (flax linen, flax nnx, plain JAX; optax updates), not shaped to what
jaxmem models well. The corpus measures (``bench/corpus_bench.py``) and tests
(``tests/api/test_corpus.py``); the examples in ``examples/`` stay for users.

Rules for an entry: ``make()`` returns ``(step, args)``, ``step`` a pure
function of ``args`` (concrete arrays, made from a fixed seed), returning
its new state (and any metrics); it compiles on XLA:CPU in seconds and its
unplanned compiled peak is between 4 and 200 MiB at every size listed.
``donate``: the argument positions a training loop would donate.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

#: The family modules, in the order the tables list them.
FAMILIES = ("convnets", "generative", "sequences", "structured")
#: The held-out set (``heldout.py``): written after the estimate was last
#: changed; it measures how the figures of ``FAMILIES`` generalise
#: (``bench/corpus_bench.py --set heldout``).
HELDOUT = ("heldout",)
#: The fresh set (``fresh.py``): written after the last estimate change of
#: issue 14, when the held-out steps had served to diagnose the estimate
#: (``bench/corpus_bench.py --set fresh``).
FRESH = ("fresh",)
#: The unseen set (``unseen.py``): written after the fresh set had served to
#: diagnose the estimate (its graph attention step), measured as it came
#: (``bench/corpus_bench.py --set unseen``).
UNSEEN = ("unseen",)
#: The novel set (``novel.py``): written after the unseen set had served to
#: diagnose the estimate (its capsule and Sinkhorn steps), measured as it
#: came (``bench/corpus_bench.py --set novel``).
NOVEL = ("novel",)
#: The untried set (``untried.py``): written after the novel set had served
#: to diagnose the estimate (its Fourier neural operator), measured as it
#: came (``bench/corpus_bench.py --set untried``).
UNTRIED = ("untried",)
#: Every set's modules, the main corpus first.
EVERY = FAMILIES + HELDOUT + FRESH + UNSEEN + NOVEL + UNTRIED
#: Every set by the name the benches' tables give it, in order.
SETS = (("main", FAMILIES), ("heldout", HELDOUT), ("fresh", FRESH), ("unseen", UNSEEN),
        ("novel", NOVEL), ("untried", UNTRIED))


@dataclasses.dataclass(frozen=True)
class Entry:
  """One train step of the corpus.

  Attributes:
    name: unique, ``"<family>/<variant>-<size>"``.
    family: the model family (``"cnn"``, ``"unet"``, ``"rnn"``, ...).
    make: builds ``(step, args)``.
    donate: argument positions a training loop donates (``donate_argnums``).
    notes: what the step exercises, in a few words.
  """
  name: str
  family: str
  make: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
  donate: tuple[int, ...] = ()
  notes: str = ""


def train_step(tx: Any, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """The usual closure: grads of ``loss_fn(params, *batch)``, optax update.

  ``step(params, opt_state, *batch) -> (params, opt_state, loss)``.
  """
  import jax
  import optax

  def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss

  return step


def all_entries(families: tuple[str, ...] = FAMILIES) -> list[Entry]:
  """Every entry of every module in ``families``, in a fixed order."""
  out: list[Entry] = []
  for name in families:
    try:
      module = importlib.import_module(f"corpus.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"corpus.{name}":
        raise
      continue
    out += module.entries()
  names = [e.name for e in out]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate corpus entries: {sorted(n for n in names if names.count(n) > 1)}")
  return out
