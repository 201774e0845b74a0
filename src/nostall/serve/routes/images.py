"""``POST /v1/images/generations``: OpenAI's images API shape plus nostall's fields
(:class:`~nostall.serve.bodies.ImageBody`); answers ``{"created", "data": [{"b64_json"}],
"nostall": {...}}`` or the PNG bytes, the phase times in its headers."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from nostall.serve.answers import read_body, timing_headers
from nostall.serve.bodies import ImageBody
from nostall.serve.routes.jobs import WorkerDep, answered, refused, run, unavailable

__all__ = ["router"]

router = APIRouter()


def _job(worker: Any, raw: bytes) -> tuple[Any, Any]:
    """``(body, job)`` from an images body, or ``(body, answer)`` for one that is refused
    (``body`` is ``None`` when it does not parse). Runs off the event loop: parsing a
    large body and decoding a control image take CPU time the loop must not wait for
    (its probes would)."""
    body = read_body(raw, ImageBody)
    if isinstance(body, Response):
        return None, body
    left_out = unavailable(worker, body.model)
    if left_out is not None:
        return body, left_out
    try:
        return body, worker.image_job(body)
    except Exception as e:
        return body, refused(worker, e, body.model)


@router.post("/v1/images/generations")
async def generations(request: Request, worker: WorkerDep) -> Response:
    t0 = time.perf_counter()
    raw = await request.body()
    body, job = await asyncio.to_thread(_job, worker, raw)
    if isinstance(job, Response):
        return answered(worker, "images", body.model if body else "-", job, t0)
    out = await run(worker, request, job)
    if isinstance(out, Response):
        return answered(worker, "images", body.model, out, t0)
    headers = timing_headers(out.phases, out.switch)
    if body.response_format == "png":
        resp = Response(out.body, media_type="image/png", headers=headers)
    else:
        doc = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(out.body).decode()}],
            "nostall": {
                "model": body.model,
                "seed": out.info["seed"],
                "order": out.info["order"],
                "phases": out.phases,
                "switch": out.switch,
            },
        }
        if out.info.get("preempted_by"):  # the jobs that ran while this one was paused
            doc["nostall"]["preempted_by"] = out.info["preempted_by"]
        resp = JSONResponse(doc, headers=headers)
    return answered(worker, "images", body.model, resp, t0)
