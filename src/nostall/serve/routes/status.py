"""What an operator and an orchestrator ask a worker: ``/healthz`` and ``/readyz`` (both
503 once it drains), ``/metrics`` (Prometheus), ``/`` (the status page) and
``/status.json``."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse, JSONResponse

from nostall.serve.pages import worker_page
from nostall.serve.routes.jobs import WorkerDep

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
async def healthz(worker: WorkerDep) -> Response:
    if worker.draining:  # SIGTERM: a load balancer should stop sending work here
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(worker: WorkerDep) -> Response:
    if worker.ready:
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "draining": worker.draining}, status_code=503)


@router.get("/metrics")
async def metrics(worker: WorkerDep) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
async def status_page(worker: WorkerDep) -> str:
    jobs = getattr(worker, "videos", None)  # (the video jobs' routes ask the same way)
    videos = None if jobs is None else jobs.recent(20)
    down = getattr(worker, "videos_unavailable", None)
    return worker_page(worker.status(), videos=videos, videos_down=down)


@router.get("/status.json")
async def status_json(worker: WorkerDep) -> dict:
    return worker.status()
