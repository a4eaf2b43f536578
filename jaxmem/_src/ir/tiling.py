"""Bytes a value takes in device memory once the compiler has tiled its layout.

XLA:TPU stores arrays in tiles over their two minor-most dimensions: 8 rows
of 128 32-bit lanes (``T(8,128)`` in the compiled HLO's layouts), 16 rows for
16-bit types and 32 for 8-bit ones (packed two or four to a lane), and a 1-D
array in rows of 128. A dimension that does not fill its tiles is padded. On a
convolutional network with 16 or 32 channels this is most of the memory:
measured on XLA:TPU v5e (libtpu 0.0.42.1), the UNet example's activation
``f32[8,128,128,16]`` is compiled with layout ``{3,0,2,1:T(8,128)}`` and takes
64 MiB, eight times its 8 MiB of elements (``bench/tpu_estimate.py`` measures
what this does to the estimate on a corpus of models).

Layout assignment is XLA's, not ours, and this is a model of it. Values of a
convolution's layout class (its operands and results and what elementwise
ops make of them at the same shape, :func:`feature_minor_values`) have their
features or their batch minor-most, whichever pads less: the UNet's
activations above (batch 8) keep 16 channels on 128 lanes, the CNN example's
at batch 256 (``f32[256,32,32,32]``) are laid out ``{0,3,2,1}``, batch
minor-most and nothing padded; among the other dimensions the second-minor
one is the one padded least. Other values get
the two minor-most dimensions that pad least (XLA:TPU lays attention's
``bf16[64,256,4,32]`` out as ``{1,3,2,0}``: the sequence minor-most, the head
dimension of 32 second, nothing padded); so does a last dimension narrower
than 8 (an image's 3 channels, a trailing 1).
Layouts XLA propagates from a consumer (labels ``s32[8,128,128]`` laid out
batch-minor after a convolution's layout, 16 times their elements) are not
modelled.
Other platforms store arrays densely and :func:`tiled_nbytes` returns the
element bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol


class _OpLike(Protocol):
  """What the layout classes read of a program op."""
  outputs: tuple[int, ...]

  @property
  def primitive(self) -> str: ...

  def input_ids(self) -> list[int]: ...


LANES = 128          # the minor-most tile dimension, in elements
NARROW_MINOR = 8     # a last dimension below this many elements is not kept minor-most
SUBLANE_ROWS = 8     # second-minor tile rows of 32-bit words (16-bit types pack 16, 8-bit 32)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def tiled_nbytes(shape: Sequence[int], itemsize: int, platform: str,
                 feature_minor: bool = True) -> int:
  """Bytes of an array of ``shape`` and ``itemsize`` in ``platform``'s device memory.

  Args:
    shape: the (per-device) array shape.
    itemsize: bytes per element.
    platform: ``"tpu"`` applies XLA:TPU's tiling; any other platform is dense.
    feature_minor: the last dimension stays minor-most (a convolution's
      features, see :func:`feature_minor_values`); otherwise XLA is assumed to
      pick the two minor-most dimensions that pad least.

  Returns:
    The padded size for ``"tpu"``, else ``prod(shape) * itemsize``.

  Example:
    >>> tiled_nbytes((8, 128, 128, 16), 4, "tpu") // 2 ** 20
    64
    >>> tiled_nbytes((8, 128, 128, 16), 4, "cpu") // 2 ** 20
    8
  """
  dims = [int(d) for d in shape]
  dense = math.prod(dims) * itemsize
  if platform != "tpu" or dense == 0 or itemsize <= 0:
    return dense
  if len(dims) <= 1:
    return _round_up(dims[0] if dims else 1, LANES) * itemsize
  rows = SUBLANE_ROWS * max(1, 4 // itemsize)
  if feature_minor and dims[-1] >= NARROW_MINOR:
    minors = [len(dims) - 1, 0]   # features or batch minor-most, whichever pads less
  else:   # a narrow last dimension (image channels, a trailing 1): XLA lays out another minor-most
    minors = list(range(len(dims)))
  best = None
  for m in minors:
    others = [i for i in range(len(dims)) if i != m]
    for s in others:
      size = (math.prod(dims[i] for i in others if i != s) * _round_up(dims[s], rows)
              * _round_up(dims[m], LANES) * itemsize)
      if best is None or size < best:
        best = size
  assert best is not None
  return best


def feature_minor_values(ops: Sequence[_OpLike], avals: Sequence[Any]) -> frozenset[int]:
  """Value ids laid out features-minor: the layout class of the program's convolutions.

  A union of values connected by ops whose result has the shape of the
  operand (elementwise ops, normalizations' scale and shift): XLA gives an
  elementwise op's operands the layout of its result. A class containing a
  convolution's operand or result is in the set.
  """
  parent = list(range(len(avals)))

  def find(i: int) -> int:
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  conv: list[int] = []
  for op in ops:
    ids = op.input_ids()
    if op.primitive.startswith("conv_general_dilated"):
      conv.extend([*ids, *op.outputs])
      continue
    if len(op.outputs) != 1:
      continue
    out = op.outputs[0]
    shape = getattr(avals[out], "shape", None)
    if not shape or len(shape) < 3:
      continue
    for x in ids:
      if getattr(avals[x], "shape", None) == shape:
        parent[find(x)] = find(out)
  roots = {find(v) for v in conv}
  return frozenset(v for v in range(len(avals)) if find(v) in roots)


__all__ = ["feature_minor_values", "tiled_nbytes"]
