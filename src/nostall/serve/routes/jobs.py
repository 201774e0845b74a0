"""What the worker app's job routes share: the worker the app serves, queueing a job and
waiting for it while watching the client, the answer to a failure
(:func:`~nostall.serve.answers.answer`, the one mapping), and booking each answer in the
metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

from fastapi import Depends, Request, Response

from nostall.errors import NostallError
from nostall.serve.answers import answer
from nostall.serve.http import error_response
from nostall.serve.results import Result

__all__ = ["WorkerDep", "answered", "refused", "run", "unavailable", "worker_of"]

log = logging.getLogger("nostall.serve.app")


def worker_of(request: Request) -> Any:
    """The :class:`~nostall.serve.worker.Worker` of the app serving ``request`` (a route
    dependency)."""
    return request.app.state.worker


#: A route parameter that is the app's worker.
WorkerDep = Annotated[Any, Depends(worker_of)]


def answered(worker: Any, endpoint: str, model: str, resp: Response, t0: float) -> Response:
    """``resp``, booked in the worker's metrics (its status, and the time since ``t0``)."""
    worker.metrics.answered(
        endpoint, model, resp.status_code, time.perf_counter() - t0, worker.names()
    )
    return resp


def unavailable(worker: Any, model: str) -> Response | None:
    """The 503 for a pipeline left out at start (the reason given), else ``None``."""
    why = getattr(worker, "unavailable", {}).get(model)
    if why is None:
        return None
    return error_response(503, "model_unavailable", f"pipeline {model!r} is not served: {why}")


def refused(worker: Any, e: BaseException, model: str) -> Response:
    """The answer to a request that failed before or while its job ran."""
    if not isinstance(e, (NostallError, ValueError)):  # a bug: its traceback, once
        log.error("%s: %s", model, e, exc_info=e)
    return answer(e, model=model, models=worker.names())


def _settled(f: asyncio.Future) -> None:
    """Read the outcome of a job whose client left (asyncio logs one nobody read)."""
    if not f.cancelled():
        f.exception()


async def run(worker: Any, request: Request, job: Any) -> Result | Response:
    """Queue ``job`` and wait for its result, or the answer to give instead: a refusal
    (queue full, shutting down, unknown model), its failure, or 499 when the client left
    first (a job not yet started is then skipped; a running one finishes)."""
    try:
        future, gone = worker.submit(job)
    except Exception as e:
        return refused(worker, e, job.model)
    waiting = asyncio.ensure_future(asyncio.wrap_future(future))
    try:
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=0.2)
            if not waiting.done() and await request.is_disconnected():
                gone.set()
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
        return refused(worker, e, job.model)
