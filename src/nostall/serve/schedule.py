"""Which queued requests run next: resident pipelines first, like requests together, and
no request pushed back more than a bound beyond arrival order.

Pure: plain :class:`Request` records in, batches of them out; no threads, no torch, no
clock (the caller passes times and the set of resident pipelines). The worker
(:mod:`nostall.serve.worker`) keeps one :class:`Scheduler` under its queue's lock.

The rule, each time the device is free:

1. A *group* is the queued requests of one pipeline and one shape key (what one
   pipeline call can serve together); its oldest member leads a candidate batch, which
   takes the group's next members in arrival order, up to :attr:`Policy.batch`.
2. A candidate is *admissible* when no request it overtakes (an older one left queued)
   would then have been overtaken by more than :attr:`Policy.overtake` requests in all,
   or pushed back by more than :attr:`Policy.delay_s` seconds beyond arrival order.
   A member is added to a batch only while the batch stays admissible.
3. The oldest admissible candidate whose pipeline is resident runs; with none, the
   oldest request's batch (which overtakes nobody without riders, so it is always
   admissible: no request waits forever).

*Pushed back beyond arrival order*, for a queued request ``r``: the estimated run
seconds of the requests that ran before it although they arrived after it (a batch led
by an older request would have run first anyway: only its riders push ``r`` back; a
batch that jumps the queue is of a resident pipeline, so no switch is charged). Estimates are
moving averages of measured seconds per unit of work and of switch seconds, per
pipeline; when a batch finishes (:meth:`Scheduler.done`), the push-back it caused is
rescaled to its measured seconds, so the bound holds on measured time up to the
misestimate of the one batch in flight.

**Deadlines.** A request may carry a ``deadline`` (same clock as ``arrived``; a service
sets it from the request's SLO). When :meth:`Scheduler.next` is told the time (``now``)
and a queued request has one, the choice is earliest-deadline-first with each batch's
switch in its estimate, within the same bound:

4. Of the admissible batches that can still finish by their members' earliest deadline
   (``now`` + the batch's estimate, its switch included), the most urgent runs, unless
   a resident batch fits before it: one that leaves the urgent batch still on time runs
   first (the switch it saves is time for everyone). With no batch that can still make
   its deadline, the rule above decides (the late ones are served in arrival order, not
   chased). :meth:`Scheduler.admit` says whether a new request would meet its deadline
   in that order, and when to retry if not.

**Preemption.** A job running a pipeline of many denoising steps can be paused at a step
boundary for a queued request of another pipeline (:meth:`Scheduler.preemptor`, asked
at each boundary): one with a deadline it would miss behind what is left of the running
job by more than both switches cost (its own, and bringing the paused pipeline back when
it must leave the device for it: the caller's ``back_s``; a paused pipeline that stays
resident comes back for nothing), that it can still meet if it runs now, whose run does
not make the paused job miss a deadline it would have met, and whose jump over the older
queued requests stays within the bound of rule 2.

>>> s = Scheduler(Policy(batch=2, overtake=1), run_s=1.0, switch_s=5.0)
>>> for i, p in enumerate(["flux", "sdxl", "flux", "flux"]):
...     s.add(Request(i, p, "512x512", arrived=float(i)))
>>> [r.id for r in s.next(resident={"flux"})]  # flux is on the device: 0 and 2 (2 passes 1)
[0, 2]
>>> [r.id for r in s.next(resident={"flux"})]  # 3 would pass 1 a second time: 1 goes now
[1]
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

from nostall.errors import ArgumentError

__all__ = ["Policy", "Request", "Scheduler"]


@dataclass(frozen=True)
class Policy:
    """How a queue may reorder and group requests.

    Attributes:
        batch: at most this many requests of one pipeline and shape in one pipeline call
            (1: every request runs alone).
        overtake: no request is overtaken by more than this many later ones (0: arrival
            order, except that like requests queued back to back still batch).
        delay_s: no request is pushed back more than this many (estimated) seconds
            beyond arrival order.
    """

    batch: int = 1
    overtake: int = 8
    delay_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ArgumentError(f"batch={self.batch!r} must be a positive number of requests")
        if (
            isinstance(self.overtake, bool)
            or not isinstance(self.overtake, int)
            or self.overtake < 0
        ):
            raise ArgumentError(
                f"overtake={self.overtake!r} must be a number of requests >= 0 (0: arrival order)"
            )
        if (
            isinstance(self.delay_s, bool)
            or not isinstance(self.delay_s, (int, float))
            or not math.isfinite(self.delay_s)
            or self.delay_s < 0
        ):
            raise ArgumentError(f"delay_s={self.delay_s!r} must be a finite number of seconds >= 0")


@dataclass(frozen=True)
class Request:
    """One queued request as the scheduler sees it.

    ``id``: the caller's handle (hashable, unique while queued); ``pipeline``: what must be
    resident to run it without a switch; ``shape``: requests of one pipeline and equal
    shape can share a pipeline call; ``arrived``: enqueue time (seconds, any clock);
    ``work``: its cost in the caller's units (estimated seconds = work × the pipeline's
    measured seconds per unit); ``deadline``: when it should be done (same clock as
    ``arrived``), ``None`` for none."""

    id: Hashable
    pipeline: str
    shape: Hashable
    arrived: float
    work: float = 1.0
    deadline: float | None = None


@dataclass
class _Waiting:
    request: Request
    seq: int
    overtaken: int = 0
    delay: float = 0.0

    @property
    def order(self) -> tuple[float, int]:
        return (self.request.arrived, self.seq)


@dataclass
class _Choice:
    members: list[int]  # indexes into the queue, ascending
    charges: dict[int, tuple[int, float]] = field(default_factory=dict)  # index -> (passed, s)
    seconds: float = 0.0  # the batch's estimate, its switch included


class Scheduler:
    """The queue policy over :class:`Request` records (see the module's docstring).

    ``run_s``: seconds per unit of work assumed for a pipeline not measured yet (while
    none is: afterwards the mean of the measured ones); ``switch_s``: likewise for a
    switch; ``alpha``: weight of a new measurement in the moving averages.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        run_s: float = 1.0,
        switch_s: float = 1.0,
        alpha: float = 0.3,
    ):
        for name, value in (("run_s", run_s), ("switch_s", switch_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ArgumentError(f"{name}={value!r} must be a finite number of seconds >= 0")
        if not 0.0 < alpha <= 1.0:
            raise ArgumentError(f"alpha={alpha!r} must be in (0, 1]")
        self.policy = policy or Policy()
        self.alpha = alpha
        self._prior_run = float(run_s)
        self._prior_switch = float(switch_s)
        self._rate: dict[str, float] = {}  # pipeline -> seconds per unit of work
        self._switch: dict[str, float] = {}  # pipeline -> seconds of a switch to it
        self._priced: dict[str, float] = {}  # pipeline -> its switch's price now
        self._queue: list[_Waiting] = []  # arrival order
        self._ids: set[Hashable] = set()
        self._seq = 0
        # the batch next() returned last: what done() measures and corrects
        self._last: tuple[str, float, bool, dict[Hashable, float], float] | None = None

    # ---- the queue -----------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue ``request`` (in arrival order: ties keep the order of ``add``)."""
        if request.id in self._ids:
            raise ArgumentError(f"request id {request.id!r} is queued already")
        if not (math.isfinite(request.work) and request.work >= 0):
            raise ArgumentError(f"work={request.work!r} must be a finite number >= 0")
        if request.deadline is not None and not math.isfinite(request.deadline):
            raise ArgumentError(f"deadline={request.deadline!r} must be a finite time or None")
        w = _Waiting(request, self._seq)
        self._seq += 1
        bisect.insort(self._queue, w, key=lambda x: x.order)
        self._ids.add(request.id)

    def remove(self, id: Hashable) -> Request | None:
        """Take request ``id`` out (its client left); ``None`` if it is not queued."""
        if id not in self._ids:
            return None
        i = next(i for i, w in enumerate(self._queue) if w.request.id == id)
        self._ids.discard(id)
        return self._queue.pop(i).request

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, id: Hashable) -> bool:
        return id in self._ids

    def requests(self) -> list[Request]:
        """The queued requests in arrival order."""
        return [w.request for w in self._queue]

    def standing(self, id: Hashable) -> tuple[int, float]:
        """How often request ``id`` has been overtaken, and its push-back in seconds."""
        w = next((w for w in self._queue if w.request.id == id), None)
        if w is None:
            raise ArgumentError(f"request id {id!r} is not queued")
        return w.overtaken, w.delay

    # ---- choosing ------------------------------------------------------------------

    def peek(self, resident: Collection[str], *, now: float | None = None) -> list[Request]:
        """What :meth:`next` would return now, leaving the queue as it is."""
        if not self._queue:
            return []
        choice = self._choose(self._queue, set(resident), now)
        return [self._queue[i].request for i in choice.members]

    def next(self, resident: Collection[str], *, now: float | None = None) -> list[Request]:
        """Take the next batch off the queue (empty when nothing is queued): requests of
        one pipeline and shape, oldest first. ``resident``: the pipelines a run would not
        have to switch to; ``now``: the time the batch would start (same clock as the
        requests'), which makes the choice heed their deadlines. Call :meth:`done` when
        it has run."""
        if not self._queue:
            return []
        resident = set(resident)
        choice = self._choose(self._queue, resident, now)
        lead = self._queue[choice.members[0]].request
        pushed: dict[Hashable, float] = {}
        for i, (passed, s) in choice.charges.items():
            w = self._queue[i]
            w.overtaken += passed
            w.delay += s
            if s:
                pushed[w.request.id] = s
        taken = set(choice.members)
        out = [self._queue[i].request for i in choice.members]
        self._queue = [w for i, w in enumerate(self._queue) if i not in taken]
        self._ids.difference_update(r.id for r in out)
        work = sum(r.work for r in out)
        self._last = (lead.pipeline, work, lead.pipeline not in resident, pushed, choice.seconds)
        return out

    def preemptor(
        self,
        running: str,
        busy_s: float,
        resident: Collection[str],
        *,
        now: float,
        running_deadline: float | None = None,
        allowed: Callable[[Request], bool] | None = None,
        back_s: Callable[[Request], float] | None = None,
    ) -> Request | None:
        """The queued request worth pausing the running job for now (see the module),
        taken off the queue with the requests it overtakes charged; ``None`` if none is.
        ``running``: the running job's pipeline; ``busy_s``: its estimated seconds left;
        ``allowed``: which requests may preempt at all (the caller's rules); ``back_s``:
        the seconds it would take to bring the paused pipeline back after a request (0,
        or no ``back_s``: it stays resident beside it). Tell :meth:`observe` what it took
        once it has run."""
        best: tuple[float, int, _Choice, float] | None = None
        for i, w in enumerate(self._queue):
            r = w.request
            if r.deadline is None or r.pipeline == running:
                continue
            if allowed is not None and not allowed(r):
                continue
            switch = 0.0 if r.pipeline in resident else self.switch_estimate(r.pipeline)
            own = switch + self.run_estimate(r.pipeline, r.work)
            back = max(0.0, back_s(r)) if back_s is not None else 0.0
            if now + own > r.deadline + 1e-9:
                continue  # too late even if it ran now: not chased
            if now + busy_s + own - r.deadline <= switch + back + 1e-9:
                continue  # on time behind the running job, or too little late to pay
            pause = own + back  # the paused job resumes after both switches and the run
            if running_deadline is not None and (
                now + busy_s <= running_deadline + 1e-9 < now + busy_s + pause
            ):
                continue  # the paused job would miss a deadline it would have met
            choice = self._charge(self._queue, [i], switch + back)
            if choice is None:
                continue
            if best is None or r.deadline < best[0]:
                best = (r.deadline, i, choice, pause)
        if best is None:
            return None
        _, lead, choice, _ = best
        for i, (passed, s) in choice.charges.items():
            self._queue[i].overtaken += passed
            self._queue[i].delay += s
        r = self._queue.pop(lead).request
        self._ids.discard(r.id)
        return r

    def observe(
        self, pipeline: str, work: float, *, run_s: float, switch_s: float | None = None
    ) -> None:
        """A request run outside :meth:`next` (a preemptor) took ``run_s`` for ``work``,
        and ``switch_s`` to switch (``None``: it did not switch): the estimates learn."""
        if work > 0:
            self._rate[pipeline] = self._average(self._rate.get(pipeline), run_s / work)
        if switch_s is not None:
            self._switch[pipeline] = self._average(self._switch.get(pipeline), switch_s)

    def done(
        self, seconds: float, *, run_s: float | None = None, switch_s: float | None = None
    ) -> None:
        """The batch :meth:`next` returned last took ``seconds`` in all: the push-back
        it caused becomes measured time. ``run_s`` (the pipeline call) and ``switch_s``
        (its switch, counted only if its pipeline was not resident) update the
        estimates; a failed batch gives neither."""
        if self._last is None:
            return
        pipeline, work, switched, pushed, estimated = self._last
        self._last = None
        if run_s is not None and work > 0:
            self._rate[pipeline] = self._average(self._rate.get(pipeline), run_s / work)
        if switch_s is not None and switched:
            self._switch[pipeline] = self._average(self._switch.get(pipeline), switch_s)
        if estimated > 0 and pushed:
            scale = seconds / estimated
            for w in self._queue:
                s = pushed.get(w.request.id)
                if s is not None:
                    w.delay = max(0.0, w.delay + s * (scale - 1.0))

    # ---- estimates -----------------------------------------------------------------

    def run_estimate(self, pipeline: str, work: float = 1.0) -> float:
        """Estimated seconds of ``work`` on ``pipeline`` (its switch not included)."""
        rate = self._rate.get(pipeline)
        if rate is None:
            rate = sum(self._rate.values()) / len(self._rate) if self._rate else self._prior_run
        return rate * work

    def price(self, prices: dict[str, float]) -> None:
        """Switch prices known now (seconds, by pipeline: from where each one's bytes are
        and the tiers' measured rates); they take the place of the averages of past
        switches until the next call."""
        self._priced = dict(prices)

    def switch_estimate(self, pipeline: str) -> float:
        """Estimated seconds of a switch to ``pipeline`` when it is not resident: its
        price (:meth:`price`), else the average of its past switches."""
        priced = self._priced.get(pipeline)
        if priced is not None:
            return priced
        s = self._switch.get(pipeline)
        if s is None:
            return (
                sum(self._switch.values()) / len(self._switch)
                if self._switch
                else self._prior_switch
            )
        return s

    def estimated_wait(
        self,
        position: int,
        resident: Collection[str],
        *,
        busy_s: float = 0.0,
        now: float | None = None,
    ) -> float:
        """Estimated seconds until ``position`` more queued requests have started, in the
        order this scheduler would run them (``position`` 0: ``busy_s``, what is left of
        the batch running now; ``now``: as for :meth:`next`). A pipeline switched to is
        assumed to stay resident."""
        if position < 0:
            raise ArgumentError(f"position={position!r} must be >= 0")
        t, started = max(0.0, busy_s), 0
        for batch, _, end in self._plan(self._queue, resident, t, now):
            if started >= position:
                break
            started, t = started + len(batch), end
        return t

    def plan(
        self, resident: Collection[str], *, busy_s: float = 0.0, now: float | None = None
    ) -> list[tuple[list[Request], float, float]]:
        """The whole queue as this scheduler would run it if nothing else arrived and the
        estimates held: ``(batch, start, end)``, seconds from now (``busy_s``: what is
        left of the batch running now)."""
        return list(self._plan(self._queue, resident, max(0.0, busy_s), now))

    def admit(
        self,
        request: Request,
        resident: Collection[str],
        *,
        now: float,
        busy_s: float = 0.0,
    ) -> float | None:
        """Whether ``request`` (not queued yet) would meet its deadline if queued now, in
        the order :meth:`next` would run it: ``None`` if so (or it has none), else the
        seconds after which a retry could (how late it would finish now: the work ahead
        of it shrinks by about that much meanwhile)."""
        if request.deadline is None:
            return None
        if request.id in self._ids:
            raise ArgumentError(f"request id {request.id!r} is queued already")
        w = _Waiting(request, self._seq)
        queue = sorted([*self._queue, w], key=lambda x: x.order)
        for batch, _, end in self._plan(queue, resident, max(0.0, busy_s), now):
            if any(r.id == request.id for r in batch):
                late = now + end - request.deadline
                return None if late <= 1e-9 else late
        raise AssertionError("a queued request is in the plan")  # pragma: no cover

    # ---- internals -----------------------------------------------------------------

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.alpha * new + (1.0 - self.alpha) * old

    def _plan(self, queue: list[_Waiting], resident: Collection[str], t: float, now):
        """``(batch of requests, start, end)`` for all of ``queue`` (copied: the charges
        are simulated, not kept), from ``t`` seconds ahead."""
        queue = [_Waiting(w.request, w.seq, w.overtaken, w.delay) for w in queue]
        resident = set(resident)
        while queue:
            choice = self._choose(queue, resident, None if now is None else now + t)
            for i, (passed, s) in choice.charges.items():
                queue[i].overtaken += passed
                queue[i].delay += s
            batch = [queue[i].request for i in choice.members]
            resident.add(batch[0].pipeline)
            yield batch, t, t + choice.seconds
            t += choice.seconds
            taken = set(choice.members)
            queue = [w for i, w in enumerate(queue) if i not in taken]

    def _choose(
        self, queue: list[_Waiting], resident: set[str], now: float | None = None
    ) -> _Choice:
        if now is not None and any(w.request.deadline is not None for w in queue):
            urgent = self._by_deadline(queue, resident, now)
            if urgent is not None:
                return urgent
        head: _Choice | None = None
        seen: set[tuple[str, Hashable]] = set()
        for i, w in enumerate(queue):
            key = (w.request.pipeline, w.request.shape)
            if key in seen:
                continue
            seen.add(key)
            is_resident = w.request.pipeline in resident
            if head is not None and not is_resident:
                continue  # only a resident group may go before the oldest request's
            choice = self._grow(queue, i, is_resident)
            if choice is None:
                continue
            if is_resident:
                return choice  # the oldest admissible resident group
            head = choice  # i == 0: overtakes nobody, so always admissible
        assert head is not None, "the oldest request's batch is always admissible"
        return head

    def _by_deadline(self, queue: list[_Waiting], resident: set[str], now: float) -> _Choice | None:
        """Rule 4: the most urgent admissible batch that can still make its deadline, or a
        resident one that fits before it; ``None`` when no batch can make its deadline."""
        on_time: list[tuple[float, int, _Choice, bool]] = []
        seen: set[tuple[str, Hashable]] = set()
        for i, w in enumerate(queue):
            # Any request with a deadline may lead a batch of its group (the ones after
            # it ride along); of those without, the group's oldest.
            key = (w.request.pipeline, w.request.shape)
            if w.request.deadline is None and key in seen:
                continue
            seen.add(key)
            is_resident = w.request.pipeline in resident
            choice = self._grow(queue, i, is_resident)
            if choice is None:
                continue
            due = min(
                (
                    queue[m].request.deadline
                    for m in choice.members
                    if queue[m].request.deadline is not None
                ),
                default=math.inf,
            )
            if now + choice.seconds <= due + 1e-9:
                on_time.append((due, i, choice, is_resident))
        urgent = min(((d, i) for d, i, c, r in on_time if d < math.inf), default=None)
        if urgent is None:
            return None
        due, lead = urgent
        first = next(c for d, i, c, r in on_time if i == lead)
        fits = [
            (d, i, c)
            for d, i, c, r in on_time
            if r and i != lead and now + c.seconds + first.seconds <= due + 1e-9
        ]
        if fits and not any(r for d, i, c, r in on_time if i == lead):
            return min(fits, key=lambda x: (x[0], x[1]))[2]
        return first

    def _grow(self, queue: list[_Waiting], lead: int, is_resident: bool) -> _Choice | None:
        """The batch led by ``queue[lead]``, grown with its group's next members while it
        stays admissible; ``None`` if the leader alone is not."""
        r = queue[lead].request
        switch = 0.0 if is_resident else self.switch_estimate(r.pipeline)
        members = [lead]
        best = self._charge(queue, members, switch)
        if best is None:
            return None
        for j in range(lead + 1, len(queue)):
            if len(members) >= self.policy.batch:
                break
            q = queue[j].request
            if q.pipeline != r.pipeline or q.shape != r.shape:
                continue
            tried = self._charge(queue, [*members, j], switch)
            if tried is None:
                break  # a later member would overtake at least as much
            members.append(j)
            best = tried
        return best

    def _charge(self, queue: list[_Waiting], members: list[int], switch: float) -> _Choice | None:
        """What running ``members`` (ascending indexes; ``switch``: seconds to switch to
        them first) would charge each request it overtakes; ``None`` if that breaks the
        policy for one of them. Under rule 1-3 only a resident group overtakes, whose
        ``switch`` is 0; a batch chosen by deadline charges its switch too."""
        runs = [
            self.run_estimate(queue[m].request.pipeline, queue[m].request.work) for m in members
        ]
        choice = _Choice(members, seconds=switch + sum(runs))
        taken = set(members)
        k, t = self.policy.overtake, self.policy.delay_s
        for i in range(members[-1]):
            if i in taken:
                continue
            passed = sum(1 for m in members if m > i)
            s = sum(run for m, run in zip(members, runs, strict=True) if m > i)
            s += switch if members[0] > i else 0.0  # the switch was the leader's to make
            w = queue[i]
            if w.overtaken + passed > k or w.delay + s > t + 1e-9:
                return None
            choice.charges[i] = (passed, s)
        return choice
