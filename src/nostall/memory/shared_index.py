"""The shared pool's index: which bytes of a host-wide segment hold what, and who holds them.

Two small files sit beside the segment ``<root>/nostall-<host>-<name>``:

* ``<segment>.lock``: empty. ``flock(LOCK_EX)`` on it guards every read-modify-write of
  the index and of the journals, and the creation, replacement or removal of the segment
  (:mod:`nostall.memory.shared_segment`).
* ``<segment>.index``: the JSON document below, replaced whole (written under a temporary
  name in the same folder, then ``os.replace``), so no reader ever sees half of it::

    {"format": 1, "host": "gpu-7", "boot": "<kernel boot id>", "capacity": 1073741824,
     "epoch": "<random, new with every empty index>", "clock": 812, "next_id": 57,
     "attached": {"4121-88213": 1},              # pools open, per process (informational)
     "entries": {"56": {"digest": "<sha256 of repr(key)>", "key": "<repr(key)>",
                        "offset": 0, "size": 2097152, "nbytes": 1000,
                        "state": "ready",         # writing | ready | retired
                        "writer": null,           # "<pid>-<start>" while writing
                        "holders": {"4121-88213": 1},
                        "last_used": 811}}}       # the clock at its last use (LRU)

An entry is ``writing`` from its allocation until its writer's first release, visible only
to that writer; ``ready`` entries are served to every process; a ``retired`` entry (a newer
copy of its key was published, or a reader invalidated it) is served to nobody and is freed
when its last holder lets go. ``clock`` counts uses, so recency is comparable across
processes whatever their wall clocks say. ``epoch`` changes whenever the index is started
empty, so a handle from before (whose entry id may be reused) is told apart; an index
rebuilt from the journals keeps the epoch and the ids its holders' handles name.

A process is named ``<pid>-<start time>`` (field 22 of ``/proc/<pid>/stat``), so a pid the
kernel hands to a new process is not taken for the one that died. Every transaction first
drops the processes that are gone (zombies included): their attachments, their holds and
their journals, and it frees the entries they were writing, whose bytes are half written.
Whether a segment is open anywhere is never read from ``attached`` but from the file locks
on the segment (:mod:`nostall.memory.shared_segment`): a damaged index cannot make a
segment in use look free.

An index that is missing, cannot be read or parsed, breaks an invariant (entries that
overlap or leave the segment), was written before the last boot, or records another
capacity than the segment's, is rebuilt from the journals of the live processes
(:mod:`nostall.memory.shared_journal`), with a warning: what they hold or write is kept,
cached entries are dropped. The segment's size is read from the segment, under the lock,
by every transaction, so once rebuilt an index agrees with every process. One that names
another host is refused with :class:`~nostall.ArgumentError`; one of another format that
live processes still use (another nostall version) with :class:`~nostall.UnsupportedError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

from nostall.errors import ArgumentError, UnsupportedError
from nostall.memory.pool import GRANULE
from nostall.memory.ranges import Ranges

__all__ = ["Entry", "Index", "IndexFile", "Recovery", "alive", "digest", "process_id"]

log = logging.getLogger(__name__)

FORMAT = 1
STATES = ("writing", "ready", "retired")
_PROC = re.compile(r"[0-9]+-[0-9]+\Z")


def process_id(pid: int) -> str | None:
    """``"<pid>-<start time>"`` of a running process; ``None`` when it is gone or a zombie.

    >>> process_id(os.getpid()).startswith(f"{os.getpid()}-")
    True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces and parentheses: the fields resume
        # after its last ")". Field 3 is the state, field 22 the start time.
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):  # killed, not yet reaped: it holds nothing
            return None
        return f"{pid}-{int(fields[19])}"
    except (OSError, ValueError, IndexError):
        return None


def alive(proc: str) -> bool:
    """Whether the process named ``proc`` (``"<pid>-<start time>"``) still runs."""
    pid = proc.partition("-")[0]
    return pid.isdigit() and process_id(int(pid)) == proc


def digest(key_text: str) -> str:
    """The index's name for a key, given its ``repr``."""
    return hashlib.sha256(key_text.encode()).hexdigest()


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass
class Entry:
    """One range of the segment; see the module's docstring for the fields."""

    digest: str | None
    key: str | None
    offset: int
    size: int
    nbytes: int
    state: str
    writer: str | None
    holders: dict[str, int]
    last_used: int


@dataclass
class Index:
    """The index document, read under the lock; its methods keep its invariants."""

    host: str
    boot: str | None
    capacity: int
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))
    clock: int = 0
    next_id: int = 0
    attached: dict[str, int] = field(default_factory=dict)
    entries: dict[str, Entry] = field(default_factory=dict)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def ranges(self) -> Ranges:
        """The free ranges around every entry (best fit, as the process-local pool's)."""
        r = Ranges(self.capacity)
        for e in self.entries.values():
            r.take(e.offset, e.size)
        return r

    def add(self, key_text: str | None, offset: int, size: int, nbytes: int, writer: str) -> str:
        eid = str(self.next_id)
        self.next_id += 1
        self.entries[eid] = Entry(
            None if key_text is None else digest(key_text),
            key_text,
            offset,
            size,
            nbytes,
            "writing",
            writer,
            {writer: 1},
            self.tick(),
        )
        return eid

    def ready(self, key_digest: str) -> str | None:
        """The entry served under ``key_digest``, if one is ``ready``."""
        for eid, e in self.entries.items():
            if e.digest == key_digest and e.state == "ready":
                return eid
        return None

    def hold(self, eid: str, proc: str) -> Entry:
        e = self.entries[eid]
        e.holders[proc] = e.holders.get(proc, 0) + 1
        e.last_used = self.tick()
        return e

    def unhold(self, eid: str, proc: str, n: int = 1) -> None:
        """Give up ``n`` of ``proc``'s holds; a retired entry nobody holds is freed."""
        e = self.entries.get(eid)
        if e is None:
            return
        left = e.holders.get(proc, 0) - n
        if left > 0:
            e.holders[proc] = left
        else:
            e.holders.pop(proc, None)
        e.last_used = self.tick()
        if e.state == "retired" and not e.holders:
            del self.entries[eid]

    def publish(self, eid: str, proc: str) -> None:
        """The writer's first release: serve the entry, retire older copies of its key."""
        e = self.entries[eid]
        for other_id, other in list(self.entries.items()):
            if other_id != eid and other.digest == e.digest and other.state == "ready":
                self.retire(other_id)
        e.state, e.writer = "ready", None
        self.unhold(eid, proc)

    def retire(self, eid: str) -> None:
        e = self.entries[eid]
        e.state = "retired"
        if not e.holders:
            del self.entries[eid]

    def lru_idle(self) -> str | None:
        """The least recently used ``ready`` entry that nobody holds."""
        idle = [(e.last_used, eid) for eid, e in self.entries.items() if e.state == "ready"]
        idle = [x for x in idle if not self.entries[x[1]].holders]
        return min(idle)[1] if idle else None

    def prune(self) -> list[str]:
        """Forget every process that is gone; returns their names."""
        procs = set(self.attached)
        for e in self.entries.values():
            procs.update(e.holders)
            if e.writer is not None:
                procs.add(e.writer)
        dead = sorted(p for p in procs if not alive(p))
        if not dead:
            return []
        for p in dead:
            self.attached.pop(p, None)
        for eid, e in list(self.entries.items()):
            for p in dead:
                e.holders.pop(p, None)
            if (e.state == "writing" and e.writer in dead) or (
                e.state == "retired" and not e.holders
            ):
                del self.entries[eid]  # half-written bytes are never served
        return dead

    def to_json(self) -> str:
        doc = {"format": FORMAT, **asdict(self)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, doc: object) -> Index:
        """Rebuild a parsed document; ``ValueError`` names the first broken invariant."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not an index of format {FORMAT}")
        entries = {}
        for eid, raw in _dict(doc["entries"]).items():
            e = Entry(**raw)
            _check_entry(eid, e, _int(doc["capacity"]))
            entries[eid] = e
        index = cls(
            host=doc["host"],
            boot=doc["boot"],
            capacity=_int(doc["capacity"]),
            epoch=doc["epoch"],
            clock=_int(doc["clock"]),
            next_id=_int(doc["next_id"]),
            attached=_counts(doc["attached"]),
            entries=entries,
        )
        if not all(isinstance(x, str) for x in (index.host, index.epoch)) or not isinstance(
            index.boot, str | None
        ):
            raise ValueError("host, epoch or boot is not a string")
        if any(int(eid) >= index.next_id for eid in entries):
            raise ValueError("an entry id is not below next_id")
        end = 0
        for e in sorted(entries.values(), key=lambda e: e.offset):
            if e.offset < end:
                raise ValueError(f"entries overlap at offset {e.offset}")
            end = e.offset + e.size
        return index


def _int(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"{x!r} is not a count")
    return x


def _dict(x: object) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{x!r} is not an object")
    return x


def _counts(x: object) -> dict[str, int]:
    out = _dict(x)
    for proc, n in out.items():
        if not _PROC.match(proc) or _int(n) == 0:
            raise ValueError(f"bad process count {proc!r}: {n!r}")
    return out


def _check_entry(eid: str, e: Entry, capacity: int) -> None:
    if not all(isinstance(x, str | None) for x in (e.key, e.digest, e.writer, e.state)):
        raise ValueError(f"entry {eid!r}: a key, digest, writer or state is not a string")
    if not eid.isdigit() or e.state not in STATES:
        raise ValueError(f"entry {eid!r}: bad id or state {e.state!r}")
    if _int(e.size) == 0 or e.size % GRANULE or _int(e.offset) % GRANULE:
        raise ValueError(f"entry {eid}: offset {e.offset} or size {e.size} off the granule")
    if e.offset + e.size > capacity or not 0 < _int(e.nbytes) <= e.size:
        raise ValueError(f"entry {eid}: [{e.offset}, +{e.size}) leaves the segment")
    if (e.key is None) != (e.digest is None) or (e.key is not None and digest(e.key) != e.digest):
        raise ValueError(f"entry {eid}: key and digest disagree")
    if (e.state == "writing") != (e.writer is not None) or (
        e.writer is not None and not _PROC.match(e.writer)
    ):
        raise ValueError(f"entry {eid}: writer {e.writer!r} does not fit state {e.state}")
    _counts(e.holders)
    _int(e.last_used)


class Recovery(Protocol):
    """What rebuilds a lost index (:class:`~nostall.memory.shared_journal.Journals`)."""

    def recover(self, index: Index) -> tuple[int, int]:
        """Fill a fresh ``index`` with what live processes hold; returns (pools, entries)."""
        ...

    def forget(self, procs: Iterable[str]) -> None:
        """Drop what the processes ``procs``, gone, recorded."""
        ...


class IndexFile:
    """The lock and the index files of the segment at ``segment``, recorded for ``host``;
    an index that must be rebuilt is rebuilt from ``journals`` (without: empty)."""

    def __init__(self, segment: str, host: str, journals: Recovery | None = None):
        self.segment, self.host, self.journals = segment, host, journals
        self.path = segment + ".index"
        self.lock_path = segment + ".lock"
        self.boot = boot_id()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the segment's lock: every process's transactions run one at a time."""
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # SharedPool.destroy() unlinks the lock file while holding it: a lock won on
                # the unlinked inode guards nothing, so take the new file's instead.
                try:
                    now = os.stat(self.lock_path)
                except FileNotFoundError:
                    now = None
                mine = os.fstat(fd)
                if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    yield
                    return
            finally:
                os.close(fd)  # also gives the lock up

    def fresh(self, capacity: int) -> Index:
        return Index(host=self.host, boot=self.boot, capacity=capacity)

    def read(self, capacity: int) -> Index:
        """The index of a segment of ``capacity`` bytes (call with the lock held), pruned of
        processes that are gone; rebuilt where it is missing or cannot be trusted."""
        return self._load(capacity)[0]

    def reset(self, capacity: int) -> None:
        """Write an empty index (call with the lock held): the segment was just created."""
        self.write(self.fresh(capacity))

    def _load(self, capacity: int) -> tuple[Index, bool]:
        """:meth:`read`, and whether the index differs from the file (pruned, rebuilt)."""
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return self._rebuilt(capacity, "it is missing", quiet=True), True
        except (OSError, ValueError) as e:
            return self._rebuilt(capacity, f"it cannot be read ({type(e).__name__}: {e})"), True
        host = doc.get("host") if isinstance(doc, dict) else None
        if isinstance(host, str) and host != self.host:
            raise ArgumentError(
                f"{self.path} is the index of host {host!r}, not of this host "
                f"({self.host!r}): a root shared between hosts (or a renamed host). Give each "
                "host its own root= or name, or remove the stale segment with "
                "SharedPool.destroy(name, root=...) once no worker uses it",
                field="root",
            )
        version = doc.get("format") if isinstance(doc, dict) else None
        users = doc.get("attached") if isinstance(doc, dict) else None
        if isinstance(version, int) and version != FORMAT and isinstance(users, dict):
            users = [p for p in users if isinstance(p, str) and alive(p)]
            if users:
                # Another nostall version's workers: rebuilding their index under them
                # would hand out bytes they still read.
                raise UnsupportedError(
                    f"{self.path} is an index of format {version}, in use by process(es) "
                    f"{', '.join(users)}; this nostall reads format {FORMAT}. Give each "
                    "nostall version its own pool name, or upgrade every worker of the host"
                )
        try:
            index = Index.from_json(doc)
        except (KeyError, TypeError, ValueError) as e:
            return self._rebuilt(capacity, f"it is corrupt ({type(e).__name__}: {e})"), True
        if index.boot != self.boot:
            return self._rebuilt(capacity, "it was written before the machine last booted"), True
        if index.capacity != capacity:
            why = f"it records {index.capacity} bytes, the segment has {capacity}"
            return self._rebuilt(capacity, why), True
        dead = index.prune()
        if dead:
            log.info("shared pool %s: dropped processes that are gone: %s", self.segment, dead)
            if self.journals is not None:
                self.journals.forget(dead)
        return index, bool(dead)

    def write(self, index: Index) -> None:
        """Replace the index (call with the lock held)."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(index.to_json())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def update(self, capacity: int) -> Iterator[Index]:
        """Read the index of a segment of ``capacity`` bytes (call with the lock held), let
        the body change it, write it back if it changed. A body that raises changes
        nothing."""
        index, stale = self._load(capacity)
        before = index.to_json()
        yield index
        if stale or index.to_json() != before:
            self.write(index)

    def _rebuilt(self, capacity: int, why: str, *, quiet: bool = False) -> Index:
        """A new index of ``capacity`` bytes holding what the live processes' journals
        hold; ``quiet``: warn only if they hold anything (a missing index is the rule
        before a segment's first pool writes it)."""
        index = self.fresh(capacity)
        pools, kept = (0, 0) if self.journals is None else self.journals.recover(index)
        if quiet and not pools:
            return index
        log.warning(
            "shared pool index %s: %s; rebuilding it from the journals of the %d pool(s) "
            "open on the segment: %d entr%s they hold or write kept (served to nobody "
            "else), cached entries dropped",
            self.path,
            why,
            pools,
            kept,
            "y" if kept == 1 else "ies",
        )
        return index
