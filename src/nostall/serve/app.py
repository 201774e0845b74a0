"""The worker's HTTP API (FastAPI; ``nostall serve`` runs it under uvicorn).

``POST /v1/images/generations``  OpenAI's images API shape plus nostall's fields:
    ``{"model", "prompt", "size": "WxH", "steps", "seed", "guidance",
    "negative_prompt", "max_sequence_length", "loras": [{"name", "scale"}],
    "controlnet": {"name", "image", "scale"}, "response_format": "b64_json" | "png"}``
    (``loras``: names of the server's ``<store>/loras``, fused for this request;
    requests without them get the base; ``controlnet``: a name of its
    ``<store>/controlnets``, with a base64 control image of the request's size);
    answers ``{"created", "data": [{"b64_json"}], "nostall": {...}}`` or the PNG bytes.
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
Network-facing guards come from :mod:`nostall.serve.http`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from nostall.errors import ArgumentError, NostallError, UnknownModel
from nostall.serve.answers import answer as error_answer
from nostall.serve.answers import read_body, schema_error, timing_headers
from nostall.serve.http import error_response, harden
from nostall.serve.pages import worker_page
from nostall.serve.results import Result
from nostall.serve.worker import Worker

__all__ = ["create_app"]

log = logging.getLogger(__name__)


class LoraRef(BaseModel):
    """One LoRA of an images request: a name of the server's ``<store>/loras`` and its
    weight (an extension of OpenAI's images body)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    scale: float = 1.0


class ControlRef(BaseModel):
    """The ControlNet of an images request: a name of the server's
    ``<store>/controlnets``, the control image (base64 PNG/JPEG/WebP of the request's
    size) and its conditioning scale."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    image: str
    scale: float = 1.0


class ImageBody(BaseModel):
    """The images/generations body. OpenAI's ``n`` (1 only), ``user``, ``quality`` and
    ``style`` are accepted and ignored; unknown fields are refused (a typo should not
    silently fall back to a default)."""

    # strict: "28", 28.0 and true are not a number of steps (a client bug to show)
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str
    size: str | None = None
    steps: int | None = None
    seed: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    loras: list[LoraRef] | None = None
    controlnet: ControlRef | None = None
    response_format: Literal["b64_json", "png"] = "b64_json"
    n: int = 1
    user: str | None = None
    quality: str | None = None
    style: str | None = None


_error = error_response


def _settled(f: asyncio.Future) -> None:
    """Read the outcome of a job whose client left (asyncio logs one nobody read)."""
    if not f.cancelled():
        f.exception()


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
        },
        body_timeout=body_timeout,
        time_limit=time_limit,
    )
    m = worker.metrics

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, e: RequestValidationError) -> Response:
        return schema_error(e)

    def answer(endpoint: str, model: str, resp: Response, t0: float) -> Response:
        m.answered(endpoint, model, resp.status_code, time.perf_counter() - t0, worker.names())
        return resp

    def unavailable(model: str) -> Response | None:
        why = getattr(worker, "unavailable", {}).get(model)
        if why is None:
            return None
        return _error(503, "model_unavailable", f"pipeline {model!r} is not served: {why}")

    def unknown(model: str) -> Response:
        return _error(404, "unknown_model", f"no model {model!r}", models=worker.names())

    def refused(e: Exception, model: str) -> Response:
        """The answer to a request that failed before or while its job ran."""
        if isinstance(e, UnknownModel):
            return unknown(model)
        if not isinstance(e, (NostallError, ValueError)):  # a bug: its traceback, once
            log.error("%s: %s", model, e, exc_info=e)
        return error_answer(e, model=model)

    async def run(request: Request, job) -> Result | Response:
        try:
            future, gone = worker.submit(job)
        except Exception as e:  # queue full, shutting down, unknown model
            return refused(e, job.model)
        waiting = asyncio.ensure_future(asyncio.wrap_future(future))
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=0.2)
                if not waiting.done() and await request.is_disconnected():
                    gone.set()  # skipped if it has not started; a running job finishes
                    waiting.add_done_callback(_settled)  # its outcome has no reader now
                    who = f"{request.client.host}:{request.client.port}" if request.client else "?"
                    log.info("%s: client %s left before its answer; dropped", job.model, who)
                    return Response(status_code=499)
        except asyncio.CancelledError:  # the request's time limit, or the server stopping
            gone.set()
            waiting.add_done_callback(_settled)
            raise
        try:
            return waiting.result()
        except Exception as e:  # the worker thread survived it; say what happened
            return refused(e, job.model)

    def image_job(raw: bytes) -> tuple[Any, Any]:
        """``(body, job)`` from an images body, or ``(body, answer)`` for one that is
        refused (``body`` is ``None`` when it does not parse). Runs off the event loop:
        parsing a large body and decoding a control image take CPU time the loop must
        not wait for (its probes would)."""
        body = read_body(raw, ImageBody)
        if isinstance(body, Response):
            return None, body
        if body.n != 1:
            return body, _error(422, "invalid_value", "n: only 1", field="n", allowed=[1])
        left_out = unavailable(body.model)
        if left_out is not None:
            return body, left_out
        try:
            return body, worker.image_job(body.model_dump(exclude_none=True))
        except Exception as e:
            return body, refused(e, body.model)

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await request.body()
        body, job = await asyncio.to_thread(image_job, raw)
        if isinstance(job, Response):
            return answer("images", body.model if body else "-", job, t0)
        out = await run(request, job)
        if isinstance(out, Response):
            return answer("images", body.model, out, t0)
        headers = timing_headers(out.phases, out.switch)
        if body.response_format == "png":
            resp = Response(out.body, media_type="image/png", headers=headers)
        else:
            resp = JSONResponse(
                {
                    "created": int(time.time()),
                    "data": [{"b64_json": base64.b64encode(out.body).decode()}],
                    "nostall": {
                        "model": body.model,
                        "seed": out.info["seed"],
                        "order": out.info["order"],
                        "phases": out.phases,
                        "switch": out.switch,
                    },
                },
                headers=headers,
            )
        return answer("images", body.model, resp, t0)

    @app.post("/v1/videos/decode")
    async def decode_video(
        request: Request,
        model: str,
        fps: float = 16.0,
        mode: str = "eager",
        denormalize: bool = False,
    ) -> Response:
        from safetensors.torch import load as load_safetensors

        from nostall.serve.requests import check_video_target

        t0 = time.perf_counter()
        # everything the query decides, before a byte of the latents is read
        left_out = unavailable(model)
        if left_out is not None:
            return answer("videos", model, left_out, t0)
        try:
            check_video_target(worker.rules.video(model), worker.limits, fps=fps, mode=mode)
        except UnknownModel:
            return answer("videos", model, unknown(model), t0)
        except ArgumentError as e:
            if e.field == "model":
                e.allowed = worker.rules.serving("video", worker.names())
            return answer("videos", model, error_answer(e), t0)
        raw = await request.body()  # at most max_latent_bytes: BodyLimit saw to it

        def video_job() -> Any:  # off the event loop: parsing and checking 128 MB of latents
            try:
                tensors = load_safetensors(raw)
            except Exception as e:
                return _error(400, "malformed_body", f"body is not a safetensors file ({e})")
            z = tensors.get("latents")
            if z is None:
                msg = f"the safetensors body holds {sorted(tensors)[:20]}, not 'latents'"
                return _error(422, "invalid_value", msg, field="latents")
            try:
                return worker.video_job(model, z, fps=fps, mode=mode, denormalize=denormalize)
            except Exception as e:
                return refused(e, model)

        job = await asyncio.to_thread(video_job)
        if isinstance(job, Response):
            return answer("videos", model, job, t0)
        out = await run(request, job)
        if isinstance(out, Response):
            return answer("videos", model, out, t0)
        headers = timing_headers(out.phases, out.switch)
        headers["X-Nostall-Frames"] = str(out.info["frames"])
        return answer(
            "videos", model, Response(out.body, media_type="video/mp4", headers=headers), t0
        )

    @app.get("/v1/models")
    async def models() -> dict:
        left_out = getattr(worker, "unavailable", {})
        data = []
        for n in worker.names():
            entry: dict[str, Any] = {"id": n, "object": "model", "available": n not in left_out}
            if n in left_out:
                entry["reason"] = left_out[n]
            data.append(entry)
        return {"object": "list", "data": data}

    @app.get("/healthz")
    async def healthz() -> Response:
        if worker.draining:  # SIGTERM: a load balancer should stop sending work here
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        if worker.ready:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "draining": worker.draining}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def status_page() -> str:
        return worker_page(worker.status())

    @app.get("/status.json")
    async def status_json() -> dict:
        return worker.status()

    return app
