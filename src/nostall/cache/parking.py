"""Parking: a paused call's pipeline leaves the device for a while and comes back.

A worker pauses a long job at a denoising step to run a short one of another pipeline
inside it (:mod:`nostall.serve.preempt`). When the short job's weights do not fit beside
the paused pipeline, the paused pipeline has to make room: :func:`park` lets the
calling context's ``use()`` blocks (those holding plain base weights, without LoRAs
fused in) give their components back for the ``with`` block, so the switches inside it
may evict them like any idle component, least recently used first. Their modules are
kept aside meanwhile (:attr:`Instance.parked <nostall.cache.modules.Instance.parked>`):
no other component is copied into them or handed them, so the paused call, which holds
those very module objects, goes on with them. When the block ends, what left comes back
from the host tier (a switch like any other, in the cache's reports) and the blocks
hold their components again.

The paused call's latents, scheduler state and prompt embeddings stay where they are:
a few megabytes beside gigabytes of weights. Kernels the paused call queued are fenced
as at a block's end (an event on each of its streams): a copy into its memory waits for
them. If bringing the weights back fails (room held elsewhere), the error reaches the
paused call, which fails cleanly: its block's end gives nothing back twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from nostall.memory.events import event_done

__all__ = ["park"]


@contextlib.contextmanager
def park(cache: Any) -> Iterator[int]:
    """Park the calling context's parkable ``use()`` blocks of ``cache`` (a
    :class:`~nostall.cache.ModelCache`) for the ``with`` block; yields the bytes of
    their components that may leave (0: nothing parked)."""
    with cache._lock:
        cache._check_open()
        holds = [h for h in cache._holds.entered() if h.parkable and not h.parked]
        kept, nbytes = _let_go(cache, holds)
    try:
        yield nbytes
        for hold in holds:
            if hold.open:  # (a block cannot end inside its own call; still, nothing leaks)
                cache._switch(hold.name, mode="use", without=hold.without, build=False, resume=hold)
    finally:
        with cache._lock:
            for inst in kept:  # (back in place, or the paused call fails: free again)
                inst.parked = False


def _let_go(cache: Any, holds: list[Any]) -> tuple[list[Any], int]:
    """Under the cache's lock: ``holds`` stop counting as uses, their modules are kept
    aside, and the next copies into their memory wait for their kernels. Returns the
    modules kept aside and the bytes that may now leave."""
    kept: list[Any] = []
    nbytes = 0
    for hold in holds:
        events = []
        if cache.device.type == "cuda":
            hold.note(cache._stream())
            events = [s.record_event() for s in hold.streams]
        hold.parked = True
        for d in hold.digests:
            slot = cache._tier.slots.get(d)
            if slot is None or not slot.uses:
                continue
            slot.uses -= 1
            if events:
                slot.events = [e for e in slot.events if not event_done(e)] + events
            inst = cache._modules.viewing(d)
            if inst is not None and not inst.parked:
                inst.parked = True
                kept.append(inst)
            if slot.uses == 0:
                nbytes += slot.size
    cache._released.notify_all()
    return kept, nbytes
