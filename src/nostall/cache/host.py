"""The host tier: immutable copies of components in a pool, and who may stay.

The bytes live in a :class:`~nostall.PinnedPool` block keyed by the component's
digest, exactly as they are on disk; the pool's own eviction is off, and this tier
decides, by the admission policy of :func:`nostall.cache.placement.admit`: a newcomer
is admitted only if the room it needs, as one free run, can be taken from residents
requested less often than it was. A component that is not admitted still loads,
straight from disk to the device through the loader's staging ring.

The pool is page-locked only for a CUDA cache (a CPU cache's copies gain nothing from
pinned pages), and its pages are committed as blocks are written, not up front
(``PinnedPool(pin=False)``). A CUDA pool pins its whole budget in a background thread
from the start, so no switch waits for pinning: the default budget is therefore sized
to the store (:meth:`nostall.ModelCache`), not to the machine alone.
"""

from __future__ import annotations

import logging

import torch

from nostall.cache.placement import Extent, Requests, admit
from nostall.errors import ArgumentError, NostallError
from nostall.memory.pool import PinnedPool, size_class
from nostall.store.catalog import ComponentEntry, Store, files_key
from nostall.transfer.plan import LoadPlan

__all__ = ["HostTier", "cpu_tier_bytes", "parse_host_tier", "store_bytes"]

log = logging.getLogger(__name__)

AGE_EVERY = 64  # requests between two halvings of every request count


def store_bytes(store: Store, cap: int) -> int:
    """What ``store``'s weights take in a host tier, each distinct component's block
    once, at most ``cap`` (the default budget: a 7 MB store is not given half the
    machine). Reads every pipeline's headers; a pipeline that cannot be read is left
    out, with a warning (its own switch will say why)."""
    need: dict[str, int] = {}
    for name in store.names():
        try:
            for c in store.entry(name).weights:
                if c.digest not in need:
                    need[c.digest] = size_class(LoadPlan(c.checkpoint).host_bytes)
        except NostallError as e:
            log.warning("sizing the host tier: pipeline %r left out: %s", name, e)
    return max(min(cap, sum(need.values())), size_class(1))


def cpu_tier_bytes(store: Store, cap: int) -> int:
    """The default device tier of a CPU cache: ordinary memory, committed at the first
    switch, so sized to the store rather than to the machine. Twice the store's bytes
    (weights may be cast up to twice their width, bf16 → fp32), at most ``cap``."""
    return min(cap, 2 * store_bytes(store, cap) + (64 << 20))


def parse_host_tier(host_tier: str | None) -> str | None:
    """``None``/``"private"`` → ``None`` (this process's own pool); ``"shared:NAME"`` →
    ``NAME`` (the host's shared tier of that name); anything else an ArgumentError."""
    if host_tier is None or host_tier == "private":
        return None
    if isinstance(host_tier, str) and host_tier.startswith("shared:") and host_tier[7:]:
        return host_tier[7:]
    raise ArgumentError(
        f"host_tier={host_tier!r}; give 'private' (this process's own pinned pool) or "
        "'shared:NAME' (one tier for every process of the host that names it)",
        field="host_tier",
    )


class HostTier:
    """A pool of ``budget`` bytes with frequency-based admission; the owner locks.

    With ``shared`` (a name), the pool is the host's :class:`~nostall.memory.SharedPool`
    of that name (in ``$NOSTALL_SHM_DIR``, default ``/dev/shm``): a component any worker
    of the host read is a memory hit for all. Its admission is then the pool's own: every
    component that fits is cached, evicting what no process holds, least recently used
    first across the processes (one process's request counts say little about the
    others'), and ``budget`` is the host's, not this process's.
    """

    def __init__(self, budget: int, device: torch.device, shared: str | None = None):
        cuda = device.type == "cuda"
        self.shared = shared
        if shared is None:
            self.pool = PinnedPool(budget, evict=False, pin=cuda, device=device if cuda else None)
        else:
            from nostall.memory.shared import SharedPool

            # root: $NOSTALL_SHM_DIR, else /dev/shm (memory.shared.default_root)
            self.pool = SharedPool(shared, budget, device=device if cuda else None, evict=True)
        self.budget = self.pool.capacity
        # Shared tier: the pool's key of each component digest seen (files_key).
        self._keys: dict[str, str] = {}
        self.requests = Requests(AGE_EVERY)
        # Blocks promised to the switch being planned, not allocated yet: (offset, size).
        self._reserved: list[tuple[int, int]] = []

    def begin(self) -> None:
        """A new switch is being planned: nothing of it is reserved yet."""
        self._reserved = []

    def bind(self, c: ComponentEntry) -> None:
        """Learn the pool key of ``c``: its digest, or in a shared tier its files' key (the
        same in every process, whatever each one's digest index knows)."""
        if self.shared is not None:
            self._keys[c.digest] = files_key(c)

    def key(self, digest: str) -> str:
        """The pool key ``digest`` is cached under."""
        return self._keys.get(digest, digest)

    def request(self, digest: str) -> int:
        """Count a request for ``digest``; return its count *before* this request."""
        return self.requests.request(digest)

    def resident(self) -> set[str]:
        """The component digests whose bytes the tier holds."""
        keys = set(self.pool.cached_keys())
        if self.shared is None:
            return keys
        return {d for d, k in self._keys.items() if k in keys}

    def has(self, digest: str) -> bool:
        return self.key(digest) in set(self.pool.cached_keys())

    def admit(
        self, digest: str, host_bytes: int, prior: int, keep: set[str], *, force: bool = False
    ) -> bool:
        """Whether ``digest`` (a block of ``host_bytes``, the loader's host layout) may be
        cached; residents are evicted for it only when it then certainly fits. ``force``:
        whatever its request count (a component streamed from here must be here)."""
        if force:
            prior = 1 << 62
        need = size_class(host_bytes)
        if self.shared is not None:
            return need <= self.budget  # the shared pool evicts for it when it allocates
        residents = self._residents()
        if residents is None:
            return False
        decision = admit(
            need,
            self.budget,
            residents,
            prior=prior,
            keep=keep | {digest},
            reserved=self._reserved,
        )
        if decision is None:
            return False
        for d in decision.victims:
            self.pool.evict(d)
            log.info("host tier: evicted %s to admit %s", d[:12], digest[:12])
        self._reserved.append((decision.offset, need))
        return True

    def _residents(self) -> list[Extent] | None:
        """Where each cached block lies, or ``None`` if the pool holds blocks this tier
        cannot see (held by a load in flight: never while the owner plans a switch)."""
        out, held = [], 0
        for key in self.pool.cached_keys():
            block = self.pool.lookup(key)
            if block is None:
                continue
            try:
                out.append(
                    Extent(
                        key,
                        block.offset,
                        block.size,
                        self.requests.last(key),
                        self.requests.count(key),
                    )
                )
                held += block.size
            finally:
                block.release()
        stats = self.pool.stats(hugepages=False)
        # Free counts ranges still read by copies: they are free once those end, and
        # the pool's allocate waits for them.
        return out if held + stats.free == self.budget else None

    def evict(self, digest: str) -> int:
        return self.pool.evict(self.key(digest))

    def evict_all(self, keep: set[str] = frozenset()) -> int:
        return sum(self.evict(d) for d in self.resident() - set(keep))

    def close(self) -> None:
        self.pool.close()
