"""The fleet router's placement (issue #31, item 5): soonest done first, from each
worker's own estimates (its queue's wait, its switch price) as of its last answer."""

from __future__ import annotations

import asyncio

from nostall.serve.fleet_router import FleetRouter

GB = 10**9


def _router() -> FleetRouter:
    return FleetRouter({"flux": 34 * GB, "sdxl": 7 * GB}, [object(), object()])


def test_a_warm_worker_goes_first_unless_its_queue_outweighs_another_ones_switch():
    r = _router()
    r.models = [{"flux": ["gpu"]}, {"flux": ["host"]}]
    r.prices = [{}, {"flux": 0.6}]
    r.waits = [0.2, 0.0]
    assert r.order("flux") == [0, 1]  # 0.2 s of queue beats a 0.6 s switch
    r.waits = [2.0, 0.0]
    assert r.order("flux") == [1, 0]  # 2 s of queue does not
    r.in_flight = [0, 5]  # five sent to worker 1 since it answered: its queue grew
    assert r.order("flux") == [0, 1]


def test_before_a_worker_answered_its_tier_and_the_requests_in_flight_decide():
    r = _router()
    r.models = [{"flux": ["disk"]}, {"flux": ["host"]}]
    assert r.order("flux") == [1, 0]  # host beats disk at the default rates
    r.in_flight = [0, 4]  # 0.68 s of switch + 4 x 2 s queued > 6.8 s from disk
    assert r.order("flux") == [0, 1]


def test_an_answer_carries_the_workers_estimates_into_the_next_placement():
    r = _router()
    state = {
        "models": {"flux": ["gpu"], "sdxl": ["host"]},
        "estimated_wait_s": 1.5,
        "switch_s": {"sdxl": 0.25, "flux": 0.0},
    }

    async def call(handle):
        return {"state": state, "phases": {}, "switch": {}}

    i, tier, _ = asyncio.run(r.route("flux", call))
    assert (i, tier) == (0, "disk")  # nothing known yet: the first worker
    assert r.waits[0] == 1.5 and r.prices[0]["sdxl"] == 0.25
    assert r.state()["workers"][0]["estimated_wait_s"] == 1.5
    # worker 0 has flux warm but 1.5 s queued; worker 1 is unknown (disk: 34 GB at 5 GB/s)
    assert r.order("flux") == [0, 1]
    # sdxl: 1.5 s queued + 0.25 s there, against 7 GB from disk (1.4 s) on the idle one
    assert r.order("sdxl") == [1, 0]
