"""The fleet on a local Ray instance with two CPU workers and the embedding service: a
second request for a model lands on the worker that loaded it; an unseen model goes to
the other, idle one; prompts are encoded by the service."""

from __future__ import annotations

import os

import httpx
import pytest

from nostall.serve.local import free_port as _free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


SHARED = f"fleet-test-{os.getpid()}"  # the workers' one host tier (as `nostall fleet` runs)


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    """The folder of the workers' shared host tier (not the machine's /dev/shm)."""
    from nostall.memory import SharedPool

    folder = tmp_path_factory.mktemp("shm")
    yield folder
    SharedPool.destroy(SHARED, root=folder, force=True)


@pytest.fixture(scope="module")
def fleet_url(store, shm):
    from nostall.serve.fleet import build_embed, build_fleet

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=128 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "NOSTALL_SHM_DIR": str(shm)}},
    )
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # the embedding service as the second application; the workers encode there
    embed = build_embed(str(store), device="cpu")
    app = build_fleet(
        str(store),
        replicas=2,
        device="cpu",
        worker_options={"gpu_budget": 8 << 20, "host_budget": 64 << 20, "prepare": False,
                        "embed_url": f"http://127.0.0.1:{port}/embed",
                        "host_tier": f"shared:{SHARED}"},
    )  # fmt: skip
    if hasattr(serve, "run_many"):
        # Both applications' replicas start together (36 s -> 24 s on a 2-core machine);
        # the workers need the service only once they encode a prompt.
        serve.run_many([serve.RunTarget(embed, name="embed", route_prefix="/embed"),
                        serve.RunTarget(app, name="nostall", route_prefix="/")])  # fmt: skip
    else:
        serve.run(embed, name="embed", route_prefix="/embed")
        serve.run(app, name="nostall", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _post(url, model):
    body = {"model": model, "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 1}
    if model == "flux":
        body["max_sequence_length"] = 16
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_requests_go_where_the_model_is(fleet_url):
    first = _post(fleet_url, "flux")
    w = int(first.headers["x-nostall-worker"])
    assert first.headers["x-nostall-routed-tier"] == "disk"
    other = _post(fleet_url, "sdxl")  # unseen: the idle worker, at once
    assert int(other.headers["x-nostall-worker"]) == 1 - w
    again = _post(fleet_url, "flux")
    assert int(again.headers["x-nostall-worker"]) == w
    assert again.headers["x-nostall-routed-tier"] in ("gpu", "device")
    again_b = _post(fleet_url, "sdxl")
    assert int(again_b.headers["x-nostall-worker"]) == 1 - w
    state = httpx.get(f"{fleet_url}/fleet").json()
    assert [r["worker"] for r in state["routed"]] == [w, 1 - w, w, 1 - w]
    # the prompts were encoded by the embedding service: no text encoder was switched in
    for r in (first, other, again, again_b):
        roles = {c["role"] for c in r.json()["nostall"]["switch"]["components"]}
        assert not any(role.startswith("text_encoder") for role in roles), roles
    stats = httpx.get(f"{fleet_url}/embed/stats").json()
    assert stats["texts_encoded"] == 4  # CLIP + T5 for flux, CLIP-L + CLIP-G for sdxl, once
    assert stats["cache"]["hits"] == 4  # the second flux and sdxl prompts


def test_the_workers_keep_one_copy_of_each_component_in_the_hosts_tier(fleet_url, shm):
    from nostall.memory import SharedPool

    for model in ("flux", "sdxl"):
        _post(fleet_url, model)
    workers = {r["worker"] for r in httpx.get(f"{fleet_url}/fleet").json()["routed"]}
    assert workers == {0, 1}  # both served, each read its model once...
    with SharedPool(SHARED, 64 << 20, root=shm) as tier:
        keys = tier.cached_keys()
    # ... into the one tier: flux's transformer and VAE, sdxl's UNet and VAE, once each
    assert len(keys) == len(set(keys)) == 4, keys


def test_the_fleet_answers_bad_requests_clearly(fleet_url):
    r = httpx.post(f"{fleet_url}/v1/images/generations", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "flux" in r.json()["error"]["models"]
    r = httpx.post(f"{fleet_url}/v1/images/generations", content=b"{oops")
    assert r.status_code == 400
    r = httpx.post(f"{fleet_url}/v1/images/generations",
                   json={"model": "sdxl", "prompt": "x", "steps": 0}, timeout=120)  # fmt: skip
    assert r.status_code == 422 and "steps" in r.json()["error"]["message"]


def test_a_request_the_pipeline_rejects_is_a_4xx_and_marks_no_worker_down(fleet_url):
    # the tiny SD3 takes at most 192 px a side (pos_embed_max_size 96, patch 1, VAE x2):
    # refused before queueing, or by the pipeline as it runs; either way the client's fault
    body = {"model": "sd3", "prompt": "a cat", "size": "256x256", "steps": 2, "seed": 1}
    r = httpx.post(f"{fleet_url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] in ("invalid_value", "rejected_by_pipeline")
    workers = httpx.get(f"{fleet_url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]
    assert _post(fleet_url, "sd3").status_code == 200  # and the fleet serves on


def test_the_router_marks_down_only_for_transport_failures_and_5xx():
    from ray.exceptions import ActorDiedError, RayTaskError

    from nostall.serve.fleet import failure_status, route_outcome

    assert route_outcome(None) == (True, True)  # the call failed: down, next worker
    assert route_outcome(503) == (True, True)  # cannot take it now: down, next worker
    assert route_outcome(500) == (True, False)  # failed it: down, the error goes back
    for status in (400, 404, 408, 413, 422, 429):
        assert route_outcome(status) == (False, False)  # unchanged to the client
    assert failure_status(ActorDiedError()) is None  # transport
    raised = RayTaskError("generate", "Traceback ...", ValueError("x")).as_instanceof_cause()
    assert failure_status(raised) == 500  # the worker's own code raised


def test_worker_failures_are_answered_as_the_worker_app_answers_them():
    import torch

    from nostall.errors import (
        ArgumentError,
        BudgetExceeded,
        QueueFull,
        ShuttingDown,
        UnknownModel,
    )
    from nostall.serve.fleet import error_answer

    def status(e):
        return error_answer(e)[0]

    assert status(UnknownModel("no model 'x'", name="x", available=["flux"], close=[])) == 404
    assert status(ValueError("height above pos_embed_max_size")) == 422  # the pipeline's
    assert status(QueueFull("full")) == 429 and error_answer(QueueFull("full"))[2] == {
        "Retry-After": "1"
    }
    assert status(ShuttingDown("bye")) == 503
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert status(oom) == 503 and "Retry-After" in error_answer(oom)[2]
    no_room = BudgetExceeded("tier", tier="gpu", requested=2, budget=1, in_use=0)
    assert status(no_room) == 503
    assert status(RuntimeError("a bug")) == 500
    field = ArgumentError("steps=0: give 1 to 150")
    field.field, field.allowed = "steps", range(1, 151)  # (set as newer errors carry them)
    code, error, _ = error_answer(field)
    assert code == 422 and error["field"] == "steps" and error["allowed"] == "range(1, 151)"


def test_route_cost_orders_gpu_host_disk_then_queue():
    from nostall.serve.fleet import _tier, route_cost

    gb = 10**9
    assert route_cost("gpu", 30 * gb, 0, 2.0) == 0
    assert 0 < route_cost("host", 30 * gb, 0, 2.0) < route_cost("disk", 30 * gb, 0, 2.0)
    # a busy worker that holds the model can lose to an idle one with it in host memory
    assert route_cost("gpu", 30 * gb, 3, 2.0) > route_cost("host", 30 * gb, 0, 2.0)
    assert _tier(["gpu", "host"]) == "host" and _tier(None) == "disk" and _tier(["gpu"]) == "gpu"


def test_a_worker_killed_mid_request_is_retried_on_the_other(fleet_url):
    # Last in this module: the killed worker's replica restarts behind it.
    import threading
    import time

    holder = int(_post(fleet_url, "flux").headers["x-nostall-worker"])
    result = {}

    def slow():
        body = {"model": "flux", "prompt": "a slow cat", "size": "256x256", "steps": 40,
                "seed": 5, "max_sequence_length": 16}  # fmt: skip
        result["r"] = httpx.post(f"{fleet_url}/v1/images/generations", json=body, timeout=600)

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 60
    while (state := httpx.get(f"{fleet_url}/fleet").json())["workers"][holder]["in_flight"] < 1:
        assert time.monotonic() < deadline, "the slow request never reached the flux worker"
        time.sleep(0.05)  # polling the router, not waiting for time to pass
    name = state["workers"][holder]["actor"]
    ray.kill(ray.get_actor(name, namespace="serve"))
    t.join(600)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert int(r.headers["x-nostall-worker"]) == 1 - holder  # served by the other worker


def test_workers_of_one_host_share_its_memory_by_default():
    from nostall.serve.fleet import worker_budgets

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
