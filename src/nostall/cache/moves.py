"""Moves: each missing component's way onto the device in one switch, issued together.

A switch plans (under the cache's lock) one :class:`Move` per component that is not on
the device: the module instance that will view it, its slot, the events the copy into
the slot waits for, and the tier it comes from. :func:`issue` then starts every load
at once, outside the lock: host-tier hits first (they only need the link), then reads
from disk, and points each module at its slot while the link is busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nostall.cache.device import DeviceTier, Slot
from nostall.cache.modules import Instance
from nostall.cache.partial import Partial
from nostall.cache.report import ComponentSwitch
from nostall.errors import InternalError, PoolExhausted
from nostall.memory.pool import PinnedPool
from nostall.store.catalog import ComponentEntry
from nostall.transfer.loader import Loader

__all__ = ["Move", "issue"]


@dataclass(eq=False)
class Move:
    c: ComponentEntry
    inst: Instance
    slot: Slot
    after: list[Any]  # events the copy into the slot waits for (kernels still reading it)
    tier: str  # "host" or "disk"
    cached: bool  # kept in the host tier (a host hit, or a read the tier admitted)
    in_place: bool  # into an idle instance of the same architecture, at its offset
    pending: Any = None  # the loader's PendingLoad once issued
    build_s: float = 0.0
    key: str | None = None  # the host tier's key, when not the digest (a shared tier)
    # a read from disk hashes its bytes: content unknown, or a digest index claim to prove
    # (Store.must_hash)
    hash: bool = False
    partial: Partial | None = None  # resident in part: its layout (cache.partial)

    def row(self) -> ComponentSwitch:
        """This move's line of the switch report (after :func:`issue`)."""
        stats = self.pending.wait().stats if self.pending is not None else None
        return ComponentSwitch(
            self.c.role,
            self.c.class_name,
            self.c.digest[:12],
            self.slot.nbytes,
            self.tier,
            cached=self.cached,
            in_place=self.in_place,
            read_s=stats.read_s if stats else 0.0,
            copy_s=stats.h2d_s if stats else 0.0,
            build_s=self.build_s,
            hashed=self.pending is not None and self.pending.digests is not None,
            streamed=self.partial.plan.streamed_bytes if self.partial is not None else 0,
        )


def issue(
    moves: list[Move],
    *,
    loader: Loader,
    tier: DeviceTier,
    pool: PinnedPool,
    device: torch.device,
    prefetch: bool,
) -> None:
    """Issue every copy, point the modules at their slots while the link is busy, then
    wait for the copies. A prefetch does not order the current stream after them: its
    consumer waits for each slot's ``done`` event."""
    cuda = device.type == "cuda"
    order = sorted(moves, key=lambda m: m.tier != "host")
    for mv in order:
        after = list(mv.after)
        if cuda and not prefetch:
            # Memory freed here may still be read by work queued on this stream.
            after.append(torch.cuda.current_stream(device).record_event())
        kwargs = {
            "device": device,
            "dtype": mv.inst.targets,
            "key": mv.key or mv.c.digest,
            "into": tier.view(mv.slot),
            "after": after if cuda else None,
            # Back at the offset its module views: no new views needed.
            "views": mv.inst.offset != mv.slot.offset or mv.partial is not None,
            # A component whose content is unknown or unproven is hashed by the reads
            # that load it (reader threads, as the bytes land): no pass of its own.
            "digest": mv.tier == "disk" and mv.hash,
        }
        if mv.partial is not None:  # the resident part only; the blocks stream
            kwargs["names"] = mv.partial.resident
        try:
            mv.pending = loader.start(mv.c.checkpoint, pool=pool if mv.cached else None, **kwargs)
        except PoolExhausted:
            if mv.partial is not None:  # it streams from the host tier: no way round it
                raise
            # The host tier admitted it where the pool's free runs differed from the
            # plan's (a range still read by an earlier copy): read it straight to the
            # device instead (nothing was copied yet).
            mv.cached = False
            mv.pending = loader.start(mv.c.checkpoint, **kwargs)
        tensors = mv.pending.tensors
        if mv.partial is not None:
            tensors = {**tensors, **mv.partial.ring_views(tier.view(mv.slot))}
        mv.build_s += mv.inst.bind(tensors, mv.slot, mv.c, device, partial=mv.partial)
    for mv in order:
        mv.pending.wait(join=not prefetch)
        mv.slot.done = mv.pending.done
        if mv.partial is not None:
            host = pool.lookup(mv.key or mv.c.digest)
            if host is None:
                raise InternalError(
                    f"{mv.c.folder}: streamed in part, and its bytes are not in the host tier"
                )
            mv.partial.start(mv.inst.module, host, tier.view(mv.slot), device)
