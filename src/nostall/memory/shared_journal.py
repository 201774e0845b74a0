"""Each open shared pool's journal of what it holds: the index can be lost, the holds cannot.

``<segment>.procs/<pid>-<start time>.<token>.json``, one per open
:class:`~nostall.memory.SharedPool` object, replaced whole (a temporary name, then
``os.replace``) inside every index transaction that changes what the pool holds, before
the index itself is written::

    {"format": 1,
     "holds": [{"epoch": "<the index's epoch>", "id": "56", "offset": 0, "size": 2097152,
                "nbytes": 1000, "key": "<repr(key)>", "writing": false, "count": 2}]}

When the index must be rebuilt (it is missing, unreadable, corrupt, or records another
capacity than the segment's), :meth:`Journals.recover` rebuilds it from the journals of the
processes still alive, so that no byte anyone holds is handed out:

* the epoch the most holds were taken in, and the entry ids of that epoch, are kept, so
  existing handles still name their entries and their release frees the right one;
* an entry being written stays ``writing``, its writer's (its release publishes it); an
  entry being read becomes ``retired``: served to nobody, freed when its last holder lets
  go; cached entries nobody holds are dropped;
* holds that disagree (one id with two ranges, ranges that overlap, another epoch's) are
  kept as one ``retired`` entry over the union of their ranges, held by all their holders:
  never handed out before every one of those processes is gone.

Journals of processes that are gone are deleted: by the rebuild, and by every
transaction that finds a process gone (:meth:`Journals.forget`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from nostall.memory.pool import GRANULE
from nostall.memory.shared_index import Entry, Index, alive, digest

__all__ = ["Hold", "Journal", "Journals"]

log = logging.getLogger(__name__)

FORMAT = 1
_FILE = re.compile(r"([0-9]+-[0-9]+)\.[0-9a-f]+\.json(\.tmp)?\Z")


@dataclass
class Hold:
    """One entry a pool object holds: ``count`` handles, the allocating one ``writing``."""

    epoch: str
    id: str
    offset: int
    size: int
    nbytes: int
    key: str | None
    writing: bool
    count: int

    def fits(self, capacity: int) -> bool:
        """Whether the hold is well formed and inside a segment of ``capacity`` bytes."""
        ints = (self.offset, self.size, self.nbytes, self.count)
        return (
            isinstance(self.epoch, str)
            and isinstance(self.id, str)
            and self.id.isdigit()
            and isinstance(self.key, str | None)
            and isinstance(self.writing, bool)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints)
            and self.size > 0
            and self.count > 0
            and not (self.offset % GRANULE or self.size % GRANULE)
            and self.offset + self.size <= capacity
            and 0 < self.nbytes <= self.size
        )


class Journal:
    """The journal of one pool object (of process ``proc``) in ``folder``."""

    def __init__(self, folder: str, proc: str):
        self.folder = folder
        self.path = os.path.join(folder, f"{proc}.{secrets.token_hex(4)}.json")

    def write(self, holds: Iterable[Hold]) -> None:
        """Replace the journal (call with the index lock held)."""
        doc = {"format": FORMAT, "holds": [asdict(h) for h in holds]}
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, separators=(",", ":")))
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Journals:
    """The journals of the segment at ``segment``: ``<segment>.procs/``."""

    def __init__(self, segment: str):
        self.segment = segment
        self.folder = segment + ".procs"

    def new(self, proc: str) -> Journal:
        return Journal(self.folder, proc)

    def _names(self) -> list[tuple[str, str, bool]]:
        """``(file, process, is a temporary)`` of every journal file, sorted by file."""
        try:
            names = sorted(os.listdir(self.folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [(f, m[1], bool(m[2])) for f in names if (m := _FILE.match(f))]

    def live(self) -> list[str]:
        """The live processes that have a journal here."""
        return sorted({p for _, p, _ in self._names() if alive(p)})

    def forget(self, procs: Iterable[str]) -> None:
        """Delete the journals of ``procs`` (processes that are gone)."""
        gone = set(procs)
        for f, proc, _ in self._names():
            if proc in gone:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, f))

    def clear(self) -> None:
        """Delete every journal (the segment is being created: nobody has it open)."""
        self.forget({p for _, p, _ in self._names()})

    def remove(self) -> bool:
        """Delete the folder and everything in it; whether it existed."""
        if not os.path.lexists(self.folder):
            return False
        if os.path.isdir(self.folder) and not os.path.islink(self.folder):
            shutil.rmtree(self.folder, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.folder)
        return True

    def read(self, capacity: int) -> list[tuple[str, list[Hold]]]:
        """``(process, holds)`` of every live process's journal (call with the index lock
        held); journals of processes that are gone are deleted."""
        out = []
        for f, proc, tmp in self._names():
            path = os.path.join(self.folder, f)
            if not alive(proc):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            if tmp:
                continue  # a live writer's next journal, not yet in place
            try:
                with open(path, "rb") as fh:
                    doc = json.loads(fh.read())
                if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                    raise ValueError(f"not a journal of format {FORMAT}")
                holds = [Hold(**raw) for raw in doc["holds"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning(
                    "shared pool %s: the journal %s of live process %s cannot be read (%s: "
                    "%s); what that process holds is not protected",
                    self.segment,
                    path,
                    proc,
                    type(e).__name__,
                    e,
                )
                holds = []
            bad = [h for h in holds if not h.fits(capacity)]
            if bad:
                log.warning(
                    "shared pool %s: journal %s: %d hold(s) do not fit the %d-byte segment "
                    "(e.g. %s); ignored",
                    self.segment,
                    path,
                    len(bad),
                    capacity,
                    bad[0],
                )
            out.append((proc, [h for h in holds if h.fits(capacity)]))
        return out

    def recover(self, index: Index) -> tuple[int, int]:
        """Fill ``index`` (fresh, of the segment's capacity) with what live processes hold;
        returns how many pool objects' journals were read and how many entries were kept."""
        journals = self.read(index.capacity)
        for proc, _ in journals:
            index.attached[proc] = index.attached.get(proc, 0) + 1
        records = [(proc, h) for proc, holds in journals for h in holds]
        if not records:
            return len(journals), 0
        epochs = Counter(h.epoch for _, h in records)
        index.epoch = max(epochs, key=lambda e: (epochs[e], e))
        index.next_id = 1 + max(int(h.id) for _, h in records if h.epoch == index.epoch)
        groups: dict[tuple[str, str], list[tuple[str, Hold]]] = {}
        for proc, h in records:
            groups.setdefault((h.epoch, h.id), []).append((proc, h))
        # Each (epoch, id) spans its records' union; spans that overlap form one cluster.
        spans = sorted(
            (min(h.offset for _, h in recs), max(h.offset + h.size for _, h in recs), k)
            for k, recs in groups.items()
        )
        clusters: list[tuple[int, int, list[tuple[str, str]]]] = []
        for start, end, k in spans:
            if clusters and start < clusters[-1][1]:
                s, e, ks = clusters.pop()
                clusters.append((s, max(e, end), [*ks, k]))
            else:
                clusters.append((start, end, [k]))
        for start, end, ks in clusters:
            recs = [r for k in ks for r in groups[k]]
            if len(ks) == 1 and ks[0][0] == index.epoch and _agree(recs):
                index.entries[ks[0][1]] = _entry(recs, index.tick())
            else:
                log.warning(
                    "shared pool %s: bytes [%d, %d) are in holds that disagree or come from "
                    "an older index (%d hold(s)); kept reserved until every holder is gone",
                    self.segment,
                    start,
                    end,
                    len(recs),
                )
                eid = str(index.next_id)
                index.next_id += 1
                size = end - start
                index.entries[eid] = Entry(
                    digest=None,
                    key=None,
                    offset=start,
                    size=size,
                    nbytes=size,
                    state="retired",
                    writer=None,
                    holders=_holders(recs),
                    last_used=index.tick(),
                )
        return len(journals), len(index.entries)


def _agree(recs: list[tuple[str, Hold]]) -> bool:
    """One range and key for every record; a writing record is the entry's only one."""
    shapes = {(h.offset, h.size, h.nbytes, h.key) for _, h in recs}
    writing = [h for _, h in recs if h.writing]
    return len(shapes) == 1 and (not writing or (len(recs) == 1 and writing[0].count == 1))


def _holders(recs: list[tuple[str, Hold]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for proc, h in recs:
        out[proc] = out.get(proc, 0) + h.count
    return out


def _entry(recs: list[tuple[str, Hold]], clock: int) -> Entry:
    h = recs[0][1]
    state, writer = ("writing", recs[0][0]) if h.writing else ("retired", None)
    key_digest = None if h.key is None else digest(h.key)
    return Entry(
        key_digest, h.key, h.offset, h.size, h.nbytes, state, writer, _holders(recs), clock
    )
