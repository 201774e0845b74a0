"""Step-level preemption in the queue policy (:meth:`Scheduler.preemptor`): which queued
request is worth pausing the running job for, priced by its switch, within the fairness
bound, never making the paused job late; as a pure, property-tested unit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nostall.serve.schedule import Policy, Request, Scheduler

WIDE = Policy(batch=1, overtake=50, delay_s=1e6)  # the bound out of the way


def _sched(policy=WIDE, run_s=1.0, switch_s=2.0) -> Scheduler:
    return Scheduler(policy, run_s=run_s, switch_s=switch_s)


def test_a_request_late_behind_the_running_job_and_on_time_now_preempts():
    s = _sched()
    s.add(Request("sdxl", "sdxl", "512", arrived=0.0, deadline=5.0))  # switch 2 + run 1
    r = s.preemptor("flux", busy_s=10.0, resident={"flux"}, now=0.0)
    assert r is not None and r.id == "sdxl" and len(s) == 0  # taken off the queue


def test_no_preemption_when_it_is_on_time_anyway_or_the_gain_does_not_pay_the_switch():
    s = _sched()
    s.add(Request("sdxl", "sdxl", "512", arrived=0.0, deadline=14.0))
    assert s.preemptor("flux", busy_s=10.0, resident={"flux"}, now=0.0) is None  # 13 <= 14
    s.remove("sdxl")
    # 1.5 s late behind the running job, but its switch costs 2 s: not worth it
    s.add(Request("sdxl", "sdxl", "512", arrived=0.0, deadline=11.5))
    assert s.preemptor("flux", busy_s=10.0, resident={"flux"}, now=0.0) is None
    # resident already (no switch to pay): half a second late is worth a pause
    s.remove("sdxl")
    s.add(Request("sdxl", "sdxl", "512", arrived=0.0, deadline=10.5))
    assert s.preemptor("flux", busy_s=10.0, resident={"flux", "sdxl"}, now=0.0) is not None


def test_not_the_running_pipeline_not_one_too_late_even_now_not_one_refused():
    s = _sched()
    s.add(Request("flux-2", "flux", "512", arrived=0.0, deadline=2.0))  # same pipeline
    s.add(Request("late", "sd3", "512", arrived=0.0, deadline=2.0))  # 3 s even now
    s.add(Request("lora", "sdxl", "512", arrived=0.0, deadline=4.0))
    none = s.preemptor("flux", 10.0, {"flux"}, now=0.0, allowed=lambda r: r.id != "lora")
    assert none is None and len(s) == 3
    assert s.preemptor("flux", 10.0, {"flux"}, now=0.0).id == "lora"


def test_the_paused_job_is_not_made_late_and_the_most_urgent_goes_first():
    s = _sched()
    s.add(Request("a", "sdxl", "512", arrived=0.0, deadline=6.0))
    s.add(Request("b", "sd3", "512", arrived=0.1, deadline=4.0))
    # the paused job would end at 10 and must by 12: a 3 s pause would make it late
    assert s.preemptor("flux", 10.0, {"flux"}, now=0.0, running_deadline=12.0) is None
    # due at 14: it still makes it; the most urgent (b) goes first
    assert s.preemptor("flux", 10.0, {"flux"}, now=0.0, running_deadline=14.0).id == "b"
    # a paused job already late is not kept from a pause
    assert s.preemptor("flux", 10.0, {"flux"}, now=0.0, running_deadline=5.0).id == "a"


def test_the_jump_stays_within_the_fairness_bound_and_is_charged():
    s = _sched(Policy(batch=1, overtake=1, delay_s=100.0))
    s.add(Request("old", "sd3", "512", arrived=0.0))  # no deadline: waits its turn
    s.add(Request("a", "sdxl", "512", arrived=1.0, deadline=5.0))
    s.add(Request("b", "sdxl", "768", arrived=2.0, deadline=5.0))
    assert s.preemptor("flux", 10.0, {"flux"}, now=2.0).id == "a"
    assert s.standing("old") == (1, 3.0)  # overtaken once, pushed back switch + run
    # overtaking "old" a second time breaks the bound: b cannot preempt
    assert s.preemptor("flux", 10.0, {"flux", "sdxl"}, now=2.0) is None


def test_the_way_back_of_a_parked_pipeline_is_priced():
    # sdxl would be 7 s late behind flux; its switch costs 2 s: worth a pause beside flux,
    # and with 3 s to bring flux back, not with 5 s (7 s gained, 7 s paid)
    def one(back_s):
        s = _sched()
        s.add(Request("a", "sdxl", "512", arrived=0.0, deadline=7.0))
        return s.preemptor("flux", 10.0, {"flux"}, now=1.0, back_s=back_s)

    assert one(None).id == "a" and one(lambda r: 3.0).id == "a"
    assert one(lambda r: 5.0) is None


def test_what_a_preemptor_took_teaches_the_estimates():
    s = _sched()
    s.observe("sdxl", 2.0, run_s=1.0, switch_s=0.5)
    assert s.run_estimate("sdxl", 1.0) == 0.5 and s.switch_estimate("sdxl") == 0.5


@settings(max_examples=200, deadline=None)
@given(
    waiting=st.lists(
        st.tuples(
            st.sampled_from(["flux", "sdxl", "sd3", "sdxl-b"]),
            st.floats(0.0, 10.0),  # arrived
            st.one_of(st.none(), st.floats(0.0, 40.0)),  # deadline
            st.floats(0.1, 4.0),  # work
        ),
        max_size=8,
    ),
    busy=st.floats(0.0, 30.0),
    resident=st.sets(st.sampled_from(["flux", "sdxl", "sd3", "sdxl-b"])),
    running_deadline=st.one_of(st.none(), st.floats(0.0, 50.0)),
    overtake=st.integers(0, 3),
    # seconds to bring the paused pipeline back, per preemptor's pipeline (it must leave
    # for some: parked), 0 for those that fit beside it
    back=st.dictionaries(st.sampled_from(["sdxl", "sd3", "sdxl-b"]), st.floats(0.0, 5.0)),
)
def test_any_preemption_pays_for_itself_keeps_the_paused_deadline_and_the_bound(
    waiting, busy, resident, running_deadline, overtake, back
):
    now = 10.0
    s = Scheduler(Policy(batch=1, overtake=overtake, delay_s=20.0), run_s=1.0, switch_s=2.0)
    for i, (p, arrived, deadline, work) in enumerate(waiting):
        s.add(Request(i, p, "512", arrived=arrived, work=work, deadline=deadline))
    r = s.preemptor(
        "flux",
        busy,
        resident | {"flux"},
        now=now,
        running_deadline=running_deadline,
        back_s=lambda r: back.get(r.pipeline, 0.0),
    )
    if r is None:
        return
    switch = 0.0 if r.pipeline in resident else 2.0
    cost = switch + r.work
    home = back.get(r.pipeline, 0.0)
    assert r.pipeline != "flux" and r.deadline is not None
    assert now + cost <= r.deadline + 1e-6  # on time now
    # late behind it by more than both switches: its own, and the paused one's way back
    assert now + busy + cost - r.deadline > switch + home
    if running_deadline is not None and now + busy <= running_deadline:
        assert now + busy + cost + home <= running_deadline + 1e-6
    for q in s.requests():
        overtaken, pushed = s.standing(q.id)
        assert overtaken <= overtake and pushed <= 20.0 + 1e-6
