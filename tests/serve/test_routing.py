"""The fleet router's rules, without Ray: costs, what a failure marks down, budgets."""

from __future__ import annotations

import pytest

from nostall.serve.routing import route_cost, route_outcome, slowest_tier, worker_budgets


def test_the_router_marks_down_only_for_transport_failures_and_5xx():
    assert route_outcome(None) == (True, True)  # the call failed: down, next worker
    assert route_outcome(503) == (True, True)  # cannot take it now: down, next worker
    assert route_outcome(500) == (True, False)  # failed it: down, the error goes back
    for status in (400, 404, 408, 413, 422, 429):
        assert route_outcome(status) == (False, False)  # unchanged to the client


@pytest.mark.parametrize("status", [None, 400, 422, 500, 503])
def test_a_request_that_broke_the_checks_marks_no_worker_down_whatever_it_raised(status):
    # (a control image that crashed a decoder was a 500 and took both workers down)
    assert route_outcome(status, fault="request") == (False, False)


def test_failure_status_tells_a_dead_replica_from_a_raising_worker():
    ray = pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError, RayTaskError

    from nostall.serve.routing import failure_status

    assert ray is not None
    assert failure_status(ActorDiedError()) is None  # transport
    raised = RayTaskError("generate", "Traceback ...", ValueError("x")).as_instanceof_cause()
    assert failure_status(raised) == 500  # the worker's own code raised


def test_route_cost_orders_gpu_host_disk_then_queue():
    gb = 10**9
    assert route_cost("gpu", 30 * gb, 0, 2.0) == 0
    assert 0 < route_cost("host", 30 * gb, 0, 2.0) < route_cost("disk", 30 * gb, 0, 2.0)
    # a busy worker that holds the model can lose to an idle one with it in host memory
    assert route_cost("gpu", 30 * gb, 3, 2.0) > route_cost("host", 30 * gb, 0, 2.0)
    assert slowest_tier(["gpu", "host"]) == "host" and slowest_tier(None) == "disk"
    assert slowest_tier(["gpu"]) == "gpu"


def test_workers_of_one_host_share_its_memory_by_default():
    gb = 1 << 30
    assert worker_budgets(2, gpu=True, options={}, limit=256 * gb) == {"host_budget": 64 * gb}
    cpu = worker_budgets(4, gpu=False, options={"max_queue": 3}, limit=16 * gb)
    assert cpu == {"host_budget": 2 * gb, "gpu_budget": gb, "max_queue": 3}
    given = worker_budgets(2, gpu=True, options={"host_budget": 5}, limit=256 * gb)
    assert given == {"host_budget": 5}  # what the user gives wins
    small = worker_budgets(2, gpu=True, options={}, limit=256 * gb, store_bytes=3 * gb)
    assert small == {"host_budget": 3 * gb}  # no more than the store needs
    # One shared tier is the host's: not divided by the workers that map it.
    shared = worker_budgets(4, gpu=True, options={"host_tier": "shared:f"}, limit=256 * gb)
    assert shared == {"host_budget": 128 * gb, "host_tier": "shared:f"}
