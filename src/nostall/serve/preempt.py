"""Step-level preemption across models: a worker's long job paused at a denoising step
for a short job of another pipeline that would otherwise miss its SLO.

At each step boundary of a job running alone (:class:`~nostall.serve.calls.PhaseClock`
calls the runner's ``on_step``), :class:`Preemption` asks the queue
(:meth:`Lineup.preemptor <nostall.serve.lineup.Lineup.preemptor>`, whose rule is
:meth:`Scheduler.preemptor <nostall.serve.schedule.Scheduler.preemptor>`) whether a
queued image job is worth a pause, and runs it there, on the worker's thread, inside the
paused pipeline call: the paused job's latents, scheduler state, prompt embeddings and
generator stay where they are (on the device), its pipeline stays held (nothing of it is
evicted), and when the short job is done its call goes on from the same step, so its
output is the one it would have had run straight through.

What may preempt: an image job of another pipeline (not the paused one's: a pipeline
object is one call at a time), without LoRAs or a ControlNet (those change weights the
paused job might share), whose missing weights fit in the device tier beside what is
held (the paused pipeline cannot leave, and a switch that found no room would fail the
short job). One preemption at a time (a preempting job is not itself paused). Its time
is the paused job's ``preempted`` phase, left out of that job's denoise time; the
paused job's answer lists what ran inside it (``info["preempted_by"]``). A paused job
whose client left meanwhile is dropped at its next step (:class:`~nostall.Cancelled`),
its memory given back, instead of running to the end for nobody.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nostall.errors import Cancelled, NostallError
from nostall.serve.jobs import GenerateJob, ImageJob, VideoJob
from nostall.serve.prices import placement

__all__ = ["Preemption"]

log = logging.getLogger(__name__)

_ROOM = 0.9  # of the device tier's bytes not held: fragmentation and the watermark's


class Preemption:
    """A worker's preemption (see the module): :meth:`__call__` is its runner's
    ``on_step``. ``worker``: the :class:`~nostall.serve.worker.Worker` (its queue, lock,
    lineup, cache, budget, and ``_finish`` to run and settle a job)."""

    def __init__(self, worker: Any):
        self._worker = worker
        self._inside = False  # a preempting job runs now (it is not paused itself)
        self._by: dict[int, list[dict[str, Any]]] = {}  # id(paused job) -> what ran inside
        self.count = 0

    def allowed(self, ticket: Any, running: str | None = None) -> bool:
        """Whether ``ticket``'s job may pause a running job (of pipeline ``running``, if
        named) at all: an image job of another pipeline, without LoRAs or ControlNet."""
        job = ticket.job
        if not isinstance(job, ImageJob) or isinstance(job, (VideoJob, GenerateJob)):
            return False
        if job.loras or job.controlnet is not None:
            return False
        return running is None or job.model != running

    def _room(self) -> tuple[Any, int] | None:
        """The cache's components now and the device-tier bytes a switch may use beside
        what is held in use (``None``: unknown)."""
        try:
            stats = self._worker.cache.stats()
        except NostallError as e:  # (closed at shutdown)
            log.debug("no cache stats (%s): not preempting", e)
            return None
        held = sum(
            c["bytes"] for c in stats.components.values() if c["in_use"] and c["tier"] == "gpu"
        )
        return stats.components, int(_ROOM * max(0, stats.gpu_budget - held))

    def _fits(self, job: ImageJob, where: Any, room: int) -> bool:
        """Whether ``job``'s missing weights fit in ``room`` (:meth:`_room`)."""
        w = self._worker
        try:
            host, disk = placement(w.cache, job.model, w.runner.without(job), where=where)
        except NostallError as e:
            log.debug("placement of %s unknown (%s): not preempting for it", job.model, e)
            return False
        return host + disk <= room

    def __call__(self, job: Any, steps: int) -> float:
        """At step ``steps`` of ``job`` (running alone): run the queued job worth pausing
        it for, if any; the seconds that took (0.0: none ran)."""
        w = self._worker
        if self._inside or not w.config.preempt or w._stop.is_set():
            return 0.0
        with w._cond:
            if id(job) in self._by and any(
                t.job is job and t.cancelled.is_set() for t in w._running
            ):
                # paused before, and its client left since: dropped here, its memory back
                raise Cancelled(f"the client went away; stopped after {steps} denoiser calls")
            if not any(self.allowed(t, job.model) for t in w._queue):
                return 0.0
        room = self._room()  # (asks the cache: not under the queue's lock)
        if room is None:
            return 0.0
        where, free = room
        fits: dict[str, bool] = {}

        def allowed(t: Any) -> bool:
            if not self.allowed(t, job.model):
                return False
            if t.job.model not in fits:
                fits[t.job.model] = self._fits(t.job, where, free)
            return fits[t.job.model]

        with w._cond:
            ticket = w._lineup.preemptor(allowed)
            if ticket is not None:
                w._queue.remove(ticket)
                w.metrics.queue_depth.set(len(w._queue))
        if ticket is None or not ticket.future.set_running_or_notify_cancel():
            return 0.0
        t = time.perf_counter()
        self._inside = True
        try:
            with w.budget.paused():
                result = w._finish(ticket)
        finally:
            self._inside = False
        seconds = time.perf_counter() - t
        with w._cond:
            w._lineup.preempted(ticket, seconds, result)
        self.count += 1
        w.metrics.preemptions.inc()
        self._by.setdefault(id(job), []).append(
            {"model": ticket.job.model, "at_step": steps, "seconds": seconds}
        )
        log.info(
            "%s paused at step %d for %s (%.2f s)", job.model, steps, ticket.job.model, seconds
        )
        return seconds

    def take(self, job: Any) -> list[dict[str, Any]]:
        """What ran inside ``job`` (emptied: its result is being booked)."""
        return self._by.pop(id(job), [])
