"""The two-level pinned host pool.

Level 1 — **slabs**: the pool reserves its whole byte budget as one anonymous
mapping (:class:`~nostall.memory.host.HostArena`) and pins it slab by slab in a
background thread started by the constructor, so pinning (seconds for tens of
gigabytes) never sits on a request's path.

Level 2 — **blocks**: requests are rounded up to a size class (eighth-of-a-power-
of-two steps above 16 MiB, 2 MiB granules below) and carved from the slabs as
contiguous ranges by best fit; freed ranges coalesce with their neighbours. The
rounding is what makes MuseAI's sequence — load 2.8 GB, load 8.5 GB, free the
2.8 GB, load 2.9 GB — land the 2.9 GB request exactly in the freed hole instead
of pinning anew: both round to the same class.

A block may be **cached** under a key (a checkpoint's file identity): when its
last holder releases it, its bytes stay in the pool, idle, so the next load of the
same checkpoint is one host→device copy. Idle cached blocks are evicted least-
recently used when a request does not fit (``evict=True``, the default) or only on
the caller's demand (``evict=False``: the request raises :class:`PoolExhausted`).
A block is never evicted while anyone holds it.

Who may write a block: only its allocator, before the first release. Cached bytes
are served to later holders read-only by convention — nostall copies them out
(to the GPU, or into a CPU load's own memory) and never hands out a view of them.

Memory given back is reused only after every copy that reads it has finished:
copies register their CUDA event with :meth:`Block.fence`, and a dropped block's
range waits, *outside* the pool's lock, for those events before it is carved again.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from nostall.errors import ArgumentError, BusyError, ClosedError, PoolExhausted
from nostall.memory.events import event_done, wait_event
from nostall.memory.host import (
    HostArena,
    cuda_available,
    hugepage_bytes,
    memory_available,
    memory_limit,
    round_up,
)
from nostall.memory.pinning import Pinning, device_index, teardown
from nostall.memory.ranges import Ranges

__all__ = ["Block", "PinnedPool", "PoolStats", "size_class"]

log = logging.getLogger(__name__)

GRANULE = 2 << 20
_SMALL = 16 << 20


def size_class(nbytes: int) -> int:
    """The block size a request of ``nbytes`` is rounded up to.

    Multiples of 2 MiB up to 16 MiB; above that, the next multiple of 1/8 of the
    request's power of two (waste ≤ 12.5%).

    >>> size_class(1), size_class(3 << 20)
    (2097152, 4194304)
    >>> size_class(2_800_000_000) == size_class(2_900_000_000)
    True
    """
    if nbytes <= 0:
        raise ArgumentError(f"block size must be positive, got {nbytes}")
    if nbytes <= _SMALL:
        return round_up(nbytes, GRANULE)
    step = max(GRANULE, (1 << (nbytes.bit_length() - 1)) // 8)
    return round_up(nbytes, step)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's accounting, in bytes.

    Attributes:
        capacity: the byte budget (the reserved mapping).
        pinned: bytes page-locked so far (grows while the background thread pins).
        in_use: bytes of blocks someone holds (rounded sizes).
        cached: bytes of idle cached blocks (evictable).
        free: bytes in no block (including ranges still waiting for a copy to end).
        largest_free: the largest contiguous free run.
        requested: bytes actually asked for by live and cached blocks (before rounding).
        blocks: live and cached blocks.
        hugepages: bytes of the pool backed by transparent huge pages (``None`` if unknown
            or not asked for); DMA from 4 KiB pages ran ~20% slower on our H200 host.
    """

    capacity: int
    pinned: int
    in_use: int
    cached: int
    free: int
    largest_free: int
    requested: int
    blocks: int
    hugepages: int | None = None

    @property
    def fragmentation(self) -> float:
        """Share of free bytes outside the largest free run (0 = one hole)."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free

    @property
    def rounding_waste(self) -> float:
        """Share of held bytes lost to size-class rounding."""
        held = self.in_use + self.cached
        return 0.0 if held == 0 else 1.0 - self.requested / held


class Block:
    """A contiguous range of the pool: ``[offset, offset + size)`` of its arena.

    Held by whoever allocated or looked it up until :meth:`release`. Views from
    :attr:`tensor` and :meth:`view` are valid while the block is held; the holder
    that allocated it fills it, later holders only read it.
    """

    __slots__ = (
        "__weakref__",
        "_events",
        "_pool",
        "holders",
        "key",
        "last_used",
        "nbytes",
        "offset",
        "size",
    )

    def __init__(self, pool: PinnedPool, offset: int, size: int, nbytes: int, key: Hashable | None):
        self._pool = pool
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.key = key
        self._events: list[Any] = []
        self.holders = 1
        self.last_used = time.monotonic()

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    @property
    def tensor(self) -> torch.Tensor:
        """uint8 view of the block, valid while the block is held."""
        return self._pool.arena.tensor[self.offset : self.offset + self.size]

    def view(self) -> memoryview:
        """A memoryview of the block for readers; valid while the block is held."""
        return self._pool.arena.view(self.offset, self.offset + self.size)

    def split(self, start: int, end: int):
        """Cut block-relative ``[start, end)`` where the pages' registrations change."""
        for a, b in self._pool.arena.split(self.offset + start, self.offset + end):
            yield a - self.offset, b - self.offset

    def fence(self, event: Any) -> None:
        """Record a copy that reads the block: its memory is not reused before ``event``
        (a CUDA event recorded after the copy) has completed."""
        self._pool._fence(self, event)

    def invalidate(self) -> None:
        """Never serve these bytes from the cache (the read into the block failed or was
        cut short): on release the block is freed instead of cached."""
        self._pool._invalidate(self)

    def release(self) -> None:
        """Give the block back: cached blocks stay readable, others become free."""
        self._pool._release(self)

    def __repr__(self) -> str:
        return (
            f"Block(offset={self.offset}, size={self.size}, nbytes={self.nbytes}, "
            f"key={self.key!r}, holders={self.holders})"
        )


class PinnedPool:
    """A byte-budgeted pool of page-locked host memory for checkpoints.

    The constructor reserves ``capacity`` bytes of address space and starts a
    background thread that pins it slab by slab (``slab_bytes`` per CUDA
    registration); :meth:`wait_pinned` waits for it. Without CUDA (or with
    ``pin=False``) the same pool hands out page-aligned pageable memory, and
    reserves only address space: no page is touched until a block's holder writes it.

    One pool serves every GPU of the process: the pages are registered as
    *portable*, so copies to any GPU run at link speed from them. ``device`` names
    the GPU whose CUDA context does the registering (default: the current one):
    give the GPU your process works on, so pinning creates no context on GPU 0.

    The pool refuses a budget beyond the memory this process can have (its
    container's cgroup limit, else the machine's), with :class:`~nostall.ArgumentError`,
    and logs a warning when the budget exceeds what the OS reports available now.
    A pool that is garbage-collected, or still open at interpreter exit, stops its
    pin thread and unregisters its memory.

    >>> pool = PinnedPool(256 << 20)
    >>> block = pool.allocate(100 << 20)
    >>> block.size >= 100 << 20
    True
    >>> block.release(); pool.close()
    """

    def __init__(
        self,
        capacity: int,
        *,
        device: str | torch.device | int | None = None,
        slab_bytes: int = 1 << 30,
        pin: bool | None = None,
        evict: bool = True,
        background: bool = True,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ArgumentError(
                f"pool capacity must be a positive number of bytes, got {capacity!r}"
            )
        if slab_bytes <= 0 or slab_bytes % GRANULE:
            raise ArgumentError(f"slab_bytes={slab_bytes} must be a positive multiple of {GRANULE}")
        capacity = round_up(capacity, GRANULE)
        check_capacity(capacity)
        self.capacity = capacity
        self.auto_evict = evict
        self.pin = cuda_available() if pin is None else pin
        self.device = device_index(device) if self.pin else None
        self.arena = HostArena(capacity, segment_bytes=slab_bytes, device=self.device)
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a holder lets go
        self._ranges = Ranges(capacity)
        self._fenced: list[tuple[list[Any], int, int]] = []  # dropped, a copy may still read
        self._blocks: set[Block] = set()
        self._cache: dict[Hashable, Block] = {}
        self._state = "open"  # open → closing → closed
        self._pinning = Pinning(self.arena, self.pin, self.device)
        self._pinner: threading.Thread | None = None
        if not self.pin:
            # Pageable memory has nothing to lock, and touching every page up front made
            # the whole budget resident (a test process reached 13 GiB RSS) for blocks that
            # may never be carved: a page is first touched by whoever writes its block.
            self._pinning.skip()
        elif background:
            self._pinner = threading.Thread(
                target=self._pinning.run, name="nostall-pool-pin", daemon=True
            )
        self._finalizer = weakref.finalize(self, teardown, self._pinning, self._pinner, self.arena)
        if self._pinner is not None:
            self._pinner.start()
        elif self.pin:
            self._pinning.run()

    # ---- level 1: slabs ----------------------------------------------------------

    def wait_pinned(self, nbytes: int | None = None, timeout: float | None = None) -> bool:
        """Wait until the first ``nbytes`` (default: all) of the pool are pinned."""
        n = self.arena.num_segments
        upto = n if nbytes is None else min(n, -(-nbytes // self.arena.segment_bytes))
        return self._pinning.wait(upto, timeout)

    # ---- level 2: blocks ---------------------------------------------------------

    def allocate(self, nbytes: int, *, key: Hashable | None = None) -> Block:
        """A block of at least ``nbytes``, held by the caller until :meth:`Block.release`.

        With ``key``, the block is cached under it on release (replacing an older
        entry of that key). Waits for the slabs under the block to be pinned.
        Raises :class:`PoolExhausted` when no free run fits even after evicting
        idle cached blocks (when ``evict`` is on).
        """
        size = size_class(nbytes)
        while True:
            with self._lock:
                self._check_open()
                self._reclaim()
                offset = self._ranges.carve(size)
                while offset is None and self.auto_evict and self._evict_one(size):
                    offset = self._ranges.carve(size)
                if offset is not None:
                    block = Block(self, offset, size, nbytes, key)
                    self._blocks.add(block)
                    break
                pending = [e for events, _, _ in self._fenced for e in events]
                if not pending:
                    raise self._exhausted(size, nbytes)
            # Ranges dropped while copies still read them: wait for those copies with
            # the lock released (another thread may be releasing or copying), then retry.
            for e in pending:
                wait_event(e)
        try:
            self.wait_pinned(offset + size)
        except BaseException:
            # Pinning failed (or the wait was interrupted): nobody will ever hold this
            # block (nor read it: under its key it would be served unwritten), so give
            # its range back before the error leaves.
            self._invalidate(block)
            self._release(block)
            raise
        return block

    def lookup(self, key: Hashable) -> Block | None:
        """The cached block under ``key``, now held by the caller, or ``None``.

        The caller reads it (copies it out) and releases it; it must not write it.
        """
        with self._lock:
            self._check_open()
            block = self._cache.get(key)
            if block is None:
                return None
            block.holders += 1
            block.last_used = time.monotonic()
            return block

    def evict(self, key: Hashable | None = None) -> int:
        """Drop idle cached blocks (all, or the one under ``key``); returns bytes freed.

        Blocks that are held are skipped: their users still read them.
        """
        with self._lock:
            victims = [
                b for k, b in self._cache.items() if (key is None or k == key) and b.holders == 0
            ]
            for b in victims:
                self._drop(b)
            return sum(b.size for b in victims)

    def cached_keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._cache)

    def stats(self, *, hugepages: bool = True) -> PoolStats:
        """The pool's accounting. ``hugepages=False`` skips the huge-page count (it reads
        ``/proc/self/smaps``: a page-table walk of the whole process, about 0.1-0.3 s
        once a GPU process maps tens of GB) for callers on a request path."""
        with self._lock:
            self._reclaim()
            free = self._ranges.free + sum(s for _, _, s in self._fenced)
            cached = sum(b.size for b in self._blocks if b.holders == 0)
            in_use = sum(b.size for b in self._blocks) - cached
            largest = self._ranges.largest
            requested = sum(b.nbytes for b in self._blocks)
            blocks = len(self._blocks)
            closed = self._state == "closed"
        pinned = self.arena.pinned_bytes if self.pin and not closed else 0
        # /proc/self/smaps is read without the lock: it takes milliseconds per GB mapped.
        huge = None
        if hugepages and not closed:
            huge = hugepage_bytes(self.arena.address, self.capacity)
        return PoolStats(
            capacity=self.capacity,
            pinned=pinned,
            in_use=in_use,
            cached=cached,
            free=free,
            largest_free=largest,
            requested=requested,
            blocks=blocks,
            hugepages=huge,
        )

    # ---- lifecycle ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state != "open"

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop pinning, wait for held blocks and pending copies, unregister the memory.

        New allocations and lookups are refused from the call on. Blocks still held
        by other threads' loads are waited for, up to ``timeout`` seconds; if some are
        still held then, :class:`~nostall.BusyError` names them and the memory stays
        registered (call ``close`` again later). Idempotent once it has succeeded.
        """
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closing"
        self._pinning.stop()
        if self._pinner is not None:
            self._pinner.join()
        with self._released:
            if not self._released.wait_for(
                lambda: all(b.holders == 0 for b in self._blocks), timeout
            ):
                held = [b for b in self._blocks if b.holders]
                raise BusyError(
                    f"cannot close the pinned pool: {len(held)} block(s) still held after "
                    f"{timeout} s ({sum(b.size for b in held) / 1e9:.3f} GB, e.g. {held[0]!r}); "
                    "release them (let in-flight loads finish) and call close() again"
                )
            events = [e for b in self._blocks for e in b._events]
            events += [e for evs, _, _ in self._fenced for e in evs]
            self._blocks.clear()
            self._cache.clear()
            self._fenced.clear()
            self._ranges.clear()
            self._state = "closed"
        for e in events:
            wait_event(e)  # no copy may read the pages once they are unregistered
        self._finalizer()

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats(hugepages=False)
        return (
            f"PinnedPool(capacity={s.capacity}, pinned={s.pinned}, in_use={s.in_use}, "
            f"cached={s.cached}, free={s.free}, state={self._state})"
        )

    # ---- internals (called with self._lock held unless noted) ---------------------

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClosedError("the pinned pool is closed; create a new PinnedPool")

    def _reclaim(self) -> None:
        # Event.query() does not block: ranges whose copies have ended become free.
        still = []
        for events, off, size in self._fenced:
            events = [e for e in events if not event_done(e)]
            if events:
                still.append((events, off, size))
            else:
                self._ranges.give_back(off, size)
        self._fenced = still

    def _evict_one(self, size: int) -> bool:
        idle = [b for b in self._cache.values() if b.holders == 0]
        if not idle:
            return False
        victim = min(idle, key=lambda b: b.last_used)
        log.info("evicting cached block %r to make room for %d bytes", victim.key, size)
        self._drop(victim)
        self._reclaim()
        return True

    def _drop(self, block: Block) -> None:
        if block.key is not None and self._cache.get(block.key) is block:
            del self._cache[block.key]
        self._blocks.discard(block)
        events, block._events = block._events, []
        if events:
            # A copy may still read the block: its bytes are reused only after it ends.
            self._fenced.append((events, block.offset, block.size))
        else:
            self._ranges.give_back(block.offset, block.size)

    def _fence(self, block: Block, event: Any) -> None:
        if event is None:
            return
        with self._lock:
            # Drop finished events so a block copied out thousands of times stays small.
            block._events = [e for e in block._events if not event_done(e)]
            block._events.append(event)

    def _invalidate(self, block: Block) -> None:
        with self._lock:
            if block.key is not None and self._cache.get(block.key) is block:
                del self._cache[block.key]
            block.key = None

    def _release(self, block: Block) -> None:
        with self._lock:
            if block not in self._blocks:
                return
            if block.holders <= 0:
                raise RuntimeError(f"{block!r} released more often than it was held")
            block.holders -= 1
            block.last_used = time.monotonic()
            if block.holders:
                return
            self._released.notify_all()
            if block.key is not None and self._state == "open":
                old = self._cache.get(block.key)
                if old is not None and old is not block:
                    # A newer read of the same checkpoint wins; the old copy goes once idle.
                    old.key = None
                    if old.holders == 0:
                        self._drop(old)
                self._cache[block.key] = block
            else:
                self._drop(block)

    def _exhausted(self, size: int, nbytes: int) -> PoolExhausted:
        stuck = sum(b.size for b in self._blocks)
        largest = self._ranges.largest
        hint = (
            "evict cached checkpoints with pool.evict() or release blocks you hold"
            if not self.auto_evict
            else "release blocks you still hold, or create a larger pool"
        )
        return PoolExhausted(
            f"pinned pool cannot hold {nbytes / 1e9:.3f} GB (rounded to {size / 1e9:.3f} GB): "
            f"capacity {self.capacity / 1e9:.3f} GB, {stuck / 1e9:.3f} GB held, largest free run "
            f"{largest / 1e9:.3f} GB; {hint}",
            requested=size,
            capacity=self.capacity,
            in_use=stuck,
            largest_free=largest,
        )


def check_capacity(capacity: int) -> None:
    """:class:`~nostall.ArgumentError` when a pool of ``capacity`` bytes cannot fit this
    process's memory limit; a warning when it exceeds what the OS reports available now."""
    limit, source = memory_limit()
    if limit is not None and capacity > limit:
        where = "this container's cgroup limit" if source == "cgroup" else "the machine's memory"
        raise ArgumentError(
            f"pool capacity {capacity / 1e9:.2f} GB exceeds {where} ({limit / 1e9:.2f} GB); "
            "pinned memory cannot be swapped, so the process would be killed. Give a smaller "
            "capacity."
        )
    available = memory_available()
    if available is not None and capacity > available:
        log.warning(
            "pool capacity %.2f GB exceeds the %.2f GB the OS reports available now; "
            "pinning will push out page cache and other processes' memory (on a VM whose "
            "memory grows on demand this is expected)",
            capacity / 1e9,
            available / 1e9,
        )
