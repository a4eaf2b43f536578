"""Small DSA instances with known optima, shared by the DSA tests."""

from __future__ import annotations

# Best-fit (SmartPool, Zhang et al. §III-C) puts the 6-byte buffer at 0, the 4-byte [1, 6) one on it at 6,
# the 4-byte [0, 2) one into the hole [0, 6) and then finds no hole for the 3-byte one: 13.
# The optimum is the max load, 11 (found by hand and by brute force).
BF_SUBOPTIMAL = dict(lower=[1, 3, 1, 0], upper=[2, 6, 6, 2], size=[3, 6, 4, 4])
# Optimum 11 > max load 10 (brute force): only an exhausted search can prove it.
ABOVE_MAX_LOAD = dict(lower=[0, 0, 0, 1, 1, 2, 2, 3, 4], upper=[2, 3, 1, 4, 2, 3, 5, 4, 5],
                      size=[1, 1, 8, 5, 3, 2, 2, 3, 8])


def brute_force(lower, upper, size) -> int:
  """Smallest footprint by trying every offset below the incumbent (tiny instances only)."""
  n = len(size)
  order = sorted(range(n), key=lambda i: -size[i])
  best = [sum(size)]
  off = [0] * n

  def rec(k: int, foot: int) -> None:
    if foot >= best[0]:
      return
    if k == n:
      best[0] = foot
      return
    b = order[k]
    for o in range(best[0] - size[b]):
      if all(not (lower[j] < upper[b] and lower[b] < upper[j] and off[j] < o + size[b]
                  and o < off[j] + size[j]) for j in order[:k] if size[j] and size[b]):
        off[b] = o
        rec(k + 1, max(foot, o + size[b]) if size[b] else foot)
  rec(0, 0)
  return best[0]
