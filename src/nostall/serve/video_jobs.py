"""Video generation jobs of one worker, in the shape of OpenAI's Videos API: made from a
request, queued on the worker, their progress and outcome kept in a
:class:`~nostall.serve.video_store.VideoStore` that outlives the process.

A job is ``queued`` until the worker's thread takes it, ``in_progress`` while it
denoises (progress: 0–90% over the steps) and while the asynchronous frame pipeline
decodes and writes it (90–99% over the frames; the worker's thread is on to the next
job by then), ``completed`` once its MP4 is in place under its final name (100%), else
``failed`` (with the error's code and message) or ``cancelled`` (:meth:`VideoJobs.cancel`:
a queued job never runs, a running one stops at its next denoising step; nothing is
left under the final name). A client that disconnects loses nothing: it polls
:meth:`VideoJobs.get` later, or lists them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from nostall.errors import ArgumentError, Cancelled, NostallError, ShuttingDown, SinkError
from nostall.serve.bodies import VideoBody, parse
from nostall.serve.jobs import GenerateJob
from nostall.serve.video_requests import check_generate, generate_rules
from nostall.serve.video_store import VideoStore, as_openai

__all__ = ["VideoJobs"]

log = logging.getLogger(__name__)

DENOISE_SHARE = 90  # percent of a job's progress its denoising steps count for


class VideoJobs:
    """The video jobs of ``worker`` (a :class:`~nostall.serve.worker.Worker`), kept in
    ``folder`` (the MP4s and ``videos.sqlite``) within ``max_bytes`` of videos
    (oldest removed first). Opening it marks the jobs a previous process left
    unfinished failed (``interrupted``), and adds the ``nostall_video_*`` metrics to
    the worker's (:class:`~nostall.serve.metrics.VideoMetrics`)."""

    def __init__(self, worker: Any, folder: str, *, max_bytes: int | None = None):
        self.worker = worker
        self.store = VideoStore(folder, max_bytes=max_bytes)
        self._lock = threading.Lock()
        self._live: dict[str, tuple[GenerateJob, threading.Event]] = {}  # queued/running
        self._began: dict[str, float] = {}  # running: perf_counter when it went in_progress
        self.metrics = worker.metrics.watch_videos(self.counts)

    def close(self) -> None:
        self.store.close()

    # ---- making jobs -------------------------------------------------------------

    def rules(self, model: str) -> Any:
        """``model``'s generate rules: :class:`~nostall.UnknownModel` for a model the
        store lacks, :class:`~nostall.ArgumentError` (``model``) for one that makes no
        video, listing those that do."""
        entry = self.worker.cache.store.entry(model)  # UnknownModel, naming what exists
        rules = generate_rules(entry)
        if rules is None:
            raise ArgumentError(
                f"model {model!r} is a {entry.class_name}: it makes no video; choose one of "
                f"{self.models()}",
                field="model",
                allowed=self.models(),
            )
        return rules

    def models(self) -> list[str]:
        """The served pipelines that generate video."""
        out = []
        for name in self.worker.names():
            if name in self.worker.unavailable:
                continue
            try:
                if generate_rules(self.worker.cache.store.entry(name)) is not None:
                    out.append(name)
            except (NostallError, OSError, ValueError):
                continue
        return out

    def create(self, body: VideoBody | dict[str, Any], image: bytes | None = None) -> dict:
        """Check ``body`` (and the multipart ``image``), queue its job and return the
        OpenAI video object (``status: queued``). Refusals raise before anything is
        kept: :class:`~nostall.ArgumentError`, :class:`~nostall.UnknownModel`,
        :class:`~nostall.QueueFull`, :class:`~nostall.ShuttingDown`."""
        body = parse(VideoBody, body)
        fields = check_generate(body, self.rules(body.model), self.worker.limits, image)
        params = {k: v for k, v in fields.items() if k not in ("prompt", "image")}
        params["input_reference"] = fields["image"] is not None
        size = f"{fields['width']}x{fields['height']}"
        seconds = f"{(fields['frames'] - 1) / fields['fps']:g}"
        row = self.store.create(body.model, body.prompt, size=size, seconds=seconds, params=params)
        vid = row["id"]
        job = GenerateJob.of(vid, body.model, self.store.path(vid), fields)
        job.progress = self._progress_of(job)
        with self._lock:
            try:
                future, gone = self.worker.submit(job)
            except BaseException:
                self.store.fail(vid, "not_queued", "the worker refused the job")
                self.store.delete(vid)
                raise
            self._live[vid] = (job, gone)
        future.add_done_callback(lambda f: self._ran(job, f))
        return as_openai(self.store.get(vid))

    def _progress_of(self, job: GenerateJob):
        last = [-1]

        def progress(steps: int, frames: int) -> None:
            if frames == 0 and steps <= 1 and last[0] < 0 and self.store.start(job.id):
                with self._lock:
                    self._began[job.id] = time.perf_counter()
            share = DENOISE_SHARE * steps // job.steps
            if frames:
                share = DENOISE_SHARE + (99 - DENOISE_SHARE) * frames // job.frames
            if share != last[0]:  # one write per percent, however many steps and frames
                last[0] = share
                self.store.progress(job.id, share)

        return progress

    # ---- outcomes (worker and writer threads) --------------------------------------

    def _ran(self, job: GenerateJob, f: Future) -> None:
        """The worker's thread is done with ``job``: it failed, or the writer is
        finishing its MP4."""
        e = f.exception()
        if e is not None:
            self._settle_error(job, e)
            return
        result = f.result()
        written: Future = result.info.pop("written")
        phases = dict(result.phases)

        def finished(w: Future) -> None:
            err = w.exception()
            if err is not None:
                self._settle_error(job, err)
                return
            out = w.result()
            stats = out.stats
            info = {
                "frames": out.frames,
                "fps": out.fps,
                # decode_write: from the decode's launch to the MP4 in place (the frame
                # pipeline's run: chunks decoded, copied, encoded, the file renamed)
                "phases": {**phases, "decode_write": stats.wall_s, "write_close": stats.close_s},
                "switch": {
                    "moved_bytes": result.switch.get("moved_bytes", 0),
                    "tiers": sorted({c["tier"] for c in result.switch.get("components", [])}),
                },
                "degraded": list(out.degraded),
            }
            with self._lock:
                self._live.pop(job.id, None)
                began = self._began.pop(job.id, None)
            try:
                if not self.store.complete(job.id, info=info):
                    return  # cancelled meanwhile: counted by cancel()
            except SinkError as e:  # no file under its name: failed, not left in_progress
                self._settle_error(job, e)
                return
            except Exception:  # (the store closed under a late writer): said, not raised
                log.exception("video %s was written but could not be recorded", job.id)
                return
            self.metrics.completed(
                seconds=None if began is None else time.perf_counter() - began,
                denoise=phases.get("denoise"),
                decode_write=stats.wall_s,
                frames=out.frames,
            )

        written.add_done_callback(finished)

    def _settle_error(self, job: GenerateJob, e: BaseException) -> None:
        with self._lock:
            self._live.pop(job.id, None)
            self._began.pop(job.id, None)
        try:
            if isinstance(e, Cancelled):  # cancel() stopped it, or it never ran
                status, changed = "cancelled", self.store.cancel(job.id)
            else:
                code = "shutting_down" if isinstance(e, ShuttingDown) else _code(e)
                status = "failed"
                changed = self.store.fail(job.id, code, f"{type(e).__name__}: {e}"[:2000])
        except Exception:
            log.exception("video %s ended (%s) but could not be recorded", job.id, e)
            return
        if changed:  # (False: cancel() ended it first, and counted it)
            self.metrics.ended.labels(status).inc()

    # ---- what the routes ask -------------------------------------------------------

    def get(self, vid: str) -> dict:
        """The OpenAI video object of ``vid``; :class:`KeyError` for an id this worker
        never made (HTTP 404)."""
        row = self.store.get(vid)
        if row is None:
            raise KeyError(vid)
        return as_openai(row)

    def list(self, *, after: str | None = None, limit: int = 20, order: str = "desc") -> dict:
        if order not in ("asc", "desc"):
            raise ArgumentError(f"order={order!r}: asc or desc", field="order")
        items, more = self.store.list(after=after, limit=limit, order=order)
        data = [as_openai(r) for r in items]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    def cancel(self, vid: str) -> dict:
        """``DELETE`` of ``vid``: a queued or running job is cancelled (the object comes
        back, ``status: cancelled``); a finished one is deleted with its file
        (``{"id", "object": "video.deleted", "deleted": true}``)."""
        row = self.store.get(vid)
        if row is None:
            raise KeyError(vid)
        if row["status"] in ("queued", "in_progress"):
            with self._lock:
                live = self._live.get(vid)
            if live is not None:
                live[0].cancel.set()  # a running job stops at its next step
                live[1].set()  # a queued one is skipped
            if self.store.cancel(vid):
                self.metrics.ended.labels("cancelled").inc()
            return as_openai(self.store.get(vid))
        self.store.delete(vid)
        return {"id": vid, "object": "video.deleted", "deleted": True}

    def content(self, vid: str) -> str:
        """The path of ``vid``'s finished MP4; :class:`KeyError` for an unknown id,
        :class:`~nostall.ArgumentError` (``status``, HTTP 409) for an unfinished one."""
        row = self.store.get(vid)
        if row is None:
            raise KeyError(vid)
        if row["status"] != "completed":
            raise ArgumentError(
                f"video {vid} is {row['status']}: its content exists once it is completed",
                field="status",
                allowed=["completed"],
            )
        return self.store.path(vid)

    def counts(self) -> dict[str, Any]:
        return self.store.counts()

    def recent(self, n: int = 20) -> list[dict]:
        """The ``n`` (1..100) newest jobs as OpenAI video objects (the status page's)."""
        return self.list(limit=n)["data"]


def _code(e: BaseException) -> str:
    """A failed job's error code, as the HTTP answers name the same error."""
    from nostall.serve.answers import error_answer

    return error_answer(e)[1]["type"]
