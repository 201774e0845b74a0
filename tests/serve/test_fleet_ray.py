"""The fleet on Ray Serve as ``nostall fleet`` runs it: two CPU workers and the embedding
service on one local Ray instance. One test, so one Ray session, however the tests are
spread over processes (starting Ray and its replicas is most of its time); the routing
rules it shares with the in-process fleet are test_fleet.py's."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from nostall.serve.local import free_port

ray = pytest.importorskip("ray")  # (ray.serve, 1.3 s more, only where the test runs)

pytestmark = pytest.mark.slow


def _post(url, model, **kw):
    body = {"model": model, "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 1,
            "max_sequence_length": 16, **kw}  # fmt: skip
    if model != "flux":
        body.pop("max_sequence_length")
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)


def test_the_fleet_on_ray_routes_encodes_shares_a_tier_and_outlives_a_worker(
    store, tmp_path, monkeypatch
):
    serve = pytest.importorskip("ray.serve")
    # Ray's processes inherit this one's environment (as under ``nostall fleet``; a
    # runtime_env would start a process to set up each worker's). Serve's proxy must
    # answer its readiness check within 5 s, three times, or it is killed and serve.start
    # fails: on 2 cores beside the other test workers it did not.
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("NOSTALL_SHM_DIR", str(tmp_path))

    from nostall.memory import SharedPool
    from nostall.serve.fleet import build_embed, build_fleet

    shared = f"fleet-ray-{os.getpid()}"
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=80 << 20,  # (Ray's least)
        log_to_driver=False,
    )
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        embed = build_embed(str(store), device="cpu")
        app = build_fleet(
            str(store),
            replicas=2,
            device="cpu",
            worker_options={
                "gpu_budget": 8 << 20,
                "host_budget": 64 << 20,
                "prepare": False,
                "embed_url": f"{url}/embed",
                "host_tier": f"shared:{shared}",
            },
        )
        # Both applications' replicas start together; the workers need the service only
        # once they encode a prompt.
        if hasattr(serve, "run_many"):
            serve.run_many(
                [
                    serve.RunTarget(embed, name="embed", route_prefix="/embed"),
                    serve.RunTarget(app, name="nostall", route_prefix="/"),
                ]
            )
        else:  # (Ray before 2.50)
            serve.run(embed, name="embed", route_prefix="/embed")
            serve.run(app, name="nostall", route_prefix="/")

        # Routed where the model is: an unseen one to the idle worker.
        first = _post(url, "flux")
        assert first.status_code == 200, first.text
        w = int(first.headers["x-nostall-worker"])
        assert first.headers["x-nostall-routed-tier"] == "disk"
        other = _post(url, "sdxl")
        assert other.status_code == 200, other.text
        assert int(other.headers["x-nostall-worker"]) == 1 - w
        again = _post(url, "flux")
        assert int(again.headers["x-nostall-worker"]) == w
        assert again.headers["x-nostall-routed-tier"] in ("gpu", "device")
        state = httpx.get(f"{url}/fleet").json()
        assert [r["worker"] for r in state["routed"]] == [w, 1 - w, w]
        assert all(s["actor"] for s in state["workers"])  # (what the kill below names)

        # Encoded by the service behind Ray's proxy: no text encoder switched in.
        for r in (first, other, again):
            roles = {c["role"] for c in r.json()["nostall"]["switch"]["components"]}
            assert not any(role.startswith("text_encoder") for role in roles), roles
        stats = httpx.get(f"{url}/embed/stats").json()
        assert stats["texts_encoded"] == 4 and stats["cache"]["hits"] == 2

        # One host tier for the workers' processes: each component once.
        with SharedPool(shared, 64 << 20, root=tmp_path) as tier:
            keys = tier.cached_keys()
        assert len(keys) == len(set(keys)) == 4, keys

        # A request's fault, answered as a status across Ray, marks no worker down.
        bad = httpx.post(
            f"{url}/v1/images/generations", json={"model": "sdxl", "prompt": "x", "steps": 0}
        )
        assert bad.status_code == 422 and "steps" in bad.json()["error"]["message"]

        # A worker killed mid-request: the request is retried on the other.
        result = {}

        def slow():
            result["r"] = _post(url, "flux", prompt="a slow cat", size="64x64", steps=40)

        t = threading.Thread(target=slow)
        t.start()
        deadline = time.monotonic() + 60
        while (state := httpx.get(f"{url}/fleet").json())["workers"][w]["in_flight"] < 1:
            assert time.monotonic() < deadline, "the slow request never reached the flux worker"
            time.sleep(0.05)  # polling the router, not waiting for time to pass
        assert [x["down"] for x in state["workers"]] == [False, False]
        ray.kill(ray.get_actor(state["workers"][w]["actor"], namespace="serve"))
        t.join(600)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert int(r.headers["x-nostall-worker"]) == 1 - w  # served by the other worker
    finally:
        # (ray.shutdown alone: it ends Serve's actors with the rest of this local cluster,
        # seconds sooner than serve.shutdown's graceful stop of each replica)
        ray.shutdown()
        SharedPool.destroy(shared, root=tmp_path, force=True)
