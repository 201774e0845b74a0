"""The worker's queue order: its waiting jobs as :mod:`nostall.serve.schedule` records,
the model cache's residency, batches of like image jobs as one pipeline call, and the
wait a 429's ``Retry-After`` is estimated from.

A job with an SLO (``slo_s``, from a request's ``slo_ms``) has a deadline: the queue
runs earliest deadline first within the fairness bound, and :meth:`Lineup.admit` tells
the worker when a new one could not meet its SLO behind what waits (it is refused at
once, with how late it would be as the wait).

A :class:`Lineup` keeps no lock: the worker calls it under its queue's lock, except
:meth:`Lineup.resident`, which asks the model cache and is called outside that lock
(the cache's lock may be held for seconds while it allocates its device tier).

Batching (``Policy.batch`` > 1): image jobs of one pipeline with equal size, steps,
guidance, sequence length and negative-prompt use share one pipeline call
(:mod:`nostall.serve.calls`, which says why their images can differ in the last bits
from the same requests run alone); a decode always runs alone.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

from nostall.errors import ArgumentError, Cancelled, NostallError
from nostall.serve.prices import SwitchPrices, placement
from nostall.serve.schedule import Policy, Request, Scheduler

__all__ = ["Lineup"]

log = logging.getLogger(__name__)

# priors until the first measurements: seconds per megapixel-step of an image (or per
# million latent values of a video) and of a switch; measured averages replace them
RUN_S, SWITCH_S = 0.05, 1.0


class Lineup:
    """The queue policy of one worker over its tickets (objects with ``job``,
    ``arrived``, ``future`` and ``cancelled``, as the worker makes them).

    ``without(job)``: the roles a job's switch leaves out (what residency is judged
    on); ``cache``: the worker's :class:`~nostall.ModelCache`."""

    def __init__(self, policy: Policy, cache: Any, without: Any):
        self.policy = policy
        self.schedule = Scheduler(policy, run_s=RUN_S, switch_s=SWITCH_S)
        self._cache = cache
        self._without = without
        self._pipelines: dict[str, tuple[str, tuple[str, ...]]] = {}  # key -> (model, roles)
        self._alone: set[tuple[str, Hashable]] = set()  # (key, shape) whose batch failed
        self._group: tuple[str, Hashable] | None = None  # the last batch's
        self._predicted: str | None = None  # prefetched since the last batch began
        self._resident: set[str] = set()  # as last seen
        self._running: tuple[str, float, float] | None = None  # key, since, estimate
        self._batch: list[Any] = []  # the running batch's tickets
        self.prices = SwitchPrices()  # the tiers' measured rates

    # ---- under the worker's lock ---------------------------------------------------

    def add(self, ticket: Any) -> None:
        """Queue ``ticket`` behind the others (it is in the worker's deque already)."""
        job = ticket.job
        try:
            roles = tuple(self._without(job))
        except ArgumentError:  # the job fails when it runs, with this error
            roles = ()
        key, shape, work = _terms(job, self.policy.batch > 1)
        if (key, shape) in self._alone:
            shape = object()
        self._pipelines[key] = (job.model, roles)
        self.schedule.add(self._request(ticket, key, shape, work))

    def admit(self, ticket: Any, preempts: bool = False) -> float | None:
        """``None`` when ``ticket`` (not queued yet) would meet its job's SLO
        (``slo_s``; a job without one always would), else how late it would be: the
        seconds a client should wait before retrying. ``preempts``: the ticket may pause
        the running job (the worker's rules, :meth:`preemptor`), so it need not wait for
        that job to end if it is of another pipeline."""
        if getattr(ticket.job, "slo_s", None) is None:
            return None
        key, shape, work = _terms(ticket.job, self.policy.batch > 1)
        resident, busy = self._now_resident()
        request = self._request(ticket, key, shape, work)
        now = time.perf_counter()
        late = self.schedule.admit(request, resident, now=now, busy_s=busy)
        if late is not None and preempts and self._pausable() and self.running != key:
            late = self.schedule.admit(request, resident, now=now, busy_s=0.0)
        return late

    def _pausable(self) -> bool:
        return self._running is not None and len(self._batch) == 1

    def preemptor(self, allowed: Any, back_s: Any = None) -> Any:
        """At a step boundary of the running job: the queued ticket worth pausing it for
        (taken off the schedule; the caller takes it out of its deque and runs it), or
        ``None`` (:meth:`Scheduler.preemptor`; ``allowed(ticket)``: the worker's rules;
        ``back_s(ticket)``: seconds to bring the paused pipeline back after it). Call
        :meth:`preempted` once it has run."""
        if not self._pausable():
            return None
        resident, busy = self._now_resident()
        running = self._batch[0]
        slo = getattr(running.job, "slo_s", None)
        r = self.schedule.preemptor(
            self._running[0],
            busy,
            resident,
            now=time.perf_counter(),
            running_deadline=None if slo is None else running.arrived + slo,
            allowed=lambda r: not r.id.cancelled.is_set() and allowed(r.id),
            back_s=None if back_s is None else lambda r: back_s(r.id),
        )
        return None if r is None else r.id

    def preempted(self, ticket: Any, seconds: float, result: Any) -> None:
        """``ticket`` (from :meth:`preemptor`) ran for ``seconds`` inside the paused job
        (``result``: its :class:`~nostall.serve.worker.Result`, ``None`` if it failed):
        the paused job's estimate moves on by that much, and the estimates learn."""
        if self._running is not None:
            key, since, estimate = self._running
            self._running = (key, since + seconds, estimate)
        if result is None:
            return
        key, _, work = _terms(ticket.job, False)
        switch = result.phases.get("switch", 0.0)
        moved = any(c.get("tier") in ("host", "disk") for c in result.switch.get("components", []))
        self.schedule.observe(
            key, work, run_s=max(0.0, seconds - switch), switch_s=switch if moved else None
        )
        if result.switch:
            self.prices.observe(result.switch)

    def _request(self, ticket: Any, key: str, shape: Hashable, work: float) -> Request:
        slo = getattr(ticket.job, "slo_s", None)
        deadline = None if slo is None else ticket.arrived + slo
        return Request(ticket, key, shape, ticket.arrived, work, deadline)

    @property
    def running(self) -> str | None:
        """The pipeline key of the batch running now (``None``: none runs)."""
        return self._running[0] if self._running is not None else None

    def wanted(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """The queued jobs' pipelines: key → (model, roles left out)."""
        return {k: self._pipelines[k] for k in {r.pipeline for r in self.schedule.requests()}}

    def take(
        self, queue: deque, resident: set[str], prices: dict[str, float] | None = None
    ) -> list[Any]:
        """The next batch, out of ``queue`` (the worker's deque of tickets) too. Tickets
        that left the deque (a shutdown failed them) are forgotten; those whose client
        left are failed with :class:`~nostall.Cancelled` and dropped. ``prices``: each
        wanted pipeline's switch now (:meth:`priced`)."""
        if prices is not None:
            self.schedule.price(prices)
        present = set(queue)
        for r in self.schedule.requests():
            t = r.id
            if t not in present or t.cancelled.is_set():
                self.schedule.remove(t)
                if t in present:
                    queue.remove(t)
                    if t.future.set_running_or_notify_cancel():
                        t.future.set_exception(Cancelled("the client went away"))
        self._resident = set(resident)
        chosen = self.schedule.next(resident, now=time.perf_counter())
        if not chosen:
            return []
        batch = [r.id for r in chosen]
        taken = set(batch)
        kept = [t for t in queue if t not in taken]
        queue.clear()
        queue.extend(kept)
        key = chosen[0].pipeline
        estimate = sum(self.schedule.run_estimate(key, r.work) for r in chosen)
        if key not in resident:
            estimate += self.schedule.switch_estimate(key)
        self._group = (key, chosen[0].shape)
        self._predicted = None
        self._running = (key, time.perf_counter(), estimate)
        self._batch = batch
        return batch

    def predict(self, resident: set[str]) -> tuple[str, tuple[str, ...]] | None:
        """The pipeline (model, roles left out) the next batch would switch to, to be
        prefetched; ``None`` when it would run on one of ``resident``, or was named
        already since the running batch began."""
        batch = self.schedule.peek(resident, now=time.perf_counter())
        if not batch or batch[0].pipeline in resident or batch[0].pipeline == self._predicted:
            return None
        self._predicted = batch[0].pipeline
        return self._pipelines[batch[0].pipeline]

    def done(self, seconds: float, results: list[Any]) -> None:
        """The batch :meth:`take` returned last has run for ``seconds``; ``results``: the
        :class:`~nostall.serve.worker.Result` of each job that succeeded."""
        self._running, self._batch = None, []
        if not results:
            self.schedule.done(seconds)
            return
        switch = results[0].phases.get("switch", 0.0)
        self.schedule.done(seconds, run_s=max(0.0, seconds - switch), switch_s=switch)
        if results[0].switch:
            self.prices.observe(results[0].switch)

    def alone(self) -> None:
        """The last batch's pipeline and shape run unbatched from now on (that batch ran
        out of device memory)."""
        if self._group is not None:
            self._alone.add(self._group)

    def retry_after(self) -> float:
        """Estimated seconds until half of the waiting jobs have started: a client told
        to come back then finds room, and the queue has not run dry meanwhile."""
        resident, busy = self._now_resident()
        n = len(self.schedule)
        return self.schedule.estimated_wait(n // 2, resident, busy_s=busy, now=time.perf_counter())

    def wait_s(self) -> float:
        """Estimated seconds until every waiting job has run (what a new one waits)."""
        resident, busy = self._now_resident()
        n = len(self.schedule)
        return self.schedule.estimated_wait(n, resident, busy_s=busy, now=time.perf_counter())

    def _now_resident(self) -> tuple[set[str], float]:
        """The pipelines resident as last seen (and the running batch's), and the
        estimated seconds left of that batch."""
        resident = set(self._resident)
        busy = 0.0
        if self._running is not None:
            key, since, estimate = self._running
            resident.add(key)
            # A batch past its estimate is not done: say a quarter of it is left.
            busy = max(estimate - (time.perf_counter() - since), 0.25 * estimate)
        return resident, busy

    # ---- outside the worker's lock -------------------------------------------------

    def priced(self, wanted: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, float]:
        """Each of ``wanted``'s switch price now: its bytes not on the device, by tier,
        at the rates switches measured (:mod:`nostall.serve.prices`)."""
        out: dict[str, float] = {}
        if not wanted:
            return out
        where = self._cache.stats().components
        for key, (model, roles) in wanted.items():
            try:
                host, disk = placement(self._cache, model, roles, where=where)
            except NostallError as e:  # a broken pipeline folder: its switch fails anyway
                log.debug("placement of %s unknown: %s", model, e)
                continue
            out[key] = self.prices.seconds(host=host, disk=disk)
        return out

    def resident(self, wanted: dict[str, tuple[str, tuple[str, ...]]]) -> set[str]:
        """Which of ``wanted`` (:meth:`wanted`) the cache holds on the device now."""
        out = set()
        for key, (model, roles) in wanted.items():
            try:
                if self._cache.resident(model, without=roles):
                    out.add(key)
            except NostallError as e:  # a broken pipeline folder: never resident
                log.debug("residency of %s unknown: %s", model, e)
        return out


def _terms(job: Any, batching: bool) -> tuple[str, Hashable, float]:
    """``(key, shape, work)`` of a job: the pipeline as a switch for it moves it, what
    must be equal to share a call, and its cost (megapixel-steps; a video: millions of
    latent values)."""
    latents = getattr(job, "latents", None)
    if latents is not None:  # a decode: the VAE alone, never batched
        return f"{job.model} (vae)", object(), latents.numel() / 1e6
    key = job.model
    work = job.width * job.height * job.steps / 1e6
    frames = getattr(job, "frames", None)
    if frames is not None:  # a video to generate: one long job, never batched
        return key, object(), work * (frames + 3) / 4  # a latent frame costs an image
    if not batching or getattr(job, "controlnet", None) is not None:  # its own image
        return key, object(), work
    shape = (
        job.width,
        job.height,
        job.steps,
        job.guidance,
        job.max_sequence_length,
        job.negative_prompt is None,
        job.loras,  # one pipeline call fuses one set of LoRAs
    )
    return key, shape, work
