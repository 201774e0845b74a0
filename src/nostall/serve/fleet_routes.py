"""The fleet router's HTTP API, one :class:`fastapi.APIRouter` per resource, answering the
worker app's routes with its error shape: ``POST /v1/images/generations``, ``POST
/v1/videos/decode`` (routed like images, to the worker where the pipeline's VAE is),
``GET /v1/models``, ``/healthz``, ``/readyz`` (503 while every worker is down),
``/metrics`` (the router's Prometheus metrics), ``/`` (a status page), ``/status.json``
and ``/fleet`` (its routing state).

The routes serve the :class:`~nostall.serve.fleet_router.FleetRouter` of the app
(``app.state.fleet``) or, under Ray Serve, the one of the ingress replica running them
(:func:`fleet_of`). :func:`fleet_app` puts them behind the worker app's token, body and
time limits (:func:`~nostall.serve.http.harden`).
"""

# No "from __future__ import annotations": Ray pickles the ingress app by value, and
# FastAPI must see the real Request class in the routes' annotations there.

import asyncio
import base64
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from nostall.serve.answers import read_body
from nostall.serve.bodies import ImageBody
from nostall.serve.fleet_router import FleetRouter

__all__ = ["fleet_app", "fleet_of", "images", "models", "status", "videos"]


def fleet_of(request: Request) -> FleetRouter:
    """The router serving ``request``: the app's own (``app.state.fleet``), else, under
    Ray Serve, the ingress replica's (its ``fleet``)."""
    fleet = getattr(request.app.state, "fleet", None)
    if fleet is None:
        from ray import serve

        fleet = serve.get_replica_context().servable_object.fleet
    return fleet


FleetDep = Annotated[FleetRouter, Depends(fleet_of)]

images = APIRouter()
videos = APIRouter()
models = APIRouter()
status = APIRouter()


@images.post("/v1/images/generations")
async def generations(request: Request, fleet: FleetDep) -> Response:
    t0 = time.perf_counter()
    body = await asyncio.to_thread(read_body, await request.body(), ImageBody)
    if isinstance(body, Response):
        return fleet.answered("images", body, t0)
    unknown = fleet.unknown(body.model)
    if unknown is not None:
        return fleet.answered("images", unknown, t0)
    routed = await fleet.route(body.model, lambda w: w.generate.remote(body))
    if isinstance(routed, Response):
        return fleet.answered("images", routed, t0)
    i, tier, out = routed
    headers = fleet.headers(i, tier, out)
    if body.response_format == "png":
        return fleet.answered(
            "images", Response(out["png"], media_type="image/png", headers=headers), t0
        )
    doc = {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(out["png"]).decode()}],
        "nostall": {
            "model": body.model,
            "worker": i,
            "seed": out["seed"],
            "phases": out["phases"],
            "switch": out["switch"],
        },
    }
    return fleet.answered("images", JSONResponse(doc, headers=headers), t0)


@videos.post("/v1/videos/decode")
async def decode_video(
    request: Request,
    fleet: FleetDep,
    model: str,
    fps: float = 16.0,
    mode: str = "eager",
    denormalize: bool = False,
) -> Response:
    t0 = time.perf_counter()
    unknown = fleet.unknown(model)
    if unknown is not None:
        return fleet.answered("videos", unknown, t0)
    raw = await request.body()  # at most max_latent_bytes: BodyLimit saw to it
    routed = await fleet.route(model, lambda w: w.decode.remote(model, raw, fps, mode, denormalize))
    if isinstance(routed, Response):
        return fleet.answered("videos", routed, t0)
    i, tier, out = routed
    headers = {**fleet.headers(i, tier, out), "X-Nostall-Frames": str(out["frames"])}
    return fleet.answered(
        "videos", Response(out["mp4"], media_type="video/mp4", headers=headers), t0
    )


@models.get("/v1/models")
async def list_models(fleet: FleetDep) -> dict:
    data = [{"id": n, "object": "model", "available": True} for n in fleet.names]
    return {"object": "list", "data": data}


@status.get("/fleet")
async def fleet_state(fleet: FleetDep) -> dict:
    return fleet.state()


@status.get("/status.json")
async def status_json(fleet: FleetDep) -> dict:
    return fleet.state()


@status.get("/", response_class=HTMLResponse)
async def status_page(fleet: FleetDep) -> str:
    from nostall.serve.pages import fleet_page

    return fleet_page(fleet.state())


@status.get("/metrics")
async def metrics(fleet: FleetDep) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    fleet.up()
    return Response(fleet.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@status.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@status.get("/readyz")
async def readyz(fleet: FleetDep) -> Response:
    up = fleet.up()
    return JSONResponse({"ready": up > 0, "workers_up": up}, 200 if up else 503)


def fleet_app(
    *, limits: Any = None, token: str | None = None, time_limit: float | None = 600.0
) -> FastAPI:
    """The router's app: its routes behind ``token`` and ``time_limit`` (as the worker
    app's), bodies within what ``limits`` (the workers'
    :class:`~nostall.serve.requests.Limits`) let a decode or a ControlNet image take."""
    from nostall.serve.http import harden
    from nostall.serve.requests import Limits

    limits = limits or Limits()
    app = FastAPI(title="nostall fleet")
    harden(
        app,
        token=token,
        body_limits={
            "/v1/videos/decode": limits.max_latent_bytes,
            "/v1/images/generations": max(1 << 20, limits.max_control_bytes * 4 // 3 + 4096),
        },
        time_limit=time_limit,
    )
    for room in (images, videos, models, status):
        app.include_router(room)
    return app
