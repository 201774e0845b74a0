from __future__ import annotations

import gc
import threading

from nostall.memory.ring import StagingRing


def test_a_ring_nobody_closed_is_unpinned_when_collected():
    ring = StagingRing(slots=2, slot_bytes=1 << 20, pin=False)
    arena = ring.arena
    del ring
    gc.collect()
    assert arena.tensor is None  # closed: its pages unregistered, the mapping let go


def test_close_is_idempotent_and_waits_for_nothing_when_no_copy_was_issued():
    ring = StagingRing(slots=2, slot_bytes=1 << 20, pin=False)
    ring.reset()
    assert len(ring.acquire(0, threading.Event())) == 1 << 20
    ring.close()
    ring.close()
    assert ring.arena.tensor is None
