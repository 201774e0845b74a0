"""The cost model of partial residency (nostall.stream.cost), a pure unit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nostall.stream.cost import plan, simulate, spread

MB = 1 << 20


def test_spread_takes_evenly_spaced_positions():
    assert spread(list(range(8)), 2) == [2, 6]
    assert spread(list(range(8)), 8) == list(range(8))
    assert spread([3, 5, 9], 0) == []


def test_a_call_is_bound_by_the_link_or_the_compute_whichever_is_longer():
    blocks = [10 * MB] * 8
    link = 10 * MB  # a block a second
    every = list(range(8))
    # no compute: the link moves every block once per call (a buffer per block would
    # keep them; 2 buffers: all 8 move)
    assert simulate(blocks, every, 2, link_bytes_s=link, compute_s=[0.0] * 8) == 8.0
    # slow compute: the copies hide behind it (the next call's first blocks land while
    # this one's last blocks compute)
    slow = simulate(blocks, every, 2, link_bytes_s=link, compute_s=[2.0] * 8)
    assert slow == 16.0
    # one buffer: each copy waits for the block before it, nothing overlaps
    assert simulate(blocks, every, 1, link_bytes_s=link, compute_s=[2.0] * 8) == 24.0
    # half the blocks resident, spread: their compute hides the others' copies
    half = simulate(blocks, [1, 3, 5, 7], 2, link_bytes_s=link, compute_s=[0.5] * 8)
    assert half == 4.0  # the 4 copies, back to back, are the bound


def test_as_many_blocks_stay_as_fit_and_the_largest_stream_first():
    blocks = [4 * MB] * 4 + [2 * MB] * 4  # (FLUX: double blocks, then single ones)
    whole = sum(blocks) + MB
    assert plan(blocks, MB, whole, link_bytes_s=1e9).resident
    p = plan(blocks, MB, whole - 3 * MB, link_bytes_s=1e9)
    assert p is not None and p.device_bytes <= whole - 3 * MB
    assert all(blocks[i] == 4 * MB for i in p.streamed)  # the large ones go first
    # nothing fits: its rest and one buffer of its largest block are more than given
    assert plan(blocks, MB, MB + 4 * MB - 1, link_bytes_s=1e9) is None
    assert plan(blocks, MB, MB + 4 * MB, link_bytes_s=1e9).depth == 1


def test_with_compute_known_the_fastest_plan_that_fits_wins():
    blocks = [10 * MB] * 8
    compute = [1.0] * 8
    budget = 6 * 10 * MB  # 6 blocks' worth
    p = plan(blocks, 0, budget, link_bytes_s=10 * MB, compute_s=compute)
    assert p is not None and p.predicted_call_s is not None
    others = [
        plan(blocks, 0, budget, link_bytes_s=10 * MB, compute_s=compute, depths=(d,))
        for d in (1, 2, 3)
    ]
    assert p.predicted_call_s == min(o.predicted_call_s for o in others if o is not None)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    rest=st.integers(0, 50),
    budget=st.integers(1, 600),
    more=st.integers(0, 100),
)
def test_a_plan_fits_its_budget_and_more_budget_never_streams_more(blocks, rest, budget, more):
    p = plan(blocks, rest, budget, link_bytes_s=10.0)
    if p is None:
        assert rest + max(blocks) > budget  # not even one buffer for everything
        return
    assert p.device_bytes <= budget
    assert p.resident_bytes + sum(blocks[i] for i in p.streamed) == rest + sum(blocks)
    q = plan(blocks, rest, budget + more, link_bytes_s=10.0)
    assert q is not None and q.streamed_bytes <= p.streamed_bytes
