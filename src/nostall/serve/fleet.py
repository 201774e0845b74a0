"""A fleet of generation workers on Ray Serve, one per GPU, routed by bytes
(``nostall fleet``).

Ray Serve's own answer to "send the request where the model is" is model multiplexing:
its router counts models per replica (``max_num_models_per_replica``), loads them one at
a time, and waits before it routes a model no replica holds yet. A diffusion worker's
cost is bytes, not models: a replica whose model cache holds a pipeline in GPU memory
serves it for nothing, one holding it in pinned host memory for a copy at the link's
speed, one that must read it for the disk's. So this fleet routes itself:

* each worker is its own single-replica deployment (``worker-0`` ... ``worker-{N-1}``,
  one GPU each), running a :class:`~nostall.serve.worker.Worker` (model cache, queue,
  prefetch) with no HTTP server of its own;
* the ingress deployment (the router) keeps, per worker, where each pipeline's
  components are (refreshed by every answer) and how many requests it has in flight,
  and sends each request to the worker with the lowest estimated cost: the switch
  (0 on the GPU, bytes / host link, bytes / disk) plus the work queued ahead of it.
  A pipeline no worker holds goes at once to the cheapest worker. Ties go to the worker
  holding fewer bytes, so pipelines spread over the fleet;
* a worker that dies mid-request (a transport failure: the replica died or cannot be
  reached) or answers 503 (no room, out of device memory, shutting down) is marked down
  for a while (its ``Retry-After``, else ``down_s``) and the request is retried on the
  next cheapest one; one that answers another 5xx is marked down and its answer goes
  back (a request that broke one worker is not tried on all of them). A 4xx is the
  request's own fault: it goes back to the client unchanged, and no worker is marked
  down (:func:`route_outcome`). Each worker answers every failure of a job as a status
  (:func:`error_answer`, the worker app's mapping), so a request the pipeline rejects is
  a 422, never a dead replica.

The embedding service (:mod:`nostall.serve.embed`) runs as a second application,
:func:`build_embed`, under the route prefix ``/embed``; the workers are given its URL
through Ray Serve's HTTP proxy (``embed_url``), encode prompts there and switch their
pipelines in without the text encoders. On GPUs it takes a small share of one GPU
(``gpu_share``) and the workers ask for the rest of theirs, so Ray puts it beside a
worker.

Scaling to a Ray cluster: start Ray on each node (``ray start --head`` on one,
``ray start --address=HEAD:6379`` on the others, each node with its GPUs), then run
``nostall fleet --replicas N`` with N the number of GPUs in the cluster: Ray places one
worker per GPU wherever the GPUs are; the router and the HTTP proxy run on the head.
Each worker's cache reads the store from its own node (a shared file system or a copy
per node).

Memory: unless ``worker_options`` set them, each worker's pinned host tier is half the
host's memory limit divided by ``replicas``, or what the store needs there if less (and on
CPU workers the device tier a quarter of the limit, likewise divided), so the workers of
one host together take what one worker alone would. On a cluster, pass ``host_budget``
for each node's share.
"""

# No "from __future__ import annotations": Ray pickles the deployments by value, and
# FastAPI must see the real Request class in the routes' annotations there.

import asyncio
import base64
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nostall.errors import ArgumentError, NostallError

__all__ = [
    "build_embed",
    "build_fleet",
    "error_answer",
    "failure_status",
    "route_cost",
    "route_outcome",
    "worker_budgets",
]

log = logging.getLogger(__name__)

# What a switch costs per byte, by the tier the bytes come from (seconds per byte).
# H200 figures (docs/BENCHMARKS.md): host tier → GPU 54 GB/s; page cache ~34 GB/s;
# a cold read far less. Only their order matters much: gpu < host < disk.
_SECONDS_PER_BYTE = {"gpu": 0.0, "device": 0.0, "host": 1 / 50e9, "disk": 1 / 5e9}
_REQUEST_S = 2.0  # the estimated time of one queued request, until measured


def route_cost(tier: str, nbytes: int, in_flight: int, request_s: float) -> float:
    """Estimated seconds until a worker could finish switching to a pipeline: its switch
    (``nbytes`` from ``tier``) after the ``in_flight`` requests it already has."""
    return nbytes * _SECONDS_PER_BYTE.get(tier, _SECONDS_PER_BYTE["disk"]) + in_flight * request_s


def route_outcome(status: int | None) -> tuple[bool, bool]:
    """What the router does after a worker failed a request: ``(mark it down, try the
    next worker)``. ``status`` is the worker's answer, or None when the call itself failed
    (the replica died or cannot be reached).

    >>> route_outcome(None), route_outcome(503), route_outcome(500), route_outcome(422)
    ((True, True), (True, True), (True, False), (False, False))
    """
    if status is None or status == 503:  # gone, or cannot take it now: another may
        return True, True
    if status >= 500:  # it failed the job: down for a while, and the error goes back
        return True, False
    return False, False  # the request's own fault: back to the client unchanged


def failure_status(e: BaseException) -> int | None:
    """The status of a worker call that raised: None for a transport failure (the replica
    died, was unreachable, or Ray Serve could not place the call), 500 for an exception
    the worker's own code raised (answered as such: a bug, not a dead replica)."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(e, RayTaskError) and not isinstance(e, RayActorError):
        return 500
    return None


def error_answer(e: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(status, error, headers)`` for a job that failed with ``e``, as the worker app
    answers it (:mod:`nostall.serve.app`): 404 unknown model, 422 a value the request or
    the pipeline refused (with ``field`` and ``allowed`` where the error names them), 429
    queue full, 503 shutting down, no room or out of device memory (with
    ``Retry-After``), 500 anything else. ``error`` is the JSON ``{"type", "message", ...}``.

    >>> error_answer(ValueError("height 4096 above 3072"))[:2]
    (422, {'type': 'rejected_by_pipeline', 'message': 'height 4096 above 3072'})
    """
    import json
    import math

    from nostall.errors import (
        BudgetExceeded,
        Cancelled,
        QueueFull,
        ServeError,
        ShuttingDown,
        UnknownModel,
    )

    def retry(default: float) -> dict[str, str]:
        wait = getattr(e, "retry_after", None) or default
        return {"Retry-After": str(max(1, math.ceil(wait)))}

    def err(kind: str, message: str | None = None) -> dict[str, Any]:
        return {"type": kind, "message": str(e) if message is None else message}

    if isinstance(e, UnknownModel):
        return 404, err("unknown_model"), {}
    if isinstance(e, QueueFull):
        return 429, err("queue_full"), retry(1)
    if isinstance(e, ArgumentError):
        out = err("invalid_value")
        if getattr(e, "field", None) is not None:
            allowed = getattr(e, "allowed", None)
            try:
                json.dumps(allowed)
            except (TypeError, ValueError):
                allowed = str(allowed)
            out.update(field=e.field, allowed=allowed)
        return 422, out, {}
    if isinstance(e, (ShuttingDown, Cancelled)):
        return 503, err("shutting_down"), {}
    if isinstance(e, BudgetExceeded):
        return 503, err("no_room"), retry(5)
    if isinstance(e, ServeError) and getattr(e, "retry_after", None) is not None:
        return 503, err("device_busy"), retry(5)  # out of device memory twice
    if type(e).__name__ == "OutOfMemoryError":  # torch's, where a worker lets it through
        return 503, err("out_of_memory", f"OutOfMemoryError: {e}"), retry(5)
    if isinstance(e, ValueError):  # the pipeline refused what it was given (check_inputs)
        return 422, err("rejected_by_pipeline"), {}
    if isinstance(e, NostallError):
        return 500, err(type(e).__name__), {}
    return 500, err(type(e).__name__, f"{type(e).__name__}: {e}"), {}


def _tier(tiers: list[str] | None) -> str:
    """The slowest tier any of a pipeline's components is in (what its switch waits for)."""
    if not tiers:
        return "disk"
    for t in ("disk", "host", "device", "gpu"):
        if t in tiers:
            return t
    return "disk"


def worker_budgets(
    replicas: int,
    *,
    gpu: bool,
    options: dict[str, Any],
    limit: int | None = None,
    store_bytes: int | None = None,
    embed_bytes: int = 0,
) -> dict[str, Any]:
    """One worker's options: ``options``, with the host tier (and on a CPU the device
    tier) defaulting to the one-worker default divided by ``replicas`` (the host tier
    not divided when ``options`` name a shared one, ``host_tier="shared:NAME"``: every
    worker of the host maps the same); the host tier no
    larger than ``store_bytes``, what the store takes there
    (:func:`nostall.cache.host.store_bytes`). On GPUs, ``embed_bytes``: what an embedding
    service sharing a worker's GPU takes there (its encoders,
    :func:`~nostall.serve.budget.text_encoder_bytes`); each worker's device budget leaves
    it out (``external``), since Ray may put the service beside any of them, unless
    ``options`` give the device tier."""
    from nostall.memory.host import memory_limit

    limit = limit or memory_limit()[0] or (16 << 30)
    # One shared host tier (host_tier="shared:NAME") is the host's: not divided.
    shared = str(options.get("host_tier") or "").startswith("shared:")
    host = limit // 2 // (1 if shared else replicas)
    out: dict[str, Any] = {"host_budget": host if store_bytes is None else min(host, store_bytes)}
    if not gpu:
        out["gpu_budget"] = limit // 4 // replicas
    elif embed_bytes and "gpu_budget" not in options:
        out["external"] = embed_bytes
    return {**out, **options}


def build_embed(
    models: str,
    *,
    device: str = "cuda",
    gpu_share: float = 0.1,
    options: dict[str, Any] | None = None,
):
    """The embedding service as a Ray Serve application (one replica). Run it with
    ``serve.run(build_embed(...), name="embed", route_prefix="/embed")`` and give the
    workers ``embed_url="http://<proxy>/embed"``. ``options``: EmbeddingService's."""
    from ray import serve

    if not 0.0 < gpu_share < 1.0:
        raise ArgumentError(f"gpu_share={gpu_share!r} must be in (0, 1)")
    opts = dict(options or {})

    def embed_app():  # runs in the replica: the service and its FastAPI app live there
        from nostall.serve.embed import EmbeddingService, create_embed_app

        service = EmbeddingService(models, device=device, **opts)
        service.start()  # (the app's lifespan starts it too; starting twice is a no-op)
        return create_embed_app(service)

    gpus = gpu_share if device.startswith("cuda") else 0
    deployment = serve.deployment(
        serve.ingress(embed_app)(),
        name="embed",
        num_replicas=1,
        ray_actor_options={"num_gpus": gpus, "num_cpus": 1},
    )
    return deployment.bind()


def build_fleet(
    models: str,
    *,
    replicas: int,
    device: str = "cuda",
    worker_options: dict[str, Any] | None = None,
    down_s: float = 30.0,
    gpu_share: float = 1.0,
):
    """The Ray Serve application: ``replicas`` workers and the routing ingress. Run it
    with ``serve.run(build_fleet(...))``. ``gpu_share``: the GPU fraction each worker
    asks Ray for (below 1 when the embedding service shares a GPU; more than half keeps
    one worker per GPU)."""
    from ray import serve

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ArgumentError(f"replicas={replicas!r}: give one or more workers")
    if not 0.5 < gpu_share <= 1.0:
        raise ArgumentError(f"gpu_share={gpu_share!r} must be in (0.5, 1]: one worker per GPU")
    gpus = gpu_share if device.startswith("cuda") else 0
    opts = dict(worker_options or {})

    @serve.deployment(num_replicas=1, ray_actor_options={"num_gpus": gpus, "num_cpus": 1})
    class FleetWorker:
        def __init__(self, index: int):
            import ray

            from nostall.cache.host import store_bytes
            from nostall.cache.store import Store
            from nostall.serve.budget import text_encoder_bytes
            from nostall.serve.worker import Worker

            self.index = index
            self.actor = ray.get_runtime_context().get_actor_name()  # for operators (and tests)
            store = Store.shared(models)  # scanned once: sizing and the worker's cache share it
            need = None if "host_budget" in opts else store_bytes(store, 1 << 62)
            embed = text_encoder_bytes(store) if gpus and gpu_share < 1 else 0  # beside one
            budgets = worker_budgets(
                replicas, gpu=bool(gpus), options=opts, store_bytes=need, embed_bytes=embed
            )
            self.worker = Worker(store, device=device, **budgets).start()

        async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
            try:
                job = self.worker.image_job(body)
                future, _ = self.worker.submit(job)
                out = await asyncio.wrap_future(future)
            except Exception as e:  # an answer: a raise here reads as a worker fault
                status, error, headers = error_answer(e)
                return {"status": status, "error": error, "headers": headers,
                        "state": self.state()}  # fmt: skip
            return {
                "png": out.body,
                "phases": out.phases,
                "switch": out.switch,
                "seed": out.info["seed"],
                "state": self.state(),
            }

        def state(self) -> dict[str, Any]:
            s = self.worker.status()
            return {
                "index": self.index,
                "actor": self.actor,
                "models": s["models"],
                "queue": len(s["queue"]),
            }

        def __del__(self):
            w = getattr(self, "worker", None)
            if w is not None:
                w.shutdown(timeout=60)

    app = FastAPI(title="nostall fleet")

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class Router:
        def __init__(self, *workers):
            from nostall.cache.store import Store

            self.workers = list(workers)
            # The process's one store of this folder, kept while the router lives.
            self.store = store = Store.shared(models)
            self.names = store.names()
            self.nbytes = {
                n: sum(
                    c.checkpoint.nbytes
                    for c in store.entry(n).components.values()
                    if c is not None and c.weights
                )
                for n in self.names
            }
            self.models: list[dict[str, list[str]]] = [{} for _ in self.workers]
            self.actors: list[str | None] = [None] * len(self.workers)
            self.in_flight = [0] * len(self.workers)
            self.down_until = [0.0] * len(self.workers)
            self.request_s = _REQUEST_S
            self.routed: list[dict[str, Any]] = []

        def _order(self, model: str) -> list[int]:
            now = time.monotonic()
            live = [i for i in range(len(self.workers)) if self.down_until[i] <= now]
            if not live:
                live = list(range(len(self.workers)))

            def key(i: int):
                tier = _tier(self.models[i].get(model))
                cost = route_cost(
                    tier, self.nbytes.get(model, 0), self.in_flight[i], self.request_s
                )
                held = sum(
                    self.nbytes.get(m, 0)
                    for m, tiers in self.models[i].items()
                    if _tier(tiers) in ("gpu", "device")
                )
                return (cost, held, i)

            return sorted(live, key=key)

        @app.post("/v1/images/generations")
        async def generations(self, request: Request) -> Response:
            import json

            from pydantic import ValidationError

            from nostall.serve.app import ImageBody

            try:
                parsed = ImageBody.model_validate(json.loads(await request.body()))
            except json.JSONDecodeError as e:
                return JSONResponse(
                    {"error": {"type": "malformed_json", "message": f"body is not JSON: {e}"}}, 400
                )
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"]) or "body"
                return JSONResponse(
                    {"error": {"type": "invalid_value", "message": f"{where}: {first['msg']}"}}, 422
                )
            body = parsed.model_dump(exclude_none=True)
            model = body["model"]
            if model not in self.names:
                return JSONResponse(
                    {"error": {"type": "unknown_model", "message": f"no model {model!r}",
                               "models": self.names}}, 404,
                )  # fmt: skip
            fmt = body.pop("response_format", "b64_json")
            for ignored in ("n", "user", "quality", "style"):
                body.pop(ignored, None)
            last: dict[str, Any] | None = None
            for i in self._order(model):
                tier = _tier(self.models[i].get(model))
                self.in_flight[i] += 1
                t = time.perf_counter()
                try:
                    out = await self.workers[i].generate.remote(body)
                except Exception as e:
                    why = {"type": type(e).__name__, "message": f"worker {i}: {e}"}
                    out = {"status": failure_status(e), "headers": {}, "error": why}
                finally:
                    self.in_flight[i] -= 1
                if "state" in out:
                    self.models[i] = out["state"]["models"]
                    self.actors[i] = out["state"].get("actor")
                if "error" in out:
                    status, headers = out["status"], out["headers"]
                    down, retry = route_outcome(status)
                    if down:
                        wait = float(headers.get("Retry-After", 0)) or down_s
                        self.down_until[i] = time.monotonic() + wait
                        log.warning("worker %d down for %.0f s (%s: %s)", i, wait, status,
                                    out["error"]["type"])  # fmt: skip
                    if retry:
                        last = out
                        continue
                    return JSONResponse({"error": out["error"]}, status, headers=headers)
                elapsed = time.perf_counter() - t
                self.request_s = 0.8 * self.request_s + 0.2 * elapsed
                self.routed.append({"model": model, "worker": i, "tier_before": tier})
                self.routed = self.routed[-1000:]
                headers = {"X-Nostall-Worker": str(i), "X-Nostall-Routed-Tier": tier}
                if fmt == "png":
                    return Response(out["png"], media_type="image/png", headers=headers)
                return JSONResponse(
                    {
                        "created": int(time.time()),
                        "data": [{"b64_json": base64.b64encode(out["png"]).decode()}],
                        "nostall": {
                            "model": model,
                            "worker": i,
                            "seed": out["seed"],
                            "phases": out["phases"],
                            "switch": out["switch"],
                        },
                    },
                    headers=headers,
                )
            why = last["error"] if last else {"type": "none", "message": "no worker"}
            return JSONResponse(
                {"error": {"type": "no_worker", "message": f"every worker failed; the last: "
                           f"{why['type']}: {why['message']}"}},
                503,
                headers=(last or {}).get("headers") or None,
            )  # fmt: skip

        @app.get("/v1/models")
        async def list_models(self) -> dict:
            return {"object": "list", "data": [{"id": n, "object": "model"} for n in self.names]}

        @app.get("/fleet")
        async def fleet(self) -> dict:
            return {
                "workers": [
                    {
                        "index": i,
                        "actor": self.actors[i],
                        "models": self.models[i],
                        "in_flight": self.in_flight[i],
                        "down": self.down_until[i] > time.monotonic(),
                    }
                    for i in range(len(self.workers))
                ],
                "routed": self.routed[-100:],
                "request_s": self.request_s,
            }

        @app.get("/healthz")
        async def healthz(self) -> dict:
            return {"status": "ok"}

    workers = [FleetWorker.options(name=f"worker-{i}").bind(i) for i in range(replicas)]
    return Router.bind(*workers)
