"""The embedding service through real HTTP, its client, and the worker using it."""

from __future__ import annotations

import base64
import io
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
        ({"encoder": "flux/text_encoder_9", "texts": ["x"]}, 404, "no text encoder"),
        ({"encoder": "flux/text_encoder_2", "texts": ["x"], "max_length": 0}, 422, "max_length"),
        ({"encoder": "flux/text_encoder_2", "texts": []}, 422, "texts"),
        ({"texts": ["x"]}, 400, "expected"),
    ],
)
def test_bad_embedding_requests_are_clear(embed, body, status, says):
    server, _ = embed()
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status and says in r.json()["error"]["message"]
    ok = {"encoder": "flux/text_encoder_2", "texts": ["x"], "max_length": 8}
    assert httpx.post(f"{server.url}/v1/embeddings", json=ok, timeout=30).status_code == 200


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
    from nostall.quant.check import sqnr_db
    from nostall.serve.embed import EmbeddingService

    models = tmp_path / "models"
    models.mkdir()
    nostall.quantize(store / "flux", models / "flux8")
    service = EmbeddingService(models, device="cpu").start()
    try:
        out, hits = service.encode("flux8/text_encoder_2", ["a red fox"], 16)
    finally:
        service.shutdown()
    t5 = service._by_name["flux8/text_encoder_2"].module
    assert any(p.dtype == torch.float8_e4m3fn for p in t5.parameters())  # served in FP8
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
