from __future__ import annotations

import ctypes
import gc
import logging
import sys
import threading
import time

import pytest
import torch

from nostall.errors import ArgumentError, BusyError, ClosedError, NostallError, PoolExhausted
from nostall.memory.host import PAGE
from nostall.memory.pool import GRANULE, PinnedPool, size_class

MB = 1_000_000


@pytest.fixture
def pool():
    p = PinnedPool(128 << 20, slab_bytes=32 << 20, pin=False)
    assert p.wait_pinned(timeout=30)
    yield p
    p.close(timeout=5)  # a test that forgets a held block fails here, not after a minute


def test_size_classes_round_up_and_bound_waste():
    assert size_class(1) == GRANULE
    assert size_class(GRANULE + 1) == 2 * GRANULE
    for n in (17 << 20, 300 * MB, 2_800 * MB, 23_780 * MB):
        c = size_class(n)
        assert n <= c <= n * 1.125 + GRANULE
        assert c % GRANULE == 0
    # MuseAI's example lands in one class: the 2.9 GB load reuses the freed 2.8 GB block.
    assert size_class(2_800 * MB) == size_class(2_900 * MB)
    with pytest.raises(ValueError):
        size_class(0)


def test_museai_sequence_reuses_the_freed_block(pool):
    # The example scaled down 100x: load 28 MB, load 85 MB, free 28 MB, load 29 MB.
    a = pool.allocate(28 * MB)
    b = pool.allocate(85 * MB) if size_class(85 * MB) + a.size <= pool.capacity else None
    first = a.offset
    a.release()
    c = pool.allocate(29 * MB)
    assert c.offset == first  # same memory, nothing new carved or pinned
    assert pool.stats().blocks == (3 if b else 2) - 1
    c.release()
    if b:
        b.release()
    s = pool.stats()
    assert s.free == pool.capacity and s.largest_free == pool.capacity and s.fragmentation == 0


def test_exhaustion_is_a_clear_error_and_leaves_pool_usable(pool):
    held = pool.allocate(100 << 20)
    with pytest.raises(PoolExhausted, match="cannot hold") as info:
        pool.allocate(64 << 20)
    e = info.value
    assert e.requested == 64 << 20 and e.capacity == 128 << 20
    assert e.in_use == held.size and e.largest_free == (128 << 20) - held.size
    held.release()
    pool.allocate(64 << 20).release()
    assert pool.stats().in_use == 0


def test_freed_neighbours_coalesce(pool):
    blocks = [pool.allocate(16 << 20) for _ in range(4)]
    for b in (blocks[1], blocks[3], blocks[2]):
        b.release()
    s = pool.stats()
    assert s.largest_free == pool.capacity - (16 << 20)
    blocks[0].release()
    assert pool.stats().largest_free == pool.capacity


def test_fragmentation_statistic(pool):
    blocks = [pool.allocate(16 << 20) for _ in range(8)]
    for b in blocks[::2]:
        b.release()
    s = pool.stats()
    assert s.free == 64 << 20 and s.largest_free == 16 << 20
    assert s.fragmentation == pytest.approx(0.75)
    for b in blocks[1::2]:
        b.release()


def test_cached_blocks_are_reused_then_evicted_lru(pool):
    a = pool.allocate(50 << 20, key="a")
    a.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    a.release()
    hit = pool.lookup("a")
    assert hit is a and hit.tensor[:4].tolist() == [1, 2, 3, 4]
    hit.release()
    b = pool.allocate(50 << 20, key="b")
    b.release()
    pool.lookup("a").release()  # "a" is now more recently used than "b"
    c = pool.allocate(50 << 20, key="c")  # does not fit: evicts the LRU entry, "b"
    assert set(pool.cached_keys()) == {"a"}
    c.release()
    assert set(pool.cached_keys()) == {"a", "c"}
    assert pool.evict("a") == a.size
    assert pool.lookup("a") is None


def test_no_eviction_when_caller_drives_it():
    with PinnedPool(64 << 20, slab_bytes=32 << 20, pin=False, evict=False) as p:
        p.allocate(48 << 20, key="x").release()
        with pytest.raises(PoolExhausted, match=r"pool\.evict"):
            p.allocate(32 << 20)
        assert p.evict() == 48 << 20
        p.allocate(32 << 20).release()


def test_held_blocks_are_never_evicted(pool):
    a = pool.allocate(100 << 20, key="a")  # held, not released
    with pytest.raises(PoolExhausted):
        pool.allocate(64 << 20)
    assert pool.evict() == 0
    a.release()


def test_newer_entry_replaces_older_of_same_key(pool):
    old = pool.allocate(8 << 20, key="k")
    old.release()
    new = pool.allocate(8 << 20, key="k")
    new.release()
    hit = pool.lookup("k")
    assert hit is new
    hit.release()
    assert pool.stats().blocks == 1


def test_double_release_is_caught(pool):
    pool.allocate(4 << 20, key="k").release()
    assert pool.lookup("k-other") is None
    a, b = pool.lookup("k"), pool.lookup("k")
    assert a is b and a.holders == 2
    a.release()
    b.release()
    with pytest.raises(RuntimeError, match="released more often"):
        a.release()


def test_use_after_close(pool):
    pool.close()
    with pytest.raises(ClosedError):
        pool.allocate(1)
    with pytest.raises(ClosedError):
        pool.lookup("x")
    pool.close()  # idempotent


def test_capacity_beyond_the_memory_limit_is_refused(monkeypatch):
    from nostall.memory import pool as pool_mod

    monkeypatch.setattr(pool_mod, "memory_limit", lambda: (256 << 20, "cgroup"))
    with pytest.raises(ArgumentError, match="cgroup limit") as info:
        PinnedPool(512 << 20, pin=False)
    assert isinstance(info.value, NostallError) and isinstance(info.value, ValueError)
    monkeypatch.setattr(pool_mod, "memory_limit", lambda: (256 << 20, "machine"))
    with pytest.raises(ArgumentError, match="machine's memory"):
        PinnedPool(512 << 20, pin=False)
    with pytest.raises(ArgumentError):
        PinnedPool(0)
    with pytest.raises(ArgumentError):
        PinnedPool(-5)


def test_capacity_above_available_memory_only_warns(monkeypatch, caplog):
    # A VM whose memory grows on demand reports little available at start (31 GiB of
    # 256 GiB seen): that must not refuse a pool within the real limit.
    from nostall.memory import pool as pool_mod

    monkeypatch.setattr(pool_mod, "memory_limit", lambda: (1 << 40, "machine"))
    monkeypatch.setattr(pool_mod, "memory_available", lambda: 16 << 20)
    with caplog.at_level(logging.WARNING), PinnedPool(64 << 20, pin=False) as p:
        assert p.capacity == 64 << 20
    assert "available" in caplog.text


def test_cgroup_limits_v1_and_v2(tmp_path):
    from nostall.memory.host import _cgroup_limit

    v2 = tmp_path / "v2"
    (v2 / "kube" / "pod").mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "kube" / "memory.max").write_text(f"{8 << 30}\n")
    (v2 / "kube" / "pod" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup2"
    proc.write_text("0::/kube/pod\n")
    assert _cgroup_limit(str(proc), str(v2)) == 8 << 30  # an ancestor's limit binds

    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    proc1 = tmp_path / "cgroup1"
    # Inside a container the memory controller is mounted at the cgroup itself.
    proc1.write_text("4:memory:/process_api/abc\n1:cpu:/\n")
    assert _cgroup_limit(str(proc1), str(v1)) == 3 << 30
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert _cgroup_limit(str(proc1), str(v1)) is None  # "unlimited"
    assert _cgroup_limit(str(tmp_path / "missing"), str(v1)) is None


def test_close_waits_for_a_block_another_thread_holds(pool):
    held = pool.allocate(8 << 20, key="k")
    order = []

    def holder():
        deadline = time.monotonic() + 10
        while not pool.closed and time.monotonic() < deadline:  # close() has begun
            time.sleep(0.001)
        order.append(("released", pool.arena._map is not None))
        held.release()

    t = threading.Thread(target=holder)
    t.start()
    pool.close()
    order.append(("closed", pool.arena._map is not None))
    t.join(10)
    # It waited for the holder, the memory still mapped until then, and pulled it after.
    assert order == [("released", True), ("closed", False)]


def test_close_refuses_with_busy_error_then_succeeds_after_release():
    p = PinnedPool(32 << 20, slab_bytes=16 << 20, pin=False)
    held = p.allocate(8 << 20)
    with pytest.raises(BusyError, match="still held"):
        p.close(timeout=0.05)
    with pytest.raises(ClosedError):
        p.allocate(1)  # closing: nothing new is handed out
    held.release()
    p.close(timeout=0.05)
    assert p.arena._map is None


def test_a_dropped_pool_stops_pinning_and_unmaps():
    p = PinnedPool(64 << 20, slab_bytes=16 << 20, pin=False)
    arena, fin = p.arena, p._finalizer
    p.allocate(4 << 20, key="x").release()
    del p
    gc.collect()
    assert not fin.alive
    assert arena._map is None


def test_pool_open_at_exit_is_torn_down(fork_python):
    # The README's pattern: create a pool and exit while it is still pinning. The pin
    # thread must be stopped and joined by the pool's exit hook, not killed mid-call, and
    # every segment it registered unregistered. A fake CUDA runtime holds the first
    # registration until the script's own exit hook runs, so pinning is under way then.
    code = (
        "import atexit, threading, torch\n"
        "import nostall.memory.host as h, nostall\n"
        "inside, ended = threading.Event(), threading.Event()\n"
        "calls = {'register': 0, 'unregister': 0}\n"
        "class Cudart:\n"
        "    def cudaHostRegister(self, ptr, size, flags):\n"
        "        calls['register'] += 1\n"
        "        inside.set()\n"
        "        ended.wait(30)\n"
        "        return 0\n"
        "    def cudaHostUnregister(self, ptr):\n"
        "        calls['unregister'] += 1\n"
        "        return 0\n"
        "torch.cuda.cudart = Cudart\n"
        "orig = h.HostArena.close\n"
        "def close(self):\n"
        "    orig(self)\n"
        "    print('teardown', calls['register'], calls['unregister'], flush=True)\n"
        "h.HostArena.close = close\n"
        "pool = nostall.PinnedPool(256 << 20, slab_bytes=2 << 20, pin=True)\n"
        "assert inside.wait(30)\n"
        "atexit.register(ended.set)  # runs before the pool's hook: exit hooks run LIFO\n"
    )
    p = fork_python(code, stderr=True)  # a process of its own (the conftest's fixture)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    assert "Traceback" not in stderr
    (line,) = [x for x in stdout.splitlines() if x.startswith("teardown")]
    registered, unregistered = map(int, line.split()[1:])
    assert 1 <= registered < 128  # stopped mid-way, not left to pin all 128 slabs
    assert unregistered == registered


class _GateEvent:
    """A stand-in for a CUDA event whose copy ends when the test says so."""

    def __init__(self):
        self.gate = threading.Event()
        self.waited = threading.Event()

    def query(self):
        return self.gate.is_set()

    def synchronize(self):
        self.waited.set()
        self.gate.wait(10)


def test_memory_read_by_a_copy_is_reused_only_after_it_and_the_lock_stays_free(pool):
    a = pool.allocate(100 << 20, key="a")
    event = _GateEvent()
    a.fence(event)  # a copy still reads block "a"
    a.release()
    got = []
    t = threading.Thread(target=lambda: got.append(pool.allocate(100 << 20)))
    t.start()  # evicts "a", then must wait for the copy before reusing its memory
    assert event.waited.wait(5)
    assert not got
    # The pool's lock is free while that thread waits: stats and lookups answer at once.
    t0 = time.perf_counter()
    s = pool.stats()
    assert pool.lookup("nothing") is None
    assert time.perf_counter() - t0 < 1.0
    assert s.cached == 0 and s.in_use == 0
    event.gate.set()
    t.join(5)
    assert got and got[0].offset == a.offset
    got[0].release()


def test_invalidated_block_is_not_cached(pool):
    b = pool.allocate(4 << 20, key="k")
    b.invalidate()
    b.release()
    assert pool.lookup("k") is None
    assert pool.stats().blocks == 0


class _FakeCudart:
    """Records registrations; refuses the ``refuse``-th one (0-based) as a host may."""

    def __init__(self, refuse: int | None = None):
        self.refuse = refuse
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.calls = 0

    def cudaHostRegister(self, ptr, size, flags):
        self.calls += 1
        if self.calls - 1 == self.refuse:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_pinned_stat_counts_what_cuda_registered_and_close_unregisters_it(monkeypatch):
    fake = _FakeCudart(refuse=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    pool = PinnedPool(64 << 20, slab_bytes=16 << 20, pin=True)
    assert pool.wait_pinned(timeout=30)
    # Four slabs, the second refused: it stays pageable and is not counted as pinned.
    assert pool.stats().pinned == 48 << 20
    base = pool.arena.address
    assert [(p - base, n) for p, n, _ in fake.registered] == [
        (0, 16 << 20),
        (32 << 20, 16 << 20),
        (48 << 20, 16 << 20),
    ]
    assert {f for _, _, f in fake.registered} == {1}  # portable: every GPU copies at speed
    assert "pinned=50331648" in repr(pool)
    pool.close()
    assert sorted(fake.unregistered) == [p for p, _, _ in fake.registered]
    assert pool.stats().pinned == 0


def test_a_pool_that_does_not_pin_never_calls_cuda(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with PinnedPool(64 << 20, slab_bytes=16 << 20, pin=False) as p:
        assert p.wait_pinned(timeout=0)  # nothing to wait for
        b = p.allocate(32 << 20)
        b.tensor.fill_(7)
        b.release()
        assert p.stats().pinned == 0
    assert fake.calls == 0 and fake.unregistered == []


def _resident(address: int, length: int) -> int:
    """Bytes of ``[address, address + length)`` in RAM now (``mincore``; Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (-(-length // PAGE)))()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) != 0:
        pytest.skip(f"mincore failed (errno {ctypes.get_errno()}): residency is not observable")
    return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) * PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency is Linux's")
def test_a_pageable_pool_touches_only_the_blocks_that_are_written():
    # Touching every page of a pin=False pool at construction made a test process
    # reach 13 GiB RSS. Slack: a transparent huge page may fault in around an edge.
    slack = 8 << 20
    with PinnedPool(512 << 20, slab_bytes=64 << 20, pin=False) as p:
        assert p.wait_pinned(timeout=30)
        start, size = p.arena.address, p.arena.nbytes
        assert _resident(start, size) < slack
        b = p.allocate(64 << 20)
        assert _resident(start, size) < slack  # carving a block touches nothing either
        b.tensor.fill_(1)
        inside = _resident(start + b.offset, b.size)
        assert inside == b.size
        assert _resident(start, size) - inside < slack
        b.release()


def test_a_block_whose_pinning_fails_is_given_back(monkeypatch):
    with PinnedPool(4 * GRANULE, pin=False) as pool:

        def failed(upto, timeout):
            raise NostallError("pinning failed (simulated)")

        monkeypatch.setattr(pool._pinning, "wait", failed)
        for _ in range(3):  # the whole pool each time: a leaked block would exhaust it
            with pytest.raises(NostallError, match="simulated"):
                pool.allocate(4 * GRANULE, key="ckpt")
        assert pool.lookup("ckpt") is None  # never written, so never served
        stats = pool.stats(hugepages=False)
        assert (stats.in_use, stats.blocks, stats.free) == (0, 0, pool.capacity)
