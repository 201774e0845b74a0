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

Locks: ``_switching`` admits one switch at a time (they share one copy stream);
``_lock`` guards the tiers' state and is never held across a copy or a read, so a
``use`` block can end, and ``stats()`` answer, while a switch copies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.cache.device import DeviceTier, Slot
from nostall.cache.host import HostTier
from nostall.cache.modules import Instance, build_instance
from nostall.cache.pipelines import Assembler
from nostall.cache.report import ComponentSwitch, SwitchReport
from nostall.cache.store import ComponentEntry, PipelineEntry, Store
from nostall.errors import (
    ArgumentError,
    BudgetExceeded,
    ClosedError,
    PoolExhausted,
)
from nostall.memory.host import memory_limit
from nostall.transfer.loader import Loader, resolve_device
from nostall.transfer.plan import LoadPlan

__all__ = ["CacheStats", "ModelCache"]

log = logging.getLogger("nostall.cache")


@dataclass(frozen=True)
class CacheStats:
    """Bytes of distinct components resident per tier, and each known component's tier.

    Attributes:
        gpu_bytes: weights in the device tier (ready to run); on a CPU cache, the modules'
            own memory.
        host_bytes: weights in the pinned host tier (bytes as on disk).
        components: ``digest → {"tier", "roles", "pipelines", "bytes", "in_use"}`` for
            every component of every pipeline switched to so far; ``tier`` is the
            fastest that holds it: ``"gpu"``, ``"host"`` or ``"disk"``.
    """

    device: str
    gpu_budget: int
    gpu_bytes: int
    host_budget: int
    host_bytes: int
    components: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(eq=False)
class _Move:
    c: ComponentEntry
    inst: Instance
    slot: Slot
    after: list[Any]
    tier: str
    cached: bool
    in_place: bool
    pending: Any = None
    build_s: float = 0.0


class ModelCache:
    """Diffusers pipelines from a store, switched among GPU, pinned host and disk tiers.

    Args:
        models: a folder of pipeline folders (each addressed by its folder name) or a
            mapping ``name → pipeline folder``.
        device: where the pipelines run: ``"cuda[:N]"`` or ``"cpu"`` (then the device
            tier is ordinary memory the modules own; everything else is the same, so
            CI tests it all).
        gpu_budget: bytes of the device tier, allocated once at the first switch
            (default: 80% of the GPU's free memory then; on a CPU a quarter of the
            memory limit).
        host_budget: bytes of the pinned host tier (default: half the memory limit).
        dtype: load floating weights in this dtype, keeping the modules a library keeps
            in float32 (as ``from_pretrained(torch_dtype=...)``); default: as stored.
        variant: weights variant (``"fp16"``) in every component folder.
        watermark: when a switch must evict from the device tier, it evicts idle
            components until the tier is at most this full after the switch (so the
            next switch or a prefetch finds room), or as far as idle components allow.
        wait_s: how long a switch waits for room held by pipelines in use in other
            threads before :class:`~nostall.BudgetExceeded`.
        cache_dir: where the digest index lives (see :class:`~nostall.cache.Store`;
            ``False`` keeps digests in memory). Components are identified by a digest of
            every byte, computed as they are first read and remembered there.

    >>> cache = nostall.ModelCache("/models", device="cuda", gpu_budget=36 << 30)  # doctest: +SKIP
    >>> with cache.use("flux-dev") as pipe:  # doctest: +SKIP
    ...     image = pipe("a cat", num_inference_steps=28).images[0]
    >>> print(cache.last_report.table())  # doctest: +SKIP
    """

    def __init__(
        self,
        models: str | os.PathLike | Mapping[str, str | os.PathLike],
        *,
        device: str | torch.device = "cuda",
        gpu_budget: int | None = None,
        host_budget: int | None = None,
        dtype: torch.dtype | None = None,
        variant: str | None = None,
        watermark: float = 0.95,
        wait_s: float = 300.0,
        loader: Loader | None = None,
        cache_dir: str | os.PathLike | bool | None = None,
    ):
        self.device = resolve_device(device)
        if not 0.0 < watermark <= 1.0:
            raise ArgumentError(f"watermark={watermark!r} must be in (0, 1]")
        for name, value in (("gpu_budget", gpu_budget), ("host_budget", host_budget)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ArgumentError(f"{name}={value!r} must be a positive number of bytes")
        self.store = Store(models, variant=variant, cache_dir=cache_dir)
        self.dtype = dtype
        self.watermark = watermark
        self.wait_s = wait_s
        limit = memory_limit()[0] or (16 << 30)
        if gpu_budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                gpu_budget = int(free * 0.8)
            else:
                gpu_budget = limit // 4
        self._tier = DeviceTier(self.device, gpu_budget)
        self._host = HostTier(host_budget or limit // 2, self.device)
        self._own_loader = loader is None
        self._loader = loader or Loader()
        self._assembler = Assembler()
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)
        self._switching = threading.Lock()
        self._instances: dict[str, list[Instance]] = {}
        self._plans: dict[str, LoadPlan] = {}
        # (name, roles left out) -> [pipeline object, module identities, busy in a use() block]
        self._pipes: dict[tuple[str, frozenset[str]], list[list[Any]]] = {}
        self._holders: dict[int, Counter[str]] = {}
        self._protected: set[str] = set()  # prefetched, not used yet
        self._current: set[str] = set()  # the last pipeline handed out without use()
        self._roles: dict[str, set[tuple[str, str]]] = {}  # digest -> {(pipeline, role)}
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="nostall-prefetch")
        self.reports: deque[SwitchReport] = deque(maxlen=256)
        self._tick = 0  # switches so far: the device tier's recency clock
        self._closed = False

    # ---- public ------------------------------------------------------------------

    def names(self) -> list[str]:
        """The pipelines the store holds."""
        return self.store.names()

    def pipeline(self, name: str, *, without: Iterable[str] = ()) -> Any:
        """Switch to ``name``; return its diffusers pipeline, weights on the device.

        The pipeline stays usable until a later switch needs its memory or its modules
        (calling it then raises :class:`~nostall.ClosedError`); hold it with
        :meth:`use` where other switches may happen meanwhile. ``without``: as in
        :meth:`use`.
        """
        return self._switch(name, mode="pipeline", without=without)[0]

    @contextlib.contextmanager
    def use(self, name: str, *, without: Iterable[str] = ()) -> Iterator[Any]:
        """Switch to ``name`` and hold it: nothing of it is evicted inside the block.

        ``without``: weights components (roles) to leave out: they are not moved, and
        the pipeline gets ``None`` for them, as diffusers allows. A worker whose prompts
        are encoded elsewhere leaves out the text encoders and passes ``prompt_embeds``.

        >>> with cache.use("sdxl") as pipe:  # doctest: +SKIP
        ...     image = pipe("a lighthouse").images[0]
        >>> with cache.use("flux", without=["text_encoder", "text_encoder_2"]) as pipe:  # doctest: +SKIP
        ...     image = pipe(prompt_embeds=t5, pooled_prompt_embeds=clip).images[0]
        """
        pipe, _ = self._switch(name, mode="use", without=without)
        digests = {c.digest for c in self._components(self.store.entry(name), without)}
        try:
            yield pipe
        finally:
            self._release(digests, pipe)

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
        self._components(self.store.entry(name), without)  # bad names fail here, not later
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
                        self._load_plan(c)
                    else:
                        self._assembler.files_component(c)
            for insts in self._instances.values():
                for inst in insts:
                    inst.build_s = 0.0  # paid at boot, not by the first switch
        self._host.pool.wait_pinned()
        self._loader.prepare(self.device)

    @property
    def last_report(self) -> SwitchReport | None:
        return self.reports[-1] if self.reports else None

    def stats(self) -> CacheStats:
        """Bytes per tier and every known component's tier."""
        with self._lock:
            host = self._host.resident()
            ready = {d: s for d, s in self._tier.slots.items() if s.ready}
            comps: dict[str, dict[str, Any]] = {}
            host_bytes = 0
            for d, roles in self._roles.items():
                plan = self._plans.get(d)
                disk = plan.checkpoint.nbytes if plan is not None else 0
                if d in host:
                    host_bytes += disk
                slot = ready.get(d)
                comps[d] = {
                    "tier": "gpu" if slot else "host" if d in host else "disk",
                    "roles": sorted({r for _, r in roles}),
                    "pipelines": sorted({p for p, _ in roles}),
                    "bytes": disk,
                    "in_use": bool(slot and slot.uses),
                }
            return CacheStats(
                device=str(self.device),
                gpu_budget=self._tier.budget,
                gpu_bytes=sum(s.nbytes for s in ready.values()),
                host_budget=self._host.budget,
                host_bytes=host_bytes,
                components=comps,
            )

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
        """Stop prefetching, give back the device tier, unpin the host tier. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._prefetcher.shutdown(wait=True)
        with self._switching, self._lock:
            self._tier.close()
            self._pipes.clear()
        self._host.close()
        if self._own_loader:
            self._loader.close()

    def __enter__(self) -> ModelCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the switch --------------------------------------------------------------

    def _components(self, entry: PipelineEntry, without: Iterable[str]) -> list[ComponentEntry]:
        """``entry``'s weights components but the roles in ``without`` (checked), one per
        digest."""
        without = _roles(without)
        roles = [c.role for c in entry.weights]
        unknown = sorted(without - set(roles))
        if unknown:
            raise ArgumentError(
                f"without={unknown}: pipeline {entry.name!r} has no weights component of that "
                f"name; it has {roles}"
            )
        return list({c.digest: c for c in entry.weights if c.role not in without}.values())

    def _switch(
        self, name: str, *, mode: str, without: Iterable[str] = ()
    ) -> tuple[Any, SwitchReport]:
        t0 = time.perf_counter()
        self._check_open()
        entry = self.store.entry(name)
        without = _roles(without)
        comps = self._components(entry, without)
        keep = {c.digest for c in comps}
        me = threading.get_ident()
        with self._switching:
            t_locked = time.perf_counter()
            with self._lock:
                self._check_open()
                self._tick += 1
                for c in comps:
                    self._roles.setdefault(c.digest, set()).add((name, c.role))
                moves, rows, evicted, waited = self._plan(comps, keep, mode)
                for c in comps:
                    self._tier.slots[c.digest].last_used = self._tick
                # Claimed before the lock is let go: no other switch may evict them now.
                if mode == "use":
                    held = self._holders.setdefault(me, Counter())
                    for c in comps:
                        self._tier.slots[c.digest].uses += 1
                        held[c.digest] += 1
                if mode == "prefetch":
                    self._protected = set(keep)
                else:
                    self._protected -= keep
                    if mode == "pipeline":
                        self._current = set(keep)
            try:
                self._transfer(moves, prefetch=mode == "prefetch")
            except BaseException:
                with self._lock:
                    for mv in moves:  # half-copied content must never count as resident
                        if self._tier.slots.get(mv.c.digest) is mv.slot:
                            mv.slot.uses = 0
                            self._evict_slot(mv.slot)
                    if mode == "use":
                        self._release_locked(keep, record=False)
                raise
            with self._lock:
                for mv in moves:
                    mv.slot.ready = True
                    if mv.cached:
                        self._host.admitted(mv.c.digest, mv.slot.size)
            for mv in moves:
                if mv.pending.digests is not None:
                    self._learn(mv.c, mv.pending.digests)
            with self._lock:
                pipe = (
                    None
                    if mode == "prefetch"
                    else self._pipeline_for(entry, mode == "use", without)
                )
            if mode != "prefetch" and self.device.type == "cuda":
                # A prefetch did not join the copies to its stream: the consumer does.
                stream = torch.cuda.current_stream(self.device)
                for c in comps:
                    done = self._tier.slots[c.digest].done
                    if done is not None:
                        stream.wait_event(done)
        rows.update(
            {
                mv.c.digest: ComponentSwitch(
                    mv.c.role,
                    mv.c.class_name,
                    mv.c.digest[:12],
                    mv.slot.nbytes,
                    mv.tier,
                    cached=mv.cached,
                    in_place=mv.in_place,
                    read_s=mv.pending.wait().stats.read_s if mv.pending else 0.0,
                    copy_s=mv.pending.wait().stats.h2d_s if mv.pending else 0.0,
                    build_s=mv.build_s,
                    hashed=mv.pending.digests is not None if mv.pending else False,
                )
                for mv in moves
            }
        )
        report = SwitchReport(
            pipeline=name,
            device=str(self.device),
            total_s=time.perf_counter() - t0,
            components=tuple(rows[c.digest] for c in comps),
            evicted=tuple(evicted),
            prefetch=mode == "prefetch",
            wait_s=(t_locked - t0) + waited,
            left_out=tuple(sorted(without)),
        )
        self.reports.append(report)
        log.info(
            "%sswitch to %s: %.3f s, %.2f GB moved (%s)",
            "prefetch " if report.prefetch else "",
            name,
            report.total_s,
            report.moved_bytes / 1e9,
            ", ".join(f"{c.role}={c.tier}" for c in report.components),
        )
        return pipe, report

    def _plan(self, comps: list[ComponentEntry], keep: set[str], mode: str):
        """Decide, under the lock, where every missing component goes (evicting as needed)."""
        gpu = "gpu" if self.device.type == "cuda" else "device"
        rows: dict[str, ComponentSwitch] = {}
        evicted: list[str] = []
        self._host.begin()
        missing = []
        for c in comps:
            prior = self._host.request(c.digest)
            slot = self._tier.slots.get(c.digest)
            if slot is not None and slot.ready:
                rows[c.digest] = ComponentSwitch(
                    c.role, c.class_name, c.digest[:12], slot.nbytes, gpu
                )
                continue
            plan, build_s = self._load_plan(c)
            missing.append((c, prior, plan.target_bytes, build_s))
        # Largest first: small slots placed first would cut the free runs a large one needs.
        missing.sort(key=lambda m: -m[2])
        try:
            moves, waited = self._place_all(missing, keep, mode, evicted, sticky=True)
        except BudgetExceeded:
            # Going back to old offsets can cut the free space into runs too short for the
            # largest component: place this switch's new slots again, best fit only.
            moves, waited = self._place_all(missing, keep, mode, evicted, sticky=False)
        for mv in moves:
            if mv.tier == "disk":
                prior = next(m[1] for m in missing if m[0] is mv.c)
                mv.cached = self._host.admit(mv.c.digest, mv.c.nbytes, prior, keep)
        return moves, rows, evicted, waited

    def _place_all(self, missing, keep: set[str], mode: str, evicted: list[str], *, sticky: bool):
        moves: list[_Move] = []
        waited = 0.0
        try:
            for c, _prior, need, build_s in missing:
                inst, slot, after, in_place, w = self._place(c, need, keep, mode, evicted, sticky)
                waited += w
                tier = "host" if self._host.has(c.digest) else "disk"
                moves.append(
                    _Move(
                        c,
                        inst,
                        slot,
                        after,
                        tier,
                        tier == "host",
                        in_place,
                        build_s=build_s + inst.build_s,
                    )
                )
                inst.build_s = 0.0  # reported once, by the switch that built it
        except BudgetExceeded:
            if not sticky:
                raise
            for mv in moves:
                if not mv.in_place:  # nothing was copied yet: give the new slots back
                    self._evict_slot(mv.slot)
            raise
        return moves, waited

    def _load_plan(self, c: ComponentEntry) -> tuple[LoadPlan, float]:
        plan = self._plans.get(c.digest)
        if plan is not None:
            return plan, 0.0
        t = time.perf_counter()
        insts = self._instances.get(c.arch or c.digest)
        if not insts:
            insts = self._instances[c.arch or c.digest] = [build_instance(c, self.dtype)]
        plan = self._plans[c.digest] = LoadPlan(
            c.checkpoint, insts[0].targets, mirror_file=self.device.type == "cpu"
        )
        return plan, time.perf_counter() - t - insts[0].build_s

    def _place(
        self,
        c: ComponentEntry,
        need: int,
        keep: set[str],
        mode: str,
        evicted: list[str],
        sticky: bool,
    ):
        """An instance and a slot for ``c``: in place in an idle instance of the same
        architecture when room would have to be made anyway, else a new slot."""
        arch = c.arch or c.digest
        insts = self._instances[arch]
        idle = [
            i
            for i in insts
            if i.slot is not None and i.slot.ready and self._evictable(i.slot, keep, mode)
        ]
        if idle and self._tier.largest_free < need:
            inst = min(idle, key=lambda i: i.slot.last_used)
            old = inst.slot
            evicted.append(self._describe(old.digest))
            after = self._tier.rebind(old, c.digest, need)
            return inst, old, after, True, 0.0
        slot, after, waited = self._make_room(c.digest, need, keep, mode, evicted, sticky)
        free = [i for i in insts if i.slot is None]
        inst = next((i for i in free if i.digest == c.digest), None) or next(
            (i for i in free if i.offset == slot.offset), None
        )
        if inst is None:
            inst = free[0] if free else build_instance(c, self.dtype)
            if inst not in insts:
                insts.append(inst)
        inst.slot = slot
        return inst, slot, after, False, waited

    def _make_room(
        self, digest: str, need: int, keep: set[str], mode: str, evicted: list[str], sticky: bool
    ):
        deadline = time.monotonic() + self.wait_s
        waited = 0.0
        while True:
            placed = self._tier.place(digest, need, sticky=sticky)
            if placed is not None:
                slot, after = placed
                # Evict further down to the watermark, so the next switch or a prefetch
                # finds room without evicting.
                while self._tier.used > self.watermark * self._tier.budget:
                    victim = self._victim(0, keep, mode)
                    if victim is None:
                        break
                    evicted.append(self._describe(victim.digest))
                    self._evict_slot(victim)
                return slot, after, waited
            victim = self._victim(need, keep, mode)
            if victim is not None:
                evicted.append(self._describe(victim.digest))
                self._evict_slot(victim)
                continue
            in_use = sum(
                s.size for s in self._tier.slots.values() if s.uses or s.digest in self._protected
            )
            mine = self._holders.get(threading.get_ident(), Counter())
            others = any(s.uses > mine.get(d, 0) for d, s in self._tier.slots.items())
            if need > self._tier.budget or mode == "prefetch" or not others:
                raise BudgetExceeded(
                    f"the GPU tier ({self._tier.budget / 1e9:.2f} GB) cannot hold "
                    f"{self._describe(digest)} ({need / 1e9:.2f} GB): {in_use / 1e9:.2f} GB are in "
                    f"use or prefetched, the largest free run is {self._tier.largest_free / 1e9:.2f} GB"
                    + ("" if mode != "prefetch" else "; a prefetch never evicts what is in use")
                    + "; raise gpu_budget or end the other use() blocks first",
                    tier="gpu",
                    requested=need,
                    budget=self._tier.budget,
                    in_use=in_use,
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise BudgetExceeded(
                    f"waited {self.wait_s:.0f} s for room for {self._describe(digest)}: pipelines "
                    "in use in other threads hold the GPU tier",
                    tier="gpu",
                    requested=need,
                    budget=self._tier.budget,
                    in_use=in_use,
                )
            t = time.perf_counter()
            self._released.wait(min(left, 1.0))
            waited += time.perf_counter() - t

    def _evictable(self, slot: Slot, keep: set[str], mode: str) -> bool:
        return (
            slot.uses == 0
            and slot.digest not in keep
            and slot.digest not in self._protected
            and not (mode == "prefetch" and slot.digest in self._current)
        )

    def _victim(self, need: int, keep: set[str], mode: str) -> Slot | None:
        """Least recently used first; within the oldest switch, the smallest component that
        frees enough on its own, else the largest (fewest bytes to bring back later)."""
        idle = [s for s in self._tier.slots.values() if self._evictable(s, keep, mode)]
        if not idle:
            return None
        oldest = min(s.last_used for s in idle)
        group = [s for s in idle if s.last_used == oldest]
        enough = [s for s in group if s.size >= need]
        return min(enough, key=lambda s: s.size) if enough else max(group, key=lambda s: s.size)

    def _evict_slot(self, slot: Slot) -> None:
        self._tier.evict(slot)
        for insts in self._instances.values():
            for inst in insts:
                if inst.slot is slot:
                    inst.slot = None

    def _transfer(self, moves: list[_Move], *, prefetch: bool) -> None:
        """Issue every copy (host hits first: they only need the link), point the modules
        at their slots while the link is busy, then wait."""
        order = sorted(moves, key=lambda m: m.tier != "host")
        cuda = self.device.type == "cuda"
        for mv in order:
            after = list(mv.after)
            if cuda and not prefetch:
                # Memory freed here may still be read by work queued on this stream.
                after.append(torch.cuda.current_stream(self.device).record_event())
            kwargs = {
                "device": self.device,
                "dtype": mv.inst.targets,
                "key": mv.c.digest,
                "into": self._tier.view(mv.slot),
                "after": after if cuda else None,
                # Back at the offset its module views: no new views needed.
                "views": mv.inst.offset != mv.slot.offset,
            }
            # A component whose content digest is unknown is hashed by the reads that
            # load it (reader threads, as the bytes land): no pass of its own.
            kwargs["digest"] = mv.tier == "disk" and not mv.c.exact
            try:
                pool = self._host.pool if mv.cached else None
                mv.pending = self._loader.start(mv.c.checkpoint, pool=pool, **kwargs)
            except PoolExhausted:
                # The host tier admitted it, but its free space is cut into smaller runs:
                # read it straight to the device instead (nothing was copied yet).
                mv.cached = False
                mv.pending = self._loader.start(mv.c.checkpoint, **kwargs)
            mv.build_s += mv.inst.bind(mv.pending.tensors, mv.slot, mv.c, self.device)
        for mv in order:
            mv.pending.wait(join=not prefetch)
            mv.slot.done = mv.pending.done

    def _learn(self, c: ComponentEntry, digests: list[str]) -> None:
        """The reads that loaded ``c`` hashed it: record its files' digests. If the same
        bytes were already served under another key, this copy is a duplicate nothing
        will ask for again: it leaves the host tier now and the device tier first."""
        key = self.store.learn(c, digests)
        if key == c.digest:
            return
        with self._lock:
            if self._host.has(c.digest):
                self._host.pool.evict(c.digest)
                self._host.sizes.pop(c.digest, None)
            slot = self._tier.slots.get(c.digest)
            if slot is not None:
                slot.last_used = 0
        log.info(
            "%s: its bytes equal %s's; later switches share that copy",
            self._describe(c.digest),
            key[:12],
        )

    def _release(self, digests: set[str], pipe: Any = None) -> None:
        with self._lock:
            self._release_locked(digests, record=True)
            for held in self._pipes.values():
                for item in held:
                    if item[0] is pipe:
                        item[2] = False

    def _release_locked(self, digests: set[str], *, record: bool) -> None:
        event = None
        if record and self.device.type == "cuda":
            # The next copy into these slots waits for the kernels queued so far.
            event = torch.cuda.current_stream(self.device).record_event()
        held = self._holders.get(threading.get_ident())
        for d in digests:
            slot = self._tier.slots.get(d)
            if slot is not None and slot.uses:
                slot.uses -= 1
                if event is not None:
                    slot.events.append(event)
            if held is not None:
                held[d] -= 1
                if held[d] <= 0:
                    del held[d]
        self._released.notify_all()

    # ---- pipelines ---------------------------------------------------------------

    def _pipeline_for(
        self, entry: PipelineEntry, exclusive: bool, without: frozenset[str] = frozenset()
    ) -> Any:
        """A pipeline object over the modules now holding ``entry``'s weights (``None``
        for the roles in ``without``).

        Pipeline objects carry per-run state (the scheduler's timesteps), so a
        ``use()`` block gets one no other block is using; they are kept and reused.
        """
        modules: dict[str, Any] = {}
        expect: dict[str, tuple[Instance, str]] = {}
        for role, c in entry.components.items():
            if c is None or not c.weights or role in without:
                continue
            inst = next(
                i for i in self._instances[c.arch or c.digest] if i.digest == c.digest and i.slot
            )
            modules[role] = inst.module
            expect[role] = (inst, c.digest)
        ident = tuple(id(m) for m in modules.values())
        key = (entry.name, without)
        kept = [item for item in self._pipes.get(key, []) if item[1] == ident]
        for item in kept:
            if not item[2]:
                item[2] = exclusive
                return item[0]

        def check() -> None:
            if self._closed:
                raise ClosedError(f"the model cache is closed; pipeline {entry.name!r} is gone")
            for role, (inst, digest) in expect.items():
                if inst.digest != digest or inst.slot is None or not inst.slot.ready:
                    raise ClosedError(
                        f"pipeline {entry.name!r} was switched out: its {role} now holds other "
                        "weights or left the device; get it again with cache.pipeline("
                        f"{entry.name!r}), or hold it with `with cache.use({entry.name!r})`"
                    )

        pipe = self._assembler.build(entry, modules, check, without)
        self._pipes[key] = [*kept, [pipe, ident, exclusive]]
        return pipe

    # ---- helpers -----------------------------------------------------------------

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
