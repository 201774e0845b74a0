"""The fleet's router over two CPU workers and the embedding service, all in this process
(:class:`~nostall.serve.fleet_router.LocalHandle` stands in for Ray's handles): a second
request for a model lands on the worker that loaded it; an unseen model goes to the
other, idle one; prompts are encoded by the service; a request's own fault marks no
worker down; a worker that fails as a transport does is left out and the request retried.
On Ray Serve itself: test_fleet_ray.py."""

from __future__ import annotations

import io
import itertools
import os

import httpx
import pytest

from nostall.serve.local import BackgroundServer

_FLEETS = itertools.count()


@pytest.fixture
def fleet(store, controlnets, tmp_path, monkeypatch):
    """``fleet()``: the router's URL over two fresh workers sharing one host tier (in
    ``tmp_path``, not the machine's /dev/shm) and an embedding service of their own; the
    workers, the service and the router's state are ``url.workers``, ``url.service``,
    ``url.router``."""
    from nostall.cache import Store
    from nostall.serve.config import WorkerConfig
    from nostall.serve.embed import EmbeddingService, create_embed_app
    from nostall.serve.fleet_router import FleetRouter, LocalHandle, pipeline_bytes
    from nostall.serve.fleet_routes import fleet_app
    from nostall.serve.fleet_worker import FleetMember
    from nostall.serve.worker import Worker

    monkeypatch.setenv("NOSTALL_SHM_DIR", str(tmp_path))
    made: list = []

    def make(**overrides):
        service = EmbeddingService(store, device="cpu")
        embed = BackgroundServer(create_embed_app(service)).__enter__()
        made.append(embed)
        config = WorkerConfig.from_kwargs(
            device="cpu",
            gpu_budget=8 << 20,
            host_budget=64 << 20,
            prepare=False,
            embed_url=embed.url,
            host_tier=f"shared:fleet-{os.getpid()}-{next(_FLEETS)}",
            **overrides,
        )
        workers = [Worker(store, config=config).start() for _ in range(2)]
        members = [FleetMember(i, w, actor=f"worker-{i}") for i, w in enumerate(workers)]
        nbytes = pipeline_bytes(Store.shared(store))
        router = FleetRouter(nbytes, [LocalHandle(m) for m in members])
        app = fleet_app(limits=config.limits)
        app.state.fleet = router
        server = BackgroundServer(app).__enter__()
        made.append(server)
        made.extend(workers)
        return _Fleet(server.url, workers, service, router, config.cache.host_tier)

    yield make
    for thing in reversed(made):
        if hasattr(thing, "shutdown"):
            thing.shutdown()
        else:
            thing.__exit__(None, None, None)


class _Fleet(str):
    def __new__(cls, url, workers, service, router, tier):
        self = super().__new__(cls, url)
        self.workers, self.service, self.router, self.tier = workers, service, router, tier
        return self


def _post(url, model, **kw):
    body = {"model": model, "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 1, **kw}
    if model == "flux":
        body.setdefault("max_sequence_length", 16)
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_requests_go_where_the_model_is(fleet):
    url = fleet()
    first = _post(url, "flux")
    w = int(first.headers["x-nostall-worker"])
    assert first.headers["x-nostall-routed-tier"] == "disk"
    other = _post(url, "sdxl")  # unseen: the idle worker, at once
    assert int(other.headers["x-nostall-worker"]) == 1 - w
    again = _post(url, "flux")
    assert int(again.headers["x-nostall-worker"]) == w
    assert again.headers["x-nostall-routed-tier"] in ("gpu", "device")
    again_b = _post(url, "sdxl")
    assert int(again_b.headers["x-nostall-worker"]) == 1 - w
    state = httpx.get(f"{url}/fleet").json()
    assert [r["worker"] for r in state["routed"]] == [w, 1 - w, w, 1 - w]
    # the prompts were encoded by the embedding service: no text encoder was switched in
    for r in (first, other, again, again_b):
        roles = {c["role"] for c in r.json()["nostall"]["switch"]["components"]}
        assert not any(role.startswith("text_encoder") for role in roles), roles
    stats = url.service.stats()
    assert stats["texts_encoded"] == 4  # CLIP + T5 for flux, CLIP-L + CLIP-G for sdxl, once
    assert stats["cache"]["hits"] == 4  # the second flux and sdxl prompts


def test_the_workers_keep_one_copy_of_each_component_in_the_hosts_tier(fleet, tmp_path):
    from nostall.memory import SharedPool

    url = fleet()
    for model in ("flux", "sdxl"):
        _post(url, model)
    workers = {r["worker"] for r in httpx.get(f"{url}/fleet").json()["routed"]}
    assert workers == {0, 1}  # both served, each read its model once...
    with SharedPool(url.tier.removeprefix("shared:"), 64 << 20, root=tmp_path) as tier:
        keys = tier.cached_keys()
    # ... into the one tier: flux's transformer and VAE, sdxl's UNet and VAE, once each
    assert len(keys) == len(set(keys)) == 4, keys


def test_the_fleet_answers_bad_requests_clearly(fleet):
    url = fleet()
    r = httpx.post(f"{url}/v1/images/generations", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "flux" in r.json()["error"]["models"]
    r = httpx.post(f"{url}/v1/images/generations", content=b"{oops")
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/images/generations", content=b'{"model": "\xff"}')
    assert r.status_code == 400 and r.json()["error"]["type"] == "malformed_json"  # not UTF-8
    r = httpx.post(f"{url}/v1/images/generations", json={"model": "sdxl"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "prompt"  # the worker's shape
    r = httpx.post(
        f"{url}/v1/images/generations",
        json={"model": "sdxl", "prompt": "x", "steps": 0},
        timeout=120,
    )
    assert r.status_code == 422 and "steps" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/v1/images/generations", json={"model": "sdxl", "prompt": "x", "n": 2}, timeout=120
    )
    assert r.status_code == 422 and r.json()["error"]["field"] == "n"
    workers = httpx.get(f"{url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]


def test_a_request_the_pipeline_rejects_is_a_4xx_and_marks_no_worker_down(fleet):
    url = fleet()
    # the tiny SD3 takes at most 192 px a side (pos_embed_max_size 96, patch 1, VAE x2):
    # refused before queueing, or by the pipeline as it runs; either way the client's fault
    body = {"model": "sd3", "prompt": "a cat", "size": "256x256", "steps": 2, "seed": 1}
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] in ("invalid_value", "rejected_by_pipeline")
    workers = httpx.get(f"{url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]
    assert _post(url, "sd3").status_code == 200  # and the fleet serves on


def test_the_fleet_answers_the_workers_routes(fleet, store):
    import av
    import torch
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save

    url = fleet()
    vae = AutoencoderKLWan.from_pretrained(str(store / "wan" / "vae"))
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    r = httpx.post(
        f"{url}/v1/videos/decode",
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
        f"{url}/v1/videos/decode",
        params={"model": "wan"},
        content=save({"latents": torch.cat([z, z])}),
        timeout=120,
    )
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "latents"
    garbage = httpx.post(
        f"{url}/v1/videos/decode", params={"model": "wan"}, content=b"not safetensors", timeout=120
    )
    assert garbage.status_code == 400
    assert httpx.get(f"{url}/readyz").json()["ready"]
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} >= {"flux", "wan"}
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "nostall fleet" in page.text and "worker" in page.text
    assert httpx.get(f"{url}/status.json").json()["workers"]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'nostall_fleet_requests_total{endpoint="videos",status="200"}' in metrics
    assert 'nostall_fleet_worker_up{worker="0"} 1.0' in metrics
    workers = httpx.get(f"{url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]  # the 4xx marked nobody down


def test_control_image_bombs_are_422_and_take_no_worker_down(fleet):
    import base64

    from PIL import Image

    url = fleet()
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG")
    control = {"name": "edges", "image": base64.b64encode(buf.getvalue()).decode()}
    body = {"model": "sdxl", "prompt": "x", "size": "32x32", "steps": 2, "controlnet": control}
    for _ in range(3):  # three took both workers down
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 422 and r.json()["error"]["field"] == "controlnet.image", r.text
    workers = httpx.get(f"{url}/fleet").json()["workers"]
    assert [w["down"] for w in workers] == [False, False]


def test_a_worker_whose_call_fails_in_transport_is_left_out_and_the_request_retried(fleet):
    url = fleet()
    holder = int(_post(url, "flux").headers["x-nostall-worker"])
    handle = url.router.workers[holder]

    class Gone:  # what a dead replica's handle does: the call itself fails
        def __getattr__(self, name):
            return handle.__getattr__(name) if name != "generate" else self

        def remote(self, *args):
            raise ConnectionError("the replica died")

    url.router.workers[holder] = Gone()
    # the dead one is tried first (a loaded machine can leave the holder's last estimated
    # wait above the other's tiny switch, and then the dead one would never be called)
    url.router.waits[holder], url.router.waits[1 - holder] = 0.0, 60.0
    r = _post(url, "flux", prompt="a slow cat")
    assert int(r.headers["x-nostall-worker"]) == 1 - holder  # served by the other worker
    workers = httpx.get(f"{url}/fleet").json()["workers"]
    assert workers[holder]["down"] and not workers[1 - holder]["down"]
