"""Two denoising experts in one call: the second switched in at the boundary step.

Wan 2.2's A14B pipelines run ``transformer`` (the high-noise expert) for the timesteps
at or above ``boundary_ratio × num_train_timesteps`` and ``transformer_2`` (the
low-noise one) below it; each is 28.6 GB in bf16, so on a 48 GB card both cannot be
resident beside the text encoder. A ``use()`` block of such a pipeline therefore holds
the other components and only the expert that computes now: the first on entry, and,
in the step-end callback of the step before the boundary, the second, through an
ordinary switch of that one component (the first's memory is released first, so the
switch may evict it; the copy waits, by the hold's events, for the kernels that read
it). When the device tier has room for both, the second is prefetched on the copy
stream as soon as the block begins, while the first computes, and the boundary finds it
resident.

The pipeline object is built without either expert (``None``, as diffusers allows);
:class:`Experts` sets the one in use as the pipeline's attribute and checks, before
every call, that it still holds its weights. A second call in the same block starts
again from the first expert.

Listeners (:meth:`Experts.on_swap`) hear of each expert that comes in: a phase clock
hooks its forward passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from nostall.cache.holds import Hold
from nostall.cache.report import SwitchReport
from nostall.errors import BudgetExceeded, InternalError
from nostall.store.catalog import PipelineEntry

__all__ = ["Experts", "expert_roles", "use_experts"]

log = logging.getLogger("nostall.cache")

ROLES = ("transformer", "transformer_2")


def expert_roles(entry: PipelineEntry, without: frozenset[str]) -> tuple[str, str] | None:
    """``("transformer", "transformer_2")`` when ``entry`` is a two-expert pipeline
    (both present with distinct weights and a ``boundary_ratio``) and neither is left
    out; else ``None``."""
    if entry.config.get("boundary_ratio") is None or any(r in without for r in ROLES):
        return None
    comps = [entry.components.get(r) for r in ROLES]
    if any(c is None or not c.weights for c in comps):
        return None
    if comps[0].digest == comps[1].digest:  # one module's bytes: nothing to switch
        return None
    return ROLES


@contextlib.contextmanager
def use_experts(
    cache: Any, name: str, without: frozenset[str], roles: tuple[str, str]
) -> Iterator[Any]:
    """``cache.use(name)`` (a :class:`~nostall.ModelCache`) of a two-expert pipeline: the other components held for the
    block, one expert at a time beside them (the cache's own switches, under its locks)."""
    entry = cache.store.entry(name)
    others = frozenset(r for r, c in entry.components.items() if c is not None and c.weights)
    pipe, report, hold = cache._switch(name, mode="use", without=without | set(roles))

    def switch(role: str) -> tuple[Any, Hold, SwitchReport]:
        _, rep, h = cache._switch(
            name, mode="use", without=others - {role}, build=False, expert=True
        )
        with cache._lock:
            return cache._modules.holding(entry.components[role]), h, rep

    def prefetch(role: str) -> Future:
        leave = others - {role}
        return cache._prefetcher.submit(
            lambda: cache._switch(name, mode="prefetch", without=leave, expert=True)[1]
        )

    def check(inst: Any, h: Hold) -> None:
        cache._check_open()
        stream = cache._stream()
        if inst.slot is None or not inst.slot.ready or h.digests.isdisjoint({inst.digest}):
            raise InternalError(
                f"pipeline {name!r}: an expert left the device inside its use() block"
            )
        if h.note(stream) and inst.slot.done is not None:
            stream.wait_event(inst.slot.done)

    experts = Experts(
        pipe, roles, switch=switch, release=cache._release, prefetch=prefetch, check=check
    )
    try:
        first = experts.enter()
        _merge(cache, report, first)
        object.__setattr__(pipe, "nostall_experts", experts)
        yield pipe
    finally:
        object.__setattr__(pipe, "nostall_experts", None)
        try:
            experts.close()
        finally:
            # A prefetched second expert the block never reached stays protected until a
            # switch uses it, and protected memory is never evicted: lift it.
            with cache._lock:
                cache._protected.discard(entry.components[roles[1]].digest)
            cache._release(hold)


def _merge(cache: Any, base: SwitchReport, expert: SwitchReport) -> None:
    """One report for a block's entry: the base components' switch and its first
    expert's, in the order they ran."""
    with cache._lock:
        for r in (base, expert):
            with contextlib.suppress(ValueError):
                cache.reports.remove(r)
        cache.reports.append(
            dataclasses.replace(
                base,
                total_s=base.total_s + expert.total_s,
                components=base.components + expert.components,
                evicted=base.evicted + expert.evicted,
                wait_s=base.wait_s + expert.wait_s,
            )
        )


class Experts:
    """The experts of one ``use()`` block of pipeline ``pipe``.

    ``switch(role)`` brings ``role`` to the device and returns the instance holding it
    (``.module``), the hold on it and the switch's report; ``release(hold)`` gives a
    hold back; ``prefetch(role)`` moves ``role`` in beside the current one if the budget
    has room (a future; it may fail with :class:`~nostall.BudgetExceeded`);
    ``check(inst, hold)`` refuses an instance that no longer holds its weights and
    orders a stream new to the hold after their copy.
    """

    def __init__(
        self,
        pipe: Any,
        roles: tuple[str, str],
        *,
        switch: Callable[[str], tuple[Any, Hold, SwitchReport]],
        release: Callable[[Hold], None],
        prefetch: Callable[[str], Future],
        check: Callable[[Any, Hold], None],
    ):
        self.pipe = pipe
        self.roles = roles
        self._switch = switch
        self._release = release
        self._prefetch = prefetch
        self._check = check
        self.reports: list[SwitchReport] = []  # the switches at boundaries (and back)
        self._listeners: list[Callable[[str, Any], None]] = []
        self._role: str | None = None
        self._hold: Hold | None = None
        self._inst: Any = None
        self._ahead: Future | None = None
        self._timesteps: list[float] | None = None

    @property
    def current(self) -> str | None:
        """The expert on the device for this block now."""
        return self._role

    def on_swap(self, fn: Callable[[str, Any], None]) -> None:
        """Call ``fn(role, module)`` for each expert that comes in after this call."""
        self._listeners.append(fn)

    def enter(self) -> SwitchReport:
        """The first expert in (at the block's entry); its switch's report."""
        report = self._bring(self.roles[0], report=False)
        self._ahead = self._prefetch(self.roles[1])
        return report

    def call_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Before a call of the pipeline: the first expert in (a second call of the
        block starts again from it), checked, and ``kwargs`` with a step-end callback
        that switches at the boundary."""
        if self._role != self.roles[0]:
            self._bring(self.roles[0])
        self._check(self._inst, self._hold)
        self._timesteps = None
        user = kwargs.get("callback_on_step_end")
        tensor_inputs = getattr(user, "tensor_inputs", None)  # diffusers' PipelineCallback

        def step_end(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            out = user(pipe, i, t, tensors) if user is not None else {}
            if self._role == self.roles[0] and self._crossing(pipe, i):
                self._bring(self.roles[1])
            return out if out is not None else {}

        kwargs = dict(kwargs, callback_on_step_end=step_end)
        if tensor_inputs is not None:
            kwargs["callback_on_step_end_tensor_inputs"] = list(tensor_inputs)
        return kwargs

    def close(self) -> None:
        """The block ended: a prefetch still running waited for (so that its protection
        can be lifted after it), the expert's hold given back, the pipeline left
        without one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.cancel():
            with contextlib.suppress(Exception):  # (its failure was a prefetch's: no room)
                ahead.result()
        hold, self._hold = self._hold, None
        for role in self.roles:
            self.pipe.__dict__[role] = None
        self._role = self._inst = None
        if hold is not None:
            self._release(hold)

    # ---- inside ------------------------------------------------------------------

    def _crossing(self, pipe: Any, i: int) -> bool:
        """Whether step ``i + 1`` runs below the boundary (diffusers' own test,
        ``t >= boundary`` for the first expert, on the scheduler's timesteps)."""
        if self._timesteps is None:  # once per call: one read of the device's timesteps
            self._timesteps = [float(t) for t in pipe.scheduler.timesteps.cpu()]
        ts = self._timesteps
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        return i + 1 < len(ts) and ts[i + 1] < boundary

    def _bring(self, role: str, *, report: bool = True) -> SwitchReport:
        old, self._hold = self._hold, None
        if old is not None:
            for r in self.roles:
                self.pipe.__dict__[r] = None
            self._release(old)  # first: the switch may evict the leaving expert
        ahead, self._ahead = self._ahead, None
        if ahead is not None and role == self.roles[1]:
            try:
                ahead.result()
            except BudgetExceeded as e:  # one expert at a time: switched now instead
                log.debug("the second expert was not prefetched: %s", e)
            except Exception as e:  # the switch below says what is wrong, if it still is
                log.warning("prefetching the second expert failed: %s", e)
        inst, hold, rep = self._switch(role)
        self._hold, self._inst, self._role = hold, inst, role
        self.pipe.__dict__[role] = module = inst.module
        if report:
            self.reports.append(rep)
        for fn in self._listeners:
            fn(role, module)
        return rep
