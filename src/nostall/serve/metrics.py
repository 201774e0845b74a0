"""Prometheus metrics of one worker, of one embedding service and of a fleet's router (each
its own registry: two in one process, as in the tests, never share counters).

Label values never come from a request unchecked: a model name the worker does not serve
is counted as ``"unknown"``, so clients cannot grow the number of series.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["EmbedMetrics", "FleetMetrics", "WorkerMetrics"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nostall_requests",
            "Requests answered, by endpoint, model and status code.",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "nostall_request_seconds",
            "Time from arrival to answer.",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.phases = Histogram(
            "nostall_phase_seconds",
            "Per-request phase times: queue, switch, read, copy, build, text, denoise, decode.",
            ["phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.switch_tier = Counter(
            "nostall_switch_components",
            "Components a switch found, by the tier they came from.",
            ["tier"],
            registry=r,
        )
        self.queue_depth = Gauge("nostall_queue_depth", "Requests waiting.", registry=r)
        self.rejected = Counter(
            "nostall_rejected", "Requests refused because the queue was full (429).", registry=r
        )
        self.tier_bytes = Gauge(
            "nostall_tier_bytes", "Weights resident per tier.", ["tier"], registry=r
        )

    def answered(
        self, endpoint: str, model: str, status: int, seconds: float, known: Collection[str]
    ) -> None:
        """Count one answer of ``endpoint`` for ``model`` (``"unknown"`` unless it is one
        of ``known``, or ``"-"`` when the request named none)."""
        label = model if model == "-" or model in known else "unknown"
        self.requests.labels(endpoint, label, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EmbedMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nostall_embed_requests",
            "Requests answered, by encoder and status code.",
            ["encoder", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "nostall_embed_request_seconds",
            "Time from arrival to answer.",
            buckets=_SECONDS,
            registry=r,
        )
        self.texts = Counter(
            "nostall_embed_texts",
            "Texts asked for, by where they were served from.",
            ["source"],
            registry=r,
        )
        self.batch_texts = Histogram(
            "nostall_embed_batch_texts", "Texts per encoded batch.", buckets=_BATCH, registry=r
        )
        self.batch_seconds = Histogram(
            "nostall_embed_batch_seconds",
            "Time to tokenize and encode one batch.",
            buckets=_SECONDS,
            registry=r,
        )
        self.queue_depth = Gauge("nostall_embed_queue_depth", "Texts waiting.", registry=r)
        self.cache_bytes = Gauge("nostall_embed_cache_bytes", "Bytes in the cache.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FleetMetrics:
    """The fleet router's: its answers, where it routed, and each worker's state (labels:
    endpoints, worker indexes and tiers, never request values)."""

    def __init__(self, workers: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nostall_fleet_requests",
            "Requests answered by the router, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "nostall_fleet_request_seconds",
            "Time from arrival at the router to answer.",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.routed = Counter(
            "nostall_fleet_routed",
            "Requests served, by worker and the tier its pipeline was in when routed.",
            ["worker", "tier"],
            registry=r,
        )
        self.downs = Counter(
            "nostall_fleet_worker_downs", "Times a worker was marked down.", ["worker"], registry=r
        )
        self.up = Gauge("nostall_fleet_worker_up", "1 unless marked down.", ["worker"], registry=r)
        self.in_flight = Gauge(
            "nostall_fleet_in_flight",
            "Requests routed to a worker and not yet answered.",
            ["worker"],
            registry=r,
        )
        for i in range(workers):
            self.up.labels(str(i)).set(1)
            self.in_flight.labels(str(i)).set(0)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
