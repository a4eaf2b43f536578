"""``fit`` on train steps it was not tuned to (``bench/corpus/``): budgets met, results kept, errors honest.

The corpus is measured in full by ``bench/corpus_bench.py``; here a fixed
sample of its small steps, one per kind of program (a BatchNorm CNN, an MLP
VAE, a scanned GRU, a message-passing graph net with ``segment_sum``, a
K-means step without gradients, a two-tower contrastive model), checks what
must hold on any step: the compiled peak is within the budget and the
results are jax.jit's, or the ``BudgetError`` reports a peak that is at most
the unplanned one and that ``fit`` reaches when asked for it.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
  sys.path.insert(0, str(BENCH))
from corpus import FAMILIES, FRESH, HELDOUT, NOVEL, UNSEEN, UNTRIED, all_entries  # noqa: E402

SAMPLE = ("cnn/bn-strided-s", "vae/mlp-s", "rnn/gru-scan-s", "graph/mpnn-s", "kmeans/lloyd-s",
          "contrastive/clip-mlp-s")


def test_the_corpus_is_broad():
  entries = all_entries()
  assert len(entries) >= 30
  assert len({e.family for e in entries}) >= 12
  assert len({e.name for e in entries}) == len(entries)
  assert set(SAMPLE) <= {e.name for e in entries}


def test_the_held_out_steps_are_apart_from_the_corpus():
  # Measured by `bench/corpus_bench.py --set heldout` only: no test (and so
  # no change made to pass one) looks at what jaxmem does on them.
  heldout = all_entries(HELDOUT)
  assert len(heldout) >= 16 and len({e.family for e in heldout}) >= 8
  assert not {e.name for e in heldout} & {e.name for e in all_entries(FAMILIES)}
  assert not {e.family for e in heldout} & {e.family for e in all_entries(FAMILIES)}


def test_the_fresh_steps_are_apart_from_both_other_sets():
  # Written after the held-out steps had served to diagnose the estimate;
  # measured by `bench/corpus_bench.py --set fresh` only.
  fresh = all_entries(FRESH)
  assert len(fresh) >= 8 and len({e.family for e in fresh}) >= 8
  others = all_entries(FAMILIES + HELDOUT)
  assert not {e.name for e in fresh} & {e.name for e in others}
  assert not {e.family for e in fresh} & {e.family for e in others}


def test_the_unseen_steps_are_apart_from_every_other_set():
  # Written after the fresh set had served to diagnose the estimate;
  # measured by `bench/corpus_bench.py --set unseen` only.
  unseen = all_entries(UNSEEN)
  assert len(unseen) >= 8 and len({e.family for e in unseen}) >= 8
  others = all_entries(FAMILIES + HELDOUT + FRESH)
  assert not {e.name for e in unseen} & {e.name for e in others}
  assert not {e.family for e in unseen} & {e.family for e in others}


def test_the_novel_steps_are_apart_from_every_other_set():
  # Written after the unseen set had served to diagnose the estimate;
  # measured by `bench/corpus_bench.py --set novel` only.
  novel = all_entries(NOVEL)
  assert len(novel) >= 8 and len({e.family for e in novel}) >= 8
  others = all_entries(FAMILIES + HELDOUT + FRESH + UNSEEN)
  assert not {e.name for e in novel} & {e.name for e in others}
  assert not {e.family for e in novel} & {e.family for e in others}


def test_the_untried_steps_are_apart_from_every_other_set():
  # Written after the novel set had served to diagnose the estimate;
  # measured by `bench/corpus_bench.py --set untried` only.
  untried = all_entries(UNTRIED)
  assert len(untried) >= 8 and len({e.family for e in untried}) >= 8
  others = all_entries(FAMILIES + HELDOUT + FRESH + UNSEEN + NOVEL)
  assert not {e.name for e in untried} & {e.name for e in others}
  assert not {e.family for e in untried} & {e.family for e in others}


@pytest.mark.parametrize("name", SAMPLE + ("gan/dcgan-s", "nnx/cnn-s"))
def test_results_written_into_donated_arguments_are_paired_as_xla_pairs_them(name):
  # `Program.donation_aliases` is what the estimate counts once; XLA's
  # compiled program reports the bytes it aliased.
  entry = next(e for e in all_entries() if e.name == name)
  step, args = entry.make()
  program = jaxmem.analyze(step, *args, donate_argnums=entry.donate)
  stats = jax.jit(step, donate_argnums=entry.donate).lower(*args).compile().memory_analysis()
  paired = sum(program.vars[i].nbytes for i in program.aliased_arguments)
  assert paired == stats.alias_size_in_bytes
  assert set(program.donation_aliases.values()) <= program.aliased_arguments
  assert len(set(program.donation_aliases.values())) == len(program.donation_aliases)


def _copies(args):
  return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, args)


@pytest.mark.parametrize("name", SAMPLE)
def test_fit_half_the_peak_or_say_honestly_what_is_reachable(name):
  entry = next(e for e in all_entries() if e.name == name)
  step, args = entry.make()
  jitted = jax.jit(step, donate_argnums=entry.donate)
  unplanned = jaxmem.compiled_memory(jitted.lower(*args).compile()).peak_bytes
  try:
    fitted = jaxmem.fit(0.5, donate_argnums=entry.donate)(step)
    res = fitted.fit_result(*args)
  except jaxmem.BudgetError as e:
    assert e.smallest_bytes <= unplanned
    again = jaxmem.fit(int(e.smallest_bytes), donate_argnums=entry.donate)(step)
    assert again.fit_result(*args).peak_bytes <= e.smallest_bytes
    return
  assert res.peak_bytes <= res.budget_bytes <= 0.5 * unplanned + 1
  # Fences may split a fused reduction (sums in another order): last bits only.
  for a, b in zip(jax.tree.leaves(fitted(*_copies(args))), jax.tree.leaves(jitted(*_copies(args)))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_a_floor_is_no_higher_than_a_looser_budget_reaches():
  # A small bfloat16 LM (the novel set's builder, 3 layers): its most aggressive
  # plans compile above a looser one, so the floor `fit(0.3)` reports came out
  # above the peak `fit(0.5)` reached (20.29 against 19.69 MiB) until each
  # planner's plan for a budget just under the floor was compiled too.
  from corpus import novel
  step, args = novel._bf16_lm(batch=4, seq=128, vocab=1024, dim=128, heads=4, layers=3,
                              seed=504)()
  half = jaxmem.fit(0.5, donate_argnums=(0, 1, 2))(step).fit_result(*args)
  with pytest.raises(jaxmem.BudgetError) as info:
    jaxmem.fit(0.3, donate_argnums=(0, 1, 2))(step).fit_result(*args)
  smallest = info.value.smallest_bytes
  assert smallest <= half.peak_bytes
  asked = jaxmem.fit(smallest, donate_argnums=(0, 1, 2))(step).fit_result(*args)
  assert asked.peak_bytes <= smallest
