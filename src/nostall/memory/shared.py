"""One host tier for every worker process of a host: a pool whose bytes and index are shared.

:class:`SharedPool` stands in for :class:`~nostall.PinnedPool` wherever the loader and the
model cache use one (``allocate``, ``lookup``, ``evict``, ``cached_keys``, ``stats``,
``wait_pinned``, ``close`` and a block's ``tensor``, ``view``, ``split``, ``fence``,
``invalidate``, ``release``), but a checkpoint one worker reads is a memory-cache hit for
every other worker of the host: N workers serving the same models keep one copy in host
memory instead of N.

* **Bytes**: the segment, a file ``<root>/nostall-<host>-<name>`` (``root`` defaults to
  ``$NOSTALL_SHM_DIR`` or the tmpfs ``/dev/shm``) of ``capacity`` bytes, sparse, mapped
  ``MAP_SHARED`` by each process that opens it. A block's pages are allocated when the
  block is carved (``fallocate``), so a full tmpfs is a :class:`~nostall.PoolExhausted`,
  never a ``SIGBUS`` in the middle of a read.
* **Attachment** (:mod:`nostall.memory.shared_segment`, :mod:`nostall.memory.shared_attach`):
  each open pool holds a shared file lock on the segment, which the kernel drops when its
  process dies. The segment is created, replaced at another capacity or removed only while
  nobody holds that lock, and never truncated: a block's bytes never change under its
  holder, whatever became of the index.
* **Index** (:mod:`nostall.memory.shared_index`), beside the segment, changed under a file
  lock; it records each entry's range, state and holders, and drops the holds of processes
  that died, so a crashed worker leaks nothing.
* **Journals** (:mod:`nostall.memory.shared_journal`): each open pool also records its own
  holds, so an index that is lost or damaged is rebuilt without handing out a byte that a
  live process still reads or writes.
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
  the holds still open (with a warning) instead of raising :class:`~nostall.BusyError`.
  The last pool of the host to close removes the segment and its files, unless it was
  opened with ``keep=True`` (once by anyone: the mark stays until the segment is
  destroyed). :meth:`SharedPool.segments` lists a root's segments and
  :meth:`SharedPool.destroy` removes one (``nostall shm ls``, ``nostall shm rm``).
* Opening a segment that exists with another capacity: if no process has it open, it is
  recreated at the new capacity (its entries dropped, with a warning); otherwise the
  existing capacity is used (with a warning) and :attr:`SharedPool.capacity` says so.

Processes must share a PID namespace (the index tells live processes from dead ones by
``/proc``) and a user (the files are created ``0600``). A pool object does not cross
``fork``: a child opens its own (a child's inherited copy keeps the segment counted as
open until it exits).
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import socket
import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from nostall.errors import (
    ArgumentError,
    ClosedError,
    DeviceError,
    PoolExhausted,
    UnsupportedError,
)
from nostall.memory.events import event_done, wait_event
from nostall.memory.host import HostArena, hugepage_bytes, round_up
from nostall.memory.pinning import Pinning, device_index, teardown
from nostall.memory.pool import GRANULE, Block, PoolStats, check_capacity, size_class
from nostall.memory.shared_attach import Attachment
from nostall.memory.shared_index import Entry, Index, IndexFile, digest, process_id
from nostall.memory.shared_journal import Journals
from nostall.memory.shared_segment import (
    SegmentInfo,
    default_root,
    destroy,
    list_segments,
    open_segment,
    segment_path,
)

__all__ = ["SegmentInfo", "SharedBlock", "SharedPool", "default_root", "segment_path"]

log = logging.getLogger(__name__)

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
        self.entry = entry  # (epoch, id): a new epoch, whose ids restart, names other entries
        self.writing = writing
        self.invalid = self.released = False

    def __repr__(self) -> str:
        state = "released" if self.released else "writing" if self.writing else "held"
        return (
            f"SharedBlock(entry={self.entry[1]}, offset={self.offset}, size={self.size}, "
            f"nbytes={self.nbytes}, key={self.key!r}, {state})"
        )


def _finalize(book: Attachment, pinning: Pinning, thread) -> None:
    # Runs from close(), when a pool is garbage-collected, and at interpreter exit.
    try:
        book.detach()
    except Exception as e:  # the index stays as it was; the next open prunes us once gone
        log.warning(
            "shared pool %s: could not give up this process's holds: %s", book.segment.path, e
        )
    finally:
        try:
            teardown(pinning, thread, pinning.arena)
        finally:
            book.leave()  # only once unmapped: nobody may replace the file before


class SharedPool:
    """A host tier shared by every process of this host that opens ``name``.

    The first process creates the segment ``<root>/nostall-<host>-<name>`` of ``capacity``
    bytes (rounded up to 2 MiB); later ones map it. With a CUDA ``device``, this process
    pins its mapping in a background thread (``slab_bytes`` per registration, through that
    GPU's context); :meth:`wait_pinned` waits for it. Without one (``None`` or a CPU
    device) nothing is registered and no CUDA call is made. ``root`` defaults to
    :func:`default_root` (``$NOSTALL_SHM_DIR``, else ``/dev/shm``).

    When the last pool of the host closes, the segment and its files are removed, unless
    ``keep`` (this open or an earlier one's: the mark lasts until :meth:`destroy`).

    Raises :class:`~nostall.ArgumentError` for a bad name (empty, a ``/``, over 100
    characters, other than letters, digits, ``.``, ``_``, ``-``), a capacity beyond the
    memory limit or the file system at ``root``, or a ``root`` that is not a writable
    folder; :class:`~nostall.BusyError` for a segment other processes have open that this
    one cannot map (its size is named); :class:`~nostall.DeviceError` for a CUDA device
    without CUDA.

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
    >>> os.listdir(root)  # the last pool to close removed the segment
    []
    >>> os.rmdir(root)
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        device: str | torch.device | int | None = None,
        root: str | os.PathLike | None = None,
        slab_bytes: int = 1 << 30,
        evict: bool = True,
        background: bool = True,
        keep: bool = False,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ArgumentError(
                f"shared pool capacity must be a positive number of bytes, got {capacity!r}",
                field="capacity",
            )
        if slab_bytes <= 0 or slab_bytes % GRANULE:
            raise ArgumentError(f"slab_bytes={slab_bytes} must be a positive multiple of {GRANULE}")
        self.name = name
        self.root = os.fspath(default_root() if root is None else root)
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
        journals = Journals(self.path)
        self._index = IndexFile(self.path, self.host, journals)
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a handle goes
        self._live: set[SharedBlock] = set()
        self._pending = 0  # allocations and lookups in flight
        self._state = "open"  # open → closing → closed
        self._book = self._open(capacity, proc, journals, keep)
        seg = self._book.segment
        self.capacity = seg.size
        try:
            self.arena = HostArena(
                self.capacity, segment_bytes=slab_bytes, device=self.device, fd=seg.fd
            )
        except BaseException:
            self._book.detach()
            self._book.leave()
            raise
        finally:
            os.close(seg.fd)  # the arena keeps its own descriptor
        self._pinning = Pinning(self.arena, self.pin, self.device)
        self._pinner: threading.Thread | None = None
        if not self.pin:
            self._pinning.skip()  # pages are allocated block by block, by allocate()
        elif background:
            self._pinner = threading.Thread(
                target=self._pinning.run, name="nostall-shared-pin", daemon=True
            )
        self._finalizer = weakref.finalize(self, _finalize, self._book, self._pinning, self._pinner)
        if self._pinner is not None:
            self._pinner.start()
        elif self.pin:
            self._pinning.run()

    # ---- the segment -------------------------------------------------------------

    def _open(self, capacity: int, proc: str, journals: Journals, keep: bool) -> Attachment:
        """Create or open the segment and attach to it, under the index lock."""
        try:
            with self._index.locked():
                seg = open_segment(self.path, capacity, self.root)
                try:
                    if keep:
                        os.close(os.open(self.path + ".keep", os.O_WRONLY | os.O_CREAT, 0o600))
                    book = Attachment(proc, self._index, journals.new(proc), seg)
                    book.attach()
                    return book
                except BaseException:
                    os.close(seg.fd)
                    seg.close()
                    raise
        except OSError as e:
            raise ArgumentError(
                f"cannot open the shared pool's files ({e.filename or self.path}): "
                f"{e.strerror or e}; give a root= this user can write, or another name",
                field="root",
            ) from e

    @property
    def keep(self) -> bool:
        """Whether the segment outlives its last pool (else that pool's close removes it)."""
        return os.path.exists(self.path + ".keep")

    @classmethod
    def destroy(
        cls, name: str, *, root: str | os.PathLike | None = None, force: bool = False
    ) -> bool:
        """Remove the segment ``name`` under ``root`` and its files; ``False`` if there was
        none. Raises :class:`~nostall.BusyError` naming the processes that still have it
        open, unless ``force`` (they keep their mapping, nobody finds it again, and their
        next use of the pool raises :class:`~nostall.ClosedError`)."""
        return destroy(name, os.fspath(default_root() if root is None else root), force=force)

    @classmethod
    def segments(cls, *, root: str | os.PathLike | None = None) -> list[SegmentInfo]:
        """Every segment of this host under ``root`` (default :func:`default_root`): its
        name, size, the RAM its pages take, entries, the processes that have it open,
        whether it is kept.

        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> with SharedPool("doc", 8 << 20, root=root) as pool:
        ...     [(s.name, s.capacity, s.in_use) for s in SharedPool.segments(root=root)]
        [('doc', 8388608, True)]
        >>> os.rmdir(root)
        """
        return list_segments(os.fspath(default_root() if root is None else root))

    @classmethod
    def set_keep(
        cls, name: str, keep: bool = True, *, root: str | os.PathLike | None = None
    ) -> None:
        """Mark the segment ``name`` to outlive its last pool (``keep=False``: unmark it,
        and its last pool removes it again), whether or not it exists yet: workers opened
        later with ``host_tier="shared:NAME"`` then keep their tier across restarts.

        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> SharedPool.set_keep("doc", root=root)
        >>> with SharedPool("doc", 8 << 20, root=root) as pool:
        ...     pool.keep
        True
        >>> SharedPool.destroy("doc", root=root), os.rmdir(root)
        (True, None)
        """
        path = segment_path(name, os.fspath(default_root() if root is None else root))
        if keep:
            os.close(os.open(path + ".keep", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".keep")

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
                with self._lock:
                    self._book.add(doc.epoch, eid, entry, writing=True)
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
                if eid is not None and e is not None:
                    with self._lock:
                        self._book.add(doc.epoch, eid, e, writing=False)
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
        """Give up this process's holds and unmap; the segment stays for the others. The
        last pool of the host to close removes it, unless :attr:`keep`.

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
        self._finalizer()  # gives up the holds, stops pinning, unregisters, unmaps, leaves
        with self._lock:
            self._state = "closed"

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        held = sum(h.count for h in self._book.holds.values())
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
        with self._book.transaction() as doc:
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
        block = SharedBlock(self, eid, e, key, writing)  # in the book already
        with self._released:
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
            if block.released or self._state == "closed":
                return  # nothing of it is ours to change any more
            block.invalid = True
            if block.writing:
                return  # its release frees it
        epoch, eid = block.entry
        try:
            with self._transaction() as doc:
                e = doc.entries.get(eid) if epoch == doc.epoch else None
                if e is not None and e.state == "ready":
                    doc.retire(eid)
        except ClosedError:
            if not self._book.orphaned:
                raise  # the segment is gone: nobody is served from it again

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
            self._give_up(block, epoch, eid)
        except ClosedError:
            if not self._book.orphaned:
                raise
            with self._lock:
                self._book.drop(block.entry)  # the segment is gone: nothing to give back
        finally:
            self._end(block)

    def _give_up(self, block: SharedBlock, epoch: str, eid: str) -> None:
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

    def _exhausted(self, doc: Index, size: int, nbytes: int) -> PoolExhausted:
        held = [e for e in doc.entries.values() if e.holders]
        stuck = sum(e.size for e in held)
        procs = {p for e in held for p in e.holders}
        largest = doc.ranges().largest
        hint = (
            "release blocks you hold, close idle workers, or recreate the segment larger "
            "(nostall shm rm NAME, or SharedPool.destroy(name), once no worker has it open)"
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
