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

When the tier cannot hold even one expert beside the text encoders and the rest (a
bf16 A14B on a 48 GB card: 11.4 GB of UMT5, 28.6 GB of expert, the activations), or
when it holds both experts only without them (an FP8 A14B on that card), the text
encoders leave too: the block holds them on entry, each call encodes its prompt
first (``encode_prompt``, as the call itself would), gives them back and only then
brings the first expert in, which may evict them (and prefetches the second where
their room makes it fit); a second call brings them back.

Listeners (:meth:`Experts.on_swap`) hear of each expert (and text encoder) that comes
in: a phase clock hooks its forward passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

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
    """``cache.use(name)`` (a :class:`~nostall.ModelCache`) of a two-expert pipeline: the
    other components held for the block, one expert at a time beside them (the cache's
    own switches, under its locks); the text encoders only while they encode where the
    tier cannot hold them beside an expert."""
    entry = cache.store.entry(name)
    others = frozenset(r for r, c in entry.components.items() if c is not None and c.weights)
    text = _leaving(cache, entry, roles, without)
    pipe, report, hold = cache._switch(name, mode="use", without=without | set(roles) | set(text))

    def switch(wanted: tuple[str, ...]) -> tuple[list[Any], Hold, SwitchReport]:
        leave = (others - set(wanted)) | without
        high = wanted == text  # the encoders leave soon: their room joins the free run
        _, rep, h = cache._switch(
            name, mode="use", without=leave, build=False, expert=True, high=high
        )
        with cache._lock:
            return [cache._modules.holding(entry.components[r]) for r in wanted], h, rep

    def prefetch(role: str) -> Future:
        leave = (others - {role}) | without
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
        pipe,
        roles,
        switch=switch,
        release=cache._release,
        prefetch=prefetch,
        check=check,
        text=text,
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


def _leaving(
    cache: Any, entry: PipelineEntry, roles: tuple[str, str], without: frozenset[str]
) -> tuple[str, ...]:
    """The text encoders that leave the device after encoding: all of them when the
    tier cannot hold them beside the rest and the larger expert, or when their leaving
    makes room for both experts at once (and the pipeline encodes as :func:`encoded`
    calls it); else none."""
    text = tuple(
        r
        for r, c in entry.components.items()
        if r.startswith("text_encoder") and r not in without and c is not None and c.weights
    )
    if not text:
        return ()
    import diffusers

    if _call_signature(getattr(diffusers, entry.class_name, None)) is None:
        return ()
    with cache._lock:
        size = {
            c.role: cache._tier.slot_size(cache._modules.plan(c)[0].target_bytes)
            for c in entry.distinct_weights(without)
        }
    budget, gone = cache._tier.budget, sum(size.get(r, 0) for r in text)
    both = sum(size.values())
    if both <= budget:  # everything at once
        return ()
    if both - gone <= budget:  # both experts, once the text encoders have encoded
        return text
    need = both - min(size[r] for r in roles)
    if need <= budget:  # one expert at a time beside the text encoders
        return ()
    lean = need - gone
    if lean > cache._tier.budget and _streams(cache, entry, roles, without, lean - budget):
        return text  # the expert switched in streams what does not fit (cache.partial)
    if lean > cache._tier.budget:  # refused on entry, not at the first call's switch
        raise cache._tier.no_room(
            f"{entry.name}'s larger expert beside the rest, even with its text encoders gone",
            lean,
            0,
        )
    return text


def _streams(cache: Any, entry: PipelineEntry, roles: Any, without: Any, short: int) -> bool:
    """Whether each expert can be served resident in part with ``short`` bytes fewer
    than it takes whole (the cache streams; its blocks can)."""
    if not cache.config.stream:
        return False
    from nostall.cache.device import GRANULE
    from nostall.cache.partial import least_bytes

    mirror = cache.device.type == "cpu"
    with cache._lock:
        for c in entry.distinct_weights(without):
            if c.role not in roles:
                continue
            whole = cache._tier.slot_size(cache._modules.plan(c)[0].target_bytes)
            inst = cache._modules.template(c)
            least = least_bytes(c, inst.module, inst.targets, mirror_file=mirror)
            if least is None or whole - least - GRANULE < short:
                return False
    return True


_ENCODE = (
    "prompt",
    "negative_prompt",
    "do_classifier_free_guidance",
    "num_videos_per_prompt",
    "prompt_embeds",
    "negative_prompt_embeds",
    "max_sequence_length",
    "device",
)


def _call_signature(cls: type | None) -> inspect.Signature | None:
    """The pipeline class's own ``__call__`` signature, when its ``encode_prompt``
    takes what :func:`encoded` passes (diffusers' Wan pipelines); else ``None``."""
    if cls is None or not callable(getattr(cls, "encode_prompt", None)):
        return None
    if not set(_ENCODE) <= set(inspect.signature(cls.encode_prompt).parameters):
        return None
    for c in cls.__mro__:
        fn = c.__dict__.get("__call__")
        if fn is not None:
            sig = inspect.signature(fn)
            if "prompt_embeds" in sig.parameters and "guidance_scale" in sig.parameters:
                return sig
    return None


def _keywords(
    pipe: Any, args: tuple, kwargs: dict[str, Any], sig: inspect.Signature | None = None
) -> dict[str, Any]:
    """A call's positional arguments named, by the pipeline class's own signature."""
    if sig is None:  # (the guarded class's own __call__ takes *args: the next one)
        sig = next(
            s
            for c in type(pipe).__mro__
            if "__call__" in c.__dict__
            for s in [inspect.signature(c.__dict__["__call__"])]
            if all(p.kind != p.VAR_POSITIONAL for p in s.parameters.values())
        )
    given = dict(sig.bind_partial(pipe, *args, **kwargs).arguments)
    given.pop(next(iter(sig.parameters)))  # self
    return given


def encoded(pipe: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments as keywords, with its prompt encoded now by the pipeline's
    own ``encode_prompt`` as its call would encode it (the call's defaults; guidance
    above 1 encodes the negative prompt too), ``prompt_embeds`` in place of the prompt.
    A call that brings its own embeddings is returned as it is."""
    sig = _call_signature(type(pipe))
    if sig is None:
        raise InternalError(f"{type(pipe).__name__} does not encode as the Wan pipelines do")
    given = _keywords(pipe, args, kwargs, sig)
    if given.get("prompt_embeds") is not None:
        return given

    def get(key: str) -> Any:
        if key in given:
            return given[key]
        default = sig.parameters[key].default if key in sig.parameters else None
        return None if default is inspect.Parameter.empty else default

    guidance = get("guidance_scale")
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(
            prompt=get("prompt"),
            negative_prompt=get("negative_prompt"),
            do_classifier_free_guidance=guidance is not None and guidance > 1.0,
            num_videos_per_prompt=get("num_videos_per_prompt") or 1,
            prompt_embeds=None,
            negative_prompt_embeds=get("negative_prompt_embeds"),
            max_sequence_length=get("max_sequence_length"),
            device=pipe._execution_device,
        )
    given.pop("prompt", None)
    given.pop("negative_prompt", None)
    return dict(given, prompt_embeds=embeds, negative_prompt_embeds=negative)


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

    ``switch(roles)`` brings ``roles`` to the device and returns the instances holding
    them (``.module``), the hold on them and the switch's report; ``release(hold)``
    gives a hold back; ``prefetch(role)`` moves ``role`` in beside the current one if
    the budget has room (a future; it may fail with :class:`~nostall.BudgetExceeded`);
    ``check(inst, hold)`` refuses an instance that no longer holds its weights and
    orders a stream new to the hold after their copy. ``text``: the text encoders
    that leave after encoding (none: they are held with the rest for the block).
    """

    def __init__(
        self,
        pipe: Any,
        roles: tuple[str, str],
        *,
        switch: Callable[[tuple[str, ...]], tuple[list[Any], Hold, SwitchReport]],
        release: Callable[[Hold], None],
        prefetch: Callable[[str], Future],
        check: Callable[[Any, Hold], None],
        text: tuple[str, ...] = (),
    ):
        self.pipe = pipe
        self.roles = roles
        self.text = text
        self._switch = switch
        self._release = release
        self._prefetch = prefetch
        self._check = check
        self.reports: list[SwitchReport] = []  # the switches inside calls
        self._listeners: list[Callable[[str, Any], None]] = []
        self._role: str | None = None
        self._hold: Hold | None = None
        self._inst: Any = None
        self._text_hold: Hold | None = None
        self._text_insts: list[Any] = []
        self._ahead: Future | None = None
        self._timesteps: list[float] | None = None

    @property
    def current(self) -> str | None:
        """The expert on the device for this block now."""
        return self._role

    def on_swap(self, fn: Callable[[str, Any], None]) -> None:
        """Call ``fn(role, module)`` for each expert (or text encoder) that comes in
        after this call."""
        self._listeners.append(fn)

    def enter(self) -> SwitchReport:
        """At the block's entry: the first expert in, or the text encoders where they
        leave before it; that switch's report."""
        if self.text:  # (one expert beside the rest does not fit: two cannot either)
            return self._bring_text(report=False)
        report = self._bring(self.roles[0], report=False)
        self._ahead = self._prefetch(self.roles[1])
        return report

    def call_kwargs(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Before a call of the pipeline (``args``, ``kwargs``): its prompt encoded
        first where the text encoders leave, the first expert in (a second call of the
        block starts again from it), checked, and the call's keywords with a step-end
        callback that switches at the boundary."""
        if self.text:
            if kwargs.get("prompt_embeds") is None:
                if self._text_hold is None:
                    self._leave_expert()
                    self._bring_text()
                for inst in self._text_insts:
                    self._check(inst, self._text_hold)
            kwargs = encoded(self.pipe, args, kwargs)
            self._leave_text()
        elif args:
            kwargs = _keywords(self.pipe, args, kwargs)
        if self._role != self.roles[0]:
            self._bring(self.roles[0])
            if self.text and self._ahead is None:  # room the encoders left, if enough
                self._ahead = self._prefetch(self.roles[1])
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
        can be lifted after it), the holds given back, the pipeline left without its
        experts (and leaving text encoders)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.cancel():
            with contextlib.suppress(Exception):  # (its failure was a prefetch's: no room)
                ahead.result()
        try:
            self._leave_text()
        finally:
            self._leave_expert()

    # ---- inside ------------------------------------------------------------------

    def _crossing(self, pipe: Any, i: int) -> bool:
        """Whether step ``i + 1`` runs below the boundary (diffusers' own test,
        ``t >= boundary`` for the first expert, on the scheduler's timesteps)."""
        if self._timesteps is None:  # once per call: one read of the device's timesteps
            self._timesteps = [float(t) for t in pipe.scheduler.timesteps.cpu()]
        ts = self._timesteps
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        return i + 1 < len(ts) and ts[i + 1] < boundary

    def _leave_expert(self) -> None:
        old, self._hold = self._hold, None
        for r in self.roles:
            self.pipe.__dict__[r] = None
        self._role = self._inst = None
        if old is not None:
            self._release(old)

    def _leave_text(self) -> None:
        old, self._text_hold = self._text_hold, None
        for r in self.text:
            self.pipe.__dict__[r] = None
        self._text_insts = []
        if old is not None:
            self._release(old)  # its kernels fence the switch that may evict it

    def _bring_text(self, *, report: bool = True) -> SwitchReport:
        insts, hold, rep = self._switch(self.text)
        self._text_hold, self._text_insts = hold, insts
        for role, inst in zip(self.text, insts, strict=True):
            self.pipe.__dict__[role] = inst.module
            for fn in self._listeners:
                fn(role, inst.module)
        if report:
            self.reports.append(rep)
        return rep

    def _bring(self, role: str, *, report: bool = True) -> SwitchReport:
        self._leave_expert()  # first: the switch may evict the leaving expert
        ahead, self._ahead = self._ahead, None
        if ahead is not None and role == self.roles[1]:
            try:
                ahead.result()
            except BudgetExceeded as e:  # one expert at a time: switched now instead
                log.debug("the second expert was not prefetched: %s", e)
            except Exception as e:  # the switch below says what is wrong, if it still is
                log.warning("prefetching the second expert failed: %s", e)
        (inst,), hold, rep = self._switch((role,))
        self._hold, self._inst, self._role = hold, inst, role
        self.pipe.__dict__[role] = module = inst.module
        if report:
            self.reports.append(rep)
        for fn in self._listeners:
            fn(role, module)
        return rep
