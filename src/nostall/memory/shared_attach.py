"""One shared pool object's attachment to its segment: its holds, journal, lock and leaving.

:class:`Attachment` is what a :class:`~nostall.memory.SharedPool` must still do when it is
closed or garbage-collected, so it holds no reference to the pool: its finalizer owns it.

* Every index transaction goes through :meth:`Attachment.transaction`: it first checks that
  the segment's path still names the file this pool maps (else the segment was removed by
  force, and the pool is closed), reads the index at the segment's real size, and writes
  this pool's journal (:mod:`nostall.memory.shared_journal`) before the index whenever the
  holds changed.
* :meth:`Attachment.detach` gives every hold up; :meth:`Attachment.leave`, once the pool
  has unmapped the segment, gives its file lock up and removes the segment if no pool of
  the host has it open any more and it is not kept (:mod:`nostall.memory.shared_segment`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from nostall.errors import ClosedError
from nostall.memory.shared_index import Entry, Index, IndexFile
from nostall.memory.shared_journal import Hold, Journal
from nostall.memory.shared_segment import Segment, in_use, remove

__all__ = ["Attachment"]

log = logging.getLogger(__name__)


class Attachment:
    """One pool object's attachment and holds; shared with its finalizer, never the pool.

    Changed only inside index transactions (so under the index lock); each transaction
    that changes it rewrites the journal before the index is written back."""

    def __init__(self, proc: str, index: IndexFile, journal: Journal, segment: Segment):
        self.pid, self.proc = os.getpid(), proc
        self.index, self.journal, self.segment = index, journal, segment
        self.holds: dict[tuple[str, str], Hold] = {}  # (epoch, entry id) → this pool's holds
        self.attached = False
        self.orphaned = False  # the segment was removed under us (destroy(force=True))
        self.dirty = False  # the journal is behind the book

    def add(self, epoch: str, eid: str, e: Entry, *, writing: bool) -> None:
        h = self.holds.get((epoch, eid))
        if h is None:
            self.holds[epoch, eid] = Hold(
                epoch, eid, e.offset, e.size, e.nbytes, e.key, writing, count=1
            )
        else:
            h.count += 1
        self.dirty = True

    def drop(self, eid: tuple[str, str]) -> None:
        h = self.holds.get(eid)
        if h is not None:
            h.count -= 1
            if h.count <= 0:
                del self.holds[eid]
            self.dirty = True

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Index]:
        """An index transaction on this pool's segment, its journal written with it.
        :class:`~nostall.ClosedError` once the segment was removed or replaced."""
        # Checked before locking too: the lock of a removed segment is not created again.
        if self.orphaned or self.segment.current() is None:
            self._orphaned()
        with self.index.locked():
            size = self.segment.current()
            if size is None:
                self._orphaned()
            # The segment's own size, never this process's belief: every process then
            # agrees with the index, and none rebuilds it again.
            with self.index.update(size) as doc:
                yield doc
                self.write_journal()

    def _orphaned(self) -> None:
        self.orphaned = True
        raise ClosedError(
            f"the shared pool {self.segment.path} was removed while this process had it "
            "open (SharedPool.destroy(force=True), nostall shm rm --force); open a new "
            "SharedPool"
        )

    def write_journal(self) -> None:
        if not (self.dirty and self.attached):
            return
        try:
            self.journal.write(self.holds.values())
            self.dirty = False
        except OSError as e:  # retried by the next transaction
            log.warning(
                "shared pool %s: cannot write this process's journal %s (%s): its holds "
                "are unprotected should the index be lost",
                self.segment.path,
                self.journal.path,
                e,
            )

    def attach(self) -> None:
        """Record the attachment (call with the index lock held, the segment just open)."""
        if self.segment.created:
            self.index.reset(self.segment.size)
        with self.index.update(self.segment.size) as doc:
            doc.attached[self.proc] = doc.attached.get(self.proc, 0) + 1
            self.attached = self.dirty = True
            self.write_journal()

    def detach(self) -> None:
        """Give up every hold and the attachment; unpublished entries are freed."""
        if self.pid != os.getpid():
            return  # a forked child's copy: the holds are its parent's
        try:
            with self.transaction() as doc:
                if not self.attached:
                    return
                for (epoch, eid), h in self.holds.items():
                    if epoch != doc.epoch:
                        continue  # the index was started afresh since: nothing of ours is left
                    if h.writing:
                        doc.entries.pop(eid, None)
                    else:
                        doc.unhold(eid, self.proc, h.count)
                left = doc.attached.get(self.proc, 0) - 1
                if left > 0:
                    doc.attached[self.proc] = left
                else:
                    doc.attached.pop(self.proc, None)
                self.journal.remove()
                # Cleared under the index lock: a release racing with close() sees it.
                self.holds.clear()
                self.attached = self.dirty = False
        except ClosedError:
            if not self.orphaned:
                raise
            self.holds.clear()  # the segment is gone: nobody else can see our holds
            self.attached = False

    def leave(self) -> None:
        """Give the segment's shared lock up (this process has unmapped it), and remove the
        segment if no pool has it open any more and it is not kept."""
        self.segment.close()
        if self.pid != os.getpid():
            return  # a forked child never opened the segment: its parent decides
        path = self.segment.path
        if self.orphaned or self.segment.current() is None:
            return  # removed or replaced already: nothing of ours is left to remove
        try:
            with self.index.locked():
                if os.path.exists(path + ".keep") or self.segment.current() is None:
                    return
                if not in_use(path):
                    remove(path)
                    log.info("shared pool %s: the last pool closed; segment removed", path)
        except OSError as e:
            log.warning("shared pool %s: could not remove the segment: %s", path, e)
