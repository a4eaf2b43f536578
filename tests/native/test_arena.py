"""Tests of the native host arenas (ffi/arena/, jaxmem/_src/native/arena.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jaxmem
from jaxmem._src.native import arena as arena_lib
from jaxmem._src.native.arena import ArenaStats, HostArena
from jaxmem._src.plan.host_trace import offload_trace

KiB, MiB = 1 << 10, 1 << 20
DYNAMIC = ("virtual", "best_fit")


def _dynamic(mode: str, **kw) -> HostArena:
  if mode == "virtual":
    kw.setdefault("chunk_bytes", 64 * KiB)
  return HostArena(mode, **kw)


def _planned() -> HostArena:
  # ids 0 and 1 share [0, 4096): never live together; id 2 sits beside them.
  return HostArena("planned", offsets={0: 0, 1: 0, 2: 4096, 3: 8192},
                   sizes={0: 4096, 1: 1000, 2: 3000, 3: 0})


def test_exported():
  assert jaxmem.HostArena is HostArena and jaxmem.ArenaStats is ArenaStats
  assert "HostArena" in jaxmem.__all__ and "ArenaStats" in jaxmem.__all__


# Round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", DYNAMIC)
def test_round_trip_dynamic(mode):
  rng = np.random.default_rng(0)
  with _dynamic(mode) as a:
    handles = {}
    for n in (1, 63, 64, 65, 4096, 100_000, 3 * MiB + 7):
      data = rng.integers(0, 256, size=n, dtype=np.uint8)
      h = a.allocate(n)
      a.write(h, data)
      info = a.lookup(h)
      assert info["address"] % 64 == 0 and info["nbytes"] == n and info["reserved_bytes"] >= n
      handles[h] = data
    f32 = np.arange(1000, dtype=np.float32)
    hf = a.allocate(f32.nbytes)
    a.write(hf, f32)
    np.testing.assert_array_equal(a.read(hf).view(np.float32), f32)
    a.write(hf, b"\x01\x02", offset=10)
    assert bytes(a.read(hf, offset=10, nbytes=2)) == b"\x01\x02"
    for h, data in handles.items():
      np.testing.assert_array_equal(a.read(h), data)
    h0 = a.allocate(0)
    assert a.read(h0).shape == (0,) and a.lookup(h0)["address"] == 0
    with pytest.raises(ValueError, match="overruns"):
      a.write(hf, np.zeros(f32.nbytes + 1, np.uint8))
    with pytest.raises(ValueError, match="overruns"):
      a.read(hf, offset=f32.nbytes, nbytes=1)
    for h in [*handles, hf, h0]:
      a.free(h)
    s = a.stats()
    assert s.live_bytes == 0 and s.live_allocations == 0 and s.requested_live_bytes == 0
    assert s.allocs == s.frees == len(handles) + 2
    assert s.errors == 2


def test_round_trip_planned():
  with _planned() as a:
    assert a.mode == "planned"
    h0 = a.allocate(0, 4096)
    h2 = a.allocate(2)            # size defaults to the planned one
    assert a.lookup(h2)["nbytes"] == 3000 and a.lookup(h2)["id"] == 2
    d0 = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    d2 = np.full(3000, 7, np.uint8)
    a.write(h0, d0)
    a.write(h2, d2)
    np.testing.assert_array_equal(a.read(h0), d0)
    np.testing.assert_array_equal(a.read(h2), d2)
    base = a.lookup(h0)["address"]
    assert base % 64 == 0 and a.lookup(h2)["address"] == base + 4096
    a.free(h0)
    h1 = a.allocate(1, 1000)      # reuses id 0's slot once it is free
    assert a.lookup(h1)["address"] == base
    h3 = a.allocate(3, 0)
    for h in (h1, h2, h3):
      a.free(h)
    s = a.stats()
    assert s.footprint_bytes == 8192 and s.live_bytes == 0 and s.peak_requested_bytes == 7096


# Bad handles ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", [*DYNAMIC, "planned"])
def test_stale_double_foreign_handles_raise(mode):
  a = _planned() if mode == "planned" else _dynamic(mode)
  other = _dynamic("best_fit")
  h = a.allocate(0, 4096) if mode == "planned" else a.allocate(5000)
  a.free(h)
  with pytest.raises(ValueError, match=r"double free of handle 0x[0-9a-f]{16}.*already freed"):
    a.free(h)
  with pytest.raises(ValueError, match=r"stale handle .*use after free"):
    a.read(h)
  with pytest.raises(ValueError, match=r"stale handle"):
    a.write(h, b"abc")
  with pytest.raises(ValueError, match=r"stale handle"):
    a.lookup(h)
  foreign = other.allocate(100)
  for bad in (foreign, 0, 12345, h + 1_000_000, h ^ (1 << 50), 2**64 - 1):
    with pytest.raises(ValueError, match=r"foreign handle .*never issued"):
      a.free(bad)
  with pytest.raises(ValueError, match="foreign handle"):
    a.read(foreign)
  with pytest.raises((TypeError, OverflowError)):
    a.free(-1)
  assert a.stats().errors == 4 + 6 + 1
  # The arena still works after the errors; the foreign handle is still live in its own arena.
  h2 = a.allocate(1, 1000) if mode == "planned" else a.allocate(10)
  a.free(h2)
  other.free(foreign)
  assert a.stats().live_allocations == 0 and other.stats().live_allocations == 0
  a.close()
  other.close()
  with pytest.raises(ValueError, match="closed"):
    a.allocate(1)
  a.close()  # idempotent
  assert "closed" in repr(a)


def test_handles_never_reused():
  with _dynamic("best_fit") as a:
    seen = set()
    for _ in range(1000):
      h = a.allocate(64)
      assert h not in seen
      seen.add(h)
      a.free(h)


# Planned-mode checks --------------------------------------------------------------

def test_planned_rejects_mismatches():
  with _planned() as a:
    with pytest.raises(ValueError, match="planned for 4096 bytes but 4095"):
      a.allocate(0, 4095)
    with pytest.raises(ValueError, match="not in the plan"):
      a.allocate(99, 10)
    h0 = a.allocate(0, 4096)
    with pytest.raises(ValueError, match="already live"):
      a.allocate(0, 4096)
    with pytest.raises(ValueError, match=r"overlaps a live slot at \[0, 4096\)"):
      a.allocate(1, 1000)
    with pytest.raises(TypeError, match="virtual' or 'best_fit"):
      a.stress(10)
    a.free(h0)
    h1 = a.allocate(1, 1000)
    a.free(h1)
    assert a.stats().errors == 4
  with pytest.raises(ValueError, match="nbytes must equal size"):
    with _dynamic("virtual") as d:
      d.allocate(5, 6)
  with pytest.raises(ValueError, match="not a multiple of 64"):
    HostArena("planned", offsets=[32], sizes=[10])
  with pytest.raises(ValueError, match="outside the planned footprint"):
    HostArena("planned", offsets=[0], sizes=[100], footprint=64)
  with pytest.raises(ValueError, match="same ids"):
    HostArena("planned", offsets=[0, 64], sizes=[10])
  with pytest.raises(ValueError, match="unknown arena mode"):
    HostArena("first_fit")


# Stress ---------------------------------------------------------------------------

def _check_stress(r: dict, n_ops: int) -> None:
  assert r["first_error"] == "", r["first_error"]
  assert r["ops"] == n_ops
  assert r["corrupted"] == 0
  assert r["alloc_failures"] == 0 and r["free_failures"] == 0
  assert r["bad_handle_probes"] > 0 and r["bad_handle_accepted"] == 0
  assert r["allocs"] == r["frees"] > n_ops // 3
  assert r["live_at_end"] == 0 and r["live_allocations_at_end"] == 0
  s = r["stats"]
  assert s["allocs"] == s["frees"] == r["allocs"]
  assert s["errors"] == r["bad_handle_probes"]
  assert s["peak_live_bytes"] >= s["peak_requested_bytes"] > 0
  assert s["footprint_bytes"] >= s["peak_live_bytes"]


@pytest.mark.parametrize("mode", DYNAMIC)
def test_stress_million_ops(mode):
  r = arena_lib.stress(mode, 1_000_000, seed=1234, max_bytes=64 * KiB, chunk_bytes=64 * KiB)
  _check_stress(r, 1_000_000)
  assert r["seconds"] < 60


@pytest.mark.parametrize("mode", DYNAMIC)
def test_stress_multithreaded(mode):
  with _dynamic(mode) as a:
    r = a.stress(200_000, seed=7, max_bytes=256 * KiB, threads=4, max_live=64)
    _check_stress(r, 200_000)
    assert a.stats().live_allocations == 0


def test_python_threads_share_an_arena():
  errors = []
  with _dynamic("virtual") as a:
    def worker(seed):
      rng = np.random.default_rng(seed)
      try:
        for _ in range(300):
          n = int(rng.integers(1, 200_000))
          data = rng.integers(0, 256, size=n, dtype=np.uint8)
          h = a.allocate(n)
          a.write(h, data)
          if not np.array_equal(a.read(h), data):
            errors.append(f"mismatch {h:#x}")
          a.free(h)
      except Exception as e:  # noqa: BLE001 - reported below
        errors.append(repr(e))
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors
    assert a.stats().live_allocations == 0 and a.stats().allocs == 1200


def test_stress_capacity_is_enforced():
  r = arena_lib.stress("best_fit", 20_000, seed=3, max_bytes=1 * MiB, capacity_bytes=4 * MiB,
                       max_live=64)
  assert r["corrupted"] == 0 and r["alloc_failures"] > 0 and r["free_failures"] == 0
  assert r["footprint"] <= 4 * MiB and r["live_at_end"] == 0
  with HostArena("virtual", chunk_bytes=64 * KiB, capacity_bytes=256 * KiB) as a:
    h = a.allocate(200 * KiB)
    with pytest.raises(MemoryError, match="out of capacity"):
      a.allocate(100 * KiB)
    a.free(h)
    a.free(a.allocate(256 * KiB))
  with pytest.raises(ValueError, match="multiple of the page size"):
    HostArena("virtual", chunk_bytes=1000)


# Fragmentation --------------------------------------------------------------------

def _fragmenting_trace(n: int = 32) -> list:
  """Fills one 32 MiB best-fit segment with 1 MiB blocks, frees every other, then asks for 2 MiB."""
  trace, t = [], 0
  for i in range(1, n + 1):
    trace.append((t, i, 1 * MiB))
    t += 1
  for i in range(1, n + 1, 2):
    trace.append((t, -i))
    t += 1
  for j in range(n // 4):
    trace.append((t, 1000 + j, 2 * MiB))
    t += 1
  return trace


def test_virtual_beats_best_fit_on_fragmenting_trace():
  trace = _fragmenting_trace()
  bf = arena_lib.replay(trace, "best_fit", segment_bytes=32 * MiB)
  va = arena_lib.replay(trace, "virtual", chunk_bytes=64 * KiB)
  pl = arena_lib.replay(trace, "planned")
  assert bf.peak_requested_bytes == va.peak_requested_bytes == 32 * MiB
  assert va.peak_footprint_bytes == 32 * MiB          # ideal: no fragmentation at all
  assert bf.peak_footprint_bytes == 64 * MiB          # a second segment for the 2 MiB blocks
  assert va.peak_footprint_bytes <= bf.peak_footprint_bytes
  assert pl.peak_footprint_bytes == 32 * MiB          # the offline layout is optimal here
  # Mid-trace the best-fit arena holds 16 MiB free in 1 MiB holes: external fragmentation.
  with HostArena("best_fit", segment_bytes=32 * MiB) as a:
    hs = [a.allocate(MiB) for _ in range(32)]
    for h in hs[::2]:
      a.free(h)
    s = a.stats()
    assert s.free_bytes == 16 * MiB and s.largest_free_block_bytes == MiB
    assert s.external_fragmentation == pytest.approx(1 - 1 / 16)
  with HostArena("virtual", chunk_bytes=MiB) as a:
    hs = [a.allocate(MiB) for _ in range(32)]
    for h in hs[::2]:
      a.free(h)
    s = a.stats()
    assert s.external_fragmentation == 0 and s.largest_free_block_bytes == 16 * MiB
    h = a.allocate(16 * MiB)                      # served from the 16 scattered chunks
    assert a.stats().footprint_bytes == 32 * MiB and a.stats().pool_chunks == 32
    data = np.random.default_rng(0).integers(0, 256, size=16 * MiB, dtype=np.uint8)
    a.write(h, data)
    np.testing.assert_array_equal(a.read(h), data)


def test_stats_consistency():
  rng = np.random.default_rng(5)
  for mode in DYNAMIC:
    with _dynamic(mode) as a:
      live = {}
      for _ in range(2000):
        if live and rng.random() < 0.45:
          h = list(live)[int(rng.integers(len(live)))]
          a.free(h)
          del live[h]
        else:
          n = int(rng.integers(0, 300_000))
          live[a.allocate(n)] = n
        s = a.stats()
        assert s.requested_live_bytes == sum(live.values())
        assert s.live_allocations == len(live)
        assert s.peak_live_bytes >= s.live_bytes >= s.requested_live_bytes
        assert s.peak_requested_bytes >= s.requested_live_bytes
        assert s.footprint_bytes >= s.live_bytes
        assert s.free_bytes == s.footprint_bytes - s.live_bytes
        assert 0 <= s.internal_fragmentation < 1 and 0 <= s.external_fragmentation < 1
        if s.live_bytes:
          assert s.internal_fragmentation == pytest.approx(
              1 - s.requested_live_bytes / s.live_bytes)
      if mode == "virtual":
        assert s.external_fragmentation == 0
        assert s.footprint_bytes == s.pool_chunks * s.chunk_bytes
        assert s.map_calls >= s.unmap_calls
      else:
        assert s.segments >= 1
      freed = a.free_all()
      assert freed == len(live)
      s = a.stats()
      assert s.live_bytes == 0 and s.requested_live_bytes == 0 and s.live_allocations == 0
      assert s.internal_fragmentation == 0
      assert s.peak_live_bytes >= s.live_bytes and s.peak_footprint_bytes >= s.footprint_bytes > 0


# Traces ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", arena_lib.MODES)
def test_replay_verifies_data(mode):
  rng = np.random.default_rng(2)
  trace, live, t, nxt = [], [], 0, 1
  for _ in range(400):
    if live and rng.random() < 0.5:
      i = live.pop(int(rng.integers(len(live))))
      trace.append((t, -i))
    else:
      trace.append((t, nxt, int(rng.integers(1, 100_000))))
      live.append(nxt)
      nxt += 1
    t += 1
  s = arena_lib.replay(trace, mode, iterations=2, verify=True, chunk_bytes=64 * KiB)
  assert s.live_allocations == 0 and s.allocs == s.frees == 2 * (nxt - 1)
  assert s.peak_footprint_bytes >= s.peak_requested_bytes


def test_replay_rejects_malformed_traces():
  with pytest.raises(ValueError, match="not live"):
    arena_lib.replay([(0, -3)], "best_fit")
  with pytest.raises(ValueError, match="twice"):
    arena_lib.replay([(0, 1, 10), (1, 1, 10)], "virtual")
  with pytest.raises(ValueError, match="bad trace event"):
    arena_lib.replay([(0, 0, 10)], "virtual")


def test_offload_trace_of_a_plan(mlp_small):
  step, args = mlp_small
  prog = jaxmem.analyze(step, *args)
  plan = jaxmem.plan(step, *args, budget=int(prog.peak_bytes * 0.5))
  trace = offload_trace(plan)
  assert len(trace) == 2 * plan.num_offload > 0
  allocs = [e for e in trace if len(e) == 3]
  frees = [e for e in trace if len(e) == 2]
  assert sum(e[2] for e in allocs) == plan.offloaded_bytes
  assert sorted(-e[1] for e in frees) == sorted(e[1] for e in allocs)
  assert [e[0] for e in trace] == sorted(e[0] for e in trace)
  assert offload_trace(plan.schedule()) == trace
  for mode in arena_lib.MODES:
    s = arena_lib.replay(trace, mode, chunk_bytes=64 * KiB, verify=True)
    assert s.live_allocations == 0 and s.allocs == plan.num_offload
  with pytest.raises(TypeError):
    offload_trace(42)


def test_offload_trace_of_an_async_schedule(mlp_small):
  import inspect
  from jaxmem._src.plan import schedule
  if "copies" not in inspect.signature(schedule.build_schedule).parameters:
    pytest.skip("no windowed (async) copies in this schedule")
  step, args = mlp_small
  prog = jaxmem.analyze(step, *args)
  plan = jaxmem.plan(step, *args, budget=int(prog.peak_bytes * 0.5))
  sched = schedule.build_schedule(plan.program, plan.decisions, plan.pinned, copies="async",
                                  budget=None)
  sync = offload_trace(plan.schedule())
  trace = offload_trace(sched)
  # Same buffers, each freed exactly once, whatever mix of sync and windowed copies.
  assert sorted(e[2] for e in trace if len(e) == 3) == sorted(e[2] for e in sync if len(e) == 3)
  assert sorted(-e[1] for e in trace if len(e) == 2) == list(range(1, plan.num_offload + 1))
  s = arena_lib.replay(trace, "virtual", chunk_bytes=64 * KiB, verify=True)
  assert s.live_allocations == 0 and s.allocs == plan.num_offload
