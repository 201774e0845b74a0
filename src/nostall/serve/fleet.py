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
* a worker that dies mid-request is marked down for a while and the request is retried
  on the next cheapest one.

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

__all__ = ["build_embed", "build_fleet", "route_cost", "worker_budgets"]

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
) -> dict[str, Any]:
    """One worker's options: ``options``, with the host tier (and on a CPU the device
    tier) defaulting to the one-worker default divided by ``replicas``; the host tier no
    larger than ``store_bytes``, what the store takes there
    (:func:`nostall.cache.host.store_bytes`)."""
    from nostall.memory.host import memory_limit

    limit = limit or memory_limit()[0] or (16 << 30)
    host = limit // 2 // replicas
    out = {"host_budget": host if store_bytes is None else min(host, store_bytes)}
    if not gpu:
        out["gpu_budget"] = limit // 4 // replicas
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
            from nostall.serve.worker import Worker

            self.index = index
            self.actor = ray.get_runtime_context().get_actor_name()  # for operators (and tests)
            store = Store.shared(models)  # scanned once: sizing and the worker's cache share it
            need = None if "host_budget" in opts else store_bytes(store, 1 << 62)
            budgets = worker_budgets(replicas, gpu=bool(gpus), options=opts, store_bytes=need)
            self.worker = Worker(store, device=device, **budgets).start()

        async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
            from nostall.errors import UnknownModel
            from nostall.serve.worker import QueueFull

            try:
                job = self.worker.image_job(body)
                future, _ = self.worker.submit(job)
                out = await asyncio.wrap_future(future)
            except UnknownModel as e:
                return {"error": (404, "unknown_model", str(e)), "state": self.state()}
            except QueueFull as e:
                return {"error": (429, "queue_full", str(e)), "state": self.state()}
            except ArgumentError as e:
                return {"error": (422, "invalid_value", str(e)), "state": self.state()}
            except NostallError as e:
                return {"error": (500, type(e).__name__, str(e)), "state": self.state()}
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
            last: Exception | None = None
            for i in self._order(model):
                tier = _tier(self.models[i].get(model))
                self.in_flight[i] += 1
                t = time.perf_counter()
                try:
                    out = await self.workers[i].generate.remote(body)
                except Exception as e:  # the replica died or is unreachable: next one
                    log.warning("worker %d failed (%s); retrying elsewhere", i, e)
                    self.down_until[i] = time.monotonic() + down_s
                    last = e
                    continue
                finally:
                    self.in_flight[i] -= 1
                self.models[i] = out["state"]["models"]
                self.actors[i] = out["state"].get("actor")
                if "error" in out:
                    status, kind, message = out["error"]
                    return JSONResponse({"error": {"type": kind, "message": message}}, status)
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
            return JSONResponse(
                {"error": {"type": "no_worker", "message": f"every worker failed: {last}"}}, 503
            )

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
