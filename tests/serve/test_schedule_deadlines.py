"""Deadlines in the queue policy: earliest deadline first with each batch's switch priced,
a resident batch first when the urgent one still makes it, the late ones not chased,
the fairness bound kept; admission says when a deadline cannot be met and when to retry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nostall.errors import ArgumentError
from nostall.serve.schedule import Policy, Request, Scheduler

WIDE = Policy(batch=1, overtake=50, delay_s=1e6)  # the bound out of the way


def _ids(batch):
    return [r.id for r in batch]


def _drain(s: Scheduler, resident: set[str], now: float = 0.0) -> list:
    """Run the queue out with estimates exact; returns ids in run order."""
    order = []
    while len(s):
        batch = s.next(resident, now=now)
        lead = batch[0]
        seconds = (0.0 if lead.pipeline in resident else s.switch_estimate(lead.pipeline)) + sum(
            s.run_estimate(r.pipeline, r.work) for r in batch
        )
        s.done(seconds)
        resident = {lead.pipeline}
        now += seconds
        order += _ids(batch)
    return order


def test_earliest_deadline_first_on_one_resident_pipeline():
    s = Scheduler(WIDE, run_s=1.0, switch_s=5.0)
    for i, due in enumerate([9.0, 3.0, 6.0, 2.0]):
        s.add(Request(i, "flux", "512", arrived=float(i) * 0.01, deadline=due))
    assert _drain(s, {"flux"}) == [3, 1, 2, 0]
    # without the time, the same queue runs in arrival order (deadlines unused)
    for i, due in enumerate([9.0, 3.0, 6.0, 2.0]):
        s.add(Request(i, "flux", "512", arrived=float(i) * 0.01, deadline=due))
    assert [_ids(s.next({"flux"}))[0] for _ in range(4)] == [0, 1, 2, 3]


def test_a_resident_batch_goes_first_when_the_urgent_switch_still_makes_its_deadline():
    s = Scheduler(WIDE, run_s=1.0, switch_s=5.0)
    s.add(Request("sdxl", "sdxl", "512", arrived=0.0, deadline=7.0))  # switch 5 + run 1
    s.add(Request("flux", "flux", "512", arrived=1.0, deadline=100.0))
    assert _ids(s.peek({"flux"}, now=0.0)) == ["flux"]  # 1 + 6 <= 7: flux fits before
    assert _ids(s.peek({"flux"}, now=0.5)) == ["sdxl"]  # 0.5 + 1 + 6 > 7: sdxl now
    # a resident batch of the urgent one's own pipeline needs no insertion: it runs
    s.add(Request("sdxl-2", "sdxl", "768", arrived=2.0, deadline=6.5))
    assert _ids(s.peek({"sdxl"}, now=0.0)) == ["sdxl-2"]


def test_requests_already_late_are_not_chased_and_the_rest_stay_on_time():
    s = Scheduler(WIDE, run_s=2.0, switch_s=0.0)
    s.add(Request("late", "flux", "512", arrived=0.0, deadline=1.0))  # needs 2 s
    s.add(Request("soon", "flux", "512", arrived=1.0, deadline=4.0))
    s.add(Request("later", "flux", "512", arrived=2.0, deadline=6.0))
    assert _drain(s, {"flux"}) == ["soon", "later", "late"]
    # with every deadline out of reach, arrival order
    for i in range(3):
        s.add(Request(i, "flux", "512", arrived=float(i), deadline=0.5))
    assert _drain(s, {"flux"}) == [0, 1, 2]


def test_the_fairness_bound_holds_against_deadlines():
    s = Scheduler(Policy(batch=1, overtake=1, delay_s=1e6), run_s=1.0, switch_s=0.0)
    s.add(Request("old", "flux", "512", arrived=0.0, deadline=50.0))
    for i in range(3):
        s.add(Request(i, "flux", "512", arrived=1.0 + i, deadline=2.0 + i))
    # 0 may overtake "old" once; 1 would be the second overtaking: "old" goes then
    assert _drain(s, {"flux"}) == [0, "old", 1, 2]


def test_admission_says_when_a_deadline_cannot_be_met_and_when_to_retry():
    s = Scheduler(WIDE, run_s=2.0, switch_s=5.0)
    for i, due in enumerate([6.0, 8.0, 10.0]):  # each just on time, 2 s apart
        s.add(Request(i, "flux", "512", arrived=float(i), deadline=due))
    new = Request("new", "flux", "512", arrived=3.0, deadline=3.0 + 4.0)
    # 1 s left of the running batch; 0 is more urgent, and after it (at 6) it can no
    # longer finish by 7: it waits behind the ones still on time, done at 12, 5 s late
    assert s.admit(new, {"flux"}, now=3.0, busy_s=1.0) == pytest.approx(5.0)
    assert "new" not in s and len(s) == 3  # nothing queued by asking
    roomy = Request("roomy", "flux", "512", arrived=3.0, deadline=3.0 + 9.0)
    assert s.admit(roomy, {"flux"}, now=3.0, busy_s=1.0) is None
    assert s.admit(Request("any", "sd3", "512", arrived=3.0), set(), now=3.0) is None
    # Retry-After is truthful: 5 s later two and a half jobs are done, and it fits
    s.next({"flux"}, now=3.0)
    s.next({"flux"}, now=5.0)
    again = Request("new", "flux", "512", arrived=8.0, deadline=8.0 + 4.0)
    assert s.admit(again, {"flux"}, now=8.0, busy_s=1.0) is None
    with pytest.raises(ArgumentError, match="is queued already"):
        s.admit(Request(2, "flux", "512", arrived=8.0, deadline=9.0), {"flux"}, now=8.0)


def test_a_deadline_must_be_a_time():
    with pytest.raises(ArgumentError, match="deadline=inf must be a finite time"):
        Scheduler().add(Request(0, "flux", "512", arrived=0.0, deadline=float("inf")))


def test_the_plan_lists_every_batch_back_to_back():
    s = Scheduler(WIDE, run_s=1.0, switch_s=4.0)
    s.add(Request(0, "sdxl", "512", arrived=0.0, deadline=20.0))
    s.add(Request(1, "flux", "512", arrived=1.0, deadline=2.0))
    plan = s.plan({"flux"}, busy_s=0.5, now=0.0)
    assert [(_ids(b), a, e) for b, a, e in plan] == [([1], 0.5, 1.5), ([0], 1.5, 6.5)]
    assert s.estimated_wait(1, {"flux"}, busy_s=0.5, now=0.0) == 1.5
    assert len(s) == 2


PIPES = ("flux", "sdxl", "sd3")


@st.composite
def _queues(draw):
    policy = Policy(
        batch=draw(st.integers(1, 3)),
        overtake=draw(st.integers(0, 4)),
        delay_s=draw(st.sampled_from([0.0, 3.0, 10.0, 1e6])),
    )
    n = draw(st.integers(0, 25))
    reqs = [
        Request(
            i,
            draw(st.sampled_from(PIPES)),
            draw(st.integers(0, 1)),
            arrived=float(i),
            work=draw(st.sampled_from([0.5, 1.0, 2.0])),
            deadline=draw(st.one_of(st.none(), st.floats(0.0, 80.0))),
        )
        for i in range(n)
    ]
    return policy, reqs, draw(st.frozensets(st.sampled_from(PIPES)))


@settings(max_examples=300, deadline=None)
@given(_queues())
def test_with_deadlines_nobody_starves_and_the_bound_holds(case):
    policy, reqs, resident = case
    s = Scheduler(policy, run_s=1.0, switch_s=2.5)
    for r in reqs:
        s.add(r)
    planned = {r.id for b, _, _ in s.plan(resident, now=0.0) for r in b}
    assert planned == {r.id for r in reqs}
    order = _drain(s, set(resident))
    assert sorted(order) == [r.id for r in reqs]  # nobody starved, nobody twice
    # recount the overtakings from the order alone: never more than the bound
    position = {i: k for k, i in enumerate(order)}
    for r in reqs:
        passed = sum(1 for q in reqs if q.id > r.id and position[q.id] < position[r.id])
        assert passed <= policy.overtake, (r.id, passed)


@settings(max_examples=100, deadline=None)
@given(_queues())
def test_without_deadlines_the_time_changes_nothing(case):
    policy, reqs, resident = case
    a, b = Scheduler(policy), Scheduler(policy)
    for r in reqs:
        plain = Request(r.id, r.pipeline, r.shape, r.arrived, r.work)
        a.add(plain)
        b.add(plain)
    while len(a):
        assert _ids(a.next(resident)) == _ids(b.next(resident, now=7.0))


def test_a_switch_is_charged_its_price_now_not_the_average_of_past_ones():
    s = Scheduler(WIDE, run_s=1.0, switch_s=5.0)
    s.add(Request("sdxl", "sdxl", "512", arrived=0.0, deadline=3.0))
    s.add(Request("flux", "flux", "512", arrived=1.0, deadline=100.0))
    assert s.switch_estimate("sdxl") == 5.0
    assert _ids(s.peek({"flux"}, now=0.0)) == ["flux"]  # 5 + 1 > 3: sdxl is late anyway
    s.price({"sdxl": 0.5})  # its bytes wait in the host tier: 0.5 s to move
    assert s.switch_estimate("sdxl") == 0.5 and s.switch_estimate("sd3") == 5.0
    assert _ids(s.peek({"flux"}, now=0.0)) == ["flux"]  # 1 + 1.5 <= 3: flux fits first
    assert _ids(s.peek({"flux"}, now=1.0)) == ["sdxl"]  # no longer: sdxl now
    s.price({})
    assert s.switch_estimate("sdxl") == 5.0
