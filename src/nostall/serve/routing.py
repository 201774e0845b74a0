"""How the fleet's router chooses a worker and what it does when one fails: pure rules,
no Ray (:mod:`nostall.serve.fleet` runs them).

* :func:`route_cost`: a worker's estimated time to serve a pipeline, from the slowest
  tier its components are in (:func:`slowest_tier`) and the requests queued ahead.
* :func:`route_outcome`: after a failed call, whether to mark the worker down and whether
  to try the next one. Only a worker that cannot take work (a transport failure, a 503)
  or whose job failed on its side (a 5xx) is marked down; a request's own fault (any
  4xx, and anything raised while checking the request, whatever its type) never is: a
  request that breaks the checks breaks them on every worker, and must not take the
  fleet down one worker at a time.
* :func:`worker_budgets`: each worker's share of the host's memory.

>>> route_outcome(None), route_outcome(503), route_outcome(500), route_outcome(422)
((True, True), (True, True), (True, False), (False, False))
>>> route_outcome(500, fault="request")
(False, False)
"""

from __future__ import annotations

from typing import Any

__all__ = ["failure_status", "route_cost", "route_outcome", "slowest_tier", "worker_budgets"]

# What a switch costs per byte, by the tier the bytes come from (seconds per byte).
# H200 figures (the benchmarks of the switch bench): host tier → GPU 54 GB/s; page cache ~34 GB/s;
# a cold read far less. Only their order matters much: gpu < host < disk.
_SECONDS_PER_BYTE = {"gpu": 0.0, "device": 0.0, "host": 1 / 50e9, "disk": 1 / 5e9}
REQUEST_S = 2.0  # the estimated time of one queued request, until measured


def route_cost(tier: str, nbytes: int, in_flight: int, request_s: float) -> float:
    """Estimated seconds until a worker could finish switching to a pipeline: its switch
    (``nbytes`` from ``tier``) after the ``in_flight`` requests it already has."""
    return nbytes * _SECONDS_PER_BYTE.get(tier, _SECONDS_PER_BYTE["disk"]) + in_flight * request_s


def slowest_tier(tiers: list[str] | None) -> str:
    """The slowest tier any of a pipeline's components is in (what its switch waits for).

    >>> slowest_tier(["gpu", "host"]), slowest_tier(None), slowest_tier(["gpu"])
    ('host', 'disk', 'gpu')
    """
    if not tiers:
        return "disk"
    for t in ("disk", "host", "device", "gpu"):
        if t in tiers:
            return t
    return "disk"


def route_outcome(status: int | None, *, fault: str = "job") -> tuple[bool, bool]:
    """What the router does after a worker failed a request: ``(mark it down, try the
    next worker)``. ``status`` is the worker's answer, or None when the call itself failed
    (the replica died or cannot be reached); ``fault`` is ``"request"`` when the worker
    refused the request while checking it (before it was queued), ``"job"`` otherwise."""
    if fault == "request":  # whatever the exception: the request's own
        return False, False
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
    worker of the host maps the same); the host tier no larger than ``store_bytes``, what
    the store takes there (:func:`nostall.cache.host.store_bytes`). On GPUs,
    ``embed_bytes``: what an embedding service sharing a worker's GPU takes there (its
    encoders, :func:`~nostall.serve.budget.text_encoder_bytes`); each worker's device
    budget leaves it out (``external``), since Ray may put the service beside any of
    them, unless ``options`` give the device tier."""
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
