"""The generation worker: one thread that owns the GPU work, a bounded queue in front of it.

HTTP handlers (:mod:`nostall.serve.app`) validate a request, :meth:`Worker.submit` it
and wait on its future; the worker thread takes jobs in arrival order, switches
pipelines through a :class:`~nostall.ModelCache` (while a job runs, the next queued
job's pipeline is prefetched on the copy stream), runs the diffusers pipeline, and
records where each request's time went:

``queue``   waiting behind other requests;
``switch``  the cache's switch to the pipeline (``read``, ``copy``, ``build`` inside it,
            and the tier each component came from);
``text``    text encoders; ``denoise`` first to last denoiser call; ``decode`` the VAE
            and post-processing after the last denoiser call (image requests);
``decode``  Wan latents → MP4 through the asynchronous frame pipeline (video requests;
            the pipeline's VAE alone is loaded for them, and kept: ``switch`` is its load).

A full queue refuses at once (:class:`QueueFull`, HTTP 429); a shutdown stops taking
jobs, fails the queued ones (:class:`ShuttingDown`, HTTP 503), lets the running one
finish, and closes the cache. A job whose client went away before it started is
skipped. A failing job fails its own future; the thread carries on.
"""

from __future__ import annotations

import io
import logging
import os
import random
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.cache import ModelCache
from nostall.errors import (  # the job errors live in the one tree; imported here as before
    ArgumentError,
    Cancelled,
    NostallError,
    QueueFull,
    ShuttingDown,
)

__all__ = [
    "ImageJob",
    "Limits",
    "QueueFull",
    "ShuttingDown",
    "VideoJob",
    "Worker",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What a request may ask for (beyond these: HTTP 422 naming the field)."""

    min_side: int = 16
    max_side: int = 2048
    max_steps: int = 150
    max_prompt_chars: int = 4000
    max_guidance: float = 50.0
    max_latent_bytes: int = 512 << 20


@dataclass
class ImageJob:
    model: str
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    guidance: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None


@dataclass
class VideoJob:
    model: str
    latents: torch.Tensor
    fps: float = 16.0
    mode: str = "eager"
    denormalize: bool = False


@dataclass
class Result:
    """What a job produced: ``body`` (PNG or MP4 bytes), its phases and the switch."""

    body: bytes
    media_type: str
    phases: dict[str, float]
    switch: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Ticket:
    job: ImageJob | VideoJob
    future: Future
    arrived: float
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """The queue, the thread and the model cache of one serving process.

    ``models``, ``device``, budgets and ``dtype`` are the :class:`~nostall.ModelCache`'s:
    ``models`` a :class:`~nostall.cache.Store`, or a folder or mapping whose store this
    process shares (an embedding service in the same process reads the same one).
    ``max_queue``: jobs allowed to wait (the running one not counted). ``prepare``: at
    :meth:`start`, do the first switch's one-time work for every pipeline
    (:meth:`ModelCache.prepare`). ``prefetch``: move the next queued job's pipeline
    while the current one runs.
    """

    def __init__(
        self,
        models: Any,
        *,
        device: str | torch.device = "cuda",
        gpu_budget: int | None = None,
        host_budget: int | None = None,
        dtype: torch.dtype | None = None,
        max_queue: int = 16,
        limits: Limits | None = None,
        prepare: bool = True,
        prefetch: bool = True,
        recent: int = 50,
        embed_url: str | None = None,
    ):
        from nostall.serve.metrics import WorkerMetrics

        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ArgumentError(f"max_queue={max_queue!r} must be a positive number of jobs")
        self.cache = ModelCache(
            models, device=device, gpu_budget=gpu_budget, host_budget=host_budget, dtype=dtype
        )
        self.device = self.cache.device
        self.limits = limits or Limits()
        self.max_queue = max_queue
        self.metrics = WorkerMetrics()
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self._prepare = prepare
        self._prefetch = prefetch
        self._queue: deque[_Ticket] = deque()
        self._cond = threading.Condition()
        self._accepting = False
        self._running: _Ticket | None = None
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self._served = 0  # jobs executed, in order (only the worker thread counts)
        # The embedding service, when configured: FLUX, SDXL and SD3 prompts are encoded
        # there (nostall.serve.prompts), the requests start before the switch and run
        # beside it.
        self._embed = None
        self._embed_pool = None
        self._embed_down_said = False
        if embed_url:
            from concurrent.futures import ThreadPoolExecutor

            from nostall.serve.client import EmbeddingClient

            self._embed = EmbeddingClient(embed_url)
            self._embed_pool = ThreadPoolExecutor(1, thread_name_prefix="nostall-embed-client")

    # ---- lifecycle ---------------------------------------------------------------

    def start(self) -> Worker:
        if self._thread is not None:
            return self
        if self._prepare:
            self.cache.prepare(*self.cache.names())
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="nostall-worker", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 300.0) -> None:
        """Take no more jobs, fail the queued ones, let the running one finish, close."""
        with self._cond:
            self._accepting = False
            waiting = list(self._queue)
            self._queue.clear()
            self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        for t in waiting:
            if t.future.set_running_or_notify_cancel():
                t.future.set_exception(ShuttingDown("the worker is shutting down; retry elsewhere"))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the running job did not finish within %.0f s of shutdown", timeout)
            self._thread = None
        self.cache.close()
        if self._embed_pool is not None:
            self._embed_pool.shutdown(wait=True)
            self._embed.close()

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
                raise ShuttingDown("the worker is not taking jobs (starting or shutting down)")
            if len(self._queue) >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(
                    f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}); "
                    "retry later"
                )
            self._queue.append(ticket)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify_all()
            running = self._running.job.model if self._running is not None else None
            first_waiting = len(self._queue) == 1
        if running is not None and first_waiting:
            # it arrived while another job runs: move its pipeline in meanwhile
            self._prefetch_next(running)
        return ticket.future, ticket.cancelled

    def image_job(self, body: dict[str, Any]) -> ImageJob:
        """An :class:`ImageJob` from an images/generations body (already JSON-parsed and
        schema-checked); :class:`~nostall.ArgumentError` naming the field otherwise."""
        lim = self.limits
        size = str(body.get("size") or "1024x1024")
        try:
            w, h = (int(v) for v in size.lower().split("x"))
        except ValueError:
            raise ArgumentError(f"size={size!r}: give WIDTHxHEIGHT, e.g. '1024x1024'") from None
        for name, v in (("width", w), ("height", h)):
            if not lim.min_side <= v <= lim.max_side or v % 8:
                raise ArgumentError(
                    f"size={size!r}: {name} {v} must be a multiple of 8 in "
                    f"[{lim.min_side}, {lim.max_side}]"
                )
        steps = body.get("steps", 28)
        if not 1 <= steps <= lim.max_steps:
            raise ArgumentError(f"steps={steps}: must be in [1, {lim.max_steps}]")
        prompt = body["prompt"]
        if not prompt.strip() or len(prompt) > lim.max_prompt_chars:
            raise ArgumentError(
                f"prompt of {len(prompt)} characters: give 1 to {lim.max_prompt_chars}"
            )
        guidance = body.get("guidance")
        if guidance is not None and not 0.0 <= guidance <= lim.max_guidance:
            raise ArgumentError(f"guidance={guidance}: must be in [0, {lim.max_guidance}]")
        seed = body.get("seed")
        if seed is None:
            seed = random.randrange(2**31)
        elif not 0 <= seed < 2**63:
            raise ArgumentError(f"seed={seed}: must be in [0, 2**63)")
        return ImageJob(
            model=body["model"],
            prompt=prompt,
            width=w,
            height=h,
            steps=steps,
            seed=seed,
            guidance=guidance,
            negative_prompt=body.get("negative_prompt"),
            max_sequence_length=body.get("max_sequence_length"),
        )

    # ---- the thread ------------------------------------------------------------------

    def _next(self) -> _Ticket | None:
        with self._cond:
            while not self._queue and self._accepting:
                self._cond.wait()
            if not self._queue:
                return None
            t = self._queue.popleft()
            self.metrics.queue_depth.set(len(self._queue))
            self._running = t
            return t

    def _run(self) -> None:
        while True:
            t = self._next()
            if t is None:
                return
            try:
                if t.cancelled.is_set() or not t.future.set_running_or_notify_cancel():
                    if not t.future.done():
                        t.future.set_exception(Cancelled("the client went away"))
                    continue
                self._prefetch_next(t.job.model)
                try:
                    result = self._execute(t)
                except BaseException as e:  # the thread carries on; the job fails
                    log.exception("job for %s failed", t.job.model)
                    t.future.set_exception(e)
                else:
                    t.future.set_result(result)
            finally:
                with self._cond:
                    self._running = None

    def _prefetch_next(self, current: str) -> None:
        if not self._prefetch:
            return
        with self._cond:
            nxt = next((q.job for q in self._queue if not q.cancelled.is_set()), None)
        if nxt is not None and nxt.model != current:
            try:
                without = self._without(nxt)
            except ArgumentError:
                return  # that job fails when it runs
            fut = self.cache.prefetch(nxt.model, without=without)
            fut.add_done_callback(_log_prefetch_failure)

    def _execute(self, t: _Ticket) -> Result:
        start = time.perf_counter()
        queue_s = start - t.arrived
        if isinstance(t.job, VideoJob):
            result = self._video(t.job, start)
        else:
            result = self._image(t.job, start)
        self._served += 1
        result.info["order"] = self._served
        result.phases = {"queue": queue_s, **result.phases}
        result.phases["total"] = time.perf_counter() - t.arrived
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
                "kind": "video" if isinstance(t.job, VideoJob) else "image",
                "model": t.job.model,
                "phases": {k: round(v, 4) for k, v in result.phases.items()},
                "tiers": sorted({c["tier"] for c in result.switch.get("components", [])}),
            }
        )
        return result

    def _switch_report(self, name: str) -> dict[str, Any]:
        for r in reversed(self.cache.reports):
            if r.pipeline == name and not r.prefetch:
                return r.as_dict()
        return {}

    def _remote_roles(self, model: str) -> tuple[str, ...]:
        """The text encoders ``model`` leaves to the embedding service (none without one,
        or for a pipeline the service cannot encode for)."""
        from nostall.serve.prompts import REMOTE_PIPELINES

        if self._embed is None:
            return ()
        entry = self.cache.store.entry(model)
        needed = REMOTE_PIPELINES.get(entry.class_name, ())
        if not needed or any(entry.components.get(r) is None for r in needed):
            return ()
        return needed

    def _remote_embeds(self, job: ImageJob) -> tuple[dict[str, torch.Tensor], float]:
        """The job's prompt embeddings from the embedding service and the seconds they
        took."""
        from nostall.serve.prompts import remote_prompt_embeds

        t = time.perf_counter()
        entry = self.cache.store.entry(job.model)
        embeds = remote_prompt_embeds(
            lambda enc, text, n, layer: self._embed.encode(enc, [text], n, layer),
            job.model,
            entry.class_name,
            {role for role, c in entry.components.items() if c is not None},
            job.prompt,
            job.negative_prompt,
            job.max_sequence_length,
            zeros_for_empty_negative=bool(entry.config.get("force_zeros_for_empty_prompt", True)),
        )
        return embeds, time.perf_counter() - t

    def _image(self, job: ImageJob, start: float) -> Result:
        # With the embedding service, the pipeline is switched in without its text
        # encoders (their bytes stay where they are) while the service encodes the
        # prompt; if the service fails, the encoders are switched in and encode locally.
        roles = self._without(job)
        remote = self._embed_pool.submit(self._remote_embeds, job) if roles else None
        embeds, text_wait, service_s = None, 0.0, 0.0
        with self.cache.use(job.model, without=roles) as pipe:
            switched = time.perf_counter()
            report = self._switch_report(job.model)
            if remote is not None:
                try:
                    embeds, service_s = remote.result()
                except NostallError as e:
                    if not self._embed_down_said:
                        self._embed_down_said = True
                        log.warning("embedding service unusable (%s); encoding locally", e)
                text_wait = time.perf_counter() - switched
            if embeds is not None or not roles:
                image, clock, done = self._generate(pipe, job, embeds)
        if roles and embeds is None:  # the service failed: the whole pipeline, locally
            with self.cache.use(job.model) as pipe:
                switched = time.perf_counter()
                report = self._switch_report(job.model)
                image, clock, done = self._generate(pipe, job, None)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        phases = {"switch": switched - start, **_switch_phases(report), **clock.phases(done)}
        if embeds is not None:  # the text phase is the wait for the service after the switch
            phases["text"] = text_wait
            phases["text_service"] = service_s
        return Result(
            buf.getvalue(), "image/png", phases, report, {"seed": job.seed, "size": image.size}
        )

    def _generate(self, pipe: Any, job: ImageJob, embeds: dict[str, torch.Tensor] | None):
        """Run ``pipe`` for ``job`` (with ``embeds`` in place of the prompts, if given):
        the image, the phase clock, and when it finished."""
        from nostall.serve.prompts import apply

        clock = _PhaseClock(pipe, self.device)
        try:
            kwargs = image_kwargs(pipe, job, self.device)
            if embeds is not None:
                apply(kwargs, embeds, pipe, self.device)
            with torch.inference_mode():
                image = pipe(**kwargs).images[0]
            _sync(self.device)
            return image, clock, time.perf_counter()
        finally:
            clock.remove()

    def _without(self, job: ImageJob | VideoJob) -> tuple[str, ...]:
        """The weights components ``job`` does not need switched in: for a decode,
        everything but the VAE; for an image, the text encoders the embedding service
        stands in for."""
        if isinstance(job, VideoJob):
            entry = self.cache.store.entry(job.model)
            if entry.components.get("vae") is None:
                raise ArgumentError(f"pipeline {job.model!r} has no vae to decode latents with")
            return tuple(c.role for c in entry.weights if c.role != "vae")
        return self._remote_roles(job.model)

    def _video(self, job: VideoJob, start: float) -> Result:
        from nostall.video import decode_to_file, denormalize

        fd, path = tempfile.mkstemp(suffix=".mp4", prefix="nostall-decode-")
        os.close(fd)
        os.remove(path)  # decode_to_file writes a temporary name and renames into it
        # the pipeline's VAE alone, through the cache (its tiers and budget): a decode
        # needs neither the transformer nor the text encoders
        with self.cache.use(job.model, without=self._without(job)) as pipe:
            switched = time.perf_counter()
            report = self._switch_report(job.model)
            vae = pipe.vae
            z = job.latents.to(self.device, next(vae.parameters()).dtype)
            if job.denormalize:
                z = denormalize(vae, z)
            try:
                t = time.perf_counter()
                with torch.inference_mode():
                    out = decode_to_file(vae, z, path, fps=job.fps, mode=job.mode)
                decode_s = time.perf_counter() - t
                with open(path, "rb") as f:
                    body = f.read()
            finally:
                if os.path.exists(path):
                    os.remove(path)
        phases = {"switch": switched - start, **_switch_phases(report), "decode": decode_s}
        return Result(body, "video/mp4", phases, report, {"frames": out.frames})

    # ---- what the status page shows ----------------------------------------------------

    def status(self) -> dict[str, Any]:
        stats = self.cache.stats()
        with self._cond:
            waiting = [t.job.model for t in self._queue]
            running = self._running.job.model if self._running else None
        resident: dict[str, set[str]] = {}
        for comp in stats.components.values():
            for p in comp["pipelines"]:
                # text encoders the embedding service stands in for are not part of what
                # an image job of p waits for (the fleet routes by these tiers)
                if not set(comp["roles"]) <= set(self._remote_roles(p)):
                    resident.setdefault(p, set()).add(comp["tier"])
        return {
            "device": stats.device,
            "ready": self.ready,
            "uptime_s": time.time() - self._started_at,
            "gpu": {"budget": stats.gpu_budget, "bytes": stats.gpu_bytes},
            "host": {"budget": stats.host_budget, "bytes": stats.host_bytes},
            "models": {
                name: sorted(resident.get(name, {"disk"}), key=["gpu", "host", "disk"].index)
                for name in self.names()
            },
            "running": running,
            "queue": waiting,
            "recent": list(self.recent),
        }


def image_kwargs(pipe: Any, job: ImageJob, device: torch.device) -> dict[str, Any]:
    """The pipeline call for ``job``: diffusers' own arguments, a generator seeded on the
    pipeline's device as a user would seed it, PIL output."""
    import inspect

    params: Any = {}
    for cls in type(pipe).__mro__:  # the pipeline's own __call__ (the cache wraps it)
        call = cls.__dict__.get("__call__")
        if call is not None:
            params = inspect.signature(call).parameters
            if "prompt" in params:
                break
    kwargs: dict[str, Any] = {
        "prompt": job.prompt,
        "height": job.height,
        "width": job.width,
        "num_inference_steps": job.steps,
        "generator": torch.Generator(device=device.type).manual_seed(job.seed),
        "output_type": "pil",
    }
    if job.guidance is not None:
        kwargs["guidance_scale"] = job.guidance
    if job.negative_prompt is not None:
        if "negative_prompt" not in params:
            raise ArgumentError(f"{type(pipe).__name__} takes no negative_prompt")
        kwargs["negative_prompt"] = job.negative_prompt
    if job.max_sequence_length is not None:
        if "max_sequence_length" not in params:
            raise ArgumentError(f"{type(pipe).__name__} takes no max_sequence_length")
        kwargs["max_sequence_length"] = job.max_sequence_length
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return kwargs


def _switch_phases(report: dict[str, Any]) -> dict[str, float]:
    comps = report.get("components", [])
    return {
        "read": sum(c.get("read_s", 0.0) for c in comps),
        "copy": sum(c.get("copy_s", 0.0) for c in comps),
        "build": sum(c.get("build_s", 0.0) for c in comps),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log_prefetch_failure(fut: Future) -> None:
    e = fut.exception()
    if e is not None:
        log.info("prefetch did not run: %s", e)


class _PhaseClock:
    """Text-encoder time and the denoising span of one pipeline call, from forward hooks.

    On CUDA the hooks record events on the current stream (no synchronisation inside
    the call: the GPU's queue keeps running) and :meth:`phases` reads them after the
    caller's one synchronisation at the end; elsewhere they read the clock."""

    _TEXT = ("text_encoder", "text_encoder_2", "text_encoder_3")
    _DENOISE = ("transformer", "unet")

    def __init__(self, pipe: Any, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start_s = time.perf_counter()
        self.start = self._mark()
        self.text: list[tuple[Any, Any]] = []  # (begin, end) marks per encoder call
        self.first: Any = None
        self.last: Any = None
        self._open: Any = None
        self._hooks = []
        for name in self._TEXT:
            m = getattr(pipe, name, None)
            if isinstance(m, torch.nn.Module):
                self._hooks.append(m.register_forward_pre_hook(self._text_in))
                self._hooks.append(m.register_forward_hook(self._text_out))
        for name in self._DENOISE:
            m = getattr(pipe, name, None)
            if isinstance(m, torch.nn.Module):
                self._hooks.append(m.register_forward_pre_hook(self._denoise_in))
                self._hooks.append(m.register_forward_hook(self._denoise_out))

    def _mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _between(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def _text_in(self, module, args) -> None:
        self._open = self._mark()

    def _text_out(self, module, args, out) -> None:
        self.text.append((self._open, self._mark()))

    def _denoise_in(self, module, args) -> None:
        if self.first is None:
            self.first = self._mark()

    def _denoise_out(self, module, args, out) -> None:
        self.last = self._mark()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def phases(self, done: float) -> dict[str, float]:
        """``done``: the clock after the call and a synchronisation."""
        text = sum(self._between(a, b) for a, b in self.text)
        if self.first is None or self.last is None:
            return {"text": text, "denoise": 0.0, "decode": done - self.start_s}
        to_last = self._between(self.start, self.last)
        return {
            "text": text,
            "denoise": self._between(self.first, self.last),
            "decode": max(0.0, (done - self.start_s) - to_last),
        }
