"""The embedding service through real HTTP, its client, and the worker using it."""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from nostall.serve.local import BackgroundServer as Server
from nostall.serve.local import free_port as _free_port


@pytest.fixture
def embed(store):
    from nostall.serve.embed import EmbeddingService, create_embed_app

    servers = []

    def start(**kw):
        kw.setdefault("device", "cpu")
        service = EmbeddingService(store, **kw)
        server = Server(create_embed_app(service)).__enter__()
        servers.append(server)
        return server, service

    yield start
    for s in servers:
        s.__exit__(None, None, None)


def _pipeline_embeds(store, prompt, max_sequence_length=16):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(store / "flux"))
    with torch.no_grad():
        t5, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None,
                                           max_sequence_length=max_sequence_length)  # fmt: skip
    return t5, pooled


def test_embeddings_equal_the_pipelines_and_repeat_from_the_cache(embed, store):
    from nostall.serve.client import EmbeddingClient

    server, service = embed()
    t5_ref, pooled_ref = _pipeline_embeds(store, "a red fox")
    with EmbeddingClient(server.url) as c:
        t5 = c.encode("flux/text_encoder_2", ["a red fox"], 16)
        clip = c.encode("flux/text_encoder", ["a red fox"])  # the tokenizer's own length
        assert torch.equal(t5["last_hidden_state"], t5_ref)
        assert "pooled" not in t5 and torch.equal(clip["pooled"], pooled_ref)
        before = service.stats()["texts_encoded"]
        r = httpx.post(f"{server.url}/v1/embeddings",
                       json={"encoder": "flux/text_encoder_2", "texts": ["a red fox"], "max_length": 16})  # fmt: skip
        assert r.headers["x-nostall-cache-hits"] == "1"
        assert service.stats()["texts_encoded"] == before  # nothing encoded again
    # FLUX-b would share these encoders; the store here names each once
    assert service.names() == sorted(
        ["flux/text_encoder", "flux/text_encoder_2", "sdxl/text_encoder", "sdxl/text_encoder_2",
         "sd3/text_encoder", "sd3/text_encoder_2", "sd3/text_encoder_3", "wan/text_encoder"]
    )  # fmt: skip


def test_concurrent_texts_are_batched_by_token_budget(embed):
    from nostall.serve.client import EmbeddingClient

    server, service = embed(token_budget=16 * 8, max_wait_s=0.05)
    out = {}

    def one(i):
        with EmbeddingClient(server.url, timeout=60) as c:
            out[i] = c.encode("flux/text_encoder_2", [f"prompt number {i}"], 16)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 32
    stats = service.stats()
    assert stats["texts_encoded"] == 32
    assert stats["batches"] < 32 and stats["batches"] >= 4  # at most 8 texts of 16 per batch
    with EmbeddingClient(server.url) as c:  # a batched text is what it is alone, to rounding
        alone = c.encode("flux/text_encoder_2", ["prompt number 3 "], 16)
    assert alone["last_hidden_state"].shape == out[3]["last_hidden_state"].shape


def test_the_cache_keeps_to_its_byte_budget(store):
    from nostall.serve.embed import EmbeddingService

    service = EmbeddingService(store, device="cpu", cache_bytes=3 * 16 * 32 * 4).start()
    try:
        for i in range(5):
            service.encode("flux/text_encoder_2", [f"text {i}"], 16)
        assert service.cache.bytes <= service.cache.budget and len(service.cache) < 5
        _, hits = service.encode("flux/text_encoder_2", ["text 4"], 16)  # the newest stays
        assert hits == 1
        _, hits = service.encode("flux/text_encoder_2", ["text 0"], 16)  # the oldest went
        assert hits == 0
    finally:
        service.shutdown()


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"encoder": "flux/text_encoder_2", "texts": ["x"], "max_length": 0}, 422, "max_length"),
        ({"encoder": "flux/text_encoder_2", "texts": []}, 422, "texts"),
        ({"texts": ["x"]}, 422, "encoder: Field required"),
        ({"encoder": "flux/text_encoder_2", "texts": ["x"], "max_lenght": 8}, 422, "max_lenght"),
        ({"encoder": "flux/text_encoder_2", "texts": ["\ud800"]}, 422, "lone surrogate"),
        ([1, 2], 422, "body"),
        ("[" * 100_000, 400, "not JSON"),  # nested past Python's recursion limit
    ],
)
def test_bad_embedding_requests_are_clear(embed, body, status, says):
    server, _ = embed()
    # json.dumps, not httpx's json=: it escapes a lone surrogate as a client may send it
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/embeddings", content=content, timeout=30)
    assert r.status_code == status and says in r.json()["error"]["message"]
    ok = {"encoder": "flux/text_encoder_2", "texts": ["x"], "max_length": 8}
    assert httpx.post(f"{server.url}/v1/embeddings", json=ok, timeout=30).status_code == 200


def test_an_unknown_encoder_is_named_as_asked(embed):
    server, service = embed()
    r = httpx.post(f"{server.url}/v1/embeddings",
                   json={"encoder": "flux/text_encoder_9", "texts": ["x"]}, timeout=30)  # fmt: skip
    error = r.json()["error"]
    assert r.status_code == 404 and "'flux/text_encoder_9'" in error["message"]
    assert error["encoder"] == "flux/text_encoder_9" and error["encoders"] == service.names()
    assert "flux/text_encoder_2" in error["close"]


@pytest.mark.parametrize(
    "field, value",
    [("max_length", "16"), ("max_length", 16.9), ("max_length", 16.0), ("max_length", True),
     ("hidden_layer", "-2"), ("hidden_layer", False)],
)  # fmt: skip
def test_lengths_and_layers_are_integers_not_strings_floats_or_booleans(embed, field, value):
    server, service = embed()
    body = {"encoder": "sdxl/text_encoder_2", "texts": ["x"], field: value}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 422 and error["field"] == field and field in error["message"]
    assert service.stats()["texts_encoded"] == 0


@pytest.mark.parametrize("max_length", [33, 77, 10_000])
def test_a_length_past_the_encoders_positions_is_422_before_it_is_loaded(embed, max_length):
    # CLIP here has 32 position embeddings; 33 used to index past them: a 500 (on a GPU, a
    # device-side assert that ended the process)
    server, service = embed()
    body = {"encoder": "flux/text_encoder", "texts": ["x"], "max_length": max_length}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 422, r.text
    assert f"max_length={max_length}" in error["message"] and "1..32" in error["message"]
    assert error["field"] == "max_length" and error["allowed"] == {"min": 1, "max": 32}
    assert not service.stats()["encoders"]["flux/text_encoder"]  # refused before loading
    ok = dict(body, max_length=32)
    assert httpx.post(f"{server.url}/v1/embeddings", json=ok, timeout=30).status_code == 200


def test_an_encoders_value_error_is_422_and_fails_only_its_own_text(store, monkeypatch):
    # token_budget of two texts: the two requests below close one batch together
    from nostall.errors import ArgumentError
    from nostall.serve.embed import EmbeddingService

    service = EmbeddingService(store, device="cpu", token_budget=2 * 8, max_wait_s=60).start()
    try:
        service.encode("flux/text_encoder_2", ["warm", "up"], 8)  # a full batch: no wait
        t5 = service._by_name["flux/text_encoder_2"].module
        bad = service._by_name["flux/text_encoder_2"].tokenizer(["bad"], max_length=8,
              padding="max_length", truncation=True, return_tensors="pt").input_ids  # fmt: skip
        forward = t5.forward

        def refuses(input_ids, **kw):
            if (input_ids == bad).all(dim=1).any():
                raise ValueError("this encoder will not take that text")
            return forward(input_ids, **kw)

        monkeypatch.setattr(t5, "forward", refuses)
        good = service.submit("flux/text_encoder_2", ["good"], 8)
        refused = service.submit("flux/text_encoder_2", ["bad"], 8)
        assert good.result(60)[0]["last_hidden_state"].shape == (1, 8, 32)
        with pytest.raises(ArgumentError, match="will not take") as info:
            refused.result(60)
        assert info.value.field == "texts"
    finally:
        service.shutdown()


@pytest.mark.parametrize(
    "error, status",
    [(ValueError("this encoder will not take that text"), 422),
     (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 503)],
    ids=["value-error", "out-of-memory"],
)  # fmt: skip
def test_an_encoders_error_at_run_time_is_answered_by_kind(embed, monkeypatch, error, status):
    server, service = embed()
    body = {"encoder": "flux/text_encoder_2", "texts": ["x"], "max_length": 8}
    assert httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30).status_code == 200
    t5 = service._by_name["flux/text_encoder_2"].module

    def fails(input_ids, **kw):
        raise error

    monkeypatch.setattr(t5, "forward", fails)
    r = httpx.post(f"{server.url}/v1/embeddings", json=dict(body, texts=["y"]), timeout=30)
    assert r.status_code == status and str(error) in r.json()["error"]["message"]
    if status == 503:
        assert int(r.headers["retry-after"]) >= 1
    monkeypatch.undo()
    again = httpx.post(f"{server.url}/v1/embeddings", json=dict(body, texts=["y"]), timeout=30)
    assert again.status_code == 200  # the batching thread carried on


def _wait_for(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_full_queue_is_429_with_a_retry_after(embed, monkeypatch):
    server, service = embed(max_queue=4, max_texts=4)
    url = f"{server.url}/v1/embeddings"
    warm = {"encoder": "flux/text_encoder_2", "texts": ["warm"], "max_length": 8}
    assert httpx.post(url, json=warm, timeout=30).status_code == 200
    t5 = service._by_name["flux/text_encoder_2"].module
    forward, entered, gate = t5.forward, threading.Event(), threading.Event()

    def held(input_ids, **kw):  # the encoder is busy until the test lets it go
        entered.set()
        assert gate.wait(60)
        return forward(input_ids, **kw)

    monkeypatch.setattr(t5, "forward", held)
    answers = {}

    def post(name, texts):
        body = {"encoder": "flux/text_encoder_2", "texts": texts, "max_length": 8}
        answers[name] = httpx.post(url, json=body, timeout=60).status_code

    running = threading.Thread(target=post, args=("running", ["a"]))
    running.start()
    try:
        assert entered.wait(30)
        queued = threading.Thread(target=post, args=("queued", ["b", "c", "d", "e"]))
        queued.start()
        _wait_for(lambda: service.stats()["queue"]["texts"] == 4, "four texts queued")
        r = httpx.post(url, json=dict(warm, texts=["f"]), timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "queue_full"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        cached = httpx.post(url, json=warm, timeout=30)  # nothing to queue: served at once
        assert cached.status_code == 200 and cached.headers["x-nostall-cache-hits"] == "1"
    finally:
        gate.set()
        running.join(60)
    queued.join(60)
    assert answers == {"running": 200, "queued": 200}


def test_retry_after_follows_the_recent_texts_per_second(store):
    from nostall.errors import ArgumentError
    from nostall.serve.embed import EmbeddingService

    service = EmbeddingService(store, device="cpu", max_queue=10, max_texts=10)
    assert service.retry_after(5) == 1  # nothing measured yet
    service._rate.add(4, 2.0)  # 2 texts/s
    with service._cond:
        service._queue.extend([None] * 10)
    assert service.retry_after(7) == 4  # 7 texts past the cap at 2 texts/s
    assert service.retry_after(500) == 60  # capped
    with pytest.raises(ArgumentError, match="max_queue=2 < max_texts=4"):
        EmbeddingService(store, device="cpu", max_queue=2, max_texts=4)


def test_the_cache_counts_keys_so_long_unique_texts_stay_within_budget(store):
    # 40 unique texts of 8,000 characters under a 64 KiB budget: the keys alone (the
    # texts) used to be 320 KB kept past it, uncounted
    import gc
    import tracemalloc

    from nostall.serve.embed import EmbeddingService

    budget = 64 << 10
    service = EmbeddingService(store, device="cpu", cache_bytes=budget).start()
    try:
        service.encode("flux/text_encoder_2", ["warm"], 16)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            service.encode("flux/text_encoder_2", [f"{i:04d}" + "x" * 7996], 16)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert service.cache.bytes <= service.cache.budget
        assert 1 < len(service.cache) < 40
        assert grown < budget  # what the process kept (Python objects; tensors are not traced)
    finally:
        service.shutdown()


def test_a_text_over_the_character_cap_is_422_naming_the_cap(embed):
    server, service = embed(max_text_chars=100)
    body = {"encoder": "flux/text_encoder_2", "texts": ["ok", "x" * 101], "max_length": 8}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 422 and error["field"] == "texts"
    assert "texts[1]: 101 characters" in error["message"] and "at most 100" in error["message"]
    assert service.stats()["texts_encoded"] == 0
    ok = dict(body, texts=["x" * 100])
    assert httpx.post(f"{server.url}/v1/embeddings", json=ok, timeout=30).status_code == 200


def test_a_slow_tokenization_holds_up_no_other_request(embed):
    # a request of long texts is tokenized in its own thread, not in the batching thread
    # that every encoder shares
    server, service = embed()
    url = f"{server.url}/v1/embeddings"
    for encoder in ("flux/text_encoder", "flux/text_encoder_2"):
        body = {"encoder": encoder, "texts": ["warm"], "max_length": 8}
        assert httpx.post(url, json=body, timeout=30).status_code == 200
    t5 = service._by_name["flux/text_encoder_2"]
    tokenizer, entered, gate = t5.tokenizer, threading.Event(), threading.Event()

    def slow(texts, **kw):
        if any(t.startswith("long") for t in texts):
            entered.set()
            assert gate.wait(60)
        return tokenizer(texts, **kw)

    t5.tokenizer = slow
    answers = {}

    def post_long():
        body = {"encoder": "flux/text_encoder_2", "texts": ["long " * 1000], "max_length": 8}
        answers["long"] = httpx.post(url, json=body, timeout=60).status_code

    long = threading.Thread(target=post_long)
    long.start()
    try:
        assert entered.wait(30)
        for encoder in ("flux/text_encoder", "flux/text_encoder_2"):
            body = {"encoder": encoder, "texts": ["short"], "max_length": 8}
            assert httpx.post(url, json=body, timeout=10).status_code == 200
        assert "long" not in answers
    finally:
        gate.set()
        long.join(60)
        t5.tokenizer = tokenizer
    assert answers == {"long": 200}


def test_a_token_guards_the_service_but_not_its_probes(store):
    from nostall.serve.embed import EmbeddingService, create_embed_app

    service = EmbeddingService(store, device="cpu")
    with Server(create_embed_app(service, api_token="s3cret")) as server:
        body = {"encoder": "flux/text_encoder_2", "texts": ["x"], "max_length": 8}
        url = f"{server.url}/v1/embeddings"
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(url, json=body, headers=wrong, timeout=30).status_code == 401
        assert httpx.get(f"{server.url}/stats").status_code == 401
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        right = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url, json=body, headers=right, timeout=30).status_code == 200
    assert service.stats()["texts_encoded"] == 1


def test_a_body_over_the_limit_is_refused_before_it_is_read(embed, store):
    import socket

    from nostall.serve.embed import EmbeddingService, create_embed_app

    service = EmbeddingService(store, device="cpu")
    with Server(create_embed_app(service, max_body_bytes=1000)) as server:
        big = {"encoder": "flux/text_encoder_2", "texts": ["x" * 2000], "max_length": 8}
        r = httpx.post(f"{server.url}/v1/embeddings", json=big, timeout=30)
        assert r.status_code == 413 and "at most 1000" in r.json()["error"]["message"]
        # a client announcing 1 GB gets its answer without sending a byte of it
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")  # fmt: skip
            assert s.recv(4096).startswith(b"HTTP/1.1 413")
    # by default, the most texts of the longest text pass, escaped as json.dumps does
    server, _ = embed(max_texts=2, max_text_chars=1000)
    full = {"encoder": "flux/text_encoder_2", "texts": ["\u00e9" * 1000] * 2, "max_length": 8}
    r = httpx.post(f"{server.url}/v1/embeddings", content=json.dumps(full), timeout=30)
    assert r.status_code == 200, r.text
    huge = dict(full, texts=["x" * 200_000])  # past the body's cap: not read to be refused
    r = httpx.post(f"{server.url}/v1/embeddings", content=json.dumps(huge), timeout=30)
    assert r.status_code == 413


def test_embed_server_takes_a_token_and_warns_when_exposed_without_one(store, monkeypatch, caplog):
    import uvicorn
    from typer.testing import CliRunner

    from nostall.cli import app

    started = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: started.append(self.config))
    monkeypatch.delenv("NOSTALL_API_TOKEN", raising=False)
    args = ["embed-server", "--models", str(store), "--device", "cpu", "--max-queue", "512",
            "--max-text-chars", "4000"]  # fmt: skip

    def warned(*extra, env=None) -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nostall.serve.http"):
            r = CliRunner().invoke(app, [*args, *extra], env=env)
        assert r.exit_code == 0, r.output
        said = [m for m in caplog.messages if "without a token" in m]
        assert len(said) <= 1, said  # once, not once per check
        return bool(said)

    assert warned("--host", "0.0.0.0")
    assert not warned("--host", "0.0.0.0", env={"NOSTALL_API_TOKEN": "t0k"})
    assert not warned("--host", "0.0.0.0", "--api-token", "t0k")
    assert not warned()  # loopback
    assert len(started) == 4 and started[0].host == "0.0.0.0"
    r = CliRunner().invoke(app, [*args, "--max-queue", "0"])
    assert r.exit_code == 2 and "max-queue" in r.output
    r = CliRunner().invoke(app, [*args, "--api-token", " t0k "])  # checked before the store
    assert r.exit_code == 2 and "token" in r.output and len(started) == 4


def test_the_client_retries_then_says_unavailable():
    from nostall.serve.client import EmbeddingClient, EmbeddingUnavailable

    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    t = time.perf_counter()
    with (
        EmbeddingClient(url, timeout=1, retries=2, backoff=0.1) as c,
        pytest.raises(EmbeddingUnavailable, match="after 3 attempts"),
    ):
        c.encode("flux/text_encoder_2", ["x"], 8)
    assert time.perf_counter() - t >= 0.3  # 0.1 + 0.2 of backoff


def _body(**kw):
    body = {"model": "flux", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 0,
            "max_sequence_length": 16}  # fmt: skip
    body.update(kw)
    return body


def _roles(r):
    return {c["role"] for c in r.json()["nostall"]["switch"]["components"]}


def _image(r):
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))


def test_the_worker_encodes_flux_prompts_in_the_service_and_falls_back(embed, serve, store, caplog):
    embed_server, service = embed()
    worker_server, _ = serve(prepare=False, embed_url=embed_server.url)
    local_server, _ = serve(prepare=False)
    with httpx.Client(timeout=120) as c:
        local = c.post(f"{local_server.url}/v1/images/generations", json=_body())
        remote = c.post(f"{worker_server.url}/v1/images/generations", json=_body())
        assert remote.status_code == 200, remote.text
        assert np.array_equal(_image(remote), _image(local))  # same bits as encoding locally
        assert "text_service" in remote.json()["nostall"]["phases"]
        assert service.stats()["texts_encoded"] == 2  # CLIP and T5, once each
        # the worker switched FLUX in without its text encoders: their bytes did not move
        assert _roles(remote) == {"transformer", "vae"}
        assert _roles(local) == {"text_encoder", "text_encoder_2", "transformer", "vae"}
        embed_server.__exit__(None, None, None)  # the service goes away
        with caplog.at_level(logging.WARNING, logger="nostall.serve.worker"):
            for _ in range(2):
                again = c.post(f"{worker_server.url}/v1/images/generations", json=_body())
                assert again.status_code == 200
                assert np.array_equal(_image(again), _image(local))
                assert "text_encoder_2" in _roles(again)  # switched in to encode locally
        said = [r for r in caplog.records if "encoding locally" in r.getMessage()]
        assert len(said) == 1


@pytest.mark.parametrize(
    "model, extra",
    [
        ("sdxl", {}),  # no negative prompt: the pipeline's zeros, as it would
        ("sdxl", {"negative_prompt": "blurry"}),
        ("sd3", {}),  # SD3 encodes "" as the negative prompt
        ("sd3", {"negative_prompt": "blurry", "max_sequence_length": 12}),
    ],
)
def test_the_worker_encodes_sdxl_and_sd3_prompts_in_the_service(embed, serve, model, extra):
    embed_server, service = embed()
    worker_server, _ = serve(prepare=False, embed_url=embed_server.url)
    local_server, _ = serve(prepare=False)
    body = {"model": model, "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 5, **extra}
    with httpx.Client(timeout=120) as c:
        local = c.post(f"{local_server.url}/v1/images/generations", json=body)
        remote = c.post(f"{worker_server.url}/v1/images/generations", json=body)
    assert local.status_code == 200 and remote.status_code == 200, remote.text
    assert np.array_equal(_image(remote), _image(local))  # the pipeline's own encode, bit for bit
    assert "text_service" in remote.json()["nostall"]["phases"]
    assert not any(r.startswith("text_encoder") for r in _roles(remote))  # left out
    # each encoder once per text: CLIP-L and CLIP-G (and SD3's T5), prompt and negative
    encoders = 3 if model == "sd3" else 2
    texts = 2 if (model == "sd3" or "negative_prompt" in extra) else 1
    assert service.stats()["texts_encoded"] == encoders * texts


def test_hidden_layers_are_the_encoders_and_checked(embed, store):
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    from nostall.serve.client import EmbeddingClient

    server, _ = embed()
    te = CLIPTextModelWithProjection.from_pretrained(str(store / "sdxl" / "text_encoder_2"))
    tok = CLIPTokenizer.from_pretrained(str(store / "sdxl" / "tokenizer_2"))
    ids = tok(["a dog"], padding="max_length", max_length=tok.model_max_length,
              truncation=True, return_tensors="pt").input_ids  # fmt: skip
    with torch.no_grad():
        ref = te(ids, output_hidden_states=True)
    with EmbeddingClient(server.url) as c:
        out = c.encode("sdxl/text_encoder_2", ["a dog"], None, -2)
        assert torch.equal(out["hidden_state"], ref.hidden_states[-2])
        assert torch.equal(out["pooled"], ref.text_embeds)  # CLIP with a projection
        last = c.encode("sdxl/text_encoder_2", ["a dog"])
        assert torch.equal(last["last_hidden_state"], ref.last_hidden_state)
    r = httpx.post(f"{server.url}/v1/embeddings",
                   json={"encoder": "sdxl/text_encoder_2", "texts": ["a"], "hidden_layer": 9})  # fmt: skip
    assert r.status_code == 422 and "hidden_layer=9" in r.json()["error"]["message"]


def test_the_service_exports_prometheus_metrics(embed):
    from prometheus_client.parser import text_string_to_metric_families

    server, _ = embed()
    body = {"encoder": "flux/text_encoder_2", "texts": ["a", "b"], "max_length": 8}
    for _ in range(2):  # encoded, then both from the cache
        assert httpx.post(f"{server.url}/v1/embeddings", json=body).status_code == 200
    assert (
        httpx.post(
            f"{server.url}/v1/embeddings", json={"encoder": "nope", "texts": ["a"]}
        ).status_code
        == 404
    )
    text = httpx.get(f"{server.url}/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    ok = (("encoder", "flux/text_encoder_2"), ("status", "200"))
    assert samples[("nostall_embed_requests_total", ok)] == 2
    assert (
        samples[("nostall_embed_requests_total", (("encoder", "unknown"), ("status", "404")))] == 1
    )
    assert samples[("nostall_embed_texts_total", (("source", "encoded"),))] == 2
    assert samples[("nostall_embed_texts_total", (("source", "cache"),))] == 2
    assert samples[("nostall_embed_batch_texts_count", ())] >= 1
    assert samples[("nostall_embed_cache_bytes", ())] > 0


def test_left_out_encoders_on_disk_do_not_make_a_model_look_cold(embed, serve):
    embed_server, _ = embed()
    server, worker = serve(prepare=False, embed_url=embed_server.url)
    with worker.cache.use("flux"):  # the encoders were once switched in (a local encode)
        pass
    worker.cache.evict("all")  # everything on disk now
    r = httpx.post(f"{server.url}/v1/images/generations", json=_body(), timeout=120)
    assert r.status_code == 200 and _roles(r) == {"transformer", "vae"}
    tiers = {c["roles"][0]: c["tier"] for c in worker.cache.stats().components.values()}
    assert tiers["text_encoder_2"] == "disk" and tiers["transformer"] == "gpu"
    # what a flux image job waits for is on the GPU: the fleet's router must see that
    assert worker.status()["models"]["flux"] == ["gpu"]


def test_the_service_serves_an_fp8_t5_folder_as_it_is(store, tmp_path):
    # `nostall quantize` output (T5 and CLIP in e4m3) served without a conversion step.
    import nostall
    from nostall.serve.embed import EmbeddingService
    from nostall.verify import sqnr_db

    models = tmp_path / "models"
    models.mkdir()
    nostall.quantize(store / "flux", models / "flux8")
    service = EmbeddingService(models, device="cpu").start()
    try:
        out, hits = service.encode("flux8/text_encoder_2", ["a red fox"], 16)
        t5 = service._by_name["flux8/text_encoder_2"].module
        assert any(p.dtype == torch.float8_e4m3fn for p in t5.parameters())  # served in FP8
    finally:
        service.shutdown()
    ref, _ = _pipeline_embeds(store, "a red fox")
    got = out["last_hidden_state"]
    assert hits == 0 and got.shape == ref.shape and got.isfinite().all()
    assert sqnr_db(ref, got) > 15


def test_a_worker_and_the_service_in_one_process_read_one_store(store):
    # One scan, one identity per file: the folder is not scanned (nor its files hashed)
    # once by the worker's cache and again by the service.
    from nostall.cache import Store
    from nostall.serve.embed import EmbeddingService
    from nostall.serve.worker import Worker

    service = EmbeddingService(store, device="cpu")
    worker = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20, prepare=False)
    try:
        assert worker.cache.store is service.store is Store.shared(store)
        given = Store(store, cache_dir=False)
        assert EmbeddingService(given, device="cpu").store is given
    finally:
        worker.shutdown()


def test_shutdown_gives_back_the_encoders_the_cache_and_the_budget_claim(store):
    from nostall.serve.budget import DeviceBudget
    from nostall.serve.embed import EmbeddingService

    budget = DeviceBudget("cpu")
    service = EmbeddingService(store, device="cpu", budget=budget).start()
    service.encode("flux/text_encoder", ["a cat"])
    assert service.stats()["encoders"]["flux/text_encoder"] is True
    assert len(service.cache) == 1 and "embedding service" in budget.claims()
    service.shutdown()
    assert not any(service.stats()["encoders"].values()) and len(service.cache) == 0
    assert "embedding service" not in budget.claims()
    service.start()  # started again: claims again, loads again
    try:
        assert "embedding service" in budget.claims()
        assert service.encode("flux/text_encoder", ["a cat"])[1] == 0  # not from the cache
    finally:
        service.shutdown()
