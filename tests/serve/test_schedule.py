"""The worker's queue policy over plain records and numbers: no torch, no threads."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nostall.errors import ArgumentError
from nostall.serve.schedule import Policy, Request, Scheduler


def _queue(s: Scheduler, *pipelines: str, shape="512", work=1.0) -> None:
    for i, p in enumerate(pipelines):
        s.add(Request(i, p, shape, arrived=float(i), work=work))


def _ids(batch: list[Request]) -> list:
    return [r.id for r in batch]


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"batch": 0}, "batch=0"),
        ({"batch": True}, "batch=True"),
        ({"batch": 2.0}, "batch=2.0"),
        ({"overtake": -1}, "overtake=-1"),
        ({"delay_s": -1.0}, "delay_s=-1.0"),
        ({"delay_s": math.nan}, "delay_s=nan"),
        ({"delay_s": "30"}, "delay_s='30'"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_value(kw, says):
    with pytest.raises(ArgumentError, match=says):
        Policy(**kw)


def test_bad_scheduler_arguments_are_refused():
    with pytest.raises(ArgumentError, match="run_s=-1"):
        Scheduler(run_s=-1)
    with pytest.raises(ArgumentError, match="alpha=0"):
        Scheduler(alpha=0)
    s = Scheduler()
    s.add(Request("a", "flux", 1, 0.0))
    with pytest.raises(ArgumentError, match="'a' is queued already"):
        s.add(Request("a", "flux", 1, 1.0))
    with pytest.raises(ArgumentError, match="work=nan"):
        s.add(Request("b", "flux", 1, 1.0, work=math.nan))
    with pytest.raises(ArgumentError, match="position=-1"):
        s.estimated_wait(-1, set())


def test_without_residency_or_batching_the_order_is_arrival_order():
    s = Scheduler()
    _queue(s, "flux", "sdxl", "flux", "sd3")
    assert [_ids(s.next(set())) for _ in range(5)] == [[0], [1], [2], [3], []]


def test_a_resident_pipeline_goes_first_then_arrival_order():
    s = Scheduler()
    _queue(s, "sdxl", "sd3", "flux", "flux")
    assert _ids(s.next({"flux"})) == [2]
    assert _ids(s.next({"flux"})) == [3]
    assert _ids(s.next({"flux"})) == [0]
    assert s.standing(1) == (2, 2.0)  # passed by 2 and 3, one second (estimated) each


def test_like_requests_share_a_batch_up_to_the_cap_and_shapes_stay_apart():
    s = Scheduler(Policy(batch=3))
    for i, (p, shape) in enumerate(
        [("flux", "512"), ("flux", "1024"), ("flux", "512"), ("flux", "512"), ("flux", "512")]
    ):
        s.add(Request(i, p, shape, float(i)))
    assert _ids(s.next({"flux"})) == [0, 2, 3]
    assert _ids(s.next({"flux"})) == [1]
    assert _ids(s.next({"flux"})) == [4]


def test_no_request_is_overtaken_more_than_k_times():
    s = Scheduler(Policy(overtake=2))
    _queue(s, "sdxl", "flux", "flux", "flux")
    assert [_ids(s.next({"flux"})) for _ in range(4)] == [[1], [2], [0], [3]]


def test_no_request_is_pushed_back_more_than_t_seconds():
    s = Scheduler(Policy(delay_s=15.0), run_s=10.0, switch_s=4.0)
    _queue(s, "sdxl", "flux", "flux")
    assert _ids(s.next({"flux"})) == [1]  # sdxl pushed back 10 s of 15
    assert _ids(s.next({"flux"})) == [0]  # another 10 s would make 20
    s = Scheduler(Policy(delay_s=9.0), run_s=10.0)
    _queue(s, "sdxl", "flux")
    assert _ids(s.next({"flux"})) == [0]  # even once is too much
    s = Scheduler(Policy(delay_s=15.0), run_s=10.0)
    _queue(s, "sdxl", "flux", work=0.5)  # work scales the estimate: 5 s
    assert _ids(s.next({"flux"})) == [1]


def test_overtake_zero_still_batches_like_requests_queued_back_to_back():
    s = Scheduler(Policy(batch=4, overtake=0))
    _queue(s, "flux", "flux", "sdxl", "flux")
    assert _ids(s.next({"flux"})) == [0, 1]  # 3 would pass 2
    assert _ids(s.next({"flux"})) == [2]
    assert _ids(s.next({"flux"})) == [3]


def test_riders_charge_only_their_own_seconds():
    # 0 leads (it is older than 1: running it first is arrival order); 2 rides along and
    # pushes 1 back by its own estimate, not by the whole batch's
    s = Scheduler(Policy(batch=2), run_s=3.0, switch_s=100.0)
    _queue(s, "flux", "sdxl", "flux")
    assert _ids(s.next(set())) == [0, 2]
    assert s.standing(1) == (1, 3.0)


def test_done_turns_the_push_back_into_measured_seconds_and_learns_the_rates():
    s = Scheduler(run_s=10.0, switch_s=5.0)
    _queue(s, "sdxl", "flux")
    assert _ids(s.next({"flux"})) == [1]
    assert s.standing(0) == (1, 10.0)
    s.done(20.0, run_s=20.0, switch_s=0.01)  # flux was resident: no switch to learn
    assert s.standing(0) == (1, 20.0)
    assert s.run_estimate("flux", 2.0) == 40.0
    assert s.switch_estimate("flux") == 5.0
    assert s.run_estimate("sd3") == 20.0  # unmeasured: the mean of the measured
    assert _ids(s.next(set())) == [0]
    s.done(12.0, run_s=9.0, switch_s=3.0)
    assert s.run_estimate("sdxl") == 9.0 and s.switch_estimate("sdxl") == 3.0
    s.add(Request(2, "sdxl", "512", 3.0))
    s.next(set())
    s.done(1.0, run_s=19.0)  # moving average: 0.3 of the new, 0.7 of the old
    assert s.run_estimate("sdxl") == pytest.approx(0.3 * 19.0 + 0.7 * 9.0)
    s.done(1.0, run_s=1000.0)  # no batch outstanding: nothing to learn
    assert s.run_estimate("sdxl") == pytest.approx(12.0)


def test_estimated_wait_follows_the_order_the_queue_would_run():
    s = Scheduler(run_s=2.0, switch_s=5.0)
    _queue(s, "sdxl", "flux", "flux", "sdxl")
    assert s.estimated_wait(0, {"flux"}, busy_s=1.5) == 1.5
    # flux, flux (resident), then sdxl twice: one switch
    assert s.estimated_wait(2, {"flux"}, busy_s=1.5) == 1.5 + 2 + 2
    assert s.estimated_wait(4, {"flux"}, busy_s=1.5) == 1.5 + 2 + 2 + 5 + 2 + 2
    assert s.estimated_wait(99, {"flux"}) == 2 + 2 + 5 + 2 + 2
    assert len(s) == 4 and s.standing(0) == (0, 0.0)  # the queue is as it was
    assert _ids(s.peek({"flux"})) == [1] and len(s) == 4


def test_remove_takes_a_request_out_of_the_running():
    s = Scheduler()
    _queue(s, "flux", "sdxl")
    assert s.remove(0).pipeline == "flux" and s.remove(0) is None
    assert 0 not in s and 1 in s
    assert [r.id for r in s.requests()] == [1]
    assert _ids(s.next({"flux"})) == [1]


def test_arrival_order_is_by_time_then_by_add():
    s = Scheduler()
    s.add(Request("late", "flux", 1, 2.0))
    s.add(Request("early", "flux", 1, 1.0))
    s.add(Request("early-too", "flux", 1, 1.0))
    assert [r.id for r in s.requests()] == ["early", "early-too", "late"]


# ---- the bounds, as properties ----------------------------------------------------------

PIPES = ("flux", "sdxl", "sd3")


@st.composite
def _runs(draw):
    policy = Policy(
        batch=draw(st.integers(1, 4)),
        overtake=draw(st.integers(0, 5)),
        delay_s=draw(st.sampled_from([0.0, 2.0, 7.5, 30.0])),
    )
    # steps: ("add", pipeline, shape, work) or ("run", resident pipelines)
    step = st.one_of(
        st.tuples(
            st.just("add"), st.sampled_from(PIPES), st.integers(0, 1), st.sampled_from([0.5, 1, 3])
        ),
        st.tuples(st.just("run"), st.frozensets(st.sampled_from(PIPES))),
    )
    return policy, draw(st.lists(step, max_size=60)), draw(st.frozensets(st.sampled_from(PIPES)))


@settings(max_examples=400, deadline=None)
@given(_runs())
def test_no_request_is_overtaken_by_more_than_k_or_pushed_back_more_than_t(case):
    policy, steps, last_resident = case
    run_s, switch_s = 1.0, 2.5
    s = Scheduler(policy, run_s=run_s, switch_s=switch_s)
    arrived: dict[int, Request] = {}
    started: dict[int, int] = {}  # id -> index of the batch it ran in
    batches: list[tuple[list[Request], bool, set[int]]] = []  # batch, resident, queued then

    def run(resident):
        queued = {r.id for r in s.requests()}
        batch = s.next(resident)
        if not batch:
            return
        lead = batch[0]
        oldest = min(queued)
        assert len(batch) <= policy.batch
        assert {(r.pipeline, r.shape) for r in batch} == {(lead.pipeline, lead.shape)}
        # members are the group's oldest, in arrival order
        group = sorted(i for i in queued if (arrived[i].pipeline, arrived[i].shape)
                       == (lead.pipeline, lead.shape))  # fmt: skip
        assert [r.id for r in batch] == group[: len(batch)]
        is_resident = lead.pipeline in resident
        if not is_resident:
            assert lead.id == oldest  # only a resident group goes before the oldest
        estimate = (0 if is_resident else switch_s) + sum(run_s * r.work for r in batch)
        s.done(estimate)  # measured = estimated: the bound is then exact
        for r in batch:
            started[r.id] = len(batches)
        batches.append((batch, is_resident, queued))

    for step in steps:
        if step[0] == "add":
            i = len(arrived)
            arrived[i] = Request(i, step[1], step[2], float(i), work=float(step[3]))
            s.add(arrived[i])
        else:
            run(step[1])
    while len(s):
        run(last_resident)
    assert set(started) == set(arrived)  # nobody starved

    # recount from the batches alone, by the module's definition
    for i in arrived:
        passed, pushed = 0, 0.0
        for b, (batch, is_resident, queued) in enumerate(batches):
            if b >= started[i] or i not in queued:
                continue
            newer = [r for r in batch if r.id > i]
            passed += len(newer)
            pushed += sum(run_s * r.work for r in newer)
            if newer and len(newer) == len(batch):
                assert is_resident  # a batch jumps the queue only to skip a switch
        assert passed <= policy.overtake, (i, passed)
        assert pushed <= policy.delay_s + 1e-9, (i, pushed)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(PIPES), max_size=20), st.frozensets(st.sampled_from(PIPES)))
def test_with_no_reordering_allowed_and_no_batching_the_queue_is_fifo(pipes, resident):
    s = Scheduler(Policy(batch=1, overtake=0))
    _queue(s, *pipes)
    assert [_ids(s.next(resident))[0] for _ in pipes] == list(range(len(pipes)))
