"""The fleet on a local Ray instance with two CPU workers and the embedding service: a
second request for a model lands on the worker that loaded it; an unseen model goes to
the other, idle one; prompts are encoded by the service."""

from __future__ import annotations

import io
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
def fleet_url(store, shm, controlnets):  # (the ControlNet there before the workers scan)
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
        worker_options={
            "gpu_budget": 8 << 20,
            "host_budget": 64 << 20,
            "prepare": False,
            "embed_url": f"http://127.0.0.1:{port}/embed",
            "host_tier": f"shared:{SHARED}",
        },
    )
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
    r = httpx.post(f"{fleet_url}/v1/images/generations", content=b'{"model": "\xff"}')
    assert r.status_code == 400 and r.json()["error"]["type"] == "malformed_json"  # not UTF-8
    r = httpx.post(f"{fleet_url}/v1/images/generations", json={"model": "sdxl"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "prompt"  # the worker's shape
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


def test_the_fleet_answers_the_workers_routes(fleet_url, store):
    import io

    import av
    import torch
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save

    vae = AutoencoderKLWan.from_pretrained(str(store / "wan" / "vae"))
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    r = httpx.post(
        f"{fleet_url}/v1/videos/decode",
        params={"model": "wan", "fps": 8},
        content=save({"latents": z}),
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and r.headers["x-nostall-frames"] == "9"
    assert "decode;dur=" in r.headers["server-timing"] and "x-nostall-worker" in r.headers
    with av.open(io.BytesIO(r.content)) as f:
        assert sum(1 for _ in f.decode(video=0)) == 9
    bad = httpx.post(
        f"{fleet_url}/v1/videos/decode",
        params={"model": "wan"},
        content=save({"latents": torch.cat([z, z])}),
        timeout=120,
    )
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "latents"
    assert (
        httpx.post(
            f"{fleet_url}/v1/videos/decode",
            params={"model": "wan"},
            content=b"not safetensors",
            timeout=120,
        ).status_code
        == 400
    )
    assert httpx.get(f"{fleet_url}/readyz").json()["ready"]
    page = httpx.get(f"{fleet_url}/")
    assert page.status_code == 200 and "nostall fleet" in page.text and "worker" in page.text
    assert httpx.get(f"{fleet_url}/status.json").json()["workers"]
    metrics = httpx.get(f"{fleet_url}/metrics").text
    assert 'nostall_fleet_requests_total{endpoint="videos",status="200"}' in metrics
    assert 'nostall_fleet_worker_up{worker="0"} 1.0' in metrics
    workers = httpx.get(f"{fleet_url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]  # the 4xx marked nobody down


def test_control_image_bombs_are_422_and_take_no_worker_down(fleet_url, controlnets):
    import base64

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG")
    control = {"name": "edges", "image": base64.b64encode(buf.getvalue()).decode()}
    body = {"model": "sdxl", "prompt": "x", "size": "32x32", "steps": 2, "controlnet": control}
    for _ in range(3):  # three took both workers down
        r = httpx.post(f"{fleet_url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 422 and r.json()["error"]["field"] == "controlnet.image", r.text
    workers = httpx.get(f"{fleet_url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]


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
