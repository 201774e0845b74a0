"""The embedding client against services that answer badly, through real HTTP: every
bad reply is an :class:`EmbeddingUnavailable`, so a worker encodes locally instead."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from nostall.errors import EmbeddingUnavailable
from nostall.serve.local import BackgroundServer as Server

_HTML = b"<!doctype html><html><body><h1>502 Bad Gateway</h1></body></html>"


@pytest.fixture
def fake():
    """A service whose every answer is ``reply`` (status, body, headers); ``seen`` holds
    each request's headers."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    reply: dict = {"status": 200, "body": b"", "headers": {}}
    seen: list[dict[str, str]] = []

    async def embeddings(request):
        await request.body()
        seen.append(dict(request.headers))
        return Response(reply["body"], reply["status"], headers=reply["headers"])

    app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])
    with Server(app) as server:
        yield server, reply, seen


def _st(**tensors: torch.Tensor) -> bytes:
    from safetensors.torch import save

    return save(tensors)


_GOOD = _st(last_hidden_state=torch.zeros(1, 8, 4), pooled=torch.zeros(1, 4))


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, _HTML, "not a safetensors"),
        (200, _GOOD[: len(_GOOD) // 2], "not a safetensors"),  # truncated, Content-Length agrees
        (200, b"", "not a safetensors"),
        (200, _st(other=torch.zeros(1, 8, 4)), "no 'last_hidden_state'"),
        (200, _st(last_hidden_state=torch.zeros(2, 8, 4)), "(2, 8, 4)"),  # two rows for one text
        (200, _st(last_hidden_state=torch.zeros(1, 9, 4)), "(1, 9, 4)"),  # 9 tokens, not 8
        (200, _st(last_hidden_state=torch.zeros(1, 8)), "(1, 8)"),
        (200, _st(last_hidden_state=torch.zeros(1, 8, 4, dtype=torch.int64)), "int64"),
        (200, _st(last_hidden_state=torch.zeros(1, 8, 4), pooled=torch.zeros(3, 4)), "pooled"),
        (404, _HTML, "404"),  # a proxy's page, not the service's JSON
        (422, b'{"error": "not the shape we send"}', "422"),
    ],
    ids=str.split(
        "html truncated empty missing rows length rank dtype pooled html-404 odd-json-422"
    ),
)
def test_bad_replies_are_embedding_unavailable(fake, status, body, says):
    from nostall.serve.client import EmbeddingClient

    server, reply, seen = fake
    reply.update(status=status, body=body)
    with (
        EmbeddingClient(server.url, retries=2, backoff=0.01) as c,
        pytest.raises(EmbeddingUnavailable) as info,
    ):
        c.encode("flux/text_encoder_2", ["a cat"], 8)
    assert says in str(info.value) and server.url in str(info.value)
    assert len(seen) == 1  # a reply that came whole and wrong is not asked for again


def test_a_good_reply_passes_and_a_hidden_state_is_checked_by_its_own_name(fake):
    from nostall.serve.client import EmbeddingClient

    server, reply, _ = fake
    reply["body"] = _GOOD
    with EmbeddingClient(server.url) as c:
        out = c.encode("flux/text_encoder", ["a cat"], 8)
        assert out["last_hidden_state"].shape == (1, 8, 4) and out["pooled"].shape == (1, 4)
        with pytest.raises(EmbeddingUnavailable, match="no 'hidden_state'"):
            c.encode("sdxl/text_encoder_2", ["a cat"], 8, -2)
        reply["body"] = _st(hidden_state=torch.zeros(2, 5, 4, dtype=torch.bfloat16))
        out = c.encode("sdxl/text_encoder_2", ["a", "b"], None, -2)  # any length when not asked
        assert out["hidden_state"].dtype == torch.bfloat16


def test_a_full_service_is_unavailable_at_once(fake):
    # 429: the service is saturated; a worker encodes locally rather than wait in line
    from nostall.serve.client import EmbeddingClient

    server, reply, seen = fake
    reply.update(status=429, body=b'{"error": {"message": "queue full"}}',
                 headers={"Retry-After": "3"})  # fmt: skip
    with (
        EmbeddingClient(server.url, retries=2, backoff=0.01) as c,
        pytest.raises(EmbeddingUnavailable, match=r"429 queue full \(Retry-After 3 s\)"),
    ):
        c.encode("flux/text_encoder_2", ["a cat"], 8)
    assert len(seen) == 1


def test_the_client_sends_its_token(fake, monkeypatch):
    from nostall.serve.client import EmbeddingClient

    server, reply, seen = fake
    reply["body"] = _GOOD
    with EmbeddingClient(server.url, token="s3cret") as c:
        c.encode("flux/text_encoder", ["a cat"], 8)
    monkeypatch.setenv("NOSTALL_API_TOKEN", "from-env")
    with EmbeddingClient(server.url) as c:  # the one token `serve` and `embed-server` read
        c.encode("flux/text_encoder", ["a cat"], 8)
    monkeypatch.delenv("NOSTALL_API_TOKEN")
    with EmbeddingClient(server.url) as c:
        c.encode("flux/text_encoder", ["a cat"], 8)
    auth = [h.get("authorization") for h in seen]
    assert auth == ["Bearer s3cret", "Bearer from-env", None]


@pytest.mark.parametrize(
    "body", [_HTML, _st(last_hidden_state=torch.zeros(3, 2, 1))], ids=["html", "wrong-shape"]
)
def test_the_worker_encodes_locally_when_the_service_answers_nonsense(fake, serve, body):
    server, reply, seen = fake
    reply["body"] = body
    worker_server, _ = serve(prepare=False, embed_url=server.url)
    local_server, _ = serve(prepare=False)
    job = {"model": "flux", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 0,
           "max_sequence_length": 16, "response_format": "png"}  # fmt: skip
    with httpx.Client(timeout=120) as c:
        remote = c.post(f"{worker_server.url}/v1/images/generations", json=job)
        local = c.post(f"{local_server.url}/v1/images/generations", json=job)
    assert seen and remote.status_code == 200, remote.text
    image = np.asarray(Image.open(io.BytesIO(remote.content)))
    assert np.array_equal(image, np.asarray(Image.open(io.BytesIO(local.content))))
