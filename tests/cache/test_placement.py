"""The placement policy over plain offsets and byte counts: no torch, no memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nostall.cache.placement import (
    Extent,
    Requests,
    admit,
    best_fit,
    evictable,
    free_runs,
    lru_victim,
    make_room,
)

MODULE = Path(__file__).parents[2] / "src" / "nostall" / "cache" / "placement.py"


def test_the_module_loads_without_torch_or_the_package():
    code = (
        "import importlib.util, sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        f"spec = importlib.util.spec_from_file_location('placement', {str(MODULE)!r})\n"
        "m = sys.modules['placement'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "print(m.best_fit([(0, 8)], 4))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_free_runs_are_the_gaps_between_taken_ranges():
    assert free_runs(100, []) == [(0, 100)]
    assert free_runs(100, [(0, 100)]) == []
    assert free_runs(100, [(60, 10), (0, 20)]) == [(20, 40), (70, 30)]


def test_best_fit_takes_the_smallest_run_then_the_lowest_address():
    runs = [(0, 30), (40, 20), (70, 20), (95, 5)]
    assert best_fit(runs, 15) == 40  # 20 beats 30; of the two 20s, the lower
    assert best_fit(runs, 25) == 0
    assert best_fit(runs, 31) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=50))
def test_best_fit_predicts_the_allocator(ops):
    # The host tier reserves a block where it predicts the pool will carve it: the
    # prediction must be the allocator's own choice, every time.
    from nostall.memory.ranges import Ranges

    r = Ranges(256)
    held: list[tuple[int, int]] = []
    for give, size in ops:
        if give and held:
            off, n = held.pop(size % len(held))
            r.give_back(off, n)
            continue
        predicted = best_fit(free_runs(256, held), size)
        assert r.carve(size) == predicted
        if predicted is not None:
            held.append((predicted, size))
        assert free_runs(256, held) == r.runs()


def test_only_idle_components_outside_the_switch_may_leave():
    rules = dict(keep={"k"}, protected={"p"}, current={"c"})
    assert evictable("x", 0, prefetch=False, **rules)
    assert not evictable("x", 1, prefetch=False, **rules)  # in a use() block
    assert not evictable("k", 0, prefetch=False, **rules)  # the switch needs it
    assert not evictable("p", 0, prefetch=False, **rules)  # prefetched, not used yet
    assert evictable("c", 0, prefetch=False, **rules)
    assert not evictable("c", 0, prefetch=True, **rules)  # a prefetch spares the current one


def test_the_lru_victim_is_the_smallest_of_the_oldest_that_frees_enough_else_the_largest():
    old_small, old_big = Extent("s", 0, 10, last_used=1), Extent("b", 10, 50, last_used=1)
    new = Extent("n", 60, 5, last_used=2)
    assert lru_victim([new, old_small, old_big], 8).key == "s"
    assert lru_victim([new, old_small, old_big], 20).key == "b"
    assert lru_victim([new, old_small, old_big], 80).key == "b"  # none is enough: largest
    assert lru_victim([], 1) is None


def test_make_room_evicts_oldest_first_until_a_run_fits_then_trims_to_the_watermark():
    a = Extent("a", 0, 30, last_used=1)
    b = Extent("b", 30, 30, last_used=2)
    c = Extent("c", 60, 30, last_used=3)
    # 10 free at the end; 35 needs a and b both gone (a alone leaves 30 + 0 contiguous).
    room = make_room(100, [a, b, c], {"a", "b", "c"}, 35, watermark=100)
    assert room.fit == ("a", "b") and room.trim == ()
    # Watermark 70: after placing 35 beside c (30) the tier holds 65: nothing to trim.
    assert make_room(100, [a, b, c], {"a", "b", "c"}, 35, watermark=70).trim == ()
    # Watermark 40: c (the only idle one left) goes too.
    assert make_room(100, [a, b, c], {"a", "b", "c"}, 35, watermark=40).trim == ("c",)
    # Room without evicting: nobody leaves.
    assert make_room(100, [a], {"a"}, 50, watermark=100).fit == ()


def test_make_room_evicts_nobody_when_no_run_could_fit():
    # b sits in the middle and is in use: a and c leaving frees 60 bytes, but in two
    # runs of 30. A placement of 40 cannot be certain: nothing may be evicted.
    a = Extent("a", 0, 30, last_used=1)
    b = Extent("b", 30, 40, last_used=1)
    c = Extent("c", 70, 30, last_used=1)
    assert make_room(100, [a, b, c], {"a", "c"}, 40, watermark=100) is None
    assert make_room(100, [a, b, c], {"a", "c"}, 30, watermark=100).fit == ("a",)


def test_admission_without_eviction_when_a_run_is_free():
    r = Extent("r", 0, 40, count=9)
    assert admit(60, 100, [r], prior=0).victims == ()
    assert admit(60, 100, [r], prior=0).offset == 40
    assert admit(101, 100, [], prior=99) is None  # larger than the tier


def test_admission_evicts_only_residents_requested_less_often():
    low = Extent("low", 0, 50, last_used=5, count=1)
    high = Extent("high", 50, 50, last_used=1, count=4)
    assert admit(50, 100, [low, high], prior=2).victims == ("low",)
    assert admit(50, 100, [low, high], prior=1) is None  # a tie keeps the resident
    assert admit(100, 100, [low, high], prior=3) is None  # high outranks the newcomer
    assert admit(100, 100, [low, high], prior=5).victims == ("low", "high")
    # A count aged to zero no longer defends its resident, whatever the newcomer's.
    stale = Extent("stale", 0, 50, count=0)
    assert admit(50, 100, [stale, high], prior=0).victims == ("stale",)
    # The switch's own components never leave.
    assert admit(50, 100, [low, high], prior=2, keep={"low"}) is None


def test_admission_under_fragmentation_evicts_nothing_unless_it_then_fits():
    # Three idle residents, each requested once, around a busy one. Evicting all three
    # would free 60 bytes, but in runs of 20 and 40: a block of 50 can never fit, so the
    # old rule (enough free bytes) evicted them and still refused. Now nobody leaves.
    a = Extent("a", 0, 20, last_used=1, count=1)
    busy = Extent("busy", 20, 40, last_used=9, count=9)
    b = Extent("b", 60, 20, last_used=2, count=1)
    c = Extent("c", 80, 20, last_used=3, count=1)
    assert admit(50, 100, [a, busy, b, c], prior=3) is None
    # 40 fits once b and c leave; a, the least valuable, is not needed for that run.
    got = admit(40, 100, [a, busy, b, c], prior=3)
    assert got is not None and set(got.victims) == {"b", "c"} and got.offset == 60


def test_admission_reserves_around_blocks_promised_in_the_same_switch():
    # The first newcomer takes the only free run; the second must not be promised it.
    first = admit(30, 100, [Extent("r", 0, 70, count=9)], prior=0)
    assert first.offset == 70
    assert admit(30, 100, [Extent("r", 0, 70, count=9)], prior=0, reserved=[(70, 30)]) is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 4)), min_size=1, max_size=8),
    st.integers(1, 100),
    st.integers(0, 5),
    st.data(),
)
def test_an_admission_always_fits_once_its_victims_are_gone(blocks, size, prior, data):
    residents, at = [], 0
    for i, (n, count) in enumerate(blocks):
        at += data.draw(st.integers(0, 10))  # gaps between residents
        if at + n > 100:
            break
        residents.append(Extent(f"r{i}", at, n, last_used=i, count=count))
        at += n
    got = admit(size, 100, residents, prior=prior)
    if got is None:
        return
    left = [(e.offset, e.size) for e in residents if e.key not in got.victims]
    runs = free_runs(100, left)
    assert best_fit(runs, size) == got.offset  # where the allocator puts it
    for e in residents:
        if e.key in got.victims:
            assert e.count < prior or e.count == 0  # only the less requested leave


def test_request_counts_age_so_old_favourites_fade():
    r = Requests(age_every=4)
    assert [r.request("a") for _ in range(3)] == [0, 1, 2]
    assert r.request("b") == 0  # the 4th request halves every count
    assert (r.count("a"), r.count("b"), r.last("a"), r.last("b")) == (1, 0, 3, 4)
    assert r.count("never") == 0 and r.last("never") == 0
