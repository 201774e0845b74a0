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
user releases it, its bytes stay in the pool, idle, so the next load of the same
checkpoint is one host→device copy. Idle cached blocks are evicted least-recently
used when a request does not fit (``evict=True``, the default) or only on the
caller's demand (``evict=False``: the request raises :class:`PoolExhausted`).
Blocks handed to callers as CPU tensors are *leased*: they are never evicted
while any of those tensors is alive.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from nostall.errors import ClosedError, DeviceError, PoolExhausted
from nostall.memory.host import (
    HostArena,
    cuda_available,
    hugepage_bytes,
    memory_available,
    round_up,
)

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
        raise ValueError(f"block size must be positive, got {nbytes}")
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
        in_use: bytes of blocks held by a user or a live lease (rounded sizes).
        cached: bytes of idle cached blocks (evictable).
        free: bytes in no block.
        largest_free: the largest contiguous free run.
        requested: bytes actually asked for by live and cached blocks (before rounding).
        blocks: live and cached blocks.
        hugepages: bytes of the pool backed by transparent huge pages (``None`` if unknown);
            DMA from 4 KiB pages ran ~20% slower on our H200 host.
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

    Owned by whoever allocated it until :meth:`release`; after release, a cached
    block's bytes belong to the pool (readable again via :meth:`PinnedPool.lookup`).
    ``event`` is the CUDA event of the last copy that reads the block: the pool
    waits on it before the memory is handed to anyone else.
    """

    __slots__ = (
        "__weakref__",
        "_pool",
        "event",
        "holders",
        "key",
        "last_used",
        "leases",
        "nbytes",
        "offset",
        "payload",
        "size",
    )

    def __init__(self, pool: PinnedPool, offset: int, size: int, nbytes: int, key: Hashable | None):
        self._pool = pool
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.key = key
        self.payload: Any = None
        self.event: Any = None
        self.holders = 1
        self.leases = 0
        self.last_used = time.monotonic()

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    @property
    def tensor(self) -> torch.Tensor:
        """uint8 view of the block (no lease: valid while the block is held)."""
        return self._pool.arena.tensor[self.offset : self.offset + self.size]

    def view(self) -> memoryview:
        """A memoryview of the block for readers; valid while the block is held."""
        return self._pool.arena.view(self.offset, self.offset + self.size)

    def split(self, start: int, end: int):
        """Cut block-relative ``[start, end)`` where the pages' registrations change."""
        for a, b in self._pool.arena.split(self.offset + start, self.offset + end):
            yield a - self.offset, b - self.offset

    def lease_tensor(self) -> torch.Tensor:
        """A uint8 CPU tensor over the block that keeps it from eviction while alive.

        Every view derived from it holds the lease too; the block becomes evictable
        (if cached) once the last such tensor is garbage.
        """
        mv = self.view()
        t = (
            torch.frombuffer(mv, dtype=torch.uint8)
            if self.size
            else torch.empty(0, dtype=torch.uint8)
        )
        self._pool._lease(self, mv)
        return t

    def release(self) -> None:
        """Give the block back: cached blocks stay readable, others become free."""
        self._pool._release(self)

    def __repr__(self) -> str:
        return (
            f"Block(offset={self.offset}, size={self.size}, nbytes={self.nbytes}, "
            f"key={self.key!r}, holders={self.holders}, leases={self.leases})"
        )


class PinnedPool:
    """A byte-budgeted pool of page-locked host memory for checkpoints.

    The constructor reserves ``capacity`` bytes of address space and starts a
    background thread that pins it slab by slab (``slab_bytes`` per CUDA
    registration); :meth:`wait_pinned` waits for it. Without CUDA (or with
    ``pin=False``) the same pool hands out page-aligned pageable memory.

    The pool refuses a budget beyond the memory the OS reports available, so a
    mis-sized pool fails with a clear error instead of an OOM kill.

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
        slab_bytes: int = 1 << 30,
        pin: bool | None = None,
        evict: bool = True,
        background: bool = True,
    ):
        if capacity <= 0:
            raise ValueError(f"pool capacity must be positive, got {capacity}")
        if slab_bytes <= 0 or slab_bytes % GRANULE:
            raise ValueError(f"slab_bytes={slab_bytes} must be a positive multiple of {GRANULE}")
        capacity = round_up(capacity, GRANULE)
        available = memory_available()
        if available is not None and capacity > available:
            raise ValueError(
                f"pool capacity {capacity / 1e9:.2f} GB exceeds the {available / 1e9:.2f} GB of "
                "memory the OS reports available; pinning it would invite the OOM killer. "
                "Give a smaller capacity."
            )
        self.capacity = capacity
        self.auto_evict = evict
        self.pin = cuda_available() if pin is None else pin
        self.arena = HostArena(capacity, segment_bytes=slab_bytes)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), address order
        self._blocks: set[Block] = set()
        self._cache: dict[Hashable, Block] = {}
        self._unleased: deque[Block] = deque()
        self._closed = False
        self._pinned_upto = 0  # slabs [0, _pinned_upto) are touched (and registered)
        self._pin_cond = threading.Condition(self._lock)
        self._pin_error: BaseException | None = None
        self._pinner: threading.Thread | None = None
        if background:
            self._pinner = threading.Thread(
                target=self._pin_all, name="nostall-pool-pin", daemon=True
            )
            self._pinner.start()
        else:
            self._pin_all()

    # ---- level 1: slabs ----------------------------------------------------------

    def _pin_all(self) -> None:
        try:
            for i in range(self.arena.num_segments):
                with self._lock:
                    if self._closed:
                        return
                self.arena.pin_segment(i, register=self.pin)
                with self._pin_cond:
                    self._pinned_upto = i + 1
                    self._pin_cond.notify_all()
        except BaseException as e:  # surfaced to whoever waits on pinning
            with self._pin_cond:
                self._pin_error = e
                self._pin_cond.notify_all()
            log.exception("pinning the pool failed")

    def wait_pinned(self, nbytes: int | None = None, timeout: float | None = None) -> bool:
        """Wait until the first ``nbytes`` (default: all) of the pool are pinned."""
        upto = self.arena.num_segments if nbytes is None else -(-nbytes // self.arena.segment_bytes)
        with self._pin_cond:
            ok = self._pin_cond.wait_for(
                lambda: self._pinned_upto >= upto or self._pin_error is not None or self._closed,
                timeout,
            )
            if self._pin_error is not None:
                raise DeviceError(
                    f"pinning the pool failed: {type(self._pin_error).__name__}: {self._pin_error}"
                ) from self._pin_error
            return ok and self._pinned_upto >= upto

    # ---- level 2: blocks ---------------------------------------------------------

    def allocate(self, nbytes: int, *, key: Hashable | None = None) -> Block:
        """A block of at least ``nbytes``, held by the caller until :meth:`Block.release`.

        With ``key``, the block is cached under it on release (replacing an older
        entry of that key). Waits for the slabs under the block to be pinned.
        Raises :class:`PoolExhausted` when no free run fits even after evicting
        idle cached blocks (when ``evict`` is on).
        """
        size = size_class(nbytes)
        with self._lock:
            self._check_open()
            self._drain()
            offset = self._carve(size)
            while offset is None and self.auto_evict and self._evict_one(size):
                offset = self._carve(size)
            if offset is None:
                raise self._exhausted(size, nbytes)
            block = Block(self, offset, size, nbytes, key)
            self._blocks.add(block)
        self.wait_pinned(offset + size)
        return block

    def lookup(self, key: Hashable) -> Block | None:
        """The cached block under ``key``, now held by the caller, or ``None``."""
        with self._lock:
            self._check_open()
            self._drain()
            block = self._cache.get(key)
            if block is None:
                return None
            block.holders += 1
            block.last_used = time.monotonic()
            return block

    def evict(self, key: Hashable | None = None) -> int:
        """Drop idle cached blocks (all, or the one under ``key``); returns bytes freed.

        Blocks that are held or leased are skipped: their users still read them.
        """
        with self._lock:
            self._drain()
            victims = [b for k, b in self._cache.items() if (key is None or k == key) and _idle(b)]
            for b in victims:
                self._drop(b)
            return sum(b.size for b in victims)

    def cached_keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._cache)

    def stats(self) -> PoolStats:
        with self._lock:
            self._drain()
            free = sum(s for _, s in self._free)
            cached = sum(b.size for b in self._blocks if _idle(b))
            in_use = sum(b.size for b in self._blocks) - cached
            return PoolStats(
                capacity=self.capacity,
                pinned=self.arena.pinned_bytes if self.pin else 0,
                in_use=in_use,
                cached=cached,
                free=free,
                largest_free=max((s for _, s in self._free), default=0),
                requested=sum(b.nbytes for b in self._blocks),
                blocks=len(self._blocks),
                hugepages=hugepage_bytes(self.arena.address, self.capacity)
                if not self._closed
                else None,
            )

    # ---- lifecycle ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop pinning, wait for pending copies, unregister the memory. Idempotent.

        CPU tensors leased from the pool stay valid (as pageable memory) until they
        are garbage; device copies in flight are waited for first.
        """
        with self._pin_cond:
            if self._closed:
                return
            self._closed = True
            self._pin_cond.notify_all()
        if self._pinner is not None:
            self._pinner.join()
        with self._lock:
            for b in list(self._blocks):
                _wait(b)
            self._blocks.clear()
            self._cache.clear()
            self._free = []
        self.arena.close()

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PinnedPool(capacity={s.capacity}, pinned={s.pinned}, in_use={s.in_use}, "
            f"cached={s.cached}, free={s.free}, closed={self._closed})"
        )

    # ---- internals (called with self._lock held unless noted) ---------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the pinned pool is closed; create a new PinnedPool")

    def _carve(self, size: int) -> int | None:
        # Best fit keeps big holes for big checkpoints; ties go to the lowest address,
        # which the background thread pins first.
        best = None
        for i, (_, run) in enumerate(self._free):
            if run >= size and (best is None or run < self._free[best][1]):
                best = i
        if best is None:
            return None
        off, run = self._free[best]
        if run == size:
            del self._free[best]
        else:
            self._free[best] = (off + size, run - size)
        return off

    def _give_back(self, off: int, size: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        free.insert(i, (off, size))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def _evict_one(self, size: int) -> bool:
        idle = [b for b in self._cache.values() if _idle(b)]
        if not idle:
            return False
        victim = min(idle, key=lambda b: b.last_used)
        log.info("evicting cached block %r to make room for %d bytes", victim.key, size)
        self._drop(victim)
        return True

    def _drop(self, block: Block) -> None:
        # A copy may still read the block; its bytes can only be reused after it ends.
        _wait(block)
        if block.key is not None and self._cache.get(block.key) is block:
            del self._cache[block.key]
        self._blocks.discard(block)
        self._give_back(block.offset, block.size)

    def _release(self, block: Block) -> None:
        with self._lock:
            if block not in self._blocks:
                return
            if block.holders <= 0:
                raise RuntimeError(f"{block!r} released more often than it was held")
            block.holders -= 1
            block.last_used = time.monotonic()
            self._drain()
            if block.holders:
                return
            if block.key is not None and not self._closed:
                old = self._cache.get(block.key)
                if old is not None and old is not block:
                    # A newer read of the same checkpoint wins; the old copy goes once idle.
                    old.key = None
                    if _idle(old):
                        self._drop(old)
                self._cache[block.key] = block
            elif block.leases == 0:
                self._drop(block)

    def _lease(self, block: Block, anchor: memoryview) -> None:
        with self._lock:
            block.leases += 1
        # The finalizer may run inside any allocation (cyclic GC), even while this
        # thread holds the pool lock: it only queues; locked calls drain the queue.
        weakref.finalize(anchor, self._unleased.append, block)

    def _drain(self) -> None:
        while self._unleased:
            block = self._unleased.popleft()
            block.leases -= 1
            if block in self._blocks and _idle(block) and block.key is None:
                self._drop(block)

    def _exhausted(self, size: int, nbytes: int) -> PoolExhausted:
        stuck = sum(b.size for b in self._blocks)
        largest = max((s for _, s in self._free), default=0)
        hint = (
            "evict cached checkpoints with pool.evict() or release blocks you hold"
            if not self.auto_evict
            else "release blocks or CPU tensors you still hold, or create a larger pool"
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


def _idle(block: Block) -> bool:
    return block.holders == 0 and block.leases == 0


def _wait(block: Block) -> None:
    if block.event is not None:
        block.event.synchronize()
        block.event = None
