"""The worker's HTTP API through real HTTP (uvicorn on loopback), tiny random pipelines."""

from __future__ import annotations

import base64
import io
import logging
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image


def _reference(store, name, *, prompt="a cat", size=32, steps=2, seed=0, **kw):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(store / name))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device="cpu").manual_seed(seed)
    image = pipe(prompt=prompt, height=size, width=size, num_inference_steps=steps,
                 generator=g, output_type="pil", **kw).images[0]  # fmt: skip
    return np.asarray(image)


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def shared_server(store):
    """One worker for the tests that leave nothing another test asserts on (bad requests,
    unknown models): starting and stopping a worker and its server each time cost more
    than the requests themselves."""
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    worker = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20, prepare=False)
    with BackgroundServer(create_app(worker)) as server:
        yield server


@pytest.fixture
def gated(monkeypatch):
    """Image jobs that wait at a gate: ``started`` is set as each begins, ``ran`` lists
    their seeds, and each waits for ``gate`` (at most 60 s) before it runs for real."""
    import types

    from nostall.serve import runner as runner_mod

    g = types.SimpleNamespace(started=threading.Event(), gate=threading.Event(), ran=[])
    real = runner_mod.Runner._image

    def slow(self, job, start):
        g.ran.append(job.seed)
        g.started.set()
        g.gate.wait(60)
        return real(self, job, start)

    monkeypatch.setattr(runner_mod.Runner, "_image", slow)
    return g


def _body(model="flux", **kw):
    body = {"model": model, "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 0}
    if model == "flux":
        body["max_sequence_length"] = 16
    body.update(kw)
    return body


def test_images_equal_diffusers_for_the_seed_and_carry_their_phases(serve, store):
    server, _ = serve()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/images/generations", json=_body())
        assert r.status_code == 200, r.text
        out = r.json()
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(out["data"][0]["b64_json"]))))
        assert np.array_equal(image, _reference(store, "flux", max_sequence_length=16))
        phases = out["nostall"]["phases"]
        for p in ("queue", "switch", "read", "copy", "build", "text", "denoise", "decode", "total"):
            assert p in phases and phases[p] >= 0
        assert phases["denoise"] > 0 and phases["text"] > 0
        assert "switch;dur=" in r.headers["server-timing"]
        assert {x["tier"] for x in out["nostall"]["switch"]["components"]} == {"disk"}
        # PNG straight, and another pipeline; then flux again from memory
        r = c.post("/v1/images/generations", json=_body("sdxl", response_format="png", seed=3))
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        image = np.asarray(Image.open(io.BytesIO(r.content)))
        assert np.array_equal(image, _reference(store, "sdxl", seed=3))
        r = c.post("/v1/images/generations", json=_body())
        assert "disk" not in r.headers["x-nostall-switch-tiers"]


@pytest.mark.parametrize(
    "body, status, says",
    [
        ("{not json", 400, "not JSON"),
        ("[" * 100_000, 400, "nested too deep"),
        (b'{"model": "\xff"}', 400, "not JSON"),
        ({"model": "flux"}, 422, "prompt"),
        (_body(size="33x32"), 422, "multiple of 8"),
        (_body(size="big"), 422, "WIDTHxHEIGHT"),
        (_body(steps=-1), 422, "steps=-1"),
        (_body(steps=10_000), 422, "steps=10000"),
        (_body(prompt="x" * 5000), 422, "prompt of 5000"),
        (_body(n=2), 422, "only 1"),
        (_body(sampler="euler"), 422, "sampler"),
        (_body(guidance=-1.0), 422, "guidance=-1.0"),
        (_body(seed=-5), 422, "seed=-5"),
        # each pipeline's own limits, before queueing (these reached the pipeline: 500)
        (_body("sd3", size="256x256"), 422, "pos_embed_max_size 96"),
        (_body(max_sequence_length=600), 422, "max_sequence_length=600"),
        (_body("sdxl", max_sequence_length=16), 422, "takes no max_sequence_length"),
        (_body("wan"), 422, "video pipeline"),
        # strict types: no string or float numbers
        (_body(steps="2"), 422, "steps: Input should be a valid integer"),
        (_body(steps=2.0), 422, "steps: Input should be a valid integer"),
        (_body(max_sequence_length="16"), 422, "max_sequence_length"),
        (_body(seed=True), 422, "seed"),
    ],
)
def test_bad_requests_get_clear_4xx_and_the_worker_keeps_serving(shared_server, body, status, says):
    with httpx.Client(base_url=shared_server.url, timeout=120) as c:
        kw = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
        r = c.post("/v1/images/generations", **kw)
        assert r.status_code == status, r.text
        assert says in r.json()["error"]["message"]
        assert c.post("/v1/images/generations", json=_body()).status_code == 200


@pytest.mark.parametrize(
    "body, field, allowed",
    [
        (_body("sd3", size="256x256"), "size", {"multiple_of": 8, "min": 16, "max": 192}),
        (_body(max_sequence_length=600), "max_sequence_length", {"min": 1, "max": 512}),
        (_body(steps=0), "steps", {"min": 1, "max": 150}),
        (_body("wan"), "model", ["flux", "sd3", "sdxl"]),
        (_body(steps="2"), "steps", None),
    ],
)
def test_a_422_names_the_field_and_the_allowed_values(shared_server, body, field, allowed):
    r = httpx.post(f"{shared_server.url}/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field
    if allowed is not None:
        assert err["allowed"] == allowed


def test_a_pipeline_value_error_at_run_time_is_422_logged_without_traceback(
    serve, monkeypatch, caplog
):
    from nostall.serve import runner as runner_mod

    real = runner_mod.image_kwargs

    def refuse(pipe, job, device):
        if job.seed == 13:
            raise ValueError("`height` and `width` have to be divisible by 8 but are 30 and 30.")
        return real(pipe, job, device)

    monkeypatch.setattr(runner_mod, "image_kwargs", refuse)
    caplog.set_level(logging.INFO)
    server, _ = serve(prepare=False)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/images/generations", json=_body(seed=13))
        assert r.status_code == 422, r.text
        assert r.json()["error"]["type"] == "rejected_by_pipeline"
        assert "divisible by 8" in r.json()["error"]["message"]
        assert c.post("/v1/images/generations", json=_body(seed=1)).status_code == 200
    refused = [x for x in caplog.records if "refused" in x.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.INFO
    assert not [x for x in caplog.records if x.exc_info or x.levelno >= logging.ERROR]


def _latents(*shape, fill=None):
    from safetensors.torch import save

    z = torch.zeros(*shape) if fill is None else torch.full(shape, fill)
    return save({"latents": z})


@pytest.mark.parametrize(
    "model, content, field, says",
    [
        ("wan", _latents(2, 16, 3, 4, 4), "latents", "a batch of 2"),
        ("wan", _latents(1, 4, 3, 4, 4), "latents", "4 channels"),
        ("wan", _latents(16, 3, 4, 4), "latents", "(1, 16, T, h, w)"),
        ("wan", _latents(1, 16, 3, 4, 4, fill=float("nan")), "latents", "NaN or infinite"),
        ("wan", _latents(1, 16, 41, 92, 160), "latents", "161 frames of at most 921600"),
        ("flux", _latents(1, 16, 3, 4, 4), "model", "not a Wan VAE"),
    ],
)
def test_bad_latents_get_422_naming_the_fault_before_queueing(serve, model, content, field, says):
    server, worker = serve(prepare=False)
    r = httpx.post(f"{server.url}/v1/videos/decode", params={"model": model},
                   content=content, timeout=60)  # fmt: skip
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and says in err["message"], err
    if field == "model":
        assert err["allowed"] == ["wan"]
    assert worker.recent == type(worker.recent)() and not worker.cache.reports  # nothing ran


def test_a_decode_query_is_checked_before_its_body_is_read(shared_server):
    head = (
        b"POST /v1/videos/decode?model=wan&mode=turbo HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 1000000\r\nConnection: close\r\n\r\n"
    )
    out = _raw(shared_server.port, head)  # no body sent at all
    assert out.startswith(b"HTTP/1.1 422") and b'"field":"mode"' in out, out[:300]
    r = httpx.post(f"{shared_server.url}/v1/videos/decode", params={"model": "wan", "fps": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "fps"
    r = httpx.post(f"{shared_server.url}/v1/videos/decode", params={"model": "nope"})
    assert r.status_code == 404 and "wan" in r.json()["error"]["models"]


def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; what the server answered before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize(
    "path, length",
    [("/v1/images/generations", 10**9), ("/v1/videos/decode?model=wan", (128 << 20) + 1)],
)
def test_a_large_body_is_refused_413_before_it_is_read(shared_server, path, length):
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    t = time.monotonic()
    out = _raw(shared_server.port, head + b"{" * 1000)
    assert out.startswith(b"HTTP/1.1 413"), out[:300]
    assert time.monotonic() - t < 10


def test_random_model_names_add_no_metric_series(shared_server):
    import random

    def series(text):
        return {ln.rsplit(" ", 1)[0] for ln in text.splitlines()
                if ln.startswith("nostall_requests_total{")}  # fmt: skip

    with httpx.Client(base_url=shared_server.url, timeout=60) as c:
        before = series(c.get("/metrics").text)
        for _ in range(300):
            name = "".join(random.choices("abcdefghijklmnopqrstuvwxyz", k=12))
            assert c.post("/v1/images/generations", json=_body(name)).status_code == 404
        after = series(c.get("/metrics").text)
    assert len(after - before) <= 1  # at most the one "unknown" series
    assert all('model="unknown"' in s for s in after - before)
    assert 'nostall_requests_total{endpoint="images",model="unknown",status="404"}' in after


def test_a_token_guards_everything_but_the_probes(store):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    worker = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20, prepare=False)
    server = BackgroundServer(create_app(worker, token="tok-123"))
    with server, httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/images/generations", json=_body())
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        for path in ("/", "/metrics", "/v1/models", "/status.json"):
            assert c.get(path).status_code == 401, path
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer tok-123"}).is_success
        r = c.post("/v1/images/generations", json=_body(),
                   headers={"Authorization": "Bearer tok-123"})  # fmt: skip
        assert r.status_code == 200


def test_a_request_past_its_time_limit_gets_504_and_its_queued_job_never_runs(store, gated):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    started, gate, ran = gated.started, gated.gate, gated.ran
    worker = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20, prepare=False)
    with BackgroundServer(create_app(worker, time_limit=1.0)) as server:
        results = {}

        def post(seed):
            results[seed] = httpx.post(f"{server.url}/v1/images/generations",
                                       json=_body(seed=seed), timeout=60)  # fmt: skip

        first = threading.Thread(target=post, args=(1,))
        first.start()
        assert started.wait(30)
        post(2)  # queued behind the first, then past its limit
        first.join(60)
        assert results[1].status_code == 504 and results[2].status_code == 504
        assert results[2].json()["error"]["type"] == "time_limit"
        gate.set()
        # The worker serves on: a job submitted past the HTTP layer (no 1 s limit on a
        # loaded machine's cold switch) runs next, and seed 2's never does.
        future, _ = worker.submit(worker.image_job(_body(seed=3)))
        assert future.result(timeout=120).info["seed"] == 3
    assert ran == [1, 3]  # seed 2's job was dropped from the queue


def test_a_broken_pipeline_folder_is_shown_unavailable_and_the_rest_served(store, tmp_path):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    models = tmp_path / "models"
    models.mkdir()
    (models / "sdxl").symlink_to(store / "sdxl", target_is_directory=True)
    (models / "broken").mkdir()
    (models / "broken" / "model_index.json").write_text("{not json")
    worker = Worker(models, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20)
    with (
        BackgroundServer(create_app(worker)) as server,
        httpx.Client(base_url=server.url, timeout=120) as c,
    ):
        data = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert data["sdxl"]["available"] and not data["broken"]["available"]
        assert "model_index.json" in data["broken"]["reason"]
        page = c.get("/").text
        assert "unavailable" in page and "broken" in page
        r = c.post("/v1/images/generations", json=_body("broken"))
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_unavailable"
        assert c.post("/v1/images/generations", json=_body("sdxl")).status_code == 200


def test_unknown_model_is_404_listing_the_models(shared_server):
    url = shared_server.url
    r = httpx.post(f"{url}/v1/images/generations", json=_body("flux-pro"), timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert "flux-pro" in err["message"] and set(err["models"]) == {"flux", "sdxl", "sd3", "wan"}


def test_a_full_queue_answers_429_and_every_accepted_request_is_served(serve, gated):

    gate = gated.gate
    server, _ = serve(max_queue=2, prepare=False)
    results: list[httpx.Response] = []

    def post(seed):
        results.append(httpx.post(f"{server.url}/v1/images/generations",
                                  json=_body(seed=seed), timeout=120))  # fmt: skip

    threads = [threading.Thread(target=post, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    _wait_for(lambda: sum(r.status_code == 429 for r in results) == 3, "three 429 answers")
    gate.set()
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 200, 429, 429, 429]  # one running, two waiting
    assert all(r.headers.get("retry-after") for r in results if r.status_code == 429)
    seeds = sorted(r.json()["nostall"]["seed"] for r in results if r.status_code == 200)
    assert len(set(seeds)) == 3  # no answer mixed up or lost
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "nostall_rejected_total 3.0" in metrics


def test_health_ready_metrics_models_and_status_page(serve):
    server, _ = serve(prepare=False)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").status_code == 200
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {
            "flux",
            "sdxl",
            "sd3",
            "wan",
        }
        c.post("/v1/images/generations", json=_body())
        text = c.get("/metrics").text
        assert 'nostall_requests_total{endpoint="images",model="flux",status="200"} 1.0' in text
        assert 'nostall_phase_seconds_count{phase="denoise"} 1.0' in text
        assert 'nostall_switch_components_total{tier="disk"}' in text
        page = c.get("/").text
        assert "<h1>nostall worker</h1>" in page and "flux" in page and "denoise" in page
        status = c.get("/status.json").json()
        assert status["models"]["flux"][0] == "gpu" or status["models"]["flux"][0] == "host"
        assert status["recent"][0]["model"] == "flux"


def test_video_decode_returns_an_mp4_of_the_latents(serve, store):
    import av
    from safetensors.torch import save

    server, worker = serve(prepare=False)
    g = torch.Generator().manual_seed(0)
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(str(store / "wan" / "vae"))
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4, generator=g)
    r = httpx.post(f"{server.url}/v1/videos/decode", params={"model": "wan", "fps": 8, "mode": "exact"},
                   content=save({"latents": z}), timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and r.headers["x-nostall-frames"] == "9"
    with av.open(io.BytesIO(r.content)) as f:
        assert sum(1 for _ in f.decode(video=0)) == 9
    assert r.headers["x-nostall-switch-tiers"] == "disk"
    again = httpx.post(f"{server.url}/v1/videos/decode", params={"model": "wan"},
                       content=save({"latents": z}), timeout=120)  # fmt: skip
    assert again.status_code == 200 and again.headers["x-nostall-switch-tiers"] == "device"
    # only the VAE was switched in, through the cache (its budget and tiers): the Wan
    # transformer and text encoder never moved
    reports = [rep for rep in worker.cache.reports if rep.pipeline == "wan"]
    assert [[c.role for c in rep.components] for rep in reports] == [["vae"], ["vae"]]
    assert reports[0].left_out == ("text_encoder", "transformer")
    bad = httpx.post(f"{server.url}/v1/videos/decode", params={"model": "wan"}, content=b"junk")
    assert bad.status_code == 400
    bad = httpx.post(f"{server.url}/v1/videos/decode", params={"model": "wan", "mode": "turbo"},
                     content=save({"latents": z}))  # fmt: skip
    assert bad.status_code == 422


def test_shutdown_finishes_the_running_job_and_fails_the_queued(serve, gated):

    started, gate = gated.started, gated.gate
    server, worker = serve(prepare=False)
    results = {}

    def post(seed):
        results[seed] = httpx.post(f"{server.url}/v1/images/generations",
                                   json=_body(seed=seed), timeout=120)  # fmt: skip

    first = threading.Thread(target=post, args=(1,))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=post, args=(2,))
    second.start()
    _wait_for(lambda: worker.status()["queue"], "the second request to be queued")
    stopper = threading.Thread(target=worker.shutdown)
    stopper.start()
    second.join(60)
    assert results[2].status_code == 503
    assert httpx.get(f"{server.url}/readyz").status_code == 503
    gate.set()
    first.join(60)
    stopper.join(60)
    assert results[1].status_code == 200  # the running job finished


def test_a_client_that_leaves_while_queued_is_skipped(serve, gated, monkeypatch, caplog):

    started, gate, ran = gated.started, gated.gate, gated.ran
    caplog.set_level(logging.INFO, logger="nostall")
    server, worker = serve(prepare=False)
    gone: list[threading.Event] = []  # per submitted job: set when its client has left
    real_submit = worker.submit

    def submit(job):
        future, left = real_submit(job)
        gone.append(left)
        return future, left

    monkeypatch.setattr(worker, "submit", submit)
    first = threading.Thread(
        target=httpx.post,
        args=(f"{server.url}/v1/images/generations",),
        kwargs={"json": _body(seed=1), "timeout": 120},
    )
    first.start()
    assert started.wait(30)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while queued
        httpx.post(f"{server.url}/v1/images/generations", json=_body(seed=2), timeout=0.5)
    assert len(gone) == 2 and gone[1].wait(30)  # the server noticed, before seed 2 could run
    gate.set()
    first.join(60)
    r = httpx.post(f"{server.url}/v1/images/generations", json=_body(seed=3), timeout=120)
    assert r.status_code == 200
    assert ran == [1, 3]  # seed 2 never ran
    assert len(worker.status()["recent"]) == 2
    left = [r for r in caplog.records if "left before its answer" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.INFO and not left[0].exc_info
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_the_next_queued_model_is_prefetched_while_the_current_one_runs(serve, monkeypatch):
    from nostall.serve import runner as runner_mod

    started, gate = threading.Event(), threading.Event()
    real = runner_mod.Runner._image

    def slow(self, job, start):
        if job.model == "flux":
            started.set()
            gate.wait(60)
        return real(self, job, start)

    monkeypatch.setattr(runner_mod.Runner, "_image", slow)
    server, worker = serve(prepare=False, gpu_budget=8 << 20)
    results = {}

    def post(name, body):
        results[name] = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)

    a = threading.Thread(target=post, args=("flux", _body()))
    a.start()
    assert started.wait(30)
    b = threading.Thread(target=post, args=("sdxl", _body("sdxl")))
    b.start()
    _wait_for(lambda: worker.status()["queue"], "the sdxl request to be queued")
    gate.set()
    a.join(60)
    b.join(60)
    assert results["flux"].status_code == 200 and results["sdxl"].status_code == 200
    assert any(r.prefetch and r.pipeline == "sdxl" for r in worker.cache.reports)
    tiers = results["sdxl"].json()["nostall"]["switch"]["components"]
    assert {c["tier"] for c in tiers} <= {"device", "gpu"}  # already moved by the prefetch
