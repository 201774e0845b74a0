from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nostall.memory.ranges import Ranges


def test_best_fit_prefers_the_smallest_hole_and_coalesces():
    r = Ranges(100)
    a, b, c = r.carve(10), r.carve(30), r.carve(20)
    r.give_back(a, 10)
    r.give_back(c, 20)  # holes: [0,10) and [40,100)
    assert r.carve(8) == 0  # the smaller hole that fits
    r.give_back(0, 8)
    r.give_back(b, 30)
    assert r.runs() == [(0, 100)]


def test_preferred_offset_is_taken_when_free():
    r = Ranges(100)
    assert r.carve(10, prefer=50) == 50
    assert r.runs() == [(0, 50), (60, 40)]
    assert r.carve(60, prefer=0) is None  # no run of 60 left
    assert r.carve(40, prefer=45) == 60  # preferred range busy: best fit instead
    assert not r.take(55, 2)


def test_high_carves_from_the_top_so_the_room_it_leaves_joins_the_free_run():
    r = Ranges(100)
    assert r.carve(10) == 0
    assert r.carve(20, high=True) == 80  # [0,10) [80,100) taken
    assert r.carve(30) == 10  # best fit from the low end
    r.give_back(80, 20)
    assert r.runs() == [(40, 60)]  # one run: what left joined the free space


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40)), max_size=60))
def test_carved_ranges_never_overlap_and_everything_comes_back(ops):
    r = Ranges(256)
    held: list[tuple[int, int]] = []
    for op, size in ops:
        if op == 0 and held:
            off, n = held.pop(size % len(held))
            r.give_back(off, n)
        else:
            off = r.carve(size, high=op == 2)
            if off is None:
                assert r.largest < size
                continue
            for o, n in held:
                assert off + size <= o or o + n <= off
            held.append((off, size))
        assert r.free + sum(n for _, n in held) == 256
    for off, n in held:
        r.give_back(off, n)
    assert r.runs() == [(0, 256)]
