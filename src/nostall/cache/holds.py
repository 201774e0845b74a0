"""Holds: the components a ``use()`` block keeps on the device, as tokens.

A :class:`Hold` is taken when a ``use()`` block is entered and given back when the
block ends, by whichever thread ends it: ``asyncio.to_thread`` may enter a block on one
worker thread and leave it on another. (Counted per thread id, as the cache once did, a
hold left on another thread stayed counted on the first one, and a later switch there
took another caller's hold for its own and refused at once instead of waiting for it.)

**Whose hold is it.** A switch that finds no room waits for other callers' holds to
end, but not for its own caller's: it would wait for itself. A hold belongs to the
context that entered it (:mod:`contextvars`: one per thread, and per asyncio task). A
hold entered inside ``to_thread`` belongs to the copy of the task's context that call
ran in, so to no later call: a switch then waits for it, up to the cache's ``wait_s``,
rather than refusing. Waiting wrongly is bounded; refusing wrongly fails a request.

**Streams.** A hold lists every CUDA stream its pipeline was called on (the pipeline
notes the calling thread's current stream on each call, and orders a stream it has not
seen after the copies that filled its components). When the hold ends, an event is
recorded on each of them and on the releasing thread's current stream: the next copy
into the components' memory waits for all of those, not only for the stream that
happened to be current where the block ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Hold", "Holds"]

# The holds entered in this context: a tuple (never mutated in place), so a context
# copied by asyncio or to_thread never sees holds entered after the copy.
_ENTERED: ContextVar[tuple[Hold, ...]] = ContextVar("nostall_cache_holds", default=())


@dataclass(eq=False)
class Hold:
    """One ``use()`` block's claim on ``digests``: open until given back, once."""

    digests: frozenset[str]
    streams: list[Any] = field(default_factory=list)  # CUDA streams its pipeline ran on
    open: bool = True
    # what the block switched to (to bring it back after parking): its pipeline, the roles
    # left out; parkable: plain base weights (no LoRA fused into them), so the copies that
    # bring it back are what it computed with
    name: str = ""
    without: frozenset[str] = frozenset()
    parkable: bool = False
    parked: bool = False  # let go of its components for a while (cache.parked())

    def note(self, stream: Any) -> bool:
        """Remember ``stream``; return whether it is new to this hold."""
        if stream is None or stream in self.streams:
            return False
        self.streams.append(stream)
        return True


class Holds:
    """The open holds of one cache. Not thread-safe: the cache's lock guards it."""

    def __init__(self) -> None:
        self._open: set[Hold] = set()

    def take(self, digests: Iterable[str]) -> Hold:
        """A new hold on ``digests``, owned by the calling context."""
        hold = Hold(frozenset(digests))
        self._open.add(hold)
        _ENTERED.set((*(h for h in _ENTERED.get() if h.open), hold))
        return hold

    def give_back(self, hold: Hold) -> bool:
        """End ``hold``, from any thread; return ``False`` if it had ended already."""
        if not hold.open:
            return False
        hold.open = False
        self._open.discard(hold)
        entered = _ENTERED.get()
        if hold in entered:
            _ENTERED.set(tuple(h for h in entered if h.open))
        return True

    def mine(self) -> Counter[str]:
        """How many open holds the calling context has on each digest (parked ones
        hold nothing)."""
        out: Counter[str] = Counter()
        for h in self.entered():
            if not h.parked:
                out.update(h.digests)
        return out

    def entered(self) -> list[Hold]:
        """The calling context's open holds, oldest first."""
        return [h for h in _ENTERED.get() if h.open and h in self._open]

    def __len__(self) -> int:
        return len(self._open)
