"""Tensor-parallel MLP blocks written the two other ways JAX offers, for `bench/sharded_fit.py`.

Megatron blocks (``tanh(tanh(h @ w1) @ w2)``, ``w1`` split by columns and
``w2`` by rows over the ``model`` axis, the batch over ``data``) trained by
one SGD step:

* ``constraints``: plain ``jnp`` code with ``jax.lax.with_sharding_constraint``
  on the activations; the weights are left unplaced, so ``jax.jit`` lets the
  partitioner choose their split (it follows the constraints).
* ``shard_map``: each block a ``jax.shard_map`` whose body multiplies the
  local shards and sums the partial products with ``psum`` over ``model``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def build(mesh: jax.sharding.Mesh, form: str, *, blocks: int = 6, batch_size: int = 4096,
          width: int = 256, hidden: int = 1024) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``(step, (weights, x))`` of ``blocks`` MLP blocks in ``form`` over ``mesh`` (``data`` x ``model``)."""
  rows = NamedSharding(mesh, P("data", None))
  hidden_split = NamedSharding(mesh, P("data", "model"))

  def block(w1: jax.Array, w2: jax.Array, h: jax.Array) -> jax.Array:
    if form == "constraints":
      a = jax.lax.with_sharding_constraint(jnp.tanh(h @ w1), hidden_split)
      return jax.lax.with_sharding_constraint(jnp.tanh(a @ w2), rows)
    def local(w1, w2, h):
      return jax.lax.psum(jnp.tanh(h @ w1) @ w2, "model")
    return jnp.tanh(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "model"), P("model", None),
                                                              P("data")),
                                  out_specs=P("data"))(w1, w2, h))

  def step(ws: Any, x: jax.Array) -> Any:
    def loss(ws: Any) -> jax.Array:
      h = x
      for w1, w2 in ws:
        h = block(w1, w2, h)
      return jnp.sum(h * h)
    return jax.tree.map(lambda a, b: a - 0.01 * b, ws, jax.grad(loss)(ws))

  keys = jax.random.split(jax.random.PRNGKey(0), 2 * blocks + 1)
  ws = [(jax.random.normal(keys[2 * i], (width, hidden)) * 0.05,
         jax.random.normal(keys[2 * i + 1], (hidden, width)) * 0.05) for i in range(blocks)]
  if form == "shard_map":
    ws = [(jax.device_put(w1, NamedSharding(mesh, P(None, "model"))),
           jax.device_put(w2, NamedSharding(mesh, P("model", None)))) for w1, w2 in ws]
  elif form != "constraints":
    raise ValueError(f"`form` must be 'constraints' or 'shard_map', got {form!r}.")
  x = jax.device_put(jax.random.normal(keys[-1], (batch_size, width)), rows)
  return step, (ws, x)
