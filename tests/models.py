"""The models the tests share, built once per configuration.

* :func:`mlp`: the flax MLP train step of ``examples/mlp.py`` (adam, cross
  entropy) -- the model most tests plan, fit and compare;
* :func:`mlp_program`: its analyzed program;
* :func:`tanh_mlp`: ``jax.grad`` of a bare tanh MLP, a program small enough to
  reason about by hand (one matmul and one ``tanh`` per layer);
* :func:`scanned_tanh_mlp`: an SGD step of the same MLP with its layers in one
  ``lax.scan``;
* :func:`hypernetwork`: an SGD step whose floor is one fusion's working set.

Tests import them (``from models import mlp``); ``conftest.py`` puts this
folder and ``examples/`` on ``sys.path``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem


@functools.cache
def mlp(batch_size: int = 256, width: int = 64, depth: int = 4
        ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``(step, args)`` of the flax MLP example: ``step(params, opt_state, x, y)``."""
  import mlp as example  # examples/mlp.py
  return example.build(batch_size=batch_size, width=width, depth=depth)


@functools.cache
def mlp_program(batch_size: int = 256, width: int = 64, depth: int = 4) -> jaxmem.Program:
  """The analyzed program of :func:`mlp`."""
  step, args = mlp(batch_size, width, depth)
  return jaxmem.analyze(step, *args)


def tanh_mlp(depth: int = 6, width: int = 256, batch: int = 2048, scale: float = 0.01
             ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``(grad_fn, (ws, x))``: the gradient of ``sum(h * h)`` after ``depth`` tanh layers."""
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x * x)
  ws = [jnp.full((width, width), scale) for _ in range(depth)]
  return jax.grad(loss), (ws, jnp.ones((batch, width)))


def scanned_tanh_mlp(layers: int = 12, width: int = 128, batch: int = 1024
                     ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``(step, (ws, x))``: an SGD step of a tanh MLP whose ``layers`` are one ``lax.scan`` over ``ws``."""
  def loss(ws, x):
    def layer(h, w):
      return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.sum(h * h)

  def step(ws, x):
    return ws - 0.1 * jax.grad(loss)(ws, x)

  return step, (jnp.full((layers, width, width), 0.01), jnp.ones((batch, width)))


def hypernetwork(batch: int = 16, points: int = 256, features: int = 16, width: int = 128
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """An SGD step of a hypernetwork: per-example weights of a tanh layer generated from a context.

  The [batch, points, width] tanh is read by the output's matmul and by its own gradient, so XLA
  writes that gradient into a buffer of its own: one fusion reads the tanh
  and writes its gradient, the step's floor with its arguments.
  """
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, points, features)), jnp.float32)
  z = jnp.asarray(rng.normal(size=(batch, 8)), jnp.float32)
  params = {"g": jnp.asarray(rng.normal(size=(8, features * width)), jnp.float32) * 0.1,
            "v": jnp.asarray(rng.normal(size=(width,)), jnp.float32)}

  def step(params, z, x):
    def loss(p):
      w = (z @ p["g"]).reshape(batch, features, width)
      h = jnp.tanh(jnp.einsum("bpf,bfw->bpw", x, w))
      return jnp.mean((h @ p["v"]) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)
  return step, (params, z, x)
