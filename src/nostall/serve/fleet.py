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
shape (:mod:`nostall.serve.fleet_routes`, plus ``/fleet``: its routing state), behind the
same token, body and time limits. The rooms: this module deploys; the routing state and
loop are :mod:`nostall.serve.fleet_router`'s (no Ray), a worker's side of a call
:mod:`nostall.serve.fleet_worker`'s.

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

Memory (:func:`~nostall.serve.routing.worker_budgets`): unless the workers' config sets
them, each worker's pinned host tier is half the host's memory limit divided by
``replicas``, or what the store needs there if less (and on CPU workers the device tier a
quarter of the limit, likewise divided), so the workers of one host together take what
one worker alone would. On a cluster, give ``host_budget`` for each node's share.
"""

# No "from __future__ import annotations": Ray pickles the deployments by value.

import dataclasses
import logging
from typing import Any

from nostall.errors import ArgumentError
from nostall.serve.config import EmbedConfig, WorkerConfig
from nostall.serve.routing import worker_budgets

__all__ = ["build_embed", "build_fleet", "worker_config"]

log = logging.getLogger(__name__)


def build_embed(
    models: str,
    *,
    device: str = "cuda",
    gpu_share: float = 0.1,
    options: dict[str, Any] | None = None,
    config: EmbedConfig | None = None,
):
    """The embedding service as a Ray Serve application (one replica). Run it with
    ``serve.run(build_embed(...), name="embed", route_prefix="/embed")`` and give the
    workers ``embed_url="http://<proxy>/embed"``. ``config`` (or ``options``, its fields
    less the device): the service's (:class:`~nostall.serve.config.EmbedConfig`),
    checked here, before Ray places anything."""
    from ray import serve

    if not 0.0 < gpu_share < 1.0:
        raise ArgumentError(f"gpu_share={gpu_share!r} must be in (0, 1)", field="gpu_share")
    if config is None:
        config = EmbedConfig(device=device, **(options or {}))
    elif options:
        raise ArgumentError("build_embed: config= and options= together; give one", field="config")
    device = str(config.device)

    def embed_app():  # runs in the replica: the service and its FastAPI app live there
        from nostall.serve.embed import EmbeddingService, create_embed_app

        service = EmbeddingService(models, config=config)
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


def worker_config(
    config: WorkerConfig,
    replicas: int,
    *,
    gpu: bool,
    limit: int | None = None,
    store_bytes: int | None = None,
    embed_bytes: int = 0,
) -> WorkerConfig:
    """``config`` with one worker's share of the host filled in where it leaves the
    budgets to their defaults (:func:`~nostall.serve.routing.worker_budgets`)."""
    c = config.cache
    given = {
        k: v
        for k, v in (
            ("gpu_budget", c.gpu_budget),
            ("host_budget", c.host_budget),
            ("host_tier", c.host_tier),
            ("external", config.external or None),
        )
        if v is not None
    }
    shares = worker_budgets(
        replicas,
        gpu=gpu,
        options=given,
        limit=limit,
        store_bytes=store_bytes,
        embed_bytes=embed_bytes,
    )
    cache = dataclasses.replace(
        c, gpu_budget=shares.get("gpu_budget"), host_budget=shares.get("host_budget")
    )
    return dataclasses.replace(config, cache=cache, external=shares.get("external", 0))


def build_fleet(
    models: str,
    *,
    replicas: int,
    device: str | None = None,
    worker_options: dict[str, Any] | None = None,
    config: WorkerConfig | None = None,
    down_s: float = 30.0,
    gpu_share: float = 1.0,
    token: str | None = None,
    time_limit: float | None = 600.0,
):
    """The Ray Serve application: ``replicas`` workers and the routing ingress. Run it
    with ``serve.run(build_fleet(...))``. ``config``: every worker's
    (:class:`~nostall.serve.config.WorkerConfig`; or ``worker_options``, its fields as
    keyword arguments; ``device``: its cache's, ``"cuda"`` by default), checked here,
    before Ray places anything; budgets it leaves to their defaults are shared out
    (:func:`worker_config`). ``gpu_share``: the GPU fraction each worker asks Ray for
    (below 1 when the embedding service shares a GPU; more than half keeps one worker per
    GPU). ``token`` and ``time_limit``: as the worker app's
    (:func:`~nostall.serve.app.create_app`)."""
    from ray import serve

    from nostall.serve.fleet_routes import fleet_app
    from nostall.serve.fleet_worker import FleetMember

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ArgumentError(f"replicas={replicas!r}: give one or more workers", field="replicas")
    if not 0.5 < gpu_share <= 1.0:
        raise ArgumentError(
            f"gpu_share={gpu_share!r} must be in (0.5, 1]: one worker per GPU", field="gpu_share"
        )
    if config is None:
        config = WorkerConfig.from_kwargs(device=device or "cuda", **(worker_options or {}))
    elif worker_options:
        raise ArgumentError(
            "build_fleet: config= and worker_options= together; give one", field="config"
        )
    elif device is not None and str(device) != str(config.cache.device):
        raise ArgumentError(
            f"device={device!r}, and the workers' config runs on {config.cache.device!r}; give one",
            field="device",
        )
    device = str(config.cache.device)
    gpus = gpu_share if device.startswith("cuda") else 0

    @serve.deployment(num_replicas=1, ray_actor_options={"num_gpus": gpus, "num_cpus": 1})
    class FleetWorker(FleetMember):
        def __init__(self, index: int):
            import ray

            from nostall.cache.host import store_bytes
            from nostall.serve.budget import text_encoder_bytes
            from nostall.serve.worker import Worker
            from nostall.store.catalog import Store

            c = config.cache
            # scanned once: sizing and the worker's cache share it
            store = Store.shared(models, variant=c.variant, cache_dir=c.cache_dir)
            need = None if c.host_budget is not None else store_bytes(store, 1 << 62)
            embed = text_encoder_bytes(store) if gpus and gpu_share < 1 else 0  # beside one
            mine = worker_config(
                config, replicas, gpu=bool(gpus), store_bytes=need, embed_bytes=embed
            )
            actor = ray.get_runtime_context().get_actor_name()  # for operators (and tests)
            super().__init__(index, Worker(store, config=mine).start(), actor)

        def __del__(self):
            self.close()

    from nostall.serve.fleet_router import pipeline_bytes
    from nostall.store.catalog import Store

    c = config.cache
    # Read here, once: the router's process then imports neither the store nor diffusers
    # (a replica's start-up on two cores was mostly those imports).
    nbytes = pipeline_bytes(Store.shared(models, variant=c.variant, cache_dir=c.cache_dir))

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(fleet_app(limits=config.limits, token=token, time_limit=time_limit))
    class Router:
        def __init__(self, *workers):
            from nostall.serve.fleet_router import FleetRouter

            self.fleet = FleetRouter(nbytes, list(workers), down_s=down_s)  # (fleet_of finds it)

    workers = [FleetWorker.options(name=f"worker-{i}").bind(i) for i in range(replicas)]
    return Router.bind(*workers)
