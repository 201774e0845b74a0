"""OpenAI's Videos API over the worker's video jobs (:mod:`nostall.serve.video_jobs`):

``POST /v1/videos``  a JSON body (:class:`~nostall.serve.bodies.VideoBody`; the image of
    an image-to-video pipeline as ``input_reference``, a data URL) or a multipart form
    of the same fields with ``input_reference`` as a file, as OpenAI's SDK sends it;
    answers the video object, ``status: queued``, at once.
``GET /v1/videos/{id}``  the object: ``status``, ``progress`` (0–100), ``error``.
``GET /v1/videos/{id}/content``  the MP4 (range requests answered); 409 until completed.
``DELETE /v1/videos/{id}``  cancels a queued or running job (at its next denoising
    step), or deletes a finished one and its file.
``GET /v1/videos?after=&limit=&order=``  the jobs, newest first, a page at a time.

A worker without a pipeline that makes video answers these 404 ``no_video_pipelines``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from nostall.errors import ArgumentError
from nostall.serve.answers import read_body
from nostall.serve.bodies import VideoBody
from nostall.serve.http import error_response
from nostall.serve.routes.jobs import WorkerDep, answered, refused

__all__ = ["router"]

router = APIRouter()

# a multipart form's fields are strings: these become numbers before the body's checks
_NUMBERS = {"frames": int, "fps": int, "steps": int, "seed": int, "max_sequence_length": int,
            "guidance": float, "guidance_2": float}  # fmt: skip


def _jobs(worker: Any) -> Any:
    return getattr(worker, "videos", None)


def _none(worker: Any) -> Response:
    why = getattr(worker, "videos_unavailable", None)
    if why is not None:
        return error_response(503, "videos_unavailable", f"video jobs are not served: {why}")
    return error_response(
        404,
        "no_video_pipelines",
        f"this worker serves no pipeline that makes video (it serves {worker.names()})",
    )


def _missing(vid: str) -> Response:
    return error_response(404, "video_not_found", f"no video {vid!r} on this worker", id=vid)


async def _form(request: Request) -> tuple[dict[str, Any], bytes | None] | Response:
    form = await request.form(max_files=1, max_fields=32)
    fields: dict[str, Any] = {}
    image = None
    for key, value in form.multi_items():
        if hasattr(value, "read"):  # an UploadFile
            if key != "input_reference":
                return error_response(
                    422, "invalid_value", f"{key}: only input_reference is a file", field=key
                )
            image = await value.read()
            continue
        kind = _NUMBERS.get(key)
        if kind is not None:
            try:
                fields[key] = kind(value)
            except ValueError:
                msg = f"{key}={value!r}: give a number"
                return error_response(422, "invalid_value", msg, field=key)
        else:
            fields[key] = value
    return fields, image


def _create(worker: Any, body: Any, image: bytes | None) -> Any:
    """Off the event loop: the checks decode the input image."""
    try:
        return worker.videos.create(body, image)
    except Exception as e:
        return refused(worker, e, getattr(body, "model", None) or "-")


@router.post("/v1/videos")
async def create_video(request: Request, worker: WorkerDep) -> Response:
    t0 = time.perf_counter()
    if _jobs(worker) is None:
        return _none(worker)
    image = None
    kind = request.headers.get("content-type", "")
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        got = await _form(request)
        if isinstance(got, Response):
            return answered(worker, "videos", "-", got, t0)
        fields, image = got
        body = read_body(json.dumps(fields).encode(), VideoBody)
    else:
        body = read_body(await request.body(), VideoBody)
    if isinstance(body, Response):
        return answered(worker, "videos", "-", body, t0)
    out = await asyncio.to_thread(_create, worker, body, image)
    if isinstance(out, Response):
        return answered(worker, "videos", body.model, out, t0)
    return answered(worker, "videos", body.model, JSONResponse(out), t0)


@router.get("/v1/videos")
async def list_videos(
    worker: WorkerDep, after: str | None = None, limit: int = 20, order: str = "desc"
) -> Response:
    if _jobs(worker) is None:
        return _none(worker)
    try:
        return JSONResponse(worker.videos.list(after=after, limit=limit, order=order))
    except ArgumentError as e:
        return refused(worker, e, "-")


@router.get("/v1/videos/{vid}")
async def get_video(vid: str, worker: WorkerDep) -> Response:
    if _jobs(worker) is None:
        return _none(worker)
    try:
        return JSONResponse(worker.videos.get(vid))
    except KeyError:
        return _missing(vid)


@router.get("/v1/videos/{vid}/content")
async def video_content(vid: str, worker: WorkerDep, variant: str = "video") -> Response:
    if _jobs(worker) is None:
        return _none(worker)
    if variant != "video":
        msg = f"variant={variant!r}: only 'video' (no thumbnail or spritesheet is made)"
        return error_response(422, "invalid_value", msg, field="variant", allowed=["video"])
    try:
        path = worker.videos.content(vid)
    except KeyError:
        return _missing(vid)
    except ArgumentError as e:  # not completed yet
        return error_response(409, "video_not_ready", str(e), id=vid)
    return FileResponse(path, media_type="video/mp4", filename=f"{vid}.mp4")


@router.delete("/v1/videos/{vid}")
async def delete_video(vid: str, worker: WorkerDep) -> Response:
    if _jobs(worker) is None:
        return _none(worker)
    try:
        return JSONResponse(await asyncio.to_thread(worker.videos.cancel, vid))
    except KeyError:
        return _missing(vid)
