"""The worker's HTTP API (FastAPI; ``nostall serve`` runs it under uvicorn).

``POST /v1/images/generations``  OpenAI's images API shape plus nostall's fields:
    ``{"model", "prompt", "size": "WxH", "steps", "seed", "guidance",
    "negative_prompt", "max_sequence_length", "loras": [{"name", "scale"}],
    "controlnet": {"name", "image", "scale"}, "response_format": "b64_json" | "png"}``
    (``loras``: names of the server's ``<store>/loras``, fused for this request;
    requests without them get the base; ``controlnet``: a name of its
    ``<store>/controlnets``, with a base64 control image of the request's size);
    answers ``{"created", "data": [{"b64_json"}], "nostall": {...}}`` or the PNG bytes.
``POST /v1/videos``, ``GET /v1/videos[/{id}[/content]]``, ``DELETE /v1/videos/{id}``
    OpenAI's Videos API: a prompt (and an image, for image-to-video) → a video job,
    polled, its MP4 fetched (:mod:`nostall.serve.routes.video_jobs`).
``POST /v1/videos/decode?model=&fps=&mode=&denormalize=``  body: safetensors bytes
    holding ``latents`` (1, C, T, h, w); answers the MP4.
``GET /v1/models``, ``/healthz``, ``/readyz`` (both 503 once the worker drains,
:meth:`~nostall.serve.worker.Worker.drain`), ``/metrics`` (Prometheus), ``/`` (status).

Every answer to a generation or decode carries the phase times in a ``Server-Timing``
header (milliseconds, what browsers' developer tools show) and ``X-Nostall-*`` headers,
and image JSON answers in ``nostall.phases`` too. Errors are JSON ``{"error": {"type",
"message", ...}}``: 400 malformed body, 401 no or wrong token (with ``token=``), 404
unknown model (listing the models), 408 a body that did not arrive in time, 413 a body
too large (refused from its ``Content-Length`` before it is read), 422 a value the
pipeline cannot take — checked before queueing against the pipeline's own limits
(:mod:`nostall.serve.requests`), or refused by the pipeline as it ran — with ``field``
and ``allowed``, 429 queue full (``Retry-After``), 503 shutting down, out of device
memory twice (``Retry-After``), a pipeline left out at start (the reason) or too many
connections, 504 no answer within the request time limit, 500 anything else (the worker
keeps serving); the mapping is :func:`nostall.serve.answers.error_answer`, the fleet's
too. Parsing a body and checking it (a control image's declared size before its pixels
are decoded) run off the event loop, so the probes are answered meanwhile.
Network-facing guards come from :mod:`nostall.serve.http`; the routes, one router per
resource, from :mod:`nostall.serve.routes`; the bodies' shapes from
:mod:`nostall.serve.bodies`.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError

from nostall.serve.answers import schema_error
from nostall.serve.bodies import ControlRef, ImageBody, LoraRef
from nostall.serve.http import harden
from nostall.serve.routes import images, models, status, video_jobs, videos
from nostall.serve.worker import Worker

__all__ = ["ControlRef", "ImageBody", "LoraRef", "create_app"]


async def _bad_query(request: Request, e: RequestValidationError) -> Response:
    return schema_error(e)


def create_app(
    worker: Worker,
    *,
    token: str | None = None,
    time_limit: float | None = 600.0,
    max_body: int = 1 << 20,
    body_timeout: float | None = 120.0,
) -> FastAPI:
    """The app over ``worker``; starting the app starts the worker, stopping it shuts the
    worker down (running job finished, queued jobs answered 503).

    ``token``: every request but ``/healthz`` and ``/readyz`` needs ``Authorization:
    Bearer <token>``. ``time_limit``: seconds a request may wait for its answer (504
    after; a queued job is then dropped). ``max_body``: bytes of a JSON body (the
    latents of a decode may take ``worker.limits.max_latent_bytes``), refused 413 from
    the ``Content-Length`` before they are read; ``body_timeout``: seconds a body may
    take to arrive (408 after)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(worker.start)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.shutdown)

    app = FastAPI(title="nostall", lifespan=lifespan)
    app.state.worker = worker  # what the routes serve (nostall.serve.routes.jobs.worker_of)
    harden(
        app,
        token=token,
        max_body=max_body,
        body_limits={
            "/v1/videos/decode": worker.limits.max_latent_bytes,
            # a ControlNet image rides in the JSON, base64
            "/v1/images/generations": max(
                max_body, worker.limits.max_control_bytes * 4 // 3 + 4096
            ),
            # an image-to-video request's image, base64 in JSON or a multipart file
            "/v1/videos": max(max_body, worker.limits.max_control_bytes * 4 // 3 + 4096),
        },
        body_timeout=body_timeout,
        time_limit=time_limit,
    )
    app.add_exception_handler(RequestValidationError, _bad_query)
    for room in (images, videos, video_jobs, models, status):
        app.include_router(room.router)
    return app
