"""The embedding service's HTTP API (``nostall embed-server``): its routes over the
:class:`~nostall.serve.embed.EmbeddingService` an app holds (``app.state.service``).

``POST /v1/embeddings`` ``{"encoder", "texts": [...], "max_length", "hidden_layer"}``
(:class:`~nostall.serve.bodies.EmbedBody`) answers a safetensors file of the tensors
(never a pickle), its ``X-Nostall-Cache-Hits`` header counting the texts served from the
cache; ``GET /v1/encoders``, ``/healthz``, ``/readyz``, ``/stats`` and ``/metrics``
(Prometheus). A failure is answered by the one mapping the worker and the fleet use
(:func:`~nostall.serve.answers.error_answer`, with the unknown encoder named).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from nostall.serve.answers import answer, read_body
from nostall.serve.bodies import EMBED_SHAPE, EmbedBody
from nostall.serve.http import harden

__all__ = ["create_embed_app", "router"]

router = APIRouter()


def service_of(request: Request) -> Any:
    """The :class:`~nostall.serve.embed.EmbeddingService` of the app serving ``request``."""
    return request.app.state.service


ServiceDep = Annotated[Any, Depends(service_of)]


@router.post("/v1/embeddings")
async def embeddings(request: Request, service: ServiceDep) -> Response:
    t0 = time.perf_counter()
    encoder, response = await _embeddings(service, await request.body())
    service.metrics.requests.labels(encoder, str(response.status_code)).inc()
    service.metrics.latency.observe(time.perf_counter() - t0)
    return response


async def _embeddings(service: Any, raw: bytes) -> tuple[str, Response]:
    """``(the encoder's metrics label, the answer)`` for the body ``raw``."""
    from safetensors.torch import save

    body = read_body(raw, EmbedBody, hint=EMBED_SHAPE)
    if isinstance(body, Response):
        return "-", body
    # metrics label only the encoders there are: a client cannot make a series a name
    label = body.encoder if body.encoder in service.names() else "unknown"
    try:
        job = await asyncio.to_thread(
            service.submit, body.encoder, body.texts, body.max_length, body.hidden_layer
        )
        await asyncio.gather(*(asyncio.wrap_future(f) for f in job.futures))
        tensors, hits = job.result(0)
    except Exception as e:  # the batching thread survived it; say what happened
        return label, answer(e, unknown="encoder")
    payload = save(
        {k: v.contiguous() for k, v in tensors.items()}, metadata={"encoder": body.encoder}
    )
    headers = {"X-Nostall-Cache-Hits": str(hits), "X-Nostall-Texts": str(len(body.texts))}
    return label, Response(payload, media_type="application/octet-stream", headers=headers)


@router.get("/v1/encoders")
async def encoders(service: ServiceDep) -> dict:
    return {"encoders": service.names()}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(service: ServiceDep) -> Response:
    return JSONResponse({"ready": service.ready}, 200 if service.ready else 503)


@router.get("/stats")
async def stats(service: ServiceDep) -> dict:
    return service.stats()


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_embed_app(
    service: Any,
    *,
    api_token: str | None = None,
    max_body_bytes: int | None = None,
    body_timeout: float | None = 120.0,
) -> FastAPI:
    """FastAPI app over ``service`` (an :class:`~nostall.serve.embed.EmbeddingService`):
    ``POST /v1/embeddings``, ``GET /v1/encoders``,
    ``/healthz``, ``/readyz``, ``/stats``, ``/metrics`` (Prometheus). Starting the app
    starts the service; stopping it shuts the service down.

    ``api_token``: every path but the probes needs ``Authorization: Bearer <token>``
    (401 otherwise). ``max_body_bytes``: bodies beyond it are refused (413) from their
    ``Content-Length``, before a byte is read (default: what ``max_texts`` texts of
    ``max_text_chars`` characters take in JSON with every character escaped, plus 64 KiB).
    ``body_timeout``: seconds a body may take to arrive (408 after).
    """
    if max_body_bytes is None:
        max_body_bytes = service.max_texts * service.max_text_chars * 6 + (64 << 10)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="nostall embeddings", lifespan=lifespan)
    app.state.service = service
    app.include_router(router)
    return harden(app, token=api_token, max_body=max_body_bytes, body_timeout=body_timeout)
