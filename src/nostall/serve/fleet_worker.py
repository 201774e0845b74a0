"""A fleet worker's side of a call: a :class:`~nostall.serve.worker.Worker` answering the
router (:mod:`nostall.serve.fleet_router`) with plain dicts, as Ray carries them.

Every outcome is an answer, never a raise: a result (``{"png" | "mp4", "phases",
"switch", "state"}``) or a failure (``{"status", "error", "headers", "fault", "state"}``,
the worker app's mapping, :func:`~nostall.serve.answers.error_answer`), so a request the
pipeline rejects reads as a 422 and never as a dead replica. ``fault`` says whose it
was: ``"request"`` (refused while checked, before it was queued: whatever was raised),
``"job"`` (it failed as it ran) or ``"model"`` (this worker could not read the pipeline;
another may). ``state`` is where this worker's pipelines are now, for the router's
next choice. :mod:`nostall.serve.fleet` runs one per GPU as a Ray Serve deployment.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nostall.errors import ArgumentError

__all__ = ["FleetMember"]


class FleetMember:
    """``worker`` (started) as the fleet's worker number ``index``; ``actor``: its Ray
    actor's name, for operators (and tests)."""

    def __init__(self, index: int, worker: Any, actor: str | None = None):
        self.index, self.worker, self.actor = index, worker, actor

    async def generate(self, body: Any) -> dict[str, Any]:
        """An images body (:class:`~nostall.serve.bodies.ImageBody`, or its JSON) run."""
        model = body.get("model") if isinstance(body, dict) else getattr(body, "model", None)
        try:
            job = self.worker.image_job(body)
        except Exception as e:  # checking the request: whatever it raised, its fault
            return self._failed(e, model, fault="request")
        out = await self._run(job)
        if "error" in out:
            return out
        return {"png": out["result"].body, "seed": out["result"].info["seed"], **out["info"]}

    async def decode(
        self, model: str, raw: bytes, fps: float, mode: str, denormalize: bool
    ) -> dict[str, Any]:
        """The latents of the safetensors body ``raw`` decoded to an MP4."""
        from safetensors.torch import load

        try:
            tensors = load(raw)
        except Exception as e:
            why = {"type": "malformed_body", "message": f"body is not a safetensors file ({e})"}
            return {"status": 400, "error": why, "headers": {}, "fault": "request"}
        try:
            if "latents" not in tensors:
                raise ArgumentError(
                    f"the safetensors body holds {sorted(tensors)[:20]}, not 'latents'",
                    field="latents",
                )
            job = self.worker.video_job(
                model, tensors["latents"], fps=fps, mode=mode, denormalize=denormalize
            )
        except Exception as e:
            return self._failed(e, model, fault="request")
        out = await self._run(job)
        if "error" in out:
            return out
        result = out["result"]
        return {"mp4": result.body, "frames": result.info["frames"], **out["info"]}

    async def _run(self, job: Any) -> dict[str, Any]:
        """Queue ``job`` and wait: ``{"result", "info"}``, or a failure's answer."""
        left_out = self.worker.unavailable.get(job.model)
        if left_out is not None:  # this worker could not read it: another may
            why = {"type": "model_unavailable", "message": f"{job.model!r}: {left_out}"}
            out = {"status": 503, "error": why, "headers": {}, "fault": "model"}
            return {**out, "state": self.state()}
        try:
            future, _ = self.worker.submit(job)
            result = await asyncio.wrap_future(future)
        except Exception as e:  # an answer: a raise here reads as a worker fault
            return self._failed(e, job.model, fault="job")
        info = {"phases": result.phases, "switch": result.switch, "state": self.state()}
        return {"result": result, "info": info}

    def _failed(self, e: BaseException, model: Any, *, fault: str) -> dict[str, Any]:
        from nostall.serve.answers import error_answer

        status, error, headers = error_answer(e, model=model, models=self.worker.names())
        out = {"status": status, "error": error, "headers": headers, "fault": fault}
        return {**out, "state": self.state()}

    def close(self) -> None:
        """Shut the worker down (its running job finished first, at most a minute)."""
        w = getattr(self, "worker", None)
        if w is not None:
            w.shutdown(timeout=60)

    def state(self) -> dict[str, Any]:
        """Where this worker's pipelines are and how many jobs it has queued."""
        s = self.worker.status()
        return {
            "index": self.index,
            "actor": self.actor,
            "models": s["models"],
            "queue": len(s["queue"]),
            # what the router places by: the queue's estimated wait, each switch's price
            "estimated_wait_s": s.get("estimated_wait_s"),
            "switch_s": s.get("switch_s", {}),
        }
