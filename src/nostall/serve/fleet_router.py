"""The fleet's router: per worker, where each pipeline's components are and how many
requests it has in flight, and the loop that sends a request to the cheapest worker and
on to the next as :func:`~nostall.serve.routing.route_outcome` says. No Ray here: a
worker is a handle whose ``generate``/``decode`` have a ``remote(...)`` to await (a Ray
Serve ``DeploymentHandle``, or :class:`LocalHandle` over an in-process
:class:`~nostall.serve.fleet_worker.FleetMember`); :mod:`nostall.serve.fleet_routes`
answers HTTP with it and :mod:`nostall.serve.fleet` deploys it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Response

from nostall.serve.answers import timing_headers
from nostall.serve.http import error_response
from nostall.serve.routing import (
    REQUEST_S,
    failure_status,
    route_cost,
    route_outcome,
    slowest_tier,
)

__all__ = ["FleetRouter", "LocalHandle", "pipeline_bytes"]

log = logging.getLogger("nostall.serve.fleet")


class LocalHandle:
    """A handle over an object in this process, as a Ray Serve handle is called:
    ``handle.generate.remote(body)`` is an awaitable of ``member.generate(body)``."""

    class _Method:
        def __init__(self, fn: Callable[..., Awaitable[Any]]):
            self._fn = fn

        def remote(self, *args: Any) -> Awaitable[Any]:
            return self._fn(*args)

    def __init__(self, member: Any):
        self._member = member

    def __getattr__(self, name: str) -> Any:
        return LocalHandle._Method(getattr(self._member, name))


def pipeline_bytes(store: Any) -> dict[str, int]:
    """Each pipeline of ``store`` (a :class:`~nostall.cache.Store`) and the bytes of its
    weights components: what a switch to it moves from the tier its components are in."""
    return {
        n: sum(
            c.checkpoint.nbytes
            for c in store.entry(n).components.values()
            if c is not None and c.weights
        )
        for n in store.names()
    }


class FleetRouter:
    """Routes requests for the pipelines ``nbytes`` names (each with the bytes of its
    weights, :func:`pipeline_bytes`) over ``workers`` (handles); a worker that failed as
    :func:`route_outcome` says is left out for its ``Retry-After``, else ``down_s``
    seconds. Reading nothing itself, a router needs neither the store nor diffusers."""

    def __init__(self, nbytes: dict[str, int], workers: list[Any], *, down_s: float = 30.0):
        from nostall.serve.metrics import FleetMetrics

        self.workers = list(workers)
        self.names = sorted(nbytes)
        self.nbytes = dict(nbytes)
        self.down_s = down_s
        self.models: list[dict[str, list[str]]] = [{} for _ in self.workers]
        # each worker's own estimates, as of its last answer: its queue's wait and the
        # price of a switch to each pipeline (None until it answered)
        self.waits: list[float | None] = [None] * len(self.workers)
        self.prices: list[dict[str, float]] = [{} for _ in self.workers]
        self.actors: list[str | None] = [None] * len(self.workers)
        self.in_flight = [0] * len(self.workers)
        self.down_until = [0.0] * len(self.workers)
        self.request_s = REQUEST_S
        self.routed: list[dict[str, Any]] = []
        self.metrics = FleetMetrics(len(self.workers))

    def order(self, model: str) -> list[int]:
        """The workers to try for ``model``, soonest done first (those marked down left
        out, unless all are): each one's estimated wait plus its switch to ``model``,
        from its own estimates as of its last answer (the wait grown by the requests
        sent to it since, the switch priced from where its bytes are at the rates its
        switches measured), or, before it answered, from the tier its bytes are in and
        the requests in flight; so a warm worker goes first unless its queue outweighs
        another's switch. Ties: the bytes each holds on its device (pipelines spread
        over the fleet), then the index."""
        now = time.monotonic()
        live = [i for i in range(len(self.workers)) if self.down_until[i] <= now]
        if not live:
            live = list(range(len(self.workers)))

        def key(i: int):
            tier = slowest_tier(self.models[i].get(model))
            if tier in ("gpu", "device"):
                switch = 0.0
            elif model in self.prices[i]:
                switch = self.prices[i][model]
            else:
                switch = route_cost(tier, self.nbytes.get(model, 0), 0, self.request_s)
            queued = self.in_flight[i] * self.request_s
            wait = queued if self.waits[i] is None else max(self.waits[i], queued)
            held = sum(
                self.nbytes.get(m, 0)
                for m, tiers in self.models[i].items()
                if slowest_tier(tiers) in ("gpu", "device")
            )
            return (switch + wait, held, i)

        return sorted(live, key=key)

    def answered(self, endpoint: str, resp: Response, t0: float) -> Response:
        """``resp``, booked in the router's metrics."""
        self.metrics.answered(endpoint, resp.status_code, time.perf_counter() - t0)
        return resp

    def unknown(self, model: Any) -> Response | None:
        """The 404 for a model the store lacks (listing them), else ``None``."""
        if model in self.names:
            return None
        return error_response(404, "unknown_model", f"no model {model!r}", models=self.names)

    async def route(
        self, model: str, call: Callable[[Any], Awaitable[dict[str, Any]]]
    ) -> tuple[int, str, dict[str, Any]] | Response:
        """Call the cheapest worker for ``model`` (``call(handle)``), then the next as
        :func:`route_outcome` says: ``(worker, tier it had, answer)`` or the error."""
        last: dict[str, Any] | None = None
        for i in self.order(model):
            tier = slowest_tier(self.models[i].get(model))
            self.in_flight[i] += 1
            self.metrics.in_flight.labels(str(i)).set(self.in_flight[i])
            t = time.perf_counter()
            try:
                out = await call(self.workers[i])
            except Exception as e:
                why = {"type": type(e).__name__, "message": f"worker {i}: {e}"}
                out = {"status": failure_status(e), "headers": {}, "error": why}
            finally:
                self.in_flight[i] -= 1
                self.metrics.in_flight.labels(str(i)).set(self.in_flight[i])
            if "state" in out:
                state = out["state"]
                self.models[i] = state["models"]
                self.actors[i] = state.get("actor")
                self.waits[i] = state.get("estimated_wait_s")
                self.prices[i] = dict(state.get("switch_s") or {})
            if "error" in out:
                failed = self._failed(i, out)
                if failed is None:
                    last = out
                    continue
                return failed
            self.request_s = 0.8 * self.request_s + 0.2 * (time.perf_counter() - t)
            self.routed.append({"model": model, "worker": i, "tier_before": tier})
            self.routed = self.routed[-1000:]
            self.metrics.routed.labels(str(i), tier).inc()
            return i, tier, out
        why = last["error"] if last else {"type": "none", "message": "no worker"}
        return error_response(
            503,
            "no_worker",
            f"every worker failed; the last: {why['type']}: {why['message']}",
            headers=(last or {}).get("headers") or None,
        )

    def _failed(self, i: int, out: dict[str, Any]) -> Response | None:
        """After worker ``i`` failed with ``out``: mark it down if it must be; ``None`` to
        try the next worker, else the answer to give."""
        status, headers = out["status"], out["headers"]
        down, retry = route_outcome(status, fault=out.get("fault", "job"))
        if out.get("fault") == "model":
            retry = True  # this worker cannot read the pipeline; another may
        if down:
            wait = float(headers.get("Retry-After", 0)) or self.down_s
            self.down_until[i] = time.monotonic() + wait
            self.metrics.downs.labels(str(i)).inc()
            log.warning("worker %d down for %.0f s (%s: %s)", i, wait, status, out["error"]["type"])
        if retry:
            return None
        error = dict(out["error"])
        kind, message = error.pop("type"), error.pop("message")
        return error_response(status, kind, message, headers=headers or None, **error)

    def headers(self, i: int, tier: str, out: dict[str, Any]) -> dict[str, str]:
        """A routed answer's headers: its phase times, the worker and the tier it had."""
        return {
            **timing_headers(out["phases"], out["switch"]),
            "X-Nostall-Worker": str(i),
            "X-Nostall-Routed-Tier": tier,
        }

    def state(self) -> dict[str, Any]:
        """The routing state (``GET /fleet``): each worker, the latest routes."""
        now = time.monotonic()
        return {
            "workers": [
                {
                    "index": i,
                    "actor": self.actors[i],
                    "models": self.models[i],
                    "in_flight": self.in_flight[i],
                    "estimated_wait_s": self.waits[i],
                    "switch_s": self.prices[i],
                    "down": self.down_until[i] > now,
                }
                for i in range(len(self.workers))
            ],
            "routed": self.routed[-100:],
            "request_s": self.request_s,
        }

    def up(self) -> int:
        """Workers not marked down now (the metrics' ``worker_up`` updated)."""
        now = time.monotonic()
        for i, until in enumerate(self.down_until):
            self.metrics.up.labels(str(i)).set(0 if until > now else 1)
        return sum(until <= now for until in self.down_until)
