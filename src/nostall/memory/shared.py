"""One host tier for every worker process of a host: a pool whose bytes and index are shared.

:class:`SharedPool` stands in for :class:`~nostall.PinnedPool` wherever the loader and the
model cache use one (``allocate``, ``lookup``, ``evict``, ``cached_keys``, ``stats``,
``wait_pinned``, ``close`` and a block's ``tensor``, ``view``, ``split``, ``fence``,
``invalidate``, ``release``), but a checkpoint one worker reads is a memory-cache hit for
every other worker of the host: N workers serving the same models keep one copy in host
memory instead of N.

* **Bytes**: the file ``<root>/nostall-<host>-<name>`` (``root`` defaults to the tmpfs
  ``/dev/shm``) of ``capacity`` bytes, sparse, mapped ``MAP_SHARED`` by each process that
  opens it. A block's pages are allocated when the block is carved (``fallocate``), so a
  full tmpfs is a :class:`~nostall.PoolExhausted`, never a ``SIGBUS`` in the middle of a read.
* **Index**: :mod:`nostall.memory.shared_index`, beside the segment, changed under a file
  lock; it records each entry's range, state and holders, and drops the holds of processes
  that died, so a crashed worker leaks nothing.
* **Pinning**: given a CUDA ``device``, each process page-locks *its own* mapping of the
  segment (``cudaHostRegister``, portable) in a background thread, slab by slab, as
  ``PinnedPool`` does: copies from the shared pages then run at link speed.

Sizes, placement and eviction follow ``PinnedPool``: blocks are rounded to its size classes
(multiples of 2 MiB) and carved best fit (ties to the lowest address: the model cache's
placement predicts offsets with that rule); when nothing fits, ``ready`` entries that no
live process holds are evicted least recently used first (``evict=False``: never, the
caller evicts). An entry is never evicted while any live process holds it.

Differences from ``PinnedPool``, all forced by other processes sharing the bytes:

* :meth:`SharedBlock.release` waits for the copies fenced on the block (their CUDA events)
  before it gives the hold up, since another process may reuse the bytes at once.
* Keys are strings, numbers, ``bytes``, ``None`` and tuples of them, matched by ``repr``
  (``("ckpt", 1)`` and ``("ckpt", 1.0)`` are two keys): other processes must rebuild them.
* :meth:`SharedPool.close` waits up to ``timeout`` for this process's blocks, then gives up
  the holds still open (with a warning) instead of raising :class:`~nostall.BusyError`;
  it never removes the segment. :meth:`SharedPool.destroy` does, when asked.
* Opening a segment that exists with another capacity: if no live process has it open, it
  is recreated at the new capacity (its entries dropped, with a warning); otherwise the
  existing capacity is used (with a warning) and :attr:`SharedPool.capacity` says so.

Processes must share a PID namespace (the index tells live processes from dead ones by
``/proc``) and a user (the files are created ``0600``). A pool object does not cross
``fork``: a child opens its own.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import json
import logging
import os
import re
import socket
import stat
import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from nostall.errors import (
    ArgumentError,
    BusyError,
    ClosedError,
    DeviceError,
    PoolExhausted,
    UnsupportedError,
)
from nostall.memory.events import event_done, wait_event
from nostall.memory.host import HostArena, hugepage_bytes, round_up
from nostall.memory.pinning import Pinning, device_index, teardown
from nostall.memory.pool import GRANULE, Block, PoolStats, check_capacity, size_class
from nostall.memory.shared_index import Entry, Index, IndexFile, alive, digest, process_id

__all__ = ["SharedBlock", "SharedPool"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_NAME = 100
MAX_KEY = 64 << 10  # bytes of repr(key): a checkpoint's identity is a few hundred


class SharedBlock(Block):
    """One hold on an entry of a :class:`SharedPool`: ``[offset, offset + size)`` of the
    segment, held by this handle until :meth:`release`.

    A block from :meth:`SharedPool.allocate` is its writer's alone until its first release,
    which publishes it to every process (unless :meth:`invalidate` was called: then it is
    freed). A block from :meth:`SharedPool.lookup` is read only. Views from :attr:`tensor`
    and :meth:`view` point into this process's mapping of the segment: valid while the
    block is held; after that another process may overwrite the bytes. Releasing twice is
    harmless.
    """

    __slots__ = ("entry", "invalid", "released", "writing")

    def __init__(self, pool: SharedPool, entry: tuple[str, str], e: Entry, key, writing: bool):
        super().__init__(pool, e.offset, e.size, e.nbytes, key)  # type: ignore[arg-type]
        self.entry = entry  # (epoch, id): ids restart when the index is started afresh
        self.writing = writing
        self.invalid = self.released = False

    def __repr__(self) -> str:
        state = "released" if self.released else "writing" if self.writing else "held"
        return (
            f"SharedBlock(entry={self.entry[1]}, offset={self.offset}, size={self.size}, "
            f"nbytes={self.nbytes}, key={self.key!r}, {state})"
        )


class _Book:
    """This pool object's holds in the index; shared with its finalizer, never the pool."""

    def __init__(self, proc: str):
        self.pid, self.proc = os.getpid(), proc
        # (epoch, entry id) → holds of this pool object
        self.holds: dict[tuple[str, str], int] = {}
        self.writing: set[tuple[str, str]] = set()  # allocated here, unpublished
        self.attached = False

    def add(self, eid: tuple[str, str], writing: bool) -> None:
        self.holds[eid] = self.holds.get(eid, 0) + 1
        if writing:
            self.writing.add(eid)

    def drop(self, eid: tuple[str, str]) -> None:
        n = self.holds.get(eid, 0) - 1
        if n > 0:
            self.holds[eid] = n
        else:
            self.holds.pop(eid, None)
        self.writing.discard(eid)

    def detach(self, index: IndexFile, capacity: int) -> None:
        """Give up every hold and the attachment; unpublished entries are freed."""
        if self.pid != os.getpid():
            return  # a forked child's copy: the holds are its parent's
        with index.transaction(capacity) as doc:
            if not self.attached:
                return
            for (epoch, eid), n in self.holds.items():
                if epoch != doc.epoch:
                    continue  # the index was started afresh since: nothing of ours is left
                if (epoch, eid) in self.writing:
                    doc.entries.pop(eid, None)
                else:
                    doc.unhold(eid, self.proc, n)
            left = doc.attached.get(self.proc, 0) - 1
            if left > 0:
                doc.attached[self.proc] = left
            else:
                doc.attached.pop(self.proc, None)
            # Cleared under the index lock: a release racing with close() sees it.
            self.holds.clear()
            self.writing.clear()
            self.attached = False


def _finalize(book: _Book, index: IndexFile, capacity: int, pinning: Pinning, thread) -> None:
    # Runs from close(), when a pool is garbage-collected, and at interpreter exit.
    try:
        book.detach(index, capacity)
    except Exception as e:  # the index stays as it was; the next open prunes us once gone
        log.warning("shared pool %s: could not give up this process's holds: %s", index.path, e)
    finally:
        teardown(pinning, thread, pinning.arena)


class SharedPool:
    """A host tier shared by every process of this host that opens ``name``.

    The first process creates the segment ``<root>/nostall-<host>-<name>`` of ``capacity``
    bytes (rounded up to 2 MiB); later ones map it. With a CUDA ``device``, this process
    pins its mapping in a background thread (``slab_bytes`` per registration, through that
    GPU's context); :meth:`wait_pinned` waits for it. Without one (``None`` or a CPU
    device) nothing is registered and no CUDA call is made.

    Raises :class:`~nostall.ArgumentError` for a bad name (empty, a ``/``, over 100
    characters, other than letters, digits, ``.``, ``_``, ``-``), a capacity beyond the
    memory limit or the file system at ``root``, or a ``root`` that is not a writable
    folder; :class:`~nostall.DeviceError` for a CUDA device without CUDA.

    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> with SharedPool("doc", 8 << 20, root=root) as pool:
    ...     block = pool.allocate(1000, key="weights")
    ...     block.tensor[:3] = 7
    ...     block.release()  # published: a hit for every process of the host
    ...     hit = pool.lookup("weights")
    ...     hit.tensor[:3].tolist(), pool.cached_keys()
    ...     hit.release()
    ([7, 7, 7], ['weights'])
    >>> SharedPool.destroy("doc", root=root), os.rmdir(root)
    (True, None)
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        device: str | torch.device | int | None = None,
        root: str | os.PathLike = "/dev/shm",
        slab_bytes: int = 1 << 30,
        evict: bool = True,
        background: bool = True,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ArgumentError(
                f"shared pool capacity must be a positive number of bytes, got {capacity!r}",
                field="capacity",
            )
        if slab_bytes <= 0 or slab_bytes % GRANULE:
            raise ArgumentError(f"slab_bytes={slab_bytes} must be a positive multiple of {GRANULE}")
        self.name = name
        self.root = os.fspath(root)
        self.host = socket.gethostname()
        self.path = segment_path(name, self.root)
        capacity = round_up(capacity, GRANULE)
        check_capacity(capacity)
        proc = process_id(os.getpid())
        if proc is None:
            raise UnsupportedError("SharedPool tells live processes from dead ones by /proc: Linux")
        self.device = _pin_device(device)
        self.pin = self.device is not None
        self.auto_evict = evict
        self._index = IndexFile(self.path, self.host)
        self._book = _Book(proc)
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a handle goes
        self._live: set[SharedBlock] = set()
        self._pending = 0  # allocations and lookups in flight
        self._state = "open"  # open → closing → closed
        fd, self.capacity = self._open_segment(capacity)
        try:
            self.arena = HostArena(
                self.capacity, segment_bytes=slab_bytes, device=self.device, fd=fd
            )
        except BaseException:
            self._book.detach(self._index, self.capacity)
            raise
        finally:
            os.close(fd)  # the arena keeps its own descriptor
        self._pinning = Pinning(self.arena, self.pin, self.device)
        self._pinner: threading.Thread | None = None
        if not self.pin:
            self._pinning.skip()  # pages are allocated block by block, by allocate()
        elif background:
            self._pinner = threading.Thread(
                target=self._pinning.run, name="nostall-shared-pin", daemon=True
            )
        self._finalizer = weakref.finalize(
            self, _finalize, self._book, self._index, self.capacity, self._pinning, self._pinner
        )
        if self._pinner is not None:
            self._pinner.start()
        elif self.pin:
            self._pinning.run()

    # ---- the segment -------------------------------------------------------------

    def _open_segment(self, capacity: int) -> tuple[int, int]:
        """Create or map the segment and attach to it, under the lock; returns an open
        descriptor and the segment's capacity."""
        try:
            with self._index.locked():
                return self._attach(capacity)
        except OSError as e:
            raise ArgumentError(
                f"cannot open the shared pool's files ({e.filename or self.path}): "
                f"{e.strerror or e}; give a root= this user can write, or another name",
                field="root",
            ) from e

    def _attach(self, capacity: int) -> tuple[int, int]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArgumentError(f"{self.path} is not a regular file; remove it", field="name")
            size = st.st_size
            doc = self._index.read(size) if size else None
            if doc is not None and size != capacity and doc.attached:
                log.warning(
                    "shared pool %s exists with %d bytes, open in %d process(es): using it "
                    "as it is instead of the %d bytes asked for",
                    self.path,
                    size,
                    len(doc.attached),
                    capacity,
                )
            elif size != capacity:
                if size:
                    log.warning(
                        "shared pool %s: recreating it with %d bytes instead of %d (no "
                        "process has it open; its cached entries are dropped)",
                        self.path,
                        capacity,
                        size,
                    )
                _check_room(self.root, capacity)
                os.ftruncate(fd, 0)  # frees the old pages
                os.ftruncate(fd, capacity)  # sparse: pages come as blocks are carved
                size, doc = capacity, self._index.fresh(capacity)
            assert doc is not None
            doc.attached[self._book.proc] = doc.attached.get(self._book.proc, 0) + 1
            self._index.write(doc)
            self._book.attached = True
            return fd, size
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def destroy(
        cls, name: str, *, root: str | os.PathLike = "/dev/shm", force: bool = False
    ) -> bool:
        """Remove the segment ``name`` under ``root`` and its index; ``False`` if there was
        none. Raises :class:`~nostall.BusyError` naming the processes that still have it
        open, unless ``force`` (they keep their mapping, and nobody finds it again)."""
        path = segment_path(name, os.fspath(root))
        index = IndexFile(path, socket.gethostname())
        if not any(os.path.exists(p) for p in (path, index.path, index.lock_path)):
            return False
        with index.locked():
            users = [p for p in _attached(index.path) if alive(p)]
            if users and not force:
                raise BusyError(
                    f"shared pool {path} is open in process(es) {', '.join(users)} "
                    "(pid-start time); close them first, or pass force=True"
                )
            leftovers = glob.glob(glob.escape(index.path) + ".*.tmp")  # writers that died
            for p in [path, index.path, *leftovers, index.lock_path]:  # the lock last, held
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        return True

    # ---- pinning -----------------------------------------------------------------

    def wait_pinned(self, nbytes: int | None = None, timeout: float | None = None) -> bool:
        """Wait until the first ``nbytes`` (default: all) of this process's mapping are
        pinned; at once without a CUDA device."""
        n = self.arena.num_segments
        upto = n if nbytes is None else min(n, -(-nbytes // self.arena.segment_bytes))
        return self._pinning.wait(upto, timeout)

    # ---- blocks ------------------------------------------------------------------

    def allocate(self, nbytes: int, *, key: Hashable | None = None) -> SharedBlock:
        """A block of at least ``nbytes`` for the caller to fill, held until its release.

        No other process sees it before that release, which publishes it under ``key``
        (replacing an older entry of that key); without ``key`` the release frees it.
        Waits for this process's pinning to cover it. Raises :class:`~nostall.PoolExhausted`
        when no free run fits even after evicting idle entries (when ``evict`` is on), or
        when the file system under the segment is full.
        """
        size = size_class(nbytes)
        text = None if key is None else _key_text(key)
        self._begin()
        try:
            with self._transaction() as doc:
                ranges = doc.ranges()
                offset = ranges.carve(size)
                while offset is None and self.auto_evict:
                    victim = doc.lru_idle()
                    if victim is None:
                        break
                    e = doc.entries.pop(victim)
                    log.info("shared pool: evicting %s to make room for %d bytes", e.key, size)
                    ranges.give_back(e.offset, e.size)
                    offset = ranges.carve(size)
                if offset is None:
                    raise self._exhausted(doc, size, nbytes)
                eid = doc.add(text, offset, size, nbytes, self._book.proc)
                entry = doc.entries[eid]
            block = self._handle((doc.epoch, eid), entry, key, writing=True)
        except BaseException:
            self._end(None)
            raise
        try:
            self.arena.commit(offset, offset + size)
            self.wait_pinned(offset + size)
        except OSError as e:
            block.invalidate()
            block.release()
            raise PoolExhausted(
                f"shared pool {self.path}: the file system under {self.root} has no room for "
                f"a block of {size / 1e9:.3f} GB ({e}); enlarge it (docker run --shm-size, or "
                "remount /dev/shm with a larger size=) or create the pool smaller",
                requested=size,
                capacity=self.capacity,
                in_use=0,
                largest_free=0,
            ) from e
        except BaseException:
            block.invalidate()
            block.release()
            raise
        return block

    def lookup(self, key: Hashable) -> SharedBlock | None:
        """The ``ready`` entry under ``key``, now held by the caller, or ``None``.

        Whichever process wrote it, this is a memory-cache hit. The caller copies the
        bytes out and releases the block; it must not write them.
        """
        wanted = digest(repr(key))
        self._begin()
        try:
            with self._transaction() as doc:
                eid = doc.ready(wanted)
                e = None if eid is None else doc.hold(eid, self._book.proc)
            if eid is None or e is None:
                self._end(None)
                return None
            block = self._handle((doc.epoch, eid), e, key, writing=False)
        except BaseException:
            self._end(None)
            raise
        try:
            self.wait_pinned(block.offset + block.size)
        except BaseException:
            block.release()
            raise
        return block

    def evict(self, key: Hashable | None = None) -> int:
        """Drop ``ready`` entries that no process holds (all, or the one under ``key``);
        returns the bytes freed. Entries held anywhere on the host are skipped."""
        if self.closed:
            return 0
        wanted = None if key is None else digest(repr(key))
        with self._transaction() as doc:
            victims = [
                eid
                for eid, e in doc.entries.items()
                if e.state == "ready" and not e.holders and wanted in (None, e.digest)
            ]
            return sum(doc.entries.pop(eid).size for eid in victims)

    def cached_keys(self) -> list[Hashable]:
        """The keys of every ``ready`` entry, least recently used first."""
        if self.closed:
            return []
        with self._transaction() as doc:
            ready = sorted((e.last_used, e.key) for e in doc.entries.values() if e.state == "ready")
        out = []
        for _, text in ready:
            try:
                out.append(ast.literal_eval(text))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                log.warning("shared pool %s: entry key %.200s cannot be rebuilt", self.path, text)
        return out

    def stats(self, *, hugepages: bool = True) -> PoolStats:
        """The whole segment's accounting, every process's entries included. ``pinned`` and
        ``hugepages`` are this process's mapping's (``hugepages=False`` skips reading
        ``/proc/self/smaps``, slow once tens of GB are mapped). ``free`` is the capacity
        less every entry; a closed pool reports zeros, as ``PinnedPool`` does."""
        if self.closed:
            return PoolStats(self.capacity, 0, 0, 0, 0, 0, 0, 0, None)
        with self._transaction() as doc:
            idle = [e for e in doc.entries.values() if e.state != "writing" and not e.holders]
            taken = sum(e.size for e in doc.entries.values())
            largest = doc.ranges().largest
            requested = sum(e.nbytes for e in doc.entries.values())
            blocks = len(doc.entries)
        cached = sum(e.size for e in idle)
        huge = None
        if hugepages:
            huge = hugepage_bytes(self.arena.address, self.capacity, "ShmemPmdMapped")
        return PoolStats(
            capacity=self.capacity,
            pinned=self.arena.pinned_bytes if self.pin else 0,
            in_use=taken - cached,
            cached=cached,
            free=self.capacity - taken,
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
        """Give up this process's holds and unmap; the segment stays for the others.

        New allocations and lookups are refused from the call on. Blocks other threads
        still hold are waited for up to ``timeout`` seconds, then given up anyway (their
        fenced copies waited for; a warning names them): their views stay mapped, but
        another process may then reuse the bytes. Idempotent.
        """
        with self._released:
            if self._state == "closed":
                return
            self._state = "closing"
            # An allocation or lookup in flight ends within one index transaction: always
            # waited for, so that its hold is in the book before the book is given up.
            self._released.wait_for(lambda: not self._pending)
            self._released.wait_for(lambda: not self._live, timeout)
            stragglers, self._live = list(self._live), set()
            events = []
            for b in stragglers:
                b.released, b.holders = True, 0
                events += b._events
                b._events = []
        if stragglers:
            log.warning(
                "closing shared pool %s: %d block(s) still held after %s s (e.g. %r); "
                "their holds are given up",
                self.path,
                len(stragglers),
                timeout,
                stragglers[0],
            )
        for e in events:
            wait_event(e)  # no copy may read the bytes once another process may reuse them
        self._finalizer()  # gives up the holds, stops pinning, unregisters, unmaps
        with self._lock:
            self._state = "closed"

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        held = sum(self._book.holds.values())
        return (
            f"SharedPool(name={self.name!r}, path={self.path!r}, capacity={self.capacity}, "
            f"held_here={held}, state={self._state})"
        )

    # ---- internals ---------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Index]:
        if os.getpid() != self._book.pid:
            raise ClosedError(
                f"this SharedPool was opened by process {self._book.pid}; a forked child "
                f"opens its own: SharedPool({self.name!r}, capacity, root={self.root!r})"
            )
        with self._index.transaction(self.capacity) as doc:
            yield doc

    def _begin(self) -> None:
        with self._lock:
            if self._state != "open":
                raise ClosedError(f"the shared pool {self.path} is closed; open a new SharedPool")
            self._pending += 1

    def _end(self, block: SharedBlock | None) -> None:
        with self._released:
            if block is None:
                self._pending -= 1
            else:
                self._live.discard(block)
            self._released.notify_all()

    def _handle(self, eid: tuple[str, str], e: Entry, key, *, writing: bool) -> SharedBlock:
        block = SharedBlock(self, eid, e, key, writing)
        with self._released:
            self._book.add(eid, writing)
            self._live.add(block)
            self._pending -= 1
        return block

    def _fence(self, block: Block, event: Any) -> None:
        if event is None:
            return
        with self._lock:
            # Drop finished events so a block copied out thousands of times stays small.
            block._events = [e for e in block._events if not event_done(e)]
            block._events.append(event)

    def _invalidate(self, block: SharedBlock) -> None:
        with self._lock:
            block.invalid = True
            if (block.writing and not block.released) or self._state == "closed":
                return  # its release frees it; or nothing is served to us any more
        epoch, eid = block.entry
        with self._transaction() as doc:
            e = doc.entries.get(eid) if epoch == doc.epoch else None
            if e is not None and e.state == "ready":
                doc.retire(eid)

    def _release(self, block: SharedBlock) -> None:
        with self._lock:
            if block.released:
                return
            block.released, block.holders = True, 0
            events, block._events = block._events, []
        # Another process may reuse the bytes as soon as the hold is gone: every copy
        # that reads them ends first (outside the lock: other threads go on meanwhile).
        for e in events:
            wait_event(e)
        epoch, eid = block.entry
        try:
            with self._transaction() as doc:
                if not self._book.attached:
                    pass  # close() gave every hold up already
                elif epoch != doc.epoch or eid not in doc.entries:
                    pass  # gone with an index that was started afresh
                elif block.writing and (block.invalid or block.key is None):
                    del doc.entries[eid]
                elif block.writing:
                    doc.publish(eid, self._book.proc)
                else:
                    doc.unhold(eid, self._book.proc)
                # Under the index lock, as close() clears the book: never given up twice.
                with self._lock:
                    self._book.drop(block.entry)
        finally:
            self._end(block)

    def _exhausted(self, doc: Index, size: int, nbytes: int) -> PoolExhausted:
        held = [e for e in doc.entries.values() if e.holders]
        stuck = sum(e.size for e in held)
        procs = {p for e in held for p in e.holders}
        largest = doc.ranges().largest
        hint = (
            "release blocks you hold, close idle workers, or recreate the segment larger "
            "(SharedPool.destroy(name) once no worker has it open)"
            if self.auto_evict
            else "evict cached entries with pool.evict(), or release blocks you hold"
        )
        return PoolExhausted(
            f"shared pool {self.path} cannot hold {nbytes / 1e9:.3f} GB (rounded to "
            f"{size / 1e9:.3f} GB): capacity {self.capacity / 1e9:.3f} GB, {stuck / 1e9:.3f} GB "
            f"held by {len(procs)} process(es), largest free run {largest / 1e9:.3f} GB; {hint}",
            requested=size,
            capacity=self.capacity,
            in_use=stuck,
            largest_free=largest,
        )


def segment_path(name: str, root: str) -> str:
    """The segment file of ``name`` under ``root`` for this host.

    >>> segment_path("tier", "/dev/shm").startswith("/dev/shm/nostall-")
    True
    """
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_NAME:
        raise ArgumentError(
            f"shared pool name {name!r}: use 1 to {MAX_NAME} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes a file name)",
            field="name",
            allowed=_NAME.pattern,
        )
    if not os.path.isdir(root):
        raise ArgumentError(f"root={root!r} is not a folder; give an existing one", field="root")
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
    return os.path.join(root, f"nostall-{host}-{name}")


def _key_text(key: Hashable) -> str:
    """``repr(key)``, once sure that another process can rebuild the key from it."""
    text = repr(key)
    try:
        ok = len(text) <= MAX_KEY and ast.literal_eval(text) == key
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        ok = False
    if not ok:
        raise ArgumentError(
            f"shared pool key {text[:200]}: other processes must rebuild the key from its "
            f"repr; use strings, numbers, bytes, None and tuples of them, under {MAX_KEY} "
            "characters",
            field="key",
        )
    return text


def _pin_device(device: str | torch.device | int | None) -> int | None:
    """The GPU that registers this process's mapping; ``None``: no registration."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"device={device!r} is not a device; use 'cuda[:N]' or None") from e
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ArgumentError(f"device={device!r}: the shared pool pins for CUDA devices only")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device={device!r}: CUDA is unavailable (no GPU visible, or a CPU-only torch); "
            "open the pool with device=None"
        )
    return device_index(dev)


def _check_room(root: str, capacity: int) -> None:
    try:
        st = os.statvfs(root)
    except OSError:
        return
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if total and capacity > total:
        raise ArgumentError(
            f"shared pool capacity {capacity / 1e9:.2f} GB exceeds the file system at {root} "
            f"({total / 1e9:.2f} GB); enlarge it (docker run --shm-size, or remount /dev/shm "
            "with a larger size=), give a smaller capacity, or another root=",
            field="capacity",
        )
    if capacity > free:
        log.warning(
            "shared pool capacity %.2f GB exceeds the %.2f GB free at %s now: allocations "
            "fail with PoolExhausted once it is full",
            capacity / 1e9,
            free / 1e9,
            root,
        )


def _attached(index_path: str) -> list[str]:
    """The processes an index records as attached, read leniently (for destroy)."""
    try:
        with open(index_path, "rb") as f:
            doc = json.loads(f.read())
        return [p for p in doc["attached"] if isinstance(p, str)]
    except (OSError, ValueError, KeyError, TypeError):
        return []
