"""The generation worker: one thread that owns the GPU work, a bounded queue in front of it.

HTTP handlers (:mod:`nostall.serve.routes`) validate a request, :meth:`Worker.submit` it
and wait on its future; the worker thread takes jobs in the order
:mod:`nostall.serve.schedule` gives (pipelines already on the device first, no job
overtaken or pushed back beyond a bound; like image jobs batched into one call when
asked), switches pipelines through a :class:`~nostall.ModelCache` (while a batch runs,
the next one's pipeline is prefetched on the copy stream), runs the diffusers
pipeline, and records where each request's time went:

``queue``   waiting behind other requests;
``switch``  the cache's switch to the pipeline (``read``, ``copy``, ``build`` inside it,
            and the tier each component came from);
``text``    text encoders; ``denoise`` first to last denoiser call; ``decode`` the VAE
            and post-processing after the last denoiser call (image requests);
``decode``  Wan latents → MP4 through the asynchronous frame pipeline (video requests;
            the pipeline's VAE alone is loaded for them, and kept: ``switch`` is its load).

A full queue refuses at once (:class:`QueueFull`, HTTP 429, with the estimated wait
for room). Stopping is bounded: :meth:`Worker.drain` (what ``nostall serve`` does on
SIGTERM) stops taking jobs at once (readiness 503, new jobs :class:`ShuttingDown`, HTTP
503), runs the queue for most of a grace period, then fails what is still queued
(:class:`ShuttingDown`) and stops the running job at its next denoising step;
:meth:`Worker.shutdown` then closes the cache (never under a job still running). A job
whose client went away before it started is skipped. A failing job fails its own future;
the thread carries on.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nostall.cache import ModelCache, Store
from nostall.cache.config import resolve_config
from nostall.cache.experts import expert_roles
from nostall.cache.partial import least_pipeline_bytes
from nostall.cache.report import human_bytes
from nostall.errors import (  # the job errors live in the one tree; imported here as before
    ArgumentError,
    Cancelled,
    LatentsError,
    NostallError,
    QueueFull,
    ShuttingDown,
)
from nostall.logs import LibraryWarningsOnce
from nostall.serve.bodies import ImageBody, parse
from nostall.serve.budget import DeviceBudget, is_out_of_memory, unfit, video_only
from nostall.serve.config import WorkerConfig
from nostall.serve.jobs import GenerateJob, ImageJob, VideoJob, activation_key
from nostall.serve.lineup import Lineup
from nostall.serve.preempt import Preemption
from nostall.serve.prices import placement
from nostall.serve.requests import (
    Limits,
    RuleBook,
    check_controlnet,
    check_image,
    check_loras,
    check_video,
)
from nostall.serve.results import Result, Settler
from nostall.serve.runner import Runner
from nostall.store.catalog import CONTROLNET_PIPELINES
from nostall.transfer.loader import resolve_device

__all__ = [
    "ImageJob",
    "Limits",
    "QueueFull",
    "ShuttingDown",
    "VideoJob",
    "Worker",
    "WorkerConfig",
]

log = logging.getLogger(__name__)


@dataclass(eq=False)  # identity: the scheduler keys its records by ticket
class _Ticket:
    job: ImageJob | VideoJob
    future: Future
    arrived: float
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """The queue, the thread and the model cache of one serving process.

    ``models``: a :class:`~nostall.cache.Store`, or a folder or mapping whose store this
    process shares (an embedding service in the same process reads the same one).
    ``config``: how it runs (:class:`~nostall.serve.config.WorkerConfig`: its model
    cache's :class:`~nostall.cache.config.CacheConfig`, queue, limits, schedule, ...);
    or give the fields of both as keyword arguments (``device="cpu", gpu_budget=...,
    max_queue=4``), not both. ``schedule``: how the queue may reorder and batch jobs
    (resident pipelines first within a fairness bound; :mod:`nostall.serve.lineup` says
    what a batch shares).

    Device memory: ``budget`` is this process's account of the device
    (:class:`~nostall.serve.budget.DeviceBudget`, shared with an embedding service in
    the same process, which claims its encoders first); without one the worker makes
    its own, sized by ``reserve`` (activation bytes; default: measured peaks) and
    ``external`` (bytes another process declared on this device). The model cache
    takes ``gpu_budget`` bytes of it, or all that is left after ``lora_room`` bytes for
    LoRA base copies (without it, a fused LoRA's base bytes wait in host memory and a
    LoRA switch copies them back over the link). A job that runs out of device
    memory is run once more after the worker frees what it can; a second time it fails
    with :class:`~nostall.errors.DeviceBusy` (HTTP 503), and the worker carries on.

    :meth:`start` refuses (:class:`~nostall.BudgetExceeded`) a store holding a pipeline
    whose job could never fit the device tier, naming it; a pipeline folder that cannot
    be read is left out (``unavailable``: name → why) and the others are served.
    """

    def __init__(
        self,
        models: Any,
        *,
        config: WorkerConfig | None = None,
        budget: DeviceBudget | None = None,
        **options: Any,
    ):
        from nostall.serve.metrics import WorkerMetrics

        if config is None:
            config = WorkerConfig.from_kwargs(**options)
        else:
            resolve_config(WorkerConfig, config, options, "Worker")  # (refuses both)
        self.config = config
        c = config.cache
        store = Store.shared(models, variant=c.variant, cache_dir=c.cache_dir)
        if budget is None:
            index = store.index.path  # the peaks are remembered beside the digest index
            budget = DeviceBudget(
                c.device,
                external=config.external,
                reserve=config.reserve,
                pipelines=store.names(),
                cache_dir=os.path.dirname(index) if index else False,
            )
        elif config.reserve is not None or config.external:
            raise ArgumentError(
                "reserve and external size the budget a worker makes; with budget= given, "
                "set them on that DeviceBudget",
                field="reserve" if config.reserve is not None else "external",
            )
        elif budget.device != resolve_device(c.device):
            raise ArgumentError(
                f"the budget is {budget.device}'s and the worker runs on {c.device}; "
                "give it the budget of its own device",
                field="device",
            )
        self.budget = budget
        gpu_budget = budget.claim_cache(store, c.gpu_budget, config.lora_room)
        reserve = budget.reserve if c.activation_reserve is None else c.activation_reserve
        try:
            self.cache = ModelCache(
                store, config=replace(c, gpu_budget=gpu_budget, activation_reserve=reserve)
            )
        except BaseException:
            budget.release("model cache")
            budget.release("LoRA base copies")
            raise
        self.unavailable: dict[str, str] = {}  # pipelines left out at start, and why
        self._quiet = LibraryWarningsOnce()
        self.device = self.cache.device
        self.limits = config.limits
        self.max_queue = config.max_queue
        self.metrics = WorkerMetrics()
        self.recent: deque[dict[str, Any]] = deque(maxlen=config.recent)
        self._queue: deque[_Ticket] = deque()  # arrival order; self._lineup orders the runs
        self._stop = threading.Event()  # set: the running job stops at its next step
        self.runner = Runner(self.cache, budget, embed_url=config.embed_url, stop=self._stop)
        self._lineup = Lineup(config.schedule, self.cache, self.runner.without)
        self.preemption = Preemption(self)
        self.runner.on_step = self.preemption
        self.metrics.watch_placement(self.status)
        self._cond = threading.Condition()
        self._accepting = False
        self._deadline: float | None = None  # monotonic: when drain or shutdown must end
        self._running: list[_Ticket] = []  # the batch running now
        self._thread: threading.Thread | None = None
        self._closing = False  # shutdown began: the thread closes what is left as it ends
        self._closing_begun = False  # _close ran (or runs): it runs once
        self._closed = threading.Event()  # set once the cache and the rest are closed
        self._started_at = time.time()
        self._served = 0  # jobs executed, in order (only the worker thread counts)
        self._settler = Settler()  # image jobs' PNGs, encoded off the worker thread
        self.videos: Any = None  # the video jobs (VideoJobs), once start() found a pipeline
        self.videos_unavailable: str | None = None  # why not, when they could not open

    # ---- lifecycle ---------------------------------------------------------------

    def start(self) -> Worker:
        """Check the pipelines against the device tier, prepare them, start the thread.
        :class:`~nostall.BudgetExceeded` when a pipeline's job could never fit."""
        if self._thread is not None:
            return self
        names = self._servable()
        self._open_videos(names)
        if self.config.prepare:
            self.cache.prepare()  # the device tier, the host tier's pinning, the copy stream
            for name in names:
                try:
                    self.cache.prepare(name)
                except Exception as e:  # one broken folder must not stop the others serving
                    self._leave_out(name, e)
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="nostall-worker", daemon=True)
        self._thread.start()
        return self

    def _open_videos(self, names: list[str]) -> None:
        """The video jobs (``POST /v1/videos``), when a served pipeline makes videos:
        their index and MP4s in ``config.video_dir`` (default ``<cache>/videos``), jobs
        a previous process left unfinished marked failed."""
        from nostall.serve.video_jobs import VideoJobs
        from nostall.serve.video_requests import generate_rules

        if not any(generate_rules(self.cache.store.entry(n)) for n in names):
            return
        folder = self.config.video_dir
        if folder is None:
            from nostall.store.digest_index import default_cache_dir

            folder = os.path.join(default_cache_dir(), "videos")
        try:
            self.videos = VideoJobs(self, os.fspath(folder), max_bytes=self.config.video_max_bytes)
        except NostallError as e:  # (a folder another worker holds): images still serve
            self.videos_unavailable = str(e)
            log.warning("video jobs are not served: %s", e)

    def drain(self, grace: float, on_done: Callable[[], None] | None = None) -> None:
        """Stop within ``grace`` seconds, losing nothing that can finish: take no more
        jobs from now on (:attr:`ready` is false, :meth:`submit` raises
        :class:`ShuttingDown`), run the queued ones until ``grace`` less a margin (a
        quarter of it, at most 5 s), then fail those still queued with
        :class:`ShuttingDown` and stop the running one at its next denoising step.
        ``on_done`` is called (from a thread of the worker's) once nothing runs, and at
        the latest half the margin before ``grace`` is up, leaving the caller that much
        to stop its server. Returns at once; a second call does nothing."""
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
            raise ArgumentError(f"grace={grace!r}: give seconds > 0")
        with self._cond:
            if self._deadline is not None:
                return
            self._accepting = False
            self._deadline = time.monotonic() + grace
            self._cond.notify_all()
        margin = min(5.0, grace / 4)

        def wait() -> None:
            with self._cond:
                idle = self._cond.wait_for(self._idle, timeout=grace - margin)
            if not idle:
                self._cut(f"the worker is shutting down and its {grace:g} s grace period ended")
                with self._cond:
                    self._cond.wait_for(self._idle, timeout=self._left() - margin / 2)
            if on_done is not None:
                on_done()

        log.info("draining: %d queued, %d running; %g s at most", *self._load(), grace)
        threading.Thread(target=wait, name="nostall-drain", daemon=True).start()

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` or :meth:`shutdown` began."""
        return self._deadline is not None

    def _load(self) -> tuple[int, int]:
        with self._cond:
            return len(self._queue), len(self._running)

    def _idle(self) -> bool:
        return not self._queue and not self._running

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic()) if self._deadline else 0.0

    def _cut(self, why: str, *, stop: bool = True) -> None:
        """Fail the queued jobs with ``why``; with ``stop``, stop the running one at its
        next step."""
        with self._cond:
            self._accepting = False
            waiting = list(self._queue)
            self._queue.clear()
            self.metrics.queue_depth.set(0)
            if stop:
                self._stop.set()
            self._cond.notify_all()
        for t in waiting:
            if t.future.set_running_or_notify_cancel():
                t.future.set_exception(ShuttingDown(f"{why}; retry elsewhere"))

    def shutdown(self, timeout: float = 300.0) -> None:
        """Take no more jobs, fail the queued ones, let the running one finish (within
        ``timeout``, or what is left of a :meth:`drain`'s grace: then it is stopped at its
        next step), then close the cache, the embedding client and the PNG encoder and
        give back the device budget's claims. A job still running after that (one that
        reaches no denoising step) keeps them open under it, since closing the cache
        would pull its weights away: the worker's thread closes them as that job ends.
        Returns without waiting for it; the process may exit meanwhile."""
        with self._cond:
            if self._deadline is None:
                self._deadline = time.monotonic() + timeout
            timeout = self._left()
            self._closing = True  # from here, the thread's end closes what is left
        self._cut("the worker is shutting down", stop=False)
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._stop.set()  # its next step ends it
                thread.join(min(5.0, max(1.0, timeout / 10)))
            if thread.is_alive():
                log.warning(
                    "the running job did not stop within %.1f s of shutdown; the model "
                    "cache stays open under it and closes when it ends",
                    timeout,
                )
                return
        self._close()

    def _close(self) -> None:
        """Close what the worker owns and give back its claims, once (called by
        :meth:`shutdown`, or by the worker's thread as its last job ends after one)."""
        with self._cond:
            if self._closing_begun:
                return
            self._closing_begun = True
        self._settler.close()
        self.cache.close()
        self.budget.release("model cache")
        self.budget.release("LoRA base copies")
        self._quiet.remove()
        self.runner.close()  # (waits for the videos being written)
        if self.videos is not None:
            self.videos.close()
        self._closed.set()

    @property
    def closed(self) -> bool:
        """Whether the worker closed its cache and gave back its budget (after
        :meth:`shutdown`, or after the job it left running ended)."""
        return self._closed.is_set()

    def _servable(self) -> list[str]:
        """The pipelines to serve: a folder that cannot be read is left out; a job that
        could never fit the device tier stops the start (:func:`~nostall.serve.budget.unfit`)."""
        names, jobs = [], []
        for name in self.cache.names():
            try:
                entry = self.cache.store.entry(name)
                jobs.append((entry, self._job_leaves_out(entry)))
            except (NostallError, OSError, ValueError) as e:
                self._leave_out(name, e)
                continue
            names.append(name)
        least = None
        if self.cache.config.stream:

            def least(entry: Any, leaves_out: frozenset[str]) -> int | None:
                experts = expert_roles(entry, leaves_out)
                return least_pipeline_bytes(self.cache, entry.name, leaves_out, experts=experts)

        error = unfit(
            jobs, self.cache.stats().gpu_budget, self.cache.dtype, self.budget, least=least
        )
        if error is not None:
            raise error
        return names

    def _job_leaves_out(self, entry: Any) -> tuple[str, ...]:
        """The weights components a job of ``entry`` runs without."""
        if video_only(entry):  # its generation jobs: every component (decode: the VAE)
            return ()
        return self.runner.remote_roles(entry.name)

    def _leave_out(self, name: str, e: BaseException) -> None:
        self.unavailable[name] = f"{type(e).__name__}: {e}"
        log.warning("pipeline %s is left out: %s", name, self.unavailable[name])

    @property
    def ready(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def names(self) -> list[str]:
        return self.cache.names()

    # ---- submitting ----------------------------------------------------------------

    def submit(self, job: ImageJob | VideoJob) -> tuple[Future, threading.Event]:
        """Queue ``job``; returns its future and an event to set if the client leaves.
        :class:`QueueFull` / :class:`ShuttingDown` at once when it cannot be queued."""
        self.cache.store.entry(job.model)  # UnknownModel now, naming what exists
        ticket = _Ticket(job, Future(), time.perf_counter())
        with self._cond:
            if not self._accepting:
                why = "shutting down" if self._deadline is not None else "starting"
                raise ShuttingDown(f"the worker is not taking jobs ({why}); retry elsewhere")
            if len(self._queue) >= self.max_queue:
                self.metrics.rejected.inc()
                wait = self._lineup.retry_after()
                raise QueueFull(
                    f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}); "
                    f"retry in about {wait:.1f} s",
                    retry_after=wait,
                )
            late = self._lineup.admit(
                ticket, preempts=self.config.preempt and self.preemption.allowed(ticket)
            )
            if late is not None:
                # Its own SLO cannot be met behind what is queued: say so now, not late.
                self.metrics.rejected.inc()
                raise QueueFull(
                    f"this request would finish about {late:.1f} s after its slo_ms "
                    f"({ticket.job.slo_s * 1e3:.0f} ms) behind the {len(self._queue)} waiting; "
                    f"retry in about {late:.1f} s, or ask for a longer slo_ms",
                    retry_after=late,
                )
            self._queue.append(ticket)
            self._lineup.add(ticket)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify_all()
            running = self._lineup.running
        if running is not None:
            # it arrived while a batch runs: the next batch's pipeline moves in meanwhile
            self._prefetch_next(running)
        return ticket.future, ticket.cancelled

    @functools.cached_property
    def rules(self) -> RuleBook:
        """What each pipeline accepts (:mod:`nostall.serve.requests`), read from its configs."""
        return RuleBook(self.cache.store, self.limits)

    def _serving(self, kind: str) -> list[str]:
        names = [n for n in self.names() if n not in getattr(self, "unavailable", {})]
        return self.rules.serving(kind, names)

    def image_job(self, body: ImageBody | Mapping[str, Any]) -> ImageJob:
        """An :class:`ImageJob` from an images/generations body (an
        :class:`~nostall.serve.bodies.ImageBody`, or the parsed JSON, whose fields and
        types are checked here), held to its pipeline before it is queued
        (:func:`~nostall.serve.requests.check_image`): :class:`~nostall.ArgumentError`
        naming the field and what it allows, :class:`~nostall.UnknownModel` for a model
        the store lacks."""
        body = parse(ImageBody, body)
        model = body.model
        try:
            fields = check_image(body, self.rules.image(model), self.limits)
        except ArgumentError as e:
            if e.field == "model":
                e.allowed = self._serving("image")
            raise
        loras = check_loras(body.loras, self.cache.loras(), self.limits)
        control = None
        if body.controlnet is not None:
            if self.cache.store.entry(model).class_name not in CONTROLNET_PIPELINES:
                raise ArgumentError(
                    f"controlnet: {model!r} takes no ControlNet here", field="controlnet"
                )
            size = (fields["width"], fields["height"])
            control = check_controlnet(body.controlnet, self.cache.controlnets(), size, self.limits)
        slo = _slo_seconds(body.slo_ms)
        return ImageJob(model=model, **fields, loras=loras, controlnet=control, slo_s=slo)

    def video_job(
        self,
        model: str,
        latents: torch.Tensor,
        *,
        fps: float = 16.0,
        mode: str = "eager",
        denormalize: bool = False,
    ) -> VideoJob:
        """A :class:`VideoJob` decoding ``latents`` (B, C, T, h, w) with ``model``'s VAE,
        checked before it is queued (:func:`~nostall.serve.requests.check_video`: a Wan
        VAE, one video of the VAE's channels, finite, within the frame and pixel caps):
        :class:`~nostall.ArgumentError` naming the field and what it allows."""
        try:
            check_video(latents, self.rules.video(model), self.limits, fps=fps, mode=mode)
        except ArgumentError as e:
            if e.field == "model":
                e.allowed = self._serving("video")
            raise
        return VideoJob(model, latents, float(fps), mode, bool(denormalize))

    # ---- the thread ------------------------------------------------------------------

    def _next(self) -> list[_Ticket]:
        """The next batch (empty once the worker takes no jobs and none are left)."""
        while True:
            with self._cond:
                while not self._queue and self._accepting:
                    self._cond.wait()
                if not self._queue:
                    return []
                wanted = self._lineup.wanted()
            resident = self._lineup.resident(wanted)  # asks the cache: not under our lock
            prices = self._lineup.priced(wanted)
            with self._cond:
                batch = self._lineup.take(self._queue, resident, prices)
                self.metrics.queue_depth.set(len(self._queue))
                self._running = batch
                if batch:  # (else every client left, or a shutdown took the queue)
                    return batch

    def _run(self) -> None:
        while True:
            batch = self._next()
            if not batch:
                with self._cond:
                    closing = self._closing
                if closing:  # a shutdown that could not wait for this thread's last job
                    self._close()
                return
            began, results = time.perf_counter(), []
            try:
                if self._stop.is_set():  # taken just before a drain's cut: not begun
                    for t in batch:
                        if t.future.set_running_or_notify_cancel():
                            t.future.set_exception(ShuttingDown("the worker is shutting down"))
                    batch = []
                live = [t for t in batch if _begin(t)]
                if live:
                    self._prefetch_next(self._lineup.running)
                    if len(live) == 1:
                        results = [self._finish(live[0])]
                    else:
                        results = self._execute_batch(live)
            finally:
                with self._cond:
                    self._lineup.done(time.perf_counter() - began, [r for r in results if r])
                    self._running = []
                    self._cond.notify_all()  # drain() waits for the worker to be idle

    def _finish(self, t: _Ticket) -> Result | None:
        """Run one job and settle its future: its result, or ``None`` if it failed."""
        try:
            result = self._execute(t)
        except BaseException as e:  # the thread carries on; the job fails
            if isinstance(e, (ValueError, LatentsError)):  # the request's fault: a 4xx
                log.info("job for %s refused: %s", t.job.model, e)
            elif isinstance(e, (ShuttingDown, Cancelled)):
                log.info("job for %s stopped: %s", t.job.model, e)
            else:
                log.exception("job for %s failed", t.job.model)
            # Its frames (the pipeline's, mid-call) hold the device tier's weights and the
            # activations: a future kept past shutdown kept 1.1 GB of device memory (H200).
            t.future.set_exception(_without_frames(e))
            return None
        self._settler.settle(t.future, result)
        return result

    def _prefetch_next(self, current: str | None) -> None:
        """Move in the pipeline the next batch would switch to, while this one runs."""
        if not self.config.prefetch:
            return
        with self._cond:
            wanted = self._lineup.wanted()
        resident = self._lineup.resident(wanted) | {current}
        with self._cond:
            nxt = self._lineup.predict(resident)
        if nxt is not None:
            try:
                fut = self.cache.prefetch(nxt[0], without=nxt[1])
            except NostallError as e:  # (closed at shutdown): the job says it when it runs
                log.info("prefetch of %s did not start: %s", nxt[0], e)
            else:
                fut.add_done_callback(_log_prefetch_failure)

    def _execute_batch(self, batch: list[_Ticket]) -> list[Result | None]:
        """Like image jobs as one pipeline call (:mod:`nostall.serve.lineup`), each its
        own image. If the call fails, each job runs alone: its own error, or its own
        out-of-memory retry (and after running out of memory, that shape runs alone)."""
        start = time.perf_counter()
        self._quiet.install()
        jobs = [t.job for t in batch]
        first = jobs[0]
        try:
            with self.budget.measure(first.model, f"{first.width}x{first.height} b{len(jobs)}"):
                results = self.runner.images(jobs, start)
        except Exception as e:
            if is_out_of_memory(e):
                with self._cond:
                    self._lineup.alone()
            log.warning(
                "a batch of %d %s jobs failed (%s: %s); running them one by one",
                len(jobs),
                first.model,
                type(e).__name__,
                e,
            )
            results = None
        if results is None:
            # Outside the handler: its traceback's frames held the failed batch's tensors,
            # which the single runs (and their out-of-memory retry) need freed.
            return [self._finish(t) for t in batch]
        for t, result in zip(batch, results, strict=True):
            self._settler.settle(t.future, self._account(t, result, start))
        return results

    def _execute(self, t: _Ticket) -> Result:
        start = time.perf_counter()
        self._quiet.install()  # (again each job: it reaches handlers added since)
        return self._account(t, self.runner.attempt(t.job, start), start)

    def _account(self, t: _Ticket, result: Result, start: float) -> Result:
        """Book a finished job (begun at ``start``): its order, phases, metrics, log line."""
        queue_s = start - t.arrived
        self._served += 1
        result.info["order"] = self._served
        result.phases = {"queue": queue_s, **result.phases}
        result.phases["total"] = time.perf_counter() - t.arrived
        by = self.preemption.take(t.job)
        if by:
            result.info["preempted_by"] = by
        for phase, s in result.phases.items():
            if phase != "total":
                self.metrics.phases.labels(phase).observe(s)
        for c in result.switch.get("components", []):
            self.metrics.switch_tier.labels(c["tier"]).inc()
        stats = self.cache.stats()
        self.metrics.tier_bytes.labels("gpu").set(stats.gpu_bytes)
        self.metrics.tier_bytes.labels("host").set(stats.host_bytes)
        self.recent.appendleft(
            {
                "at": time.strftime("%H:%M:%S"),
                "kind": _kind(t.job),
                "model": t.job.model,
                "phases": {k: round(v, 4) for k, v in result.phases.items()},
                "tiers": sorted({c["tier"] for c in result.switch.get("components", [])}),
            }
        )
        log.info("%s", _job_line(t.job, result))
        return result

    # ---- what the status page shows ----------------------------------------------------

    def status(self) -> dict[str, Any]:
        stats = self.cache.stats()
        with self._cond:
            waiting = [t.job.model for t in self._queue]
            running = self._running[0].job.model if self._running else None
            batch = len(self._running)
            wait = self._lineup.wait_s()
        # What a router needs to place a request: each model's switch price now (its
        # bytes off the device at the measured tier rates) and the queue's estimated wait.
        switch: dict[str, float] = {}
        for name in self.names():
            try:
                host, disk = placement(self.cache, name, where=stats.components)
            except NostallError:
                continue
            switch[name] = self._lineup.prices.seconds(host=host, disk=disk)
        resident: dict[str, set[str]] = {}
        for comp in stats.components.values():
            for p in comp["pipelines"]:
                # text encoders the embedding service stands in for are not part of what
                # an image job of p waits for (the fleet routes by these tiers)
                if not set(comp["roles"]) <= set(self.runner.remote_roles(p)):
                    resident.setdefault(p, set()).add(comp["tier"])
        return {
            "device": stats.device,
            "ready": self.ready,
            "draining": self.draining,
            "uptime_s": time.time() - self._started_at,
            "gpu": {"budget": stats.gpu_budget, "bytes": stats.gpu_bytes},
            "host": {"budget": stats.host_budget, "bytes": stats.host_bytes},
            "models": {
                name: sorted(resident.get(name, {"disk"}), key=["gpu", "host", "disk"].index)
                for name in self.names()
            },
            "running": running,
            "running_batch": batch,
            "queue": waiting,
            "queue_by_model": dict(Counter(waiting)),
            "preemptions": self.preemption.count,
            "estimated_wait_s": wait,
            "switch_s": switch,
            "tier_rates_gbps": {k: v / 1e9 for k, v in self._lineup.prices.rates.items()},
            "recent": list(self.recent),
            "budget": self.budget.status(),
            "unavailable": dict(self.unavailable),
            # video jobs by status and their videos' bytes (None: this worker makes none)
            "videos": None if self.videos is None else self.videos.counts(),
        }


def _job_line(job: ImageJob | VideoJob, result: Result) -> str:
    """One log line per job: what its switch moved and from where, and every phase."""
    comps = result.switch.get("components", [])
    tiers = ", ".join(f"{c['role']}={c['tier']}" for c in comps) or "nothing switched"
    moved = human_bytes(result.switch.get("moved_bytes", 0))
    phases = ", ".join(f"{k} {v:.3f}" for k, v in result.phases.items())
    _, shape = activation_key(job)
    return f"{job.model} {shape}: switch moved {moved} ({tiers}); {phases} s"


def _kind(job: Any) -> str:
    if isinstance(job, GenerateJob):
        return "video"
    return "decode" if isinstance(job, VideoJob) else "image"


def _begin(t: _Ticket) -> bool:
    """Mark ``t`` running; ``False`` (its future failed) if its client left first."""
    if t.cancelled.is_set() or not t.future.set_running_or_notify_cancel():
        if not t.future.done():
            t.future.set_exception(Cancelled("the client went away"))
        return False
    return True


def _log_prefetch_failure(fut: Future) -> None:
    e = fut.exception()
    if e is not None:
        log.info("prefetch did not run: %s", e)


def _without_frames(e: BaseException) -> BaseException:
    """``e`` and the exceptions it chains, their tracebacks dropped (logged already)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


_SLO_MAX_MS = 86_400_000.0  # a day


def _slo_seconds(slo_ms: float | None) -> float | None:
    """A request's ``slo_ms`` as seconds, checked: ``ArgumentError`` naming the field."""
    if slo_ms is None:
        return None
    if not (math.isfinite(slo_ms) and 0 < slo_ms <= _SLO_MAX_MS):
        raise ArgumentError(
            f"slo_ms: {slo_ms!r} is not a time to answer within; give milliseconds in "
            f"(0, {_SLO_MAX_MS:.0f}]",
            field="slo_ms",
            allowed=f"(0, {_SLO_MAX_MS:.0f}] ms",
        )
    return slo_ms / 1e3
