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
``GET /v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` (Prometheus), ``/`` (status).

Every answer to a generation or decode carries the phase times in a ``Server-Timing``
header (milliseconds, what browsers' developer tools show) and ``X-Nostall-*`` headers,
and image JSON answers in ``nostall.phases`` too. Errors are JSON ``{"error": {"type",
"message", ...}}``: 400 malformed body, 401 no or wrong token (with ``token=``), 404
unknown model (listing the models), 408 a body that did not arrive in time, 413 a body
too large (refused from its ``Content-Length`` before it is read), 422 a value the
pipeline cannot take — checked before queueing against the pipeline's own limits
(:mod:`nostall.serve.requests`), or refused by the pipeline as it ran — with ``field``
and ``allowed``, 429 queue full (``Retry-After``), 503 shutting down, out of device
memory twice (``Retry-After``) or a pipeline left out at start (the reason), 504 no
answer within the request time limit, 500 anything else (the worker keeps serving).
Network-facing guards come from :mod:`nostall.serve.http`.
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from nostall.errors import (
    ArgumentError,
    BudgetExceeded,
    DeviceBusy,
    LatentsError,
    NostallError,
    UnknownModel,
)
from nostall.serve.http import error_response, harden
from nostall.serve.results import Result
from nostall.serve.worker import Cancelled, QueueFull, ShuttingDown, Worker

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


def _invalid(e: ArgumentError) -> JSONResponse:
    """A 422 naming the field at fault and what it allows, where the error says."""
    extra: dict[str, Any] = {}
    if getattr(e, "field", None) is not None:
        extra["field"] = e.field
        extra["allowed"] = e.allowed
    return _error(422, "invalid_value", str(e), **extra)


def _settled(f: asyncio.Future) -> None:
    """Read the outcome of a job whose client left (asyncio logs one nobody read)."""
    if not f.cancelled():
        f.exception()


def _schema_error(e: ValidationError | Any) -> JSONResponse:
    """A 422 for a body or query that does not fit the schema (first problem named)."""
    first = e.errors()[0]
    loc = [str(x) for x in first["loc"] if x not in ("body", "query")]
    where = ".".join(loc) or "body"
    got = f" (got {first['input']!r})" if "input" in first and loc else ""
    return _error(422, "invalid_value", f"{where}: {first['msg']}{got}", field=where)


def _timing_headers(result: Result) -> dict[str, str]:
    timing = ", ".join(f"{k};dur={v * 1e3:.1f}" for k, v in result.phases.items())
    headers = {"Server-Timing": timing}
    for k, v in result.phases.items():
        headers[f"X-Nostall-{k.capitalize()}-S"] = f"{v:.4f}"
    tiers = sorted({c["tier"] for c in result.switch.get("components", [])})
    if tiers:
        headers["X-Nostall-Switch-Tiers"] = ",".join(tiers)
    return headers


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
        return _schema_error(e)

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

    async def run(request: Request, job) -> Result | Response:
        try:
            future, gone = worker.submit(job)
        except UnknownModel:
            return unknown(job.model)
        except QueueFull as e:
            wait = e.retry_after if e.retry_after is not None else 1.0  # the queue's estimate
            return _error(429, "queue_full", str(e), retry_after_s=round(wait, 3),
                          headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
        except ShuttingDown as e:
            return _error(503, "shutting_down", str(e))
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
        except ArgumentError as e:
            return _invalid(e)
        except LatentsError as e:  # the decoder's own checks, as it ran
            return _error(422, "invalid_value", str(e), field="latents")
        except (ShuttingDown, Cancelled) as e:
            return _error(503, "shutting_down", str(e))
        except BudgetExceeded as e:
            return _error(503, "no_room", str(e), headers={"Retry-After": "5"})
        except DeviceBusy as e:  # out of device memory twice: the worker carries on
            wait = str(max(1, math.ceil(e.retry_after)))
            return _error(503, "device_busy", str(e), headers={"Retry-After": wait})
        except NostallError as e:
            return _error(500, type(e).__name__, str(e))
        except ValueError as e:  # the pipeline refused what it was given (check_inputs)
            return _error(422, "rejected_by_pipeline", f"{job.model}: {e}")
        except Exception as e:  # the worker thread survived it; say what happened
            return _error(500, type(e).__name__, f"{type(e).__name__}: {e}")

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await request.body()
        try:
            body = ImageBody.model_validate(json.loads(raw))
        except ValidationError as e:
            return answer("images", "-", _schema_error(e), t0)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep
            why = "nested too deep" if isinstance(e, RecursionError) else str(e)
            bad = _error(400, "malformed_json", f"body is not JSON: {why}")
            return answer("images", "-", bad, t0)
        if body.n != 1:
            bad = _error(422, "invalid_value", "n: only 1", field="n", allowed=[1])
            return answer("images", body.model, bad, t0)
        refused = unavailable(body.model)
        if refused is not None:
            return answer("images", body.model, refused, t0)
        try:
            job = worker.image_job(body.model_dump(exclude_none=True))
        except UnknownModel:
            return answer("images", body.model, unknown(body.model), t0)
        except ArgumentError as e:
            return answer("images", body.model, _invalid(e), t0)
        out = await run(request, job)
        if isinstance(out, Response):
            return answer("images", body.model, out, t0)
        headers = _timing_headers(out)
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
        refused = unavailable(model)
        if refused is not None:
            return answer("videos", model, refused, t0)
        try:
            check_video_target(worker.rules.video(model), worker.limits, fps=fps, mode=mode)
        except UnknownModel:
            return answer("videos", model, unknown(model), t0)
        except ArgumentError as e:
            if e.field == "model":
                e.allowed = worker.rules.serving("video", worker.names())
            return answer("videos", model, _invalid(e), t0)
        raw = await request.body()  # at most max_latent_bytes: BodyLimit saw to it
        try:
            tensors = load_safetensors(raw)
        except Exception as e:
            msg = f"body is not a safetensors file ({e})"
            return answer("videos", model, _error(400, "malformed_body", msg), t0)
        z = tensors.get("latents")
        if z is None:
            msg = f"the safetensors body holds {sorted(tensors)}, not 'latents'"
            return answer("videos", model, _error(422, "invalid_value", msg, field="latents"), t0)
        try:
            job = worker.video_job(model, z, fps=fps, mode=mode, denormalize=denormalize)
        except ArgumentError as e:
            return answer("videos", model, _invalid(e), t0)
        out = await run(request, job)
        if isinstance(out, Response):
            return answer("videos", model, out, t0)
        headers = _timing_headers(out)
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
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if worker.ready:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def status_page() -> str:
        return _status_html(worker.status())

    @app.get("/status.json")
    async def status_json() -> dict:
        return worker.status()

    return app


def _status_html(s: dict[str, Any]) -> str:
    e = html.escape

    def gb(n: int) -> str:
        return f"{n / 1e9:.2f} GB"

    left_out = s.get("unavailable", {})
    rows = "".join(
        f"<tr><td>{e(name)}</td><td>{e(', '.join(tiers))}</td></tr>"
        for name, tiers in s["models"].items()
        if name not in left_out
    )
    rows += "".join(
        f"<tr><td>{e(name)}</td><td><b>unavailable</b>: {e(why)}</td></tr>"
        for name, why in left_out.items()
    )
    phases = sorted({p for r in s["recent"] for p in r["phases"]})
    head = "".join(f"<th>{e(p)} (s)</th>" for p in phases)
    recent = "".join(
        "<tr>"
        + f"<td>{e(r['at'])}</td><td>{e(r['kind'])}</td><td>{e(r['model'])}</td>"
        + f"<td>{e(', '.join(r['tiers']))}</td>"
        + "".join(f"<td>{r['phases'].get(p, 0):.3f}</td>" for p in phases)
        + "</tr>"
        for r in s["recent"]
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>nostall worker</title>
<meta http-equiv="refresh" content="5">
<style>body{{font-family:system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left}}</style></head><body>
<h1>nostall worker</h1>
<p>device <b>{e(s["device"])}</b> · {"ready" if s["ready"] else "not ready"} ·
up {s["uptime_s"]:.0f} s · running: {e(s["running"] or "nothing")} ·
queued: {len(s["queue"])}</p>
<h2>Tiers</h2>
<table><tr><th>tier</th><th>resident</th><th>budget</th></tr>
<tr><td>GPU</td><td>{gb(s["gpu"]["bytes"])}</td><td>{gb(s["gpu"]["budget"])}</td></tr>
<tr><td>pinned host</td><td>{gb(s["host"]["bytes"])}</td><td>{gb(s["host"]["budget"])}</td></tr>
</table>
<h2>Models</h2><table><tr><th>model</th><th>where its components are</th></tr>{rows}</table>
<h2>Recent requests</h2>
<table><tr><th>at</th><th>kind</th><th>model</th><th>switch from</th>{head}</tr>{recent}</table>
</body></html>"""
