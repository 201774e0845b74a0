"""The host tier over a real (unpinned) pool: admission evicts only what makes room."""

from __future__ import annotations

import pytest
import torch

from nostall.cache.host import HostTier, store_bytes

MB = 1 << 20


@pytest.fixture
def tier():
    # Four resident 2 MiB blocks fill an 8 MiB tier: A B C D, in address order.
    t = HostTier(8 * MB, torch.device("cpu"))
    for key in "ABCD":
        t.pool.allocate(2 * MB, key=key).release()
    for _ in range(5):
        t.request("B")  # B is in regular use; A, C and D were never asked for again
    yield t
    t.close()


def _offsets(t: HostTier) -> dict[str, int]:
    out = {}
    for key in t.pool.cached_keys():
        block = t.pool.lookup(key)
        out[key] = block.offset
        block.release()
    return out


def test_the_residents_lie_where_the_tier_sees_them(tier):
    assert _offsets(tier) == {"A": 0, "B": 2 * MB, "C": 4 * MB, "D": 6 * MB}


def test_no_resident_leaves_when_the_newcomer_could_still_not_fit(tier):
    # A, C and D may give way (never requested), freeing 6 MiB, but B splits that into
    # runs of 2 and 4 MiB: a 6 MiB block can never fit, so all of them stay.
    tier.begin()
    assert not tier.admit("new", 6 * MB, prior=1, keep=set())
    assert tier.resident() == {"A", "B", "C", "D"}


def test_an_admission_evicts_only_the_run_it_needs_and_the_pool_carves_it_there(tier):
    tier.begin()
    assert tier.admit("new", 4 * MB, prior=1, keep=set())
    assert tier.resident() == {"A", "B"}  # A was not in the way: it stays
    # In the same switch, a second newcomer is not promised the run the first one took
    # (nor is A evicted for a room it cannot make).
    assert not tier.admit("y", 4 * MB, prior=1, keep=set())
    assert tier.resident() == {"A", "B"}
    tier.pool.allocate(4 * MB, key="new").release()  # what the loader does next
    assert _offsets(tier)["new"] == 4 * MB


def test_the_switch_in_progress_and_regular_residents_keep_their_place(tier):
    tier.begin()
    assert not tier.admit("new", 4 * MB, prior=1, keep={"C"})  # C and D would be the run
    assert not tier.admit("big", 8 * MB, prior=3, keep=set())  # B outranks it
    assert tier.resident() == {"A", "B", "C", "D"}


def test_a_cpu_tier_pins_nothing(tier):
    assert tier.pool.pin is False and tier.pool.stats(hugepages=False).pinned == 0


def test_the_store_sized_budget_counts_each_distinct_component_once(store, tmp_path):
    from nostall.cache import Store
    from nostall.memory.pool import size_class
    from nostall.transfer.plan import LoadPlan

    s = Store(store, cache_dir=tmp_path)
    for name in s.names():
        s.index_files(name)  # content known: flux and flux-b share their encoders and VAE
    blocks = {
        c.digest: size_class(LoadPlan(c.checkpoint).host_bytes)
        for name in s.names()
        for c in s.entry(name).weights
    }
    every = sum(1 for name in s.names() for _ in s.entry(name).weights)
    assert len(blocks) < every  # shared components counted once
    assert store_bytes(s, 1 << 40) == sum(blocks.values())
    assert store_bytes(s, 4 * MB) == 4 * MB  # never more than the cap
