"""The device tier: one allocation on the device, carved into component slots.

The tier takes its whole byte budget from the device once (the first switch) and
never frees it: a switch copies into memory the tier already holds, so it pays
neither for ``cudaMalloc`` (the pool-hit copy into a fresh allocation ran 10% slower
than into reused memory) nor for the caching allocator's fragmentation. On a CPU
the tier is ordinary private memory that the modules own.

A slot is ``[offset, offset + size)`` of the buffer. It remembers the events of the
kernels that last read it (recorded when a ``use`` block ends): memory freed by an
eviction is handed to the next slot together with those events, and the copy into
it waits for them on the GPU, not on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.cache.placement import Extent
from nostall.cache.report import human_bytes
from nostall.errors import BudgetExceeded, InternalError
from nostall.memory.events import event_done
from nostall.memory.host import PAGE, HostArena, round_up
from nostall.memory.ranges import Ranges

__all__ = ["DeviceTier", "Slot", "room_beside"]

GRANULE = 4096  # slots are pages: best fit and sticky placement keep holes reusable


@dataclass(eq=False)
class Slot:
    """Device memory holding one component's weights (target layout)."""

    digest: str
    offset: int
    size: int
    nbytes: int  # the component's target bytes (``size`` is rounded up)
    uses: int = 0
    last_used: int = 0  # the number of the last switch that needed it
    events: list[Any] = field(default_factory=list)  # kernels that read it (use() ends)
    ready: bool = False  # its copies have finished
    done: Any = None  # the copy stream's event at the end of its copies


class DeviceTier:
    """Slots in one buffer of ``budget`` bytes on ``device``; the owner locks."""

    def __init__(self, device: torch.device, budget: int):
        self.device = device
        self.budget = round_up(budget, GRANULE)
        self._ranges = Ranges(self.budget)
        self._buffer: torch.Tensor | None = None
        self.slots: dict[str, Slot] = {}
        self.last_offset: dict[str, int] = {}  # where a digest lived: it goes back there if free
        self._dead: list[tuple[int, int, list[Any]]] = []  # freed ranges still read by kernels

    @property
    def used(self) -> int:
        return sum(s.size for s in self.slots.values())

    @property
    def largest_free(self) -> int:
        return self._ranges.largest

    def buffer(self) -> torch.Tensor:
        """The tier's memory, allocated on first use."""
        if self._buffer is None:
            if self.device.type == "cuda":
                try:
                    self._buffer = torch.empty(self.budget, dtype=torch.uint8, device=self.device)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    try:
                        self._buffer = torch.empty(
                            self.budget, dtype=torch.uint8, device=self.device
                        )
                    except torch.OutOfMemoryError as e:
                        free, total = torch.cuda.mem_get_info(self.device)
                        raise BudgetExceeded(
                            f"the GPU tier's budget of {self.budget / 1e9:.2f} GB does not fit on "
                            f"{self.device}: {free / 1e9:.2f} GB of {total / 1e9:.2f} GB are free; "
                            "give ModelCache a smaller gpu_budget",
                            tier="gpu",
                            requested=self.budget,
                            budget=self.budget,
                            in_use=0,
                        ) from e
            else:
                arena = HostArena(self.budget, segment_bytes=round_up(self.budget, PAGE))
                self._buffer = arena.tensor
                arena.close()  # nothing registered; the tensor keeps the mapping
        return self._buffer

    @staticmethod
    def slot_size(nbytes: int) -> int:
        """The bytes a slot for ``nbytes`` takes (whole granules)."""
        return round_up(max(nbytes, 1), GRANULE)

    def extents(self) -> list[Extent]:
        """Every slot, as the placement policy sees it."""
        return [Extent(s.digest, s.offset, s.size, s.last_used) for s in self.slots.values()]

    def no_room(
        self,
        what: str,
        nbytes: int,
        in_use: int,
        *,
        prefetch: bool = False,
        waited_s: float | None = None,
    ) -> BudgetExceeded:
        """The error for ``what`` (``nbytes``) finding no room, ``in_use`` bytes being
        held by use() blocks or a prefetch (after waiting ``waited_s`` for them)."""
        if waited_s is not None:
            message = (
                f"waited {waited_s:.0f} s for room for {what}: pipelines in use elsewhere "
                "hold the GPU tier"
            )
        else:
            message = (
                f"the GPU tier ({human_bytes(self.budget)}) cannot hold {what} "
                f"({human_bytes(nbytes)}): {human_bytes(in_use)} are in use or prefetched, "
                f"the largest free run is {human_bytes(self.largest_free)}"
                + ("; a prefetch never evicts what is in use" if prefetch else "")
                + "; raise gpu_budget or end the other use() blocks first"
            )
        return BudgetExceeded(
            message, tier="gpu", requested=nbytes, budget=self.budget, in_use=in_use
        )

    def view(self, slot: Slot) -> torch.Tensor:
        return self.buffer()[slot.offset : slot.offset + slot.size]

    def place(
        self, digest: str, nbytes: int, *, sticky: bool = True, high: bool = False
    ) -> tuple[Slot, list[Any]] | None:
        """A new slot for ``digest``, and the events the copy into it must wait for;
        ``None`` when no free run is large enough (the caller evicts and retries).
        ``sticky``: back at its last offset if that range is free (its module's views
        are then still right); ``high``: at the top of its run (it leaves soon)."""
        size = self.slot_size(nbytes)
        prefer = self.last_offset.get(digest) if sticky else None
        offset = self._ranges.carve(size, prefer=prefer, high=high)
        if offset is None:
            return None
        slot = Slot(digest, offset, size, nbytes)
        self.slots[digest] = slot
        self.last_offset[digest] = offset
        return slot, self._fences(offset, size)

    def rebind(self, slot: Slot, digest: str, nbytes: int) -> list[Any]:
        """Reuse ``slot`` for another component of the same layout (same-architecture
        switch: copied in place); return the events the copy must wait for."""
        del self.slots[slot.digest]
        events, slot.events = slot.events, []
        slot.digest, slot.nbytes, slot.ready = digest, nbytes, False
        self.slots[digest] = slot
        self.last_offset[digest] = slot.offset
        return events

    def evict(self, slot: Slot) -> None:
        """Free the slot; kernels still reading it are waited for by the next copy there."""
        if slot.uses:  # a held slot is never a victim (placement skips it)
            raise InternalError(f"slot {slot.digest[:12]} is evicted while {slot.uses} hold it")
        del self.slots[slot.digest]
        self._ranges.give_back(slot.offset, slot.size)
        if slot.events:
            self._dead.append((slot.offset, slot.size, slot.events))

    def _fences(self, offset: int, size: int) -> list[Any]:
        events, still = [], []
        for off, n, evs in self._dead:
            evs = [e for e in evs if not event_done(e)]
            if not evs:
                continue
            still.append((off, n, evs))
            if off < offset + size and offset < off + n:
                events += evs
        self._dead = still
        return events

    def close(self) -> None:
        """Forget every slot and give the buffer back (views elsewhere keep it alive)."""
        self.slots.clear()
        self._dead.clear()
        self._ranges = Ranges(self.budget)
        self._buffer = None


def room_beside(device: torch.device, nbytes: int, reserve: int | None) -> bool:
    """Whether ``nbytes`` more may be allocated on ``device`` outside the tier (the base
    copies of fused LoRAs) with ``reserve`` bytes (default: a tenth of the GPU, at least
    2 GiB) still free for activations."""
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    keep = max(2 << 30, total // 10) if reserve is None else reserve
    return free - nbytes >= keep
