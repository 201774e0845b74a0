"""The host tier: immutable pinned copies of components, and who may stay.

The bytes live in a :class:`~nostall.PinnedPool` block keyed by the component's
digest, exactly as they are on disk; the pool's own eviction is off, and this tier
decides. Plain LRU over a working set larger than the budget evicts every model just
before it is needed again (ComfyUI users reloading flux ↔ flux-canny from disk on
every switch): each request then pays a disk read and gains nothing.

So a newcomer is **admitted** only if the room it needs can be taken from residents
requested less often than it was (counts halve every ``AGE_EVERY`` requests, so old
favourites fade). Ties keep the residents. In a cycle over more models than fit, a
stable subset stays and hits instead of every request missing; a one-off model never
pushes out a model in regular use. A component that is not admitted still loads,
straight from disk to the device through the loader's staging ring.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from nostall.memory.pool import PinnedPool, size_class

__all__ = ["HostTier"]

log = logging.getLogger(__name__)

AGE_EVERY = 64


class HostTier:
    """A pool of ``budget`` bytes with frequency-based admission; the owner locks."""

    def __init__(self, budget: int, device: torch.device):
        self.pool = PinnedPool(
            budget, evict=False, device=device if device.type == "cuda" else None
        )
        self.budget = self.pool.capacity
        self._counts: Counter[str] = Counter()
        self._requests = 0
        self._last: dict[str, int] = {}  # digest -> request number of its last request
        self.sizes: dict[str, int] = {}  # digest -> block size of resident components
        self._reserved = 0  # admitted by the switch being planned, not allocated yet

    def begin(self) -> None:
        """A new switch is being planned: nothing of it is reserved yet."""
        self._reserved = 0

    def request(self, digest: str) -> int:
        """Count a request for ``digest``; return its count *before* this request."""
        before = self._counts[digest]
        self._counts[digest] += 1
        self._requests += 1
        self._last[digest] = self._requests
        if self._requests % AGE_EVERY == 0:
            for k in list(self._counts):
                self._counts[k] //= 2
                if not self._counts[k]:
                    del self._counts[k]
        return before

    def resident(self) -> set[str]:
        return set(self.pool.cached_keys())

    def has(self, digest: str) -> bool:
        return digest in self.resident()

    @property
    def used(self) -> int:
        s = self.pool.stats(hugepages=False)
        return s.in_use + s.cached

    def admit(self, digest: str, nbytes: int, prior: int, keep: set[str]) -> bool:
        """Make room for ``digest`` (``nbytes`` on disk) if residents requested less often
        than ``prior`` times can give it; return whether it may be cached."""
        need = size_class(nbytes + (4 << 10))  # the loader's host layout rounds files up
        if need > self.budget:
            return False
        stats = self.pool.stats(hugepages=False)
        if stats.largest_free - self._reserved >= need:
            self._reserved += need
            return True
        resident = self.resident() - keep - {digest}
        # Least valuable first: fewest requests, then least recently requested.
        victims = sorted(resident, key=lambda d: (self._counts[d], self._last.get(d, 0)))
        chosen = []
        free = stats.free - self._reserved
        for d in victims:
            # A resident gives way to a newcomer requested more often, or when it has not
            # been requested since its count aged away; ties keep the resident.
            if not (self._counts[d] < prior or self._counts[d] == 0):
                break
            chosen.append(d)
            free += self.sizes.get(d, 0)
            if free >= need:
                break
        if free < need:
            return False
        for d in chosen:
            self.pool.evict(d)
            self.sizes.pop(d, None)
            log.info("host tier: evicted %s to admit %s", d[:12], digest[:12])
            if self.pool.stats(hugepages=False).largest_free - self._reserved >= need:
                break
        if self.pool.stats(hugepages=False).largest_free - self._reserved >= need:
            self._reserved += need
            return True
        return False

    def admitted(self, digest: str, block_size: int) -> None:
        self.sizes[digest] = block_size

    def evict_all(self, keep: set[str] = frozenset()) -> int:
        freed = 0
        for d in self.resident() - set(keep):
            freed += self.pool.evict(d)
            self.sizes.pop(d, None)
        return freed

    def close(self) -> None:
        self.pool.close()
