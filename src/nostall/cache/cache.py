"""``ModelCache``: switch whole diffusers pipelines among three tiers at link speed.

Tiers, fastest first: **gpu** (the device tier: one allocation carved into component
slots, :mod:`~nostall.cache.device`), **host** (immutable pinned copies,
:mod:`~nostall.cache.host`), **disk** (the store). A switch asks, component by
component (shared components once), where the weights are:

* on the device: nothing to do;
* in the host tier: one copy per slab on the copy stream, issued back to back for
  every component, with the modules re-pointed while the link is busy;
* on disk: parallel reads into a pool block (when the host tier admits it) or the
  staging ring, each chunk copied as it lands.

Leaving the device costs nothing (the host copy never changed), so eviction is
bookkeeping. Budgets are bytes. Components of a pipeline in use (``with
cache.use(name)``) are never evicted, nor those of a prefetch until it is used.

Who decides what: :mod:`~nostall.cache.placement` (pure) decides who leaves and
where a component goes; the tiers (:mod:`~nostall.cache.device`,
:mod:`~nostall.cache.host`) apply it; :mod:`~nostall.cache.moves` issues the copies;
:mod:`~nostall.cache.holds` counts the ``use()`` blocks; :mod:`~nostall.cache.pipelines`
lends pipeline objects. This module runs the switch.

Locks: ``_switching`` admits one switch at a time (they share one copy stream);
``_lock`` guards the tiers' state and is never held across a copy or a read, so a
``use`` block can end, and ``stats()`` answer, while a switch copies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from nostall.adapters import Fusions, Lora, Shelf, check_fits, lora_bytes, lora_weights
from nostall.adapters.lora import adaptable
from nostall.cache import placement
from nostall.cache.config import CacheConfig, resolve_config
from nostall.cache.controlnets import attached as attach_controlnet
from nostall.cache.controlnets import listed as listed_controlnets
from nostall.cache.device import DeviceTier, Slot, room_beside
from nostall.cache.experts import expert_roles, use_experts
from nostall.cache.holds import Hold, Holds
from nostall.cache.host import HostTier, cpu_tier_bytes, parse_host_tier, store_bytes
from nostall.cache.modules import Instance, Instances
from nostall.cache.moves import Move, issue
from nostall.cache.parking import park
from nostall.cache.partial import host_refused, no_loras_streamed, streamed_in_switch
from nostall.cache.pipelines import Pipelines
from nostall.cache.report import CacheStats, ComponentSwitch, SwitchReport, collect_stats
from nostall.errors import (
    ArgumentError,
    BudgetExceeded,
    ClosedError,
    InternalError,
    UnsupportedError,
)
from nostall.memory.events import event_done
from nostall.memory.host import memory_limit
from nostall.store.catalog import ComponentEntry, PipelineEntry, Store
from nostall.transfer.loader import Loader, resolve_device

__all__ = ["CacheConfig", "CacheStats", "ModelCache"]

log = logging.getLogger("nostall.cache")


class ModelCache:
    """Diffusers pipelines from a store, switched among GPU, pinned host and disk tiers.

    Args:
        models: a :class:`~nostall.cache.Store`, a folder of pipeline folders (each
            addressed by its folder name) or a mapping ``name → pipeline folder``; a
            folder or mapping is served by the process's one store of it
            (:meth:`Store.shared`), which other users of that folder share.
        config: how the cache runs (:class:`~nostall.cache.config.CacheConfig`: device,
            the tiers' budgets, dtype, variant, watermark, ...); or give its fields as
            keyword arguments (``device="cpu", gpu_budget=...``), not both.
        loader: the :class:`~nostall.transfer.loader.Loader` to read and copy with
            (default: one of the cache's own, closed with it).

    A cache dropped without :meth:`close` gives its tiers and its prefetch thread back
    when it is collected (never at interpreter exit, when CUDA may be gone first: the
    process's end frees them then).

    >>> cache = nostall.ModelCache("/models", device="cuda", gpu_budget=36 << 30)  # doctest: +SKIP
    >>> with cache.use("flux-dev") as pipe:  # doctest: +SKIP
    ...     image = pipe("a cat", num_inference_steps=28).images[0]
    >>> print(cache.last_report.table())  # doctest: +SKIP
    """

    def __init__(
        self,
        models: Store | str | os.PathLike | Mapping[str, str | os.PathLike],
        *,
        config: CacheConfig | None = None,
        loader: Loader | None = None,
        **options: Any,
    ):
        config = resolve_config(CacheConfig, config, options, "ModelCache")
        self.config = config
        self.device = resolve_device(config.device)
        shared = parse_host_tier(config.host_tier)
        self.store = Store.shared(models, variant=config.variant, cache_dir=config.cache_dir)
        self.dtype = dtype = config.dtype
        self.watermark = config.watermark
        self.wait_s = wait_s = config.wait_s
        limit = memory_limit()[0] or (16 << 30)
        gpu_budget = config.gpu_budget
        if gpu_budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                gpu_budget = int(free * 0.8)
            else:  # ordinary memory, committed at the first switch: what the store needs
                gpu_budget = cpu_tier_bytes(self.store, limit // 4)
        loras = os.path.join(self.store.root, "loras") if self.store.root else None
        on_disk = lora_bytes(loras)
        lora_budget = config.lora_budget
        loras_host = lora_budget if lora_budget is not None else min(on_disk, limit // 8)
        host = config.host_budget or (store_bytes(self.store, limit // 2) + loras_host)
        if lora_budget is None:
            lora_budget = min(on_disk, host // 4)
        if lora_budget >= host:
            raise ArgumentError(
                f"lora_budget={lora_budget} leaves nothing of host_budget={host} for the "
                "pipelines' components; give a larger host budget or a smaller LoRA budget",
                field="lora_budget",
            )
        self._tier = DeviceTier(self.device, gpu_budget)
        self._host = HostTier(host - lora_budget, self.device, shared=shared)
        self.activation_reserve = config.activation_reserve
        self._own_loader = loader is None
        self._loader = loader or Loader()
        self._pipelines = Pipelines()
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)
        self._switching = threading.Lock()
        self._modules = Instances(dtype, mirror_file=self.device.type == "cpu")
        self._holds = Holds()
        # LoRAs: read from <store>/loras (or paths), fused into resident modules per use()
        self._shelf = Shelf(loras, lora_budget, device=self.device)
        self._fusions = Fusions(
            wait_s, room=lambda d, n: room_beside(d, n, self.activation_reserve)
        )
        self._fitted: dict[int, tuple[Any, tuple[int, ...]]] = {}  # LoRAs checked, on what
        root = self.store.root
        self._controlnets = os.path.join(root, "controlnets") if root else None
        self._protected: set[str] = set()  # prefetched, not used yet
        self._partials: dict[str, Any] = {}  # the switch being planned: what streams
        self._high = False
        self._current: set[str] = set()  # the last pipeline handed out without use()
        self._roles: dict[str, set[tuple[str, str]]] = {}  # digest -> {(pipeline, role)}
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="nostall-prefetch")
        # What close() gives back, for a cache collected without it. Not at interpreter
        # exit (atexit False): torch and CUDA may be torn down before it would run.
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._prefetcher,
            self._tier,
            self._shelf,
            self._host,
            self._loader if self._own_loader else None,
        )
        self._finalizer.atexit = False
        self.reports: deque[SwitchReport] = deque(maxlen=256)
        self._tick = 0  # switches so far: the device tier's recency clock
        self._closed = False

    # ---- public ------------------------------------------------------------------

    def names(self) -> list[str]:
        """The pipelines the store holds."""
        return self.store.names()

    def loras(self) -> list[str]:
        """The LoRA names under ``<store>/loras``."""
        return self._shelf.names()

    def lora(self, name: str, pipeline: str) -> Lora:
        """LoRA ``name`` (a name under ``<store>/loras`` or a path) as read for
        ``pipeline``'s class: read now if new or changed on disk, else as kept.
        :class:`~nostall.UnknownModel`, :class:`~nostall.CheckpointError` for a file that
        is not a readable LoRA. Its factors may view the cache's LoRA memory: that block
        stays held while the returned object lives."""
        entry = self.store.entry(pipeline)
        return self._shelf.get(name, entry.class_name, entry.folder)

    def pipeline(self, name: str, *, without: Iterable[str] = ()) -> Any:
        """Switch to ``name``; return its diffusers pipeline, weights on the device.

        The pipeline stays usable until a later switch needs its memory or its modules
        (calling it then raises :class:`~nostall.ClosedError`); hold it with
        :meth:`use` where other switches may happen meanwhile. ``without``: as in
        :meth:`use`.
        """
        pipe = self._switch(name, mode="pipeline", without=without)[0]
        self._fusions.leave(self._fusions.enter(adaptable(pipe), []))  # the base's weights
        return pipe

    @contextlib.contextmanager
    def use(
        self,
        name: str,
        *,
        without: Iterable[str] = (),
        loras: Mapping[str, float] | Iterable[tuple[str, float]] | None = None,
        controlnet: str | os.PathLike | None = None,
    ) -> Iterator[Any]:
        """Switch to ``name`` and hold it: nothing of it is evicted inside the block.

        The block may end on another thread than the one that entered it (as with
        ``asyncio.to_thread``); it may call the pipeline from any thread and stream.

        ``without``: weights components (roles) to leave out: they are not moved, and
        the pipeline gets ``None`` for them, as diffusers allows. A worker whose prompts
        are encoded elsewhere leaves out the text encoders and passes ``prompt_embeds``.

        ``loras``: ``{name: weight}`` (or ``[(name, weight)]``), fused into the
        pipeline's resident weights for the block (:mod:`nostall.adapters`); a name is
        ``<store>/loras/<name>.safetensors`` or a path. Without them the pipeline is the
        base, bit for bit, whatever an earlier block fused. Blocks that want other LoRAs
        on the same modules wait for each other; the weights never mix.

        ``controlnet``: a ControlNet (``<store>/controlnets/<name>/``, or a folder) to
        attach: the block gets diffusers' ControlNet pipeline for this one (SD, SDXL,
        SD3, FLUX), built once, over the same resident modules; only the ControlNet's
        weights move, through the tiers like any component. Pass the control image and
        ``controlnet_conditioning_scale`` when calling it.

        >>> with cache.use("sdxl") as pipe:  # doctest: +SKIP
        ...     image = pipe("a lighthouse").images[0]
        >>> with cache.use("flux", loras={"ghibli": 0.8, "detail": 0.4}) as pipe:  # doctest: +SKIP
        ...     image = pipe("a lighthouse").images[0]
        >>> with cache.use("flux", without=["text_encoder", "text_encoder_2"]) as pipe:  # doctest: +SKIP
        ...     image = pipe(prompt_embeds=t5, pooled_prompt_embeds=clip).images[0]
        """
        wanted = lora_weights(loras)  # checked before anything moves
        base = name
        experts = None
        if controlnet is not None:
            name = attach_controlnet(self.store, self._controlnets, name, controlnet)
        else:
            experts = expert_roles(self.store.entry(name), _roles(without))
        if experts is not None:
            if wanted:
                raise UnsupportedError(
                    f"{name}: LoRAs on a two-expert pipeline (transformer and "
                    "transformer_2) are not served yet; call it without loras"
                )
            with use_experts(self, name, _roles(without), experts) as pipe:
                yield pipe
            return
        pipe, _, hold = self._switch(name, mode="use", without=without)
        entered: list[Any] = []
        try:
            if wanted:
                no_loras_streamed(self, name, hold.digests)
            entered = self._attach(base, pipe, wanted, _roles(without))
            hold.name, hold.without, hold.parkable = name, _roles(without), not wanted
            yield pipe
        finally:
            self._fusions.leave(entered)
            self._release(hold)

    def parked(self) -> contextlib.AbstractContextManager[int]:
        """Inside ``use()`` blocks (on their thread, say at a step boundary of their
        call): let their pipelines leave the device while the ``with`` block runs other
        switches, and bring them back, into the very modules their call holds, before it
        ends (:mod:`~nostall.cache.parking`). Yields the bytes that may leave."""
        return park(self)

    def controlnets(self) -> list[str]:
        """The ControlNet names under ``<store>/controlnets``."""
        return listed_controlnets(self._controlnets)

    def _attach(
        self, name: str, pipe: Any, wanted: list[tuple[str, float]], without: frozenset[str]
    ) -> list[Any]:
        """Fuse ``wanted`` into ``pipe``'s modules (or restore their base); the modules
        entered, for :meth:`Fusions.leave`."""
        modules = adaptable(pipe)
        loras = [(self.lora(n, name), w) for n, w in wanted]
        ids = tuple(id(m) for m in modules.values())
        for lora, _ in loras:
            left = sorted(set(lora.roles) & set(without))
            if left:
                raise ArgumentError(
                    f"LoRA {lora.name!r} adapts {', '.join(left)}, which this switch leaves "
                    "out (prompts encoded elsewhere would not see it); use it with them",
                    field="loras",
                )
            fitted = self._fitted.get(id(lora))
            if fitted is None or fitted[0]() is not lora or fitted[1] != ids:
                check_fits(lora, modules)  # (5 ms for a FLUX LoRA: once per LoRA read)
                self._fitted = {k: v for k, v in self._fitted.items() if v[0]() is not None}
                self._fitted[id(lora)] = (weakref.ref(lora), ids)
        return self._fusions.enter(modules, loras)

    def prefetch(self, name: str, *, without: Iterable[str] = ()) -> Future[SwitchReport]:
        """Move ``name``'s missing components to the device now, on the copy stream, while
        the current pipeline computes; returns a future of the prefetch's report.

        Budgets decide what the prefetch may evict: never a component in use, nor the
        last pipeline handed out. The prefetched components are protected until a
        switch to ``name`` uses them (or another prefetch replaces them). A prefetch
        that finds no room fails its future with :class:`~nostall.BudgetExceeded`.
        """
        self._check_open()
        without = _roles(without)
        self.store.entry(name).distinct_weights(without)  # bad names fail here, not later
        return self._prefetcher.submit(
            lambda: self._switch(name, mode="prefetch", without=without)[1]
        )

    def prepare(self, *names: str) -> None:
        """Do now, off the request path, what the first switch would otherwise do: take
        the device tier's memory, pin the host tier, start the copy stream, import
        diffusers and transformers, read (and digest) the named pipelines' folders,
        build their modules on ``meta`` and load their tokenizers and scheduler
        configs. No weights move. A worker calls it at boot."""
        self._check_open()
        import diffusers  # noqa: F401  (seconds of imports a first request must not pay)
        import transformers  # noqa: F401

        entries = [self.store.entry(name) for name in names]
        with self._lock:
            self._tier.buffer()
            for entry in entries:
                for c in entry.components.values():
                    if c is None:
                        continue
                    if c.weights:
                        self._modules.plan(c)
                    else:
                        self._pipelines.assembler.files_component(c)
            self._modules.booted()
        self._host.pool.wait_pinned()
        self._loader.prepare(self.device)

    @property
    def last_report(self) -> SwitchReport | None:
        """The last switch to a pipeline (``use``, ``pipeline``, ``prefetch``); a
        two-expert pipeline's switches of its experts inside the block are in
        ``pipe.nostall_experts.reports`` (and in :attr:`reports`, marked ``expert``)."""
        return next((r for r in reversed(self.reports) if not r.expert), None)

    def stats(self) -> CacheStats:
        """Bytes per tier and every known component's tier."""
        with self._lock:
            return collect_stats(self)

    def resident(self, name: str, *, without: Iterable[str] = ()) -> bool:
        """Whether every weights component of ``name`` (less the roles in ``without``,
        as in :meth:`use`) is on the device now: a switch to it would move nothing. A
        scheduler runs such requests first; the answer may change with the next switch."""
        comps = self.store.entry(name).distinct_weights(_roles(without))
        with self._lock:
            slots = self._tier.slots
            return all((s := slots.get(c.digest)) is not None and s.ready for c in comps)

    def evict(self, tier: str = "gpu") -> int:
        """Drop every idle component from ``"gpu"``, ``"host"`` or ``"all"`` tiers; returns
        the bytes freed (benchmarks use it to start from a known state)."""
        if tier not in ("gpu", "host", "all"):
            raise ArgumentError(f"tier={tier!r}; choose 'gpu', 'host' or 'all'")
        freed = 0
        with self._switching, self._lock:
            if tier in ("gpu", "all"):
                for slot in [s for s in self._tier.slots.values() if s.uses == 0]:
                    freed += slot.size
                    self._evict_slot(slot)
                self._protected.clear()
                self._current.clear()
            if tier in ("host", "all"):
                freed += self._host.evict_all()
        return freed

    def close(self) -> None:
        """Stop prefetching, give back the device tier, unpin the host tier. Idempotent.
        The device memory is free once nothing outside the cache holds a pipeline or
        module it handed out (their weights view the tier)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._prefetcher.shutdown(wait=True)
        with self._switching, self._lock:
            self._tier.close()
            self._pipelines.clear()
            self._modules.clear()
            self._fusions.clear()
        self._shelf.close()
        self._host.close()
        if self._own_loader:
            self._loader.close()
        self._finalizer.detach()  # all given back

    def __enter__(self) -> ModelCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the switch --------------------------------------------------------------

    def _switch(
        self,
        name: str,
        *,
        mode: str,
        without: Iterable[str] = (),
        build: bool = True,
        expert: bool = False,
        high: bool = False,
        resume: Hold | None = None,
    ) -> tuple[Any, SwitchReport, Hold | None]:
        t0 = time.perf_counter()
        self._check_open()
        entry = self.store.entry(name)
        without = _roles(without)
        comps = entry.distinct_weights(without)
        keep = {c.digest for c in comps}
        hold = None
        with self._switching:
            t_locked = time.perf_counter()
            with self._lock:
                self._check_open()
                self._tick += 1
                for c in comps:
                    self._roles.setdefault(c.digest, set()).add((name, c.role))
                self._high = high  # (new slots at their runs' tops: they leave soon)
                try:
                    moves, rows, evicted, waited = self._plan(comps, keep, mode)
                finally:
                    self._high = False
                for c in comps:
                    self._tier.slots[c.digest].last_used = self._tick
                # Claimed before the lock is let go: no other switch may evict them now.
                if mode == "use":
                    hold = self._holds.take(keep) if resume is None else resume
                    hold.parked = False  # (a parked hold holds again)
                    for d in keep:
                        self._tier.slots[d].uses += 1
                if mode == "prefetch":
                    self._protected = set(keep)
                else:
                    self._protected -= keep
                    if mode == "pipeline":
                        self._current = set(keep)
            try:
                issue(
                    moves,
                    loader=self._loader,
                    tier=self._tier,
                    pool=self._host.pool,
                    device=self.device,
                    prefetch=mode == "prefetch",
                )
            except BaseException:
                with self._lock:
                    for mv in moves:  # half-copied content must never count as resident
                        if self._tier.slots.get(mv.c.digest) is mv.slot:
                            mv.slot.uses = 0
                            self._evict_slot(mv.slot)
                    if hold is not None and resume is None:
                        self._release_locked(hold, record=False)
                    elif hold is not None:  # parked again: its block's end gives nothing back
                        for d in keep:
                            slot = self._tier.slots.get(d)
                            if slot is not None and slot.uses:
                                slot.uses -= 1
                        hold.parked = True
                raise
            self._fusions.reloaded(mv.inst.module for mv in moves)  # base bytes again
            with self._lock:
                for mv in moves:
                    mv.slot.ready = True
            for mv in moves:
                if mv.pending.digests is not None:
                    self._learn(mv.c, mv.pending.digests)
            stream = self._stream()
            if hold is not None:
                hold.note(stream)  # ordered after the copies just below
            with self._lock:
                pipe = (
                    self._pipeline_for(entry, without, hold)
                    if build and mode != "prefetch"
                    else None
                )
            if mode != "prefetch" and stream is not None:
                # A prefetch did not join the copies to its stream: the consumer does.
                for c in comps:
                    done = self._tier.slots[c.digest].done
                    if done is not None:
                        stream.wait_event(done)
        rows.update({mv.c.digest: mv.row() for mv in moves})
        report = SwitchReport(
            pipeline=name,
            device=str(self.device),
            total_s=time.perf_counter() - t0,
            components=tuple(rows[c.digest] for c in comps),
            evicted=tuple(evicted),
            prefetch=mode == "prefetch",
            wait_s=(t_locked - t0) + waited,
            left_out=tuple(sorted(without)),
            expert=expert,
        )
        self.reports.append(report)
        log.info("%s", report.line())
        return pipe, report, hold

    def _plan(self, comps: list[ComponentEntry], keep: set[str], mode: str):
        """Decide, under the lock, where every missing component goes (evicting as needed)."""
        gpu = "gpu" if self.device.type == "cuda" else "device"
        rows: dict[str, ComponentSwitch] = {}
        evicted: list[str] = []
        self._host.begin()
        missing, priors = [], {}
        for c in comps:
            self._host.bind(c)
            prior = priors[c.digest] = self._host.request(c.digest)
            slot = self._tier.slots.get(c.digest)
            if slot is not None and slot.ready:
                inst = self._modules.viewing(c.digest)
                part = inst.partial if inst is not None else None
                streamed = part.plan.streamed_bytes if part is not None else 0
                rows[c.digest] = ComponentSwitch(
                    c.role, c.class_name, c.digest[:12], slot.nbytes, gpu, streamed=streamed
                )
                continue
            plan, build_s = self._modules.plan(c)
            missing.append((c, prior, plan, build_s))
        self._partials = self._streamed(comps, missing)
        # Largest first: small slots placed first would cut the free runs a large one needs.
        missing.sort(key=lambda m: -self._need(m[0], m[2]))
        try:
            moves, waited = self._place_all(missing, keep, mode, evicted, sticky=True)
        except BudgetExceeded:
            # Going back to old offsets can cut the free space into runs too short for the
            # largest component: place this switch's new slots again, best fit only.
            try:
                moves, waited = self._place_all(missing, keep, mode, evicted, sticky=False)
            except BudgetExceeded:
                # Its own resident components can cut the tier so (a shared text encoder
                # between the runs a transformer needs): those not in use leave too, and
                # everything is placed again, largest first.
                again = [
                    c
                    for c in comps
                    if c.digest in rows and self._evictable(self._tier.slots[c.digest], set(), mode)
                ]
                if not again or mode == "prefetch":
                    raise
                for c in again:
                    self._evict_slot(self._tier.slots[c.digest], evicted)
                    del rows[c.digest]
                    missing.append((c, priors[c.digest], *self._modules.plan(c)))
                missing.sort(key=lambda m: -self._need(m[0], m[2]))
                moves, waited = self._place_all(missing, keep, mode, evicted, sticky=False)
        streaming = self._modules.streaming()  # (their rings read the host tier's copies)
        for mv, (_, prior, plan, _) in zip(moves, missing, strict=True):
            mv.partial = self._partials.get(mv.c.digest)
            if mv.tier == "disk":
                force = mv.partial is not None
                mv.cached = self._host.admit(
                    mv.c.digest, plan.host_bytes, prior, keep | streaming, force=force
                )
                if force and not mv.cached:
                    for m in moves:
                        if not m.in_place:
                            self._evict_slot(m.slot)
                    raise host_refused(self._describe(mv.c.digest), plan, self._host.budget)
        self._partials = {}
        return moves, rows, evicted, waited

    def _streamed(self, comps: list[ComponentEntry], missing: list) -> dict[str, Any]:
        """The partial layouts of this switch's components that stream (cache.partial)."""
        return (
            streamed_in_switch(self, comps, [m[0] for m in missing]) if self.config.stream else {}
        )

    def _need(self, c: ComponentEntry, plan: Any) -> int:
        """The bytes ``c``'s new slot takes: its partial layout's, or its whole one's."""
        part = self._partials.get(c.digest)
        return part.nbytes if part is not None else plan.target_bytes

    def _place_all(self, missing, keep: set[str], mode: str, evicted: list[str], *, sticky: bool):
        moves: list[Move] = []
        waited = 0.0
        try:
            for c, _prior, plan, build_s in missing:
                inst, slot, after, in_place, w = self._place(
                    c, self._need(c, plan), keep, mode, evicted, sticky
                )
                waited += w
                tier = "host" if self._host.has(c.digest) else "disk"
                build_s += inst.build_s
                moves.append(
                    Move(
                        c,
                        inst,
                        slot,
                        after,
                        tier,
                        tier == "host",
                        in_place,
                        build_s=build_s,
                        key=self._host.key(c.digest),
                        hash=self.store.must_hash(c),
                    )
                )
                inst.build_s = 0.0  # reported once, by the switch that built it
        except BudgetExceeded:
            for mv in moves:
                if not mv.in_place:  # nothing was copied yet: give the new slots back
                    self._evict_slot(mv.slot)
            raise
        return moves, waited

    def _place(self, c: ComponentEntry, need: int, keep, mode: str, evicted: list, sticky: bool):
        """An instance and a slot for ``c``: in place in an idle instance of the same
        architecture when room would have to be made anyway, else a new slot."""
        idle = self._modules.idle(c, lambda slot: self._evictable(slot, keep, mode))
        whole = c.digest not in self._partials  # (a part is never copied in place)
        if idle and whole and self._tier.largest_free < need and not self._modules.parked_for(c):
            inst = min(idle, key=lambda i: i.slot.last_used)
            old = inst.slot
            evicted.append(self._describe(old.digest))
            after = self._tier.rebind(old, c.digest, need)
            return inst, old, after, True, 0.0
        slot, after, waited = self._make_room(c.digest, need, keep, mode, evicted, sticky)
        return self._modules.take(c, slot), slot, after, False, waited

    def _make_room(
        self, digest: str, need: int, keep: set[str], mode: str, evicted: list[str], sticky: bool
    ):
        """A new slot for ``digest``: evicting what the placement policy names, once it is
        certain to make room; else waiting for use() blocks elsewhere to end."""
        deadline = time.monotonic() + self.wait_s
        waited, said = 0.0, False
        while True:
            room = placement.make_room(
                self._tier.budget,
                self._tier.extents(),
                [d for d, s in self._tier.slots.items() if self._evictable(s, keep, mode)],
                self._tier.slot_size(need),
                watermark=int(self.watermark * self._tier.budget),
            )
            if room is not None:
                for d in room.fit:
                    self._evict_slot(self._tier.slots[d], evicted)
                placed = self._tier.place(digest, need, sticky=sticky, high=self._high)
                if placed is None:
                    raise InternalError(
                        f"the placement policy promised {need} free bytes for {digest[:12]}, "
                        "and the device tier has no such run"
                    )
                for d in room.trim:  # down to the watermark: the next switch finds room
                    self._evict_slot(self._tier.slots[d], evicted)
                return (*placed, waited)
            in_use = sum(
                s.size for s in self._tier.slots.values() if s.uses or s.digest in self._protected
            )
            mine = self._holds.mine()
            others = any(s.uses > mine.get(d, 0) for d, s in self._tier.slots.items())
            what = self._describe(digest)
            if need > self._tier.budget or mode == "prefetch" or not others:
                raise self._tier.no_room(what, need, in_use, prefetch=mode == "prefetch")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._tier.no_room(what, need, in_use, waited_s=self.wait_s)
            if not said:
                said = True
                log.info("%s waits for room held by use() blocks elsewhere", what)
            t = time.perf_counter()
            self._released.wait(min(left, 1.0))
            waited += time.perf_counter() - t

    def _evictable(self, slot: Slot, keep: set[str], mode: str) -> bool:
        protected, current = self._protected, self._current
        prefetch = mode == "prefetch"
        return placement.evictable(
            slot.digest,
            slot.uses,
            keep=keep,
            protected=protected,
            current=current,
            prefetch=prefetch,
        )

    def _evict_slot(self, slot: Slot, evicted: list[str] | None = None) -> None:
        if evicted is not None:
            evicted.append(self._describe(slot.digest))
        slot.events += self._modules.unbind(slot)  # (a ring's copies still in flight)
        self._tier.evict(slot)

    def _learn(self, c: ComponentEntry, digests: list[str]) -> None:
        """The reads that loaded ``c`` hashed it: record its files' digests. If the same
        bytes were already served under another key, this copy is a duplicate nothing
        will ask for again: it leaves the host tier now and the device tier first."""
        key = self.store.learn(c, digests)
        if key == c.digest:
            return
        with self._lock:
            if self._host.shared is None:  # a shared tier's copy may serve other processes
                self._host.evict(c.digest)
            slot = self._tier.slots.get(c.digest)
            if slot is not None:
                slot.last_used = 0
        log.info(
            "%s: its bytes equal %s's; later switches share that copy",
            self._describe(c.digest),
            key[:12],
        )

    def _release(self, hold: Hold) -> None:
        with self._lock:
            self._release_locked(hold, record=True)
            self._pipelines.give_back(hold)

    def _release_locked(self, hold: Hold, *, record: bool) -> None:
        if not self._holds.give_back(hold) or hold.parked:
            return  # (a parked hold's uses were given back when it was parked)
        events = []
        if record and self.device.type == "cuda":
            # The next copy into these slots waits for the kernels queued so far on every
            # stream the pipeline ran on, and on the stream current where the block ends.
            hold.note(self._stream())
            events = [s.record_event() for s in hold.streams]
        for d in hold.digests:
            slot = self._tier.slots.get(d)
            if slot is not None and slot.uses:
                slot.uses -= 1
                if events:  # (ended kernels fence nothing: a slot used all day stays small)
                    slot.events = [e for e in slot.events if not event_done(e)] + events
        self._released.notify_all()

    # ---- pipelines ---------------------------------------------------------------

    def _pipeline_for(self, entry: PipelineEntry, without: frozenset[str], hold: Hold | None):
        """A pipeline object over the modules now holding ``entry``'s weights (``None``
        for the roles in ``without``), lent to ``hold``."""
        expect: dict[str, tuple[Instance, str]] = {}
        for role, c in entry.components.items():
            if c is not None and c.weights and role not in without:
                expect[role] = (self._modules.holding(c), c.digest)

        return self._pipelines.get(
            entry, expect, without, hold, closed=lambda: self._closed, stream=self._stream
        )

    # ---- helpers -----------------------------------------------------------------

    def _stream(self) -> Any:
        """The calling thread's current CUDA stream (``None`` on a CPU cache)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _describe(self, digest: str) -> str:
        roles = self._roles.get(digest)
        if not roles:
            return digest[:12]
        pipeline, role = sorted(roles)[0]
        return f"{pipeline}/{role}"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the model cache is closed; create a new ModelCache")


def _roles(without: Iterable[str]) -> frozenset[str]:
    """``without`` as a set of roles (one name alone is one role, not its letters)."""
    return frozenset([without] if isinstance(without, str) else without)


def _release(prefetcher: ThreadPoolExecutor, *parts: Any) -> None:
    """:meth:`ModelCache.close` for a cache collected without it: no lock to take (nothing
    else holds the cache), the prefetch thread told to stop without waiting (this may run
    on it), every tier closed even when one fails."""
    if sys.is_finalizing():  # (modules and CUDA may be half torn down)
        return
    prefetcher.shutdown(wait=False, cancel_futures=True)
    for part in parts:
        if part is None:
            continue
        try:
            part.close()
        except Exception as e:  # a finalizer cannot raise: say it, close the rest
            log.warning("closing a collected model cache: %s: %s", type(part).__name__, e)
