"""The worker's HTTP API (FastAPI; ``nostall serve`` runs it under uvicorn).

``POST /v1/images/generations``  OpenAI's images API shape plus nostall's fields:
    ``{"model", "prompt", "size": "WxH", "steps", "seed", "guidance",
    "negative_prompt", "max_sequence_length", "response_format": "b64_json" | "png"}``;
    answers ``{"created", "data": [{"b64_json"}], "nostall": {...}}`` or the PNG bytes.
``POST /v1/videos/decode?model=&fps=&mode=&denormalize=``  body: safetensors bytes
    holding ``latents`` (B, C, T, h, w); answers the MP4.
``GET /v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` (Prometheus), ``/`` (status).

Every answer to a generation or decode carries the phase times in a ``Server-Timing``
header (milliseconds, what browsers' developer tools show) and ``X-Nostall-*`` headers,
and image JSON answers in ``nostall.phases`` too. Errors are JSON ``{"error": {"type",
"message"}}``: 400 malformed body, 404 unknown model (listing the models), 413 latents
too large, 422 a value out of range (naming it), 429 queue full (``Retry-After``), 503
shutting down, 500 anything else (the worker keeps serving).
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import time
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from nostall.errors import ArgumentError, BudgetExceeded, NostallError, UnknownModel
from nostall.serve.worker import Cancelled, QueueFull, Result, ShuttingDown, VideoJob, Worker

__all__ = ["create_app"]


class ImageBody(BaseModel):
    """The images/generations body. OpenAI's ``n`` (1 only), ``user``, ``quality`` and
    ``style`` are accepted and ignored; unknown fields are refused (a typo should not
    silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str
    size: str | None = None
    steps: int | None = None
    seed: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    response_format: Literal["b64_json", "png"] = "b64_json"
    n: int = 1
    user: str | None = None
    quality: str | None = None
    style: str | None = None


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    headers = extra.pop("headers", None)
    return JSONResponse(
        {"error": {"type": kind, "message": message, **extra}}, status_code=status, headers=headers
    )


def _timing_headers(result: Result) -> dict[str, str]:
    timing = ", ".join(f"{k};dur={v * 1e3:.1f}" for k, v in result.phases.items())
    headers = {"Server-Timing": timing}
    for k, v in result.phases.items():
        headers[f"X-Nostall-{k.capitalize()}-S"] = f"{v:.4f}"
    tiers = sorted({c["tier"] for c in result.switch.get("components", [])})
    if tiers:
        headers["X-Nostall-Switch-Tiers"] = ",".join(tiers)
    return headers


def create_app(worker: Worker) -> FastAPI:
    """The app over ``worker``; starting the app starts the worker, stopping it shuts the
    worker down (running job finished, queued jobs answered 503)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(worker.start)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.shutdown)

    app = FastAPI(title="nostall", lifespan=lifespan)
    m = worker.metrics

    def answer(endpoint: str, model: str, resp: Response, t0: float) -> Response:
        m.requests.labels(endpoint, model, str(resp.status_code)).inc()
        m.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return resp

    async def run(request: Request, job) -> Result | Response:
        try:
            future, gone = worker.submit(job)
        except UnknownModel:
            return _error(404, "unknown_model", f"no model {job.model!r}", models=worker.names())
        except QueueFull as e:
            return _error(429, "queue_full", str(e), headers={"Retry-After": "1"})
        except ShuttingDown as e:
            return _error(503, "shutting_down", str(e))
        waiting = asyncio.ensure_future(asyncio.wrap_future(future))
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=0.2)
            if not waiting.done() and await request.is_disconnected():
                gone.set()  # skipped if it has not started; a running job finishes
                return Response(status_code=499)
        try:
            return waiting.result()
        except ArgumentError as e:
            return _error(422, "invalid_value", str(e))
        except (ShuttingDown, Cancelled) as e:
            return _error(503, "shutting_down", str(e))
        except BudgetExceeded as e:
            return _error(503, "no_room", str(e), headers={"Retry-After": "5"})
        except NostallError as e:
            return _error(500, type(e).__name__, str(e))
        except Exception as e:  # the worker thread survived it; say what happened
            return _error(500, type(e).__name__, f"{type(e).__name__}: {e}")

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await request.body()
        try:
            body = ImageBody.model_validate(json.loads(raw))
        except json.JSONDecodeError as e:
            return answer(
                "images", "-", _error(400, "malformed_json", f"body is not JSON: {e}"), t0
            )
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            msg = f"{where}: {first['msg']}"
            return answer("images", "-", _error(422, "invalid_value", msg), t0)
        if body.n != 1:
            return answer("images", body.model, _error(422, "invalid_value", "n: only 1"), t0)
        try:
            job = worker.image_job(body.model_dump(exclude_none=True))
        except ArgumentError as e:
            return answer("images", body.model, _error(422, "invalid_value", str(e)), t0)
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

        from nostall.video.wan import MODES

        t0 = time.perf_counter()
        if mode not in MODES:
            msg = f"mode={mode!r}; choose one of {', '.join(MODES)}"
            return answer("videos", model, _error(422, "invalid_value", msg), t0)
        if not 0 < fps <= 240:
            return answer("videos", model, _error(422, "invalid_value", f"fps={fps}"), t0)
        raw = await request.body()
        if len(raw) > worker.limits.max_latent_bytes:
            msg = f"{len(raw)} bytes of latents; at most {worker.limits.max_latent_bytes}"
            return answer("videos", model, _error(413, "too_large", msg), t0)
        try:
            tensors = load_safetensors(raw)
        except Exception as e:
            msg = f"body is not a safetensors file ({e})"
            return answer("videos", model, _error(400, "malformed_body", msg), t0)
        z = tensors.get("latents")
        if z is None or z.dim() != 5:
            msg = "the safetensors body must hold 'latents' of shape (B, C, T, h, w)"
            return answer("videos", model, _error(422, "invalid_value", msg), t0)
        job = VideoJob(model=model, latents=z, fps=fps, mode=mode, denormalize=denormalize)
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
        return {"object": "list", "data": [{"id": n, "object": "model"} for n in worker.names()]}

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

    rows = "".join(
        f"<tr><td>{e(name)}</td><td>{e(', '.join(tiers))}</td></tr>"
        for name, tiers in s["models"].items()
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
