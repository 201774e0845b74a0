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
  back (a request that broke one worker is not tried on all of them). A 4xx, or any
  failure while the worker checked the request, is the request's own fault: it goes back
  to the client unchanged, and no worker is marked down
  (:func:`~nostall.serve.routing.route_outcome`). Each worker answers every failure as a
  status (:func:`~nostall.serve.answers.error_answer`, the worker app's mapping), so a
  request the pipeline rejects is a 422, never a dead replica.

The router answers the worker app's routes (:mod:`nostall.serve.app`) with its error
shape: ``POST /v1/images/generations``, ``POST /v1/videos/decode`` (routed like images,
to the worker where the pipeline's VAE is), ``GET /v1/models``, ``/healthz``,
``/readyz`` (503 while every worker is down), ``/metrics`` (the router's Prometheus
metrics: answers, latency, routes, workers up and in flight), ``/`` (a status page) and
``/status.json``, plus ``/fleet`` (its routing state); behind the same token, body and
time limits (:func:`~nostall.serve.http.harden`).

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

Memory (:func:`~nostall.serve.routing.worker_budgets`): unless ``worker_options`` set them, each worker's pinned host tier is half the
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
from fastapi.responses import HTMLResponse, JSONResponse, Response

from nostall.errors import ArgumentError
from nostall.serve.routing import (
    REQUEST_S,
    failure_status,
    route_cost,
    route_outcome,
    slowest_tier,
    worker_budgets,
)

__all__ = ["build_embed", "build_fleet"]

log = logging.getLogger(__name__)


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
    token: str | None = None,
    time_limit: float | None = 600.0,
):
    """The Ray Serve application: ``replicas`` workers and the routing ingress. Run it
    with ``serve.run(build_fleet(...))``. ``gpu_share``: the GPU fraction each worker
    asks Ray for (below 1 when the embedding service shares a GPU; more than half keeps
    one worker per GPU). ``token`` and ``time_limit``: as the worker app's
    (:func:`~nostall.serve.app.create_app`)."""
    from ray import serve

    from nostall.serve.http import harden
    from nostall.serve.requests import Limits

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ArgumentError(f"replicas={replicas!r}: give one or more workers")
    if not 0.5 < gpu_share <= 1.0:
        raise ArgumentError(f"gpu_share={gpu_share!r} must be in (0.5, 1]: one worker per GPU")
    gpus = gpu_share if device.startswith("cuda") else 0
    opts = dict(worker_options or {})
    limits = opts.get("limits") or Limits()

    @serve.deployment(num_replicas=1, ray_actor_options={"num_gpus": gpus, "num_cpus": 1})
    class FleetWorker:
        def __init__(self, index: int):
            import ray

            from nostall.cache.host import store_bytes
            from nostall.serve.budget import text_encoder_bytes
            from nostall.serve.worker import Worker
            from nostall.store.catalog import Store

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
            model = body.get("model")
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

        def _failed(self, e: Exception, model: Any, *, fault: str) -> dict[str, Any]:
            from nostall.serve.answers import error_answer

            status, error, headers = error_answer(e, model=model, models=self.worker.names())
            out = {"status": status, "error": error, "headers": headers, "fault": fault}
            return {**out, "state": self.state()}

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
    harden(
        app,
        token=token,
        body_limits={
            "/v1/videos/decode": limits.max_latent_bytes,
            "/v1/images/generations": max(1 << 20, limits.max_control_bytes * 4 // 3 + 4096),
        },
        time_limit=time_limit,
    )

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class Router:
        def __init__(self, *workers):
            from nostall.serve.metrics import FleetMetrics
            from nostall.store.catalog import Store

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
            self.request_s = REQUEST_S
            self.routed: list[dict[str, Any]] = []
            self.metrics = FleetMetrics(len(self.workers))

        def _order(self, model: str) -> list[int]:
            now = time.monotonic()
            live = [i for i in range(len(self.workers)) if self.down_until[i] <= now]
            if not live:
                live = list(range(len(self.workers)))

            def key(i: int):
                tier = slowest_tier(self.models[i].get(model))
                cost = route_cost(
                    tier, self.nbytes.get(model, 0), self.in_flight[i], self.request_s
                )
                held = sum(
                    self.nbytes.get(m, 0)
                    for m, tiers in self.models[i].items()
                    if slowest_tier(tiers) in ("gpu", "device")
                )
                return (cost, held, i)

            return sorted(live, key=key)

        def _answered(self, endpoint: str, resp: Response, t0: float) -> Response:
            self.metrics.answered(endpoint, resp.status_code, time.perf_counter() - t0)
            return resp

        async def _route(self, model: str, call) -> tuple[int, str, dict[str, Any]] | Response:
            """Call the cheapest worker for ``model`` (``call(handle)``), then the next as
            :func:`route_outcome` says: ``(worker, tier it had, answer)`` or the error."""
            from nostall.serve.http import error_response

            last: dict[str, Any] | None = None
            for i in self._order(model):
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
                    self.models[i] = out["state"]["models"]
                    self.actors[i] = out["state"].get("actor")
                if "error" in out:
                    status, headers = out["status"], out["headers"]
                    down, retry = route_outcome(status, fault=out.get("fault", "job"))
                    if out.get("fault") == "model":
                        retry = True  # this worker cannot read the pipeline; another may
                    if down:
                        wait = float(headers.get("Retry-After", 0)) or down_s
                        self.down_until[i] = time.monotonic() + wait
                        self.metrics.downs.labels(str(i)).inc()
                        kind = out["error"]["type"]
                        log.warning("worker %d down for %.0f s (%s: %s)", i, wait, status, kind)
                    if retry:
                        last = out
                        continue
                    error = dict(out["error"])
                    kind, message = error.pop("type"), error.pop("message")
                    return error_response(status, kind, message, headers=headers or None, **error)
                elapsed = time.perf_counter() - t
                self.request_s = 0.8 * self.request_s + 0.2 * elapsed
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

        def _headers(self, i: int, tier: str, out: dict[str, Any]) -> dict[str, str]:
            from nostall.serve.answers import timing_headers

            return {
                **timing_headers(out["phases"], out["switch"]),
                "X-Nostall-Worker": str(i),
                "X-Nostall-Routed-Tier": tier,
            }

        def _unknown(self, model: Any) -> Response | None:
            from nostall.serve.http import error_response

            if model in self.names:
                return None
            return error_response(404, "unknown_model", f"no model {model!r}", models=self.names)

        @app.post("/v1/images/generations")
        async def generations(self, request: Request) -> Response:
            from nostall.serve.answers import read_body
            from nostall.serve.app import ImageBody
            from nostall.serve.http import error_response

            t0 = time.perf_counter()
            raw = await request.body()
            parsed = await asyncio.to_thread(read_body, raw, ImageBody)
            if isinstance(parsed, Response):
                return self._answered("images", parsed, t0)
            if parsed.n != 1:
                bad = error_response(422, "invalid_value", "n: only 1", field="n", allowed=[1])
                return self._answered("images", bad, t0)
            body = parsed.model_dump(exclude_none=True)
            model = body["model"]
            unknown = self._unknown(model)
            if unknown is not None:
                return self._answered("images", unknown, t0)
            fmt = body.pop("response_format", "b64_json")
            for ignored in ("n", "user", "quality", "style"):
                body.pop(ignored, None)
            routed = await self._route(model, lambda w: w.generate.remote(body))
            if isinstance(routed, Response):
                return self._answered("images", routed, t0)
            i, tier, out = routed
            headers = self._headers(i, tier, out)
            if fmt == "png":
                resp = Response(out["png"], media_type="image/png", headers=headers)
                return self._answered("images", resp, t0)
            doc = {
                "created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(out["png"]).decode()}],
                "nostall": {
                    "model": model,
                    "worker": i,
                    "seed": out["seed"],
                    "phases": out["phases"],
                    "switch": out["switch"],
                },
            }
            return self._answered("images", JSONResponse(doc, headers=headers), t0)

        @app.post("/v1/videos/decode")
        async def decode_video(
            self,
            request: Request,
            model: str,
            fps: float = 16.0,
            mode: str = "eager",
            denormalize: bool = False,
        ) -> Response:
            t0 = time.perf_counter()
            unknown = self._unknown(model)
            if unknown is not None:
                return self._answered("videos", unknown, t0)
            raw = await request.body()  # at most max_latent_bytes: BodyLimit saw to it
            routed = await self._route(
                model, lambda w: w.decode.remote(model, raw, fps, mode, denormalize)
            )
            if isinstance(routed, Response):
                return self._answered("videos", routed, t0)
            i, tier, out = routed
            headers = {**self._headers(i, tier, out), "X-Nostall-Frames": str(out["frames"])}
            resp = Response(out["mp4"], media_type="video/mp4", headers=headers)
            return self._answered("videos", resp, t0)

        @app.get("/v1/models")
        async def list_models(self) -> dict:
            data = [{"id": n, "object": "model", "available": True} for n in self.names]
            return {"object": "list", "data": data}

        @app.get("/fleet")
        async def fleet(self) -> dict:
            now = time.monotonic()
            return {
                "workers": [
                    {
                        "index": i,
                        "actor": self.actors[i],
                        "models": self.models[i],
                        "in_flight": self.in_flight[i],
                        "down": self.down_until[i] > now,
                    }
                    for i in range(len(self.workers))
                ],
                "routed": self.routed[-100:],
                "request_s": self.request_s,
            }

        @app.get("/status.json")
        async def status_json(self) -> dict:
            return await self.fleet()

        @app.get("/", response_class=HTMLResponse)
        async def status_page(self) -> str:
            from nostall.serve.pages import fleet_page

            return fleet_page(await self.fleet())

        @app.get("/metrics")
        async def metrics(self) -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST

            now = time.monotonic()
            for i, until in enumerate(self.down_until):
                self.metrics.up.labels(str(i)).set(0 if until > now else 1)
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/healthz")
        async def healthz(self) -> dict:
            return {"status": "ok"}

        @app.get("/readyz")
        async def readyz(self) -> Response:
            now = time.monotonic()
            up = sum(until <= now for until in self.down_until)
            return JSONResponse({"ready": up > 0, "workers_up": up}, 200 if up else 503)

    workers = [FleetWorker.options(name=f"worker-{i}").bind(i) for i in range(replicas)]
    return Router.bind(*workers)
