"""``GET /v1/models``: the store's pipelines, each marked available or not (a pipeline
left out at start says why)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from nostall.serve.routes.jobs import WorkerDep

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models")
async def models(worker: WorkerDep) -> dict:
    left_out = getattr(worker, "unavailable", {})
    data = []
    for n in worker.names():
        entry: dict[str, Any] = {"id": n, "object": "model", "available": n not in left_out}
        if n in left_out:
            entry["reason"] = left_out[n]
        data.append(entry)
    return {"object": "list", "data": data}
