"""Prometheus metrics of one worker, of one embedding service and of a fleet's router (each
its own registry: two in one process, as in the tests, never share counters).

Label values never come from a request unchecked: a model name the worker does not serve
is counted as ``"unknown"``, so clients cannot grow the number of series.

A worker that serves video jobs adds :class:`VideoMetrics` to its registry when they open;
one that serves none exposes no ``nostall_video_*`` series at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from nostall.errors import NostallError

__all__ = ["EmbedMetrics", "FleetMetrics", "VideoMetrics", "WorkerMetrics"]

log = logging.getLogger(__name__)

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
# A video job takes from seconds (a tiny test pipeline) to an hour (Wan 14B at 720p).
_VIDEO_SECONDS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


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
        self.preemptions = Counter(
            "nostall_preemptions",
            "Jobs paused at a denoising step for a job of another pipeline.",
            registry=r,
        )
        self.videos: VideoMetrics | None = None  # once the worker serves video jobs

    def watch_videos(self, counts: Callable[[], dict[str, int]]) -> VideoMetrics:
        """Add the video jobs' metrics, their gauges read from ``counts`` at each scrape
        (:meth:`VideoJobs.counts <nostall.serve.video_jobs.VideoJobs.counts>`); a second
        call only points the gauges at the new ``counts``."""
        if self.videos is None:
            self.videos = VideoMetrics(self.registry, counts)
        else:
            self.videos.counts.source = counts
        return self.videos

    def watch_placement(self, status: Callable[[], dict[str, Any]]) -> None:
        """Add what a router places by, read from ``status`` (the worker's
        :meth:`~nostall.serve.worker.Worker.status`) at each scrape: the queue per model,
        the estimated wait, each model's switch price now, each pipeline's tiers."""
        self.registry.register(_Placement(status))

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


class VideoMetrics:
    """A worker's video jobs. The jobs by status and the bytes of the videos kept are read
    from the job store at each scrape, so they count what a previous process left too;
    the counters and histograms count what this process ended since it started.

    >>> r = CollectorRegistry()
    >>> m = VideoMetrics(r, lambda: {"queued": 0, "completed": 1, "bytes": 2048})
    >>> m.completed(seconds=12.5, denoise=10.0, decode_write=2.0, frames=81)
    >>> b'nostall_video_jobs{status="completed"} 1.0' in generate_latest(r)
    True
    """

    def __init__(self, registry: CollectorRegistry, counts: Callable[[], dict[str, int]]):
        r = registry
        self.counts = _VideoCounts(counts)
        r.register(self.counts)
        self.ended = Counter(
            "nostall_video_jobs_ended",
            "Video jobs this process ended, by how: completed, failed or cancelled.",
            ["status"],
            registry=r,
        )
        for status in ("completed", "failed", "cancelled"):
            self.ended.labels(status)  # every series from the start, at 0
        self.job_seconds = Histogram(
            "nostall_video_job_seconds",
            "Time of a completed video job from in_progress to its MP4 in place.",
            buckets=_VIDEO_SECONDS,
            registry=r,
        )
        self.phases = Histogram(
            "nostall_video_phase_seconds",
            "A completed video job's denoising steps (denoise), and its frames decoded, "
            "encoded and renamed into place (decode_write).",
            ["phase"],
            buckets=_VIDEO_SECONDS,
            registry=r,
        )
        self.frames = Counter(
            "nostall_video_frames", "Frames written into completed videos.", registry=r
        )

    def completed(
        self, *, seconds: float | None, denoise: float | None, decode_write: float, frames: int
    ) -> None:
        """Count one completed job (``None``: a time that was not measured)."""
        self.ended.labels("completed").inc()
        if seconds is not None:
            self.job_seconds.observe(seconds)
        if denoise is not None:
            self.phases.labels("denoise").observe(denoise)
        self.phases.labels("decode_write").observe(decode_write)
        self.frames.inc(frames)


class _Placement:
    """``nostall_queue_model{model}``, ``nostall_estimated_wait_seconds``,
    ``nostall_switch_price_seconds{model}`` and ``nostall_pipeline_tier{model,tier}``
    (1 for each tier holding some of the pipeline), read at each scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.status = status

    def describe(self) -> list[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.status()
        except NostallError as e:  # (closed: the worker is shutting down)
            log.debug("placement left out of a scrape: %s", e)
            s = None
        return self._families(s)

    @staticmethod
    def _families(s: dict[str, Any] | None) -> Iterator[Metric]:
        queue = GaugeMetricFamily(
            "nostall_queue_model", "Jobs waiting, per model.", labels=["model"]
        )
        wait = GaugeMetricFamily(
            "nostall_estimated_wait_seconds", "Estimated seconds until every waiting job has run."
        )
        price = GaugeMetricFamily(
            "nostall_switch_price_seconds",
            "Estimated seconds of a switch to each model now (its bytes off the device at "
            "the measured tier rates).",
            labels=["model"],
        )
        tiers = GaugeMetricFamily(
            "nostall_pipeline_tier",
            "1 for each tier holding some of a pipeline's weights (gpu, host, disk).",
            labels=["model", "tier"],
        )
        if s is not None:
            for model, n in s.get("queue_by_model", {}).items():
                queue.add_metric([model], n)
            wait.add_metric([], s.get("estimated_wait_s") or 0.0)
            for model, seconds in s.get("switch_s", {}).items():
                price.add_metric([model], seconds)
            for model, held in s.get("models", {}).items():
                for tier in held:
                    tiers.add_metric([model, tier], 1)
        yield from (queue, wait, price, tiers)


class _VideoCounts:
    """``nostall_video_jobs{status}`` and ``nostall_video_bytes``, read at each scrape
    from ``source`` (its dict: every status and ``bytes``)."""

    def __init__(self, source: Callable[[], dict[str, int]]):
        self.source = source

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        try:
            counts = self.source()
        except NostallError as e:  # (the store closed: the worker is shutting down)
            log.debug("video job counts left out of a scrape: %s", e)
            counts = None
        return self._families(counts)

    @staticmethod
    def _families(counts: dict[str, int] | None = None) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "nostall_video_jobs", "Video jobs kept, by status.", labels=["status"]
        )
        size = GaugeMetricFamily("nostall_video_bytes", "Bytes of the completed videos kept.")
        if counts is not None:
            for status, n in counts.items():
                if status != "bytes":
                    jobs.add_metric([status], n)
            size.add_metric([], counts["bytes"])
        yield jobs
        yield size


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
