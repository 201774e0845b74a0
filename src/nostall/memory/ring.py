"""A small pinned staging ring for one-shot loads that do not use a pool.

Pinning on demand costs more than the copy it speeds up (``cudaHostAlloc`` ran
at 1.4 GB/s on our H200 host, the link at 55 GB/s), so a load without a pool
streams through a few hundred MiB pinned once by the ring's owner and reused:
reader threads fill slot ``seq % slots``, the copy stream drains it, and a slot
is handed to the next chunk only after the event of the copy that reads it has
completed.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from nostall.errors import ArgumentError
from nostall.memory.events import wait_event
from nostall.memory.host import HostArena

__all__ = ["StagingRing"]


class StagingRing:
    """``slots`` pinned buffers of ``slot_bytes`` each, in one registration.

    One load at a time uses the ring (its owner, the loader, serialises loads).
    Protocol per load: :meth:`reset`; reader threads call :meth:`acquire` with the
    chunk's sequence number before reading into the slot; the thread issuing the
    copies calls :meth:`issued` with the copy's event right after issuing it.

    >>> ring = StagingRing(slots=4, slot_bytes=1 << 20, pin=False)
    >>> ring.reset(); len(ring.acquire(0, threading.Event()))
    1048576
    >>> ring.close()
    """

    def __init__(self, *, slots: int, slot_bytes: int, pin: bool, device: int | None = None):
        if slots < 2:
            raise ArgumentError(f"a staging ring needs at least 2 slots, got {slots}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        # One registration for the whole ring: a copy never spans two, and one
        # cudaHostRegister of a few hundred MiB takes milliseconds.
        # ``device``: whose CUDA context registers the ring (portable: every GPU copies from it).
        self.arena = HostArena(slots * slot_bytes, segment_bytes=slots * slot_bytes, device=device)
        self.arena.pin_segment(0, register=pin)
        self.pinned = self.arena.is_registered(0)
        self._cond = threading.Condition()
        self._issued: list[int] = []
        # Mutated in place (never rebound): the finalizer holds this list to wait for
        # the copies still reading the ring before it unpins a ring nobody closed.
        self._events: list[Any] = []
        self.reset()
        self._finalizer = weakref.finalize(self, _teardown, self.arena, self._events)

    def reset(self) -> None:
        with self._cond:
            self._issued = [s - self.slots for s in range(self.slots)]
            self._events[:] = [None] * self.slots

    def offset(self, seq: int) -> int:
        return (seq % self.slots) * self.slot_bytes

    def acquire(self, seq: int, cancel: threading.Event) -> memoryview | None:
        """Wait until slot ``seq % slots`` is free for chunk ``seq``; return its memory.

        Free means: the copy of chunk ``seq - slots`` (the slot's previous user) was
        issued *and* its event has completed. Returns ``None`` if the load is
        cancelled while waiting (the chunk will never be read).
        """
        s = seq % self.slots
        with self._cond:
            while self._issued[s] < seq - self.slots:
                if cancel.is_set():
                    return None
                self._cond.wait(0.05)
            event = self._events[s]
        if event is not None:
            # The copy engine may still read this slot; overwriting it now would
            # corrupt the chunk in flight.
            wait_event(event)
        o = self.offset(seq)
        return self.arena.view(o, o + self.slot_bytes)

    def issued(self, seq: int, event: Any) -> None:
        """Record that the copy reading chunk ``seq``'s slot was issued, with its event."""
        s = seq % self.slots
        with self._cond:
            self._issued[s] = seq
            self._events[s] = event
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait for every copy that reads the ring."""
        with self._cond:
            events = [e for e in self._events if e is not None]
        for e in events:
            wait_event(e)

    def close(self) -> None:
        """Wait for the copies that read the ring, then unpin it. Idempotent; also runs
        when a ring nobody closed is collected."""
        self._finalizer()


def _teardown(arena: HostArena, events: list[Any]) -> None:
    for e in [e for e in events if e is not None]:
        # The copy engine may still read the ring: unpinning under it is undefined.
        wait_event(e)
    arena.close()
