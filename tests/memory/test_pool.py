from __future__ import annotations

import gc

import pytest
import torch

from nostall.errors import ClosedError, PoolExhausted
from nostall.memory.pool import GRANULE, PinnedPool, size_class

MB = 1_000_000


@pytest.fixture
def pool():
    p = PinnedPool(128 << 20, slab_bytes=32 << 20, pin=False)
    assert p.wait_pinned(timeout=30)
    yield p
    p.close()


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


def test_leased_cpu_tensors_pin_the_block_until_garbage(pool):
    a = pool.allocate(100 << 20, key="a")
    t = a.lease_tensor()[10:20].view(torch.int16)  # a view keeps the lease too
    a.release()
    with pytest.raises(PoolExhausted):
        pool.allocate(64 << 20)  # "a" is cached but leased
    assert pool.stats().in_use == a.size
    del t
    gc.collect()
    assert pool.stats().cached == a.size
    pool.allocate(64 << 20).release()  # now "a" could be evicted
    assert pool.cached_keys() == []


def test_uncached_leased_block_frees_when_tensor_dies(pool):
    a = pool.allocate(10 << 20)
    t = a.lease_tensor()
    a.release()
    assert pool.stats().blocks == 1
    del t
    gc.collect()
    assert pool.stats().blocks == 0 and pool.stats().free == pool.capacity


def test_newer_entry_replaces_older_of_same_key(pool):
    old = pool.allocate(8 << 20, key="k")
    old.release()
    new = pool.allocate(8 << 20, key="k")
    new.release()
    assert pool.lookup("k") is new
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


def test_capacity_beyond_available_memory_is_refused():
    with pytest.raises(ValueError, match="available"):
        PinnedPool(1 << 50, pin=False)
    with pytest.raises(ValueError):
        PinnedPool(0)


def test_leased_views_survive_close():
    p = PinnedPool(8 << 20, pin=False)
    b = p.allocate(4 << 20)
    t = b.lease_tensor()
    t[:3] = 7
    b.release()
    p.close()
    assert t[:3].tolist() == [7, 7, 7]  # still mapped: the view owns the mapping now


def test_stats_without_cuda_report_nothing_pinned(pool):
    assert pool.stats().pinned == 0
    assert "PinnedPool(" in repr(pool)
