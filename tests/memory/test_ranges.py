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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_carved_ranges_never_overlap_and_everything_comes_back(ops):
    r = Ranges(256)
    held: list[tuple[int, int]] = []
    for give, size in ops:
        if give and held:
            off, n = held.pop(size % len(held))
            r.give_back(off, n)
        else:
            off = r.carve(size)
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
