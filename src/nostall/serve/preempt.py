"""Step-level preemption across models: a worker's long job paused at a denoising step
for a short job of another pipeline that would otherwise miss its SLO.

At each step boundary of a job running alone (:class:`~nostall.serve.calls.PhaseClock`
calls the runner's ``on_step``), :class:`Preemption` asks the queue
(:meth:`Lineup.preemptor <nostall.serve.lineup.Lineup.preemptor>`, whose rule is
:meth:`Scheduler.preemptor <nostall.serve.schedule.Scheduler.preemptor>`) whether a
queued image job is worth a pause, and runs it there, on the worker's thread, inside the
paused pipeline call: the paused job's latents, scheduler state, prompt embeddings and
generator stay where they are (on the device), and when the short job is done its call
goes on from the same step, so its output is the one it would have had run straight
through.

Where the short job's weights go: beside the paused pipeline when they fit there (the
paused pipeline stays, and coming back costs nothing); else, if the paused pipeline
holds plain base weights (no LoRA fused in, not a two-expert pipeline), it is parked
(:meth:`ModelCache.parked <nostall.cache.ModelCache.parked>`): its components may leave
for the short job's, least recently used first, and come back from the host tier into
the very modules the paused call holds before it goes on. The price of coming back (the
bytes that would leave ÷ the measured host rate) is part of the decision
(:meth:`Scheduler.preemptor <nostall.serve.schedule.Scheduler.preemptor>`'s
``back_s``): a pause has to gain more than both switches cost.

What may preempt: an image job of another pipeline (not the paused one's: a pipeline
object is one call at a time), without LoRAs or a ControlNet (those change weights the
paused job might share), whose weights fit in the device tier beside what stays held (a
switch that found no room would fail the short job). One preemption at a time (a
preempting job is not itself paused). Its time is the paused job's ``preempted`` phase,
left out of that job's denoise time; the paused job's answer lists what ran inside it
(``info["preempted_by"]``, with ``parked`` when its pipeline had to leave). A paused
job whose client left meanwhile is dropped at its next step (:class:`~nostall.Cancelled`),
its memory given back, instead of running to the end for nobody.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from nostall.cache.experts import expert_roles
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

    def _room(self) -> tuple[Any, int, int] | None:
        """The cache's components now, the device-tier bytes a switch may use beside
        what is held in use, and those it may use with the paused pipeline parked
        (``None``: unknown)."""
        try:
            stats = self._worker.cache.stats()
        except NostallError as e:  # (closed at shutdown)
            log.debug("no cache stats (%s): not preempting", e)
            return None
        held = sum(
            c["bytes"] for c in stats.components.values() if c["in_use"] and c["tier"] == "gpu"
        )
        beside = int(_ROOM * max(0, stats.gpu_budget - held))
        return stats.components, beside, int(_ROOM * stats.gpu_budget)

    def _parkable(self, job: Any) -> bool:
        """Whether the paused ``job``'s pipeline may leave for a preemptor: its weights
        are the host tier's copies (no LoRA, no ControlNet), one denoiser (not two
        experts switched at a boundary)."""
        if getattr(job, "loras", ()) or getattr(job, "controlnet", None) is not None:
            return False
        w = self._worker
        try:
            entry = w.cache.store.entry(job.model)
            return expert_roles(entry, frozenset(w.runner.without(job))) is None
        except NostallError:
            return False

    def _fits(self, job: ImageJob, where: Any, room: tuple[int, int], paused: Any) -> float | None:
        """Where ``job``'s weights go (:meth:`_room`'s ``room``: beside, parked): 0.0
        when they fit beside the paused pipeline, the estimated seconds to bring the
        paused pipeline back when it must be parked for them, ``None`` when they fit
        neither way."""
        w = self._worker
        beside, parked = room
        without = w.runner.without(job)
        try:
            host, disk = placement(w.cache, job.model, without, where=where)
            if host + disk <= beside:
                return 0.0
            if parked <= beside or not self._parkable(paused):
                return None
            comps = w.cache.store.entry(job.model).distinct_weights(frozenset(without))
            if sum(c.nbytes for c in comps) > parked:
                return None
        except NostallError as e:
            log.debug("placement of %s unknown (%s): not preempting for it", job.model, e)
            return None
        # what leaves is what does not fit beside, at most the paused pipeline's bytes
        ours = placement(w.cache, paused.model, w.runner.without(paused), where={})
        back = min(host + disk - beside, sum(ours))
        return w._lineup.prices.seconds(host=back, disk=0)

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
        where, beside, parked = room
        fits: dict[str, float | None] = {}

        def back(t: Any) -> float | None:
            if t.job.model not in fits:
                fits[t.job.model] = self._fits(t.job, where, (beside, parked), job)
            return fits[t.job.model]

        def allowed(t: Any) -> bool:
            return self.allowed(t, job.model) and back(t) is not None

        with w._cond:
            ticket = w._lineup.preemptor(allowed, back_s=lambda t: back(t) or 0.0)
            if ticket is not None:
                w._queue.remove(ticket)
                w.metrics.queue_depth.set(len(w._queue))
        if ticket is None or not ticket.future.set_running_or_notify_cancel():
            return 0.0
        park = bool(fits.get(ticket.job.model))  # (0.0: it fits beside)
        t = time.perf_counter()
        self._inside = True
        try:
            with w.budget.paused(), w.cache.parked() if park else contextlib.nullcontext():
                result = w._finish(ticket)
        finally:
            self._inside = False
        seconds = time.perf_counter() - t
        with w._cond:
            w._lineup.preempted(ticket, seconds, result)
        self.count += 1
        w.metrics.preemptions.inc()
        self._by.setdefault(id(job), []).append(
            {"model": ticket.job.model, "at_step": steps, "seconds": seconds, "parked": park}
        )
        log.info(
            "%s paused at step %d for %s (%.2f s%s)",
            job.model,
            steps,
            ticket.job.model,
            seconds,
            ", parked" if park else "",
        )
        return seconds

    def take(self, job: Any) -> list[dict[str, Any]]:
        """What ran inside ``job`` (emptied: its result is being booked)."""
        return self._by.pop(id(job), [])
