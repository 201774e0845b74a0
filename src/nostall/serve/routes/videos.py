"""``POST /v1/videos/decode?model=&fps=&mode=&denormalize=``: the body is a safetensors
file holding ``latents`` (1, C, T, h, w); answers the MP4. Everything the query decides
is checked before a byte of the latents is read."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from nostall.errors import ArgumentError
from nostall.serve.answers import answer, timing_headers
from nostall.serve.http import error_response
from nostall.serve.routes.jobs import WorkerDep, answered, refused, run, unavailable

__all__ = ["router"]

router = APIRouter()


def _job(worker: Any, model: str, raw: bytes, fps: float, mode: str, denormalize: bool) -> Any:
    """The decode job of the body ``raw``, or the answer refusing it. Off the event loop:
    parsing and checking 128 MB of latents."""
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except Exception as e:
        return error_response(400, "malformed_body", f"body is not a safetensors file ({e})")
    z = tensors.get("latents")
    if z is None:
        msg = f"the safetensors body holds {sorted(tensors)[:20]}, not 'latents'"
        return error_response(422, "invalid_value", msg, field="latents")
    try:
        return worker.video_job(model, z, fps=fps, mode=mode, denormalize=denormalize)
    except Exception as e:
        return refused(worker, e, model)


@router.post("/v1/videos/decode")
async def decode_video(
    request: Request,
    worker: WorkerDep,
    model: str,
    fps: float = 16.0,
    mode: str = "eager",
    denormalize: bool = False,
) -> Response:
    from nostall.serve.requests import check_video_target

    t0 = time.perf_counter()
    left_out = unavailable(worker, model)
    if left_out is not None:
        return answered(worker, "videos", model, left_out, t0)
    try:
        check_video_target(worker.rules.video(model), worker.limits, fps=fps, mode=mode)
    except ArgumentError as e:
        if e.field == "model":
            e.allowed = worker.rules.serving("video", worker.names())
        return answered(worker, "videos", model, answer(e), t0)
    except Exception as e:  # an unknown model: 404 listing them
        return answered(worker, "videos", model, refused(worker, e, model), t0)
    raw = await request.body()  # at most max_latent_bytes: BodyLimit saw to it
    job = await asyncio.to_thread(_job, worker, model, raw, fps, mode, denormalize)
    if isinstance(job, Response):
        return answered(worker, "videos", model, job, t0)
    out = await run(worker, request, job)
    if isinstance(out, Response):
        return answered(worker, "videos", model, out, t0)
    headers = timing_headers(out.phases, out.switch)
    headers["X-Nostall-Frames"] = str(out.info["frames"])
    resp = Response(out.body, media_type="video/mp4", headers=headers)
    return answered(worker, "videos", model, resp, t0)
