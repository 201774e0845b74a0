"""The digest index: each file's content digest, remembered by its identity on disk.

A file's digest (xxh3-128 of every data byte, :mod:`nostall.store.digest`) is
computed the first time nostall reads it; the index keeps it under the file's identity
``(device, inode, size, mtime_ns, ctime_ns)``, so a new process knows every file it
has seen before without reading a byte, and a file rewritten in place (new size or
times) is simply unknown again.

It lives beside the model store, not in it (model folders may be read-only): by default
``$NOSTALL_CACHE_DIR``, else ``$XDG_CACHE_HOME/nostall``, else ``~/.cache/nostall``,
file ``digests.sqlite``. SQLite (Python's standard library) gives atomic writes and
locking between processes, so two workers writing at once is safe. Faults never stop a
load: an index that is corrupt is moved aside and rebuilt, one that cannot be opened or
written (read-only folder, full disk) is bypassed for the rest of the process, which
then keeps its digests in memory; each is said once in the log.

Each row carries a checksum of everything in it (identity, path, digest): a row edited
by hand or corrupted fails it, is dropped and said in the log, and its file is hashed
again when next read. A checksum is no proof (any program can write a consistent
row), so the store does not trust a row with sharing either: :mod:`nostall.store.keys`.
Rows live in table ``digests``; the ``files`` table of versions before the checksum is
left to them (its files are hashed once more, on their next read).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
import time

from nostall.errors import InternalError
from nostall.store.digest import SCHEME, FileIdentity

__all__ = ["DigestIndex", "default_cache_dir", "local_source"]

log = logging.getLogger(__name__)

FILENAME = "digests.sqlite"
_TABLE = "digests"  # rows with a checksum ("files": older versions', without)
_PRUNE_ABOVE = 100_000  # rows; older rows of files that changed or vanished are dropped


def default_cache_dir() -> str:
    """``$NOSTALL_CACHE_DIR``, ``$XDG_CACHE_HOME/nostall`` or ``~/.cache/nostall``."""
    explicit = os.environ.get("NOSTALL_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nostall")


def local_source(source, cache_dir: str | os.PathLike | bool | None = None):
    """``source`` as a local path: an ``s3://`` URL is mirrored (:mod:`nostall.store.mirror`)
    under ``<cache_dir>/remote`` first; anything else is returned as it is.

    A ``cache_dir`` given as a folder is also the disk tier: weight files read from object
    storage are kept there, complete, for the next process. Without one
    (``None``/``True``/``False``), the mirror in the default cache folder holds only the
    small files and the weight files' stubs, and weights are read remotely each time.
    """
    if not (isinstance(source, str) and source.startswith("s3://")):
        return source
    from nostall.store.mirror import mirror

    keep = cache_dir not in (None, True, False)
    root = os.fspath(cache_dir) if keep else default_cache_dir()
    return mirror(source, os.path.join(root, "remote"), keep_weights=keep)


class DigestIndex:
    """Digests by file identity, in ``folder`` (default: :func:`default_cache_dir`).

    ``folder=False`` keeps them in memory only. Thread-safe; safe across processes.

    >>> index = DigestIndex("/tmp/nostall-cache")  # doctest: +SKIP
    >>> index.put(FileIdentity.stat(path), path, digest)  # doctest: +SKIP
    >>> index.get(FileIdentity.stat(path)) == digest  # doctest: +SKIP
    True
    """

    def __init__(self, folder: str | os.PathLike | bool | None = None):
        self._memory: dict[FileIdentity, str] = {}
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self.path: str | None = None
        self._said: set[str] = set()
        if folder is False:
            return
        root = default_cache_dir() if folder is None or folder is True else os.fspath(folder)
        self.path = os.path.join(root, FILENAME)
        self._open()

    # ---- public --------------------------------------------------------------------

    @property
    def persistent(self) -> bool:
        """Whether digests reach the file (else this process keeps them in memory)."""
        return self._db is not None

    def get(self, identity: FileIdentity) -> str | None:
        """The digest of the file with this identity, if any process recorded it."""
        with self._lock:
            hit = self._memory.get(identity)
            if hit is not None or self._db is None:
                return hit
            try:
                row = self._db.execute(
                    f"SELECT digest, path, tag FROM {_TABLE} WHERE dev=? AND ino=? AND size=? "
                    "AND mtime_ns=? AND ctime_ns=? AND scheme=?",
                    (*_ints(identity), SCHEME),
                ).fetchone()
            except sqlite3.Error as e:
                self._fail("read", e)
                return None
            if row is None:
                return None
            digest, path, tag = row
            if tag != _tag(identity, path, digest):
                self._drop(identity, path)
                return None
            self._memory[identity] = digest
            return digest

    def put(self, identity: FileIdentity, path: str, digest: str) -> None:
        """Record ``digest`` for the file ``path`` with this identity (replacing what the
        index held for that file before it changed)."""
        with self._lock:
            self._memory[identity] = digest
            if self._db is None:
                return
            path = os.path.abspath(path)
            row = (
                *_ints(identity),
                SCHEME,
                digest,
                path,
                time.time(),
                _tag(identity, path, digest),
            )
            try:
                with self._db:
                    self._db.execute(
                        f"INSERT OR REPLACE INTO {_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        row,
                    )
            except sqlite3.Error as e:
                self._fail("write", e)

    def _drop(self, identity: FileIdentity, path: object) -> None:
        """Delete a row that fails its checksum (the lock is held)."""
        self._say(
            f"digest index {self.path}: the row of {path!r} fails its checksum (edited by hand "
            "or corrupted); dropped: the file is hashed again when next read"
        )
        try:
            with self._db:
                self._db.execute(f"DELETE FROM {_TABLE} WHERE dev=? AND ino=?", _ints(identity)[:2])
        except sqlite3.Error as e:
            self._fail("write", e)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ---- the file --------------------------------------------------------------------

    def _open(self) -> None:
        if self.path is None:  # an in-memory index has no file to open
            raise InternalError("the digest index has no file to open")
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._db = self._connect()
        except sqlite3.DatabaseError as e:
            if not _corrupt(e):
                self._fail("open", e)
                return
            aside = f"{self.path}.corrupt-{int(time.time())}"
            self._say(
                f"digest index {self.path} is corrupt ({e}); moved to {aside} and rebuilt: "
                "files are hashed again as they are read"
            )
            try:
                os.replace(self.path, aside)
                self._db = self._connect()
            except (OSError, sqlite3.Error) as e2:
                self._fail("rebuild", e2)
        except OSError as e:
            self._fail("open", e)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        try:
            # Rows are keyed by (dev, ino): a file that changes replaces its own row.
            db.execute(
                f"CREATE TABLE IF NOT EXISTS {_TABLE} (dev INTEGER, ino INTEGER, size INTEGER, "
                "mtime_ns INTEGER, ctime_ns INTEGER, scheme TEXT, digest TEXT, path TEXT, "
                "seen REAL, tag TEXT, PRIMARY KEY (dev, ino))"
            )
            db.commit()
            (count,) = db.execute(f"SELECT count(*) FROM {_TABLE}").fetchone()
            if count > _PRUNE_ABOVE:
                with db:
                    db.execute(
                        f"DELETE FROM {_TABLE} WHERE rowid IN (SELECT rowid FROM {_TABLE} "
                        "ORDER BY seen LIMIT ?)",
                        (count - _PRUNE_ABOVE // 2,),
                    )
        except BaseException:
            db.close()
            raise
        return db

    def _fail(self, what: str, e: BaseException) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        self._say(
            f"digest index {self.path}: cannot {what} it ({e}); this process keeps digests in "
            "memory only (a new process hashes files again). Set NOSTALL_CACHE_DIR or "
            "cache_dir= to a writable folder"
        )

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("%s", message)


def _ints(i: FileIdentity) -> tuple[int, ...]:
    # SQLite integers are 64-bit signed; a device or inode number above that (some
    # network filesystems) is stored as its two's complement.
    return tuple(
        v - (1 << 64) if v >= 1 << 63 else v for v in (i.dev, i.ino, i.size, i.mtime_ns, i.ctime_ns)
    )


def _tag(identity: FileIdentity, path: object, digest: object) -> str:
    """A row's checksum: of its scheme, identity, path and digest. Not a secret (it
    catches edits and corruption, not a forger)."""
    text = f"{SCHEME}|{identity.key()}|{path}|{digest}"
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"nostall-digests").hexdigest()


def _corrupt(e: sqlite3.DatabaseError) -> bool:
    text = str(e).lower()
    return "not a database" in text or "malformed" in text or "corrupt" in text
