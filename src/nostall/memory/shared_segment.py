"""The shared pool's segment file: where it lives, who has it open, creating, listing, removing.

A segment is the file ``<root>/nostall-<host>-<name>`` (``root``: :func:`default_root`)
holding the bytes; beside it sit ``<segment>.lock`` and ``<segment>.index``
(:mod:`nostall.memory.shared_index`), ``<segment>.procs/`` (one journal per open pool,
:mod:`nostall.memory.shared_journal`) and, when it must outlive its last process,
``<segment>.keep``.

**Attachment is a file lock, not a record.** Every open pool holds ``flock(LOCK_SH)`` on a
descriptor of the segment of its own until it has unmapped it; the kernel drops the lock
when the process dies, however it dies. Under the index lock, and only when
``flock(LOCK_EX | LOCK_NB)`` on a fresh descriptor succeeds (no pool has the segment open),
a segment is created, replaced at another capacity, or removed. A segment in use is opened
as it is, whatever capacity the newcomer asked for.

**An existing file is never truncated.** A segment of another capacity is replaced by
unlinking it and creating a new file: a view that outlived its pool keeps the old pages
(an unlinked file lives on while mapped), so it reads stale bytes at worst, never faults.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass

from nostall.errors import ArgumentError, BusyError
from nostall.memory.pool import GRANULE, check_capacity
from nostall.memory.shared_index import IndexFile, process_id
from nostall.memory.shared_journal import Journals

__all__ = [
    "Segment",
    "SegmentInfo",
    "default_root",
    "destroy",
    "in_use",
    "list_segments",
    "open_segment",
    "remove",
    "segment_path",
    "users",
]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_NAME = 100
# The files beside a segment: a name ending so would collide with another name's file.
SUFFIXES = (".index", ".lock", ".keep", ".procs", ".tmp")
_LEFTOVER = re.compile(r"\.index\.[0-9]+\.tmp\Z")


def default_root() -> str:
    """The folder of the host's segments: ``$NOSTALL_SHM_DIR``, else the tmpfs ``/dev/shm``."""
    return os.environ.get("NOSTALL_SHM_DIR") or "/dev/shm"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"


def segment_path(name: str, root: str) -> str:
    """The segment file of ``name`` under ``root`` for this host.

    >>> segment_path("tier", "/dev/shm").startswith("/dev/shm/nostall-")
    True
    """
    if (
        not isinstance(name, str)
        or not _NAME.match(name)
        or len(name) > MAX_NAME
        or name.endswith(SUFFIXES)
    ):
        raise ArgumentError(
            f"shared pool name {name!r}: use 1 to {MAX_NAME} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes a file name), not ending in "
            f"{', '.join(SUFFIXES)}",
            field="name",
            allowed=_NAME.pattern,
        )
    if not os.path.isdir(root):
        raise ArgumentError(f"root={root!r} is not a folder; give an existing one", field="root")
    return os.path.join(root, f"nostall-{_host()}-{name}")


def in_use(path: str) -> bool:
    """Whether an open pool holds the segment at ``path`` (call with the index lock held:
    the probe briefly takes the exclusive lock, and only under the index lock is that
    harmless to the others)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return True
        raise
    finally:
        os.close(fd)  # also gives the probe's lock up
    return False


class Segment:
    """This pool's open segment: ``fd`` maps it (the caller closes it once mapped), the
    shared lock on a descriptor of its own says it is in use until :meth:`close`."""

    def __init__(self, path: str, fd: int, lock_fd: int, created: bool):
        self.path, self.fd, self.created = path, fd, created
        self._lock_fd: int | None = lock_fd
        st = os.fstat(fd)
        self.ident, self.size = (st.st_dev, st.st_ino), st.st_size

    def current(self) -> int | None:
        """The segment's size if ``path`` still names this segment; ``None`` once it was
        removed or replaced (``destroy(force=True)``)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_size if (st.st_dev, st.st_ino) == self.ident else None

    def close(self) -> None:
        """Give the shared lock up: call once this process has unmapped the segment."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)


def open_segment(path: str, capacity: int, root: str) -> Segment:
    """Open the segment at ``path`` (call with the index lock held): created with
    ``capacity`` bytes if missing, or replaced at ``capacity`` if nobody has it open, else
    as it is (with a warning when it has another capacity).

    Raises :class:`~nostall.BusyError` naming both sizes when the segment in use cannot be
    mapped here (not a size a pool creates, or beyond this process's memory limit)."""
    created = False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ArgumentError(f"{path} is a symbolic link; remove it", field="name") from e
    try:
        if fd is not None:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArgumentError(f"{path} is not a regular file; remove it", field="name")
            if in_use(path):
                _check_in_use(path, st.st_size, capacity)
            elif st.st_size != capacity:
                if st.st_size:
                    log.warning(
                        "shared pool %s: recreating it with %d bytes instead of %d (no "
                        "process has it open; its cached entries are dropped)",
                        path,
                        capacity,
                        st.st_size,
                    )
                os.close(fd)
                fd = None
        if fd is None:
            _check_room(root, capacity)
            fd, created = _create(path, capacity), True
        lock_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # Under the index lock nobody holds LOCK_EX for longer than a probe: no wait.
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
            return Segment(path, fd, lock_fd, created)
        except BaseException:
            os.close(lock_fd)
            raise
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


def _check_in_use(path: str, size: int, capacity: int) -> None:
    if size == capacity:
        return
    who = ", ".join(users(path)) or "unknown processes"
    if size <= 0 or size % GRANULE:
        raise BusyError(
            f"shared pool {path} is open in {who} with {size} bytes, not a segment a shared "
            f"pool creates (a multiple of {GRANULE}); this process asked for {capacity} "
            "bytes. Give this pool another name, or stop those processes and remove it"
        )
    try:
        check_capacity(size)
    except ArgumentError as e:
        raise BusyError(
            f"shared pool {path} is open in {who} with {size} bytes; this process asked "
            f"for {capacity} bytes and cannot map {size} ({e}). Give this pool another "
            "name, or raise this process's memory limit"
        ) from e
    log.warning(
        "shared pool %s exists with %d bytes, open in %s: using it as it is instead of "
        "the %d bytes asked for",
        path,
        size,
        who,
        capacity,
    )


def _create(path: str, capacity: int) -> int:
    # A new file, never a truncated old one: see the module's docstring.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    Journals(path).clear()  # nobody has the segment open, so every journal is stale
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, capacity)  # sparse: pages come as blocks are carved
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd


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


def users(path: str) -> list[str]:
    """The live processes (``"<pid>-<start time>"``) that have the segment at ``path``
    open: from their journals, and from the kernel's table of file locks."""
    procs = set(Journals(path).live())
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return sorted(procs)
    for pid in _flock_pids(st):
        proc = process_id(pid)
        if proc is not None:
            procs.add(proc)
    return sorted(procs, key=lambda p: int(p.partition("-")[0]))


def _flock_pids(st: os.stat_result) -> set[int]:
    """The pids ``/proc/locks`` names as holding a ``flock`` on the file of ``st`` (the
    process that took each lock; a forked child inheriting it is not named)."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    try:
        with open("/proc/locks") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  READ 4121 fd:01:2146409 0 EOF"; waiters have "->"
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == dev:
                    pids.add(int(parts[4]))
    except (OSError, ValueError):
        pass
    return pids


def _files(path: str) -> list[str]:
    """Every file of the segment at ``path`` but its lock file, which goes last."""
    index = path + ".index"
    leftovers = glob.glob(glob.escape(index) + ".*.tmp")  # writers that died
    return [path, index, *leftovers, path + ".keep"]


def remove(path: str) -> bool:
    """Remove the segment at ``path`` and every file beside it (call with the index lock
    held); whether there was anything to remove."""
    found = False
    for p in _files(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            found = True
    found = Journals(path).remove() or found
    with contextlib.suppress(FileNotFoundError):
        # The lock file last, while held: IndexFile.locked() retries on the new one.
        os.unlink(path + ".lock")
        found = True
    return found


def destroy(name: str, root: str, *, force: bool = False) -> bool:
    """Remove the segment ``name`` under ``root`` and its files; ``False`` if there was
    none. Raises :class:`~nostall.BusyError` naming the processes that have it open,
    unless ``force`` (they keep their mapping, nobody finds it again, and their next use
    of the pool raises :class:`~nostall.ClosedError`)."""
    path = segment_path(name, root)
    index = IndexFile(path, socket.gethostname())
    names = [path, path + ".procs", index.path, index.lock_path, path + ".keep"]
    if not any(os.path.lexists(p) for p in names):
        return False
    with index.locked():
        if in_use(path) and not force:
            who = ", ".join(users(path)) or "unknown processes"
            raise BusyError(
                f"shared pool {path} is open in process(es) {who} (pid-start time); "
                "close them first, or remove it anyway with force=True (nostall shm rm "
                "--force)"
            )
        return remove(path)


@dataclass(frozen=True)
class SegmentInfo:
    """One segment of a root, as :func:`list_segments` found it.

    Attributes:
        name: the pool's name (``SharedPool(name, ...)``, ``--host-tier shared:NAME``).
        path: the segment file.
        capacity: its size in bytes (0 when only its index or lock file is left).
        allocated: the bytes the file system gave it (tmpfs pages in RAM).
        entries: the index's entries (cached, held or being written); ``None`` when the
            index is missing or unreadable.
        processes: the live processes that have it open (``"<pid>-<start time>"``).
        in_use: whether any process has it open (it may have journals nobody can read).
        keep: whether it outlives its last process (else that process removes it).
    """

    name: str
    path: str
    capacity: int
    allocated: int
    entries: int | None
    processes: tuple[str, ...]
    in_use: bool
    keep: bool


def list_segments(root: str) -> list[SegmentInfo]:
    """Every segment of this host under ``root``, by name."""
    if not os.path.isdir(root):
        raise ArgumentError(f"root={root!r} is not a folder; give an existing one", field="root")
    prefix = f"nostall-{_host()}-"
    names = set()
    for f in os.listdir(root):
        if f.startswith(prefix):
            base = _LEFTOVER.sub("", f[len(prefix) :])
            for suffix in SUFFIXES:
                base = base.removesuffix(suffix)
            if _NAME.match(base):
                names.add(base)
    return [_info(n, os.path.join(root, prefix + n)) for n in sorted(names)]


def _info(name: str, path: str) -> SegmentInfo:
    try:
        st = os.stat(path)
        capacity, allocated = st.st_size, st.st_blocks * 512
    except FileNotFoundError:
        capacity = allocated = 0
    busy = False
    if capacity:
        with IndexFile(path, socket.gethostname()).locked():
            busy = in_use(path)
    try:
        with open(path + ".index", "rb") as f:
            entries = len(json.loads(f.read())["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        entries = None
    procs = tuple(users(path)) if busy else ()
    return SegmentInfo(
        name, path, capacity, allocated, entries, procs, busy, os.path.exists(path + ".keep")
    )
