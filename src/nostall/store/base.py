"""Storage → host memory: one read strategy per file behind a small base class.

A backend opens a file and fills byte ranges of it into host memory, in
``block_bytes`` system calls. Backends never allocate: the bytes land in the
caller's buffer (a pinned pool block or a staging slot), which becomes the
tensors — there is no bounce copy. ``os.preadv`` releases the GIL, so many
threads read one file at once.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from abc import ABC, abstractmethod

# UnsupportedBackend lives in the one error tree; it stays importable from here.
from nostall.errors import ArgumentError, CheckpointError, ReadError, UnsupportedBackend

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "REMOTE_RANGE_BYTES",
    "REMOTE_SUFFIX",
    "ReadBackend",
    "UnsupportedBackend",
    "require_regular",
]

# MuseAI's figure: 2 MiB requests need 1/16 of the syscalls of 128 KiB ones, and
# sequential 2 MiB reads keep a disk's queue full without hurting latency.
DEFAULT_BLOCK_BYTES = 2 << 20

# A mirror of object storage (nostall.store.mirror) leaves ``<file>.safetensors.remote``
# where a weight file it has not downloaded would be: the object's URL, size, ETag and
# header. A checkpoint's FileIndex then names the stub; its data is read remotely.
REMOTE_SUFFIX = ".remote"
# One ranged GET from object storage: large enough that a request's overhead (botocore's
# signing and parsing, ~2-6 ms of Python under the GIL, and a round trip) is small
# against its bytes at GB/s, small enough that a 1 GB checkpoint still spreads over 64
# connections.
REMOTE_RANGE_BYTES = 16 << 20

log = logging.getLogger(__name__)


class ReadBackend(ABC):
    """Reads byte ranges of one open file into caller-owned memory.

    ``alignment`` is what the destination address, the file offset and the length
    of every request must be multiples of (1 for buffered reads). ``degraded`` is
    ``None``, or a sentence saying which strategy was asked for and why this one
    runs instead (set by :func:`~nostall.store.open_backend` on a fallback).
    """

    name: str = ""
    alignment: int = 1
    degraded: str | None = None

    def __init__(self, path: str, *, block_bytes: int = DEFAULT_BLOCK_BYTES):
        if block_bytes <= 0 or block_bytes % 4096:
            raise ArgumentError(f"block_bytes={block_bytes} must be a positive multiple of 4096")
        self.path = path
        self.block_bytes = block_bytes
        self._realign_logged = False
        # Checked before opening: open() of a FIFO blocks until a writer appears, and a
        # device such as /dev/zero never ends.
        try:
            require_regular(os.stat(path).st_mode, path)
        except OSError as e:
            raise open_error(path, e) from e
        self.fd = self._open(path)
        try:
            st = os.fstat(self.fd)
            require_regular(st.st_mode, path)  # swapped since the stat
        except BaseException:
            self.close()
            raise
        self.size = st.st_size

    @abstractmethod
    def _open(self, path: str) -> int:
        """Open the file; raise :class:`UnsupportedBackend` if the strategy is refused."""

    def read_into(
        self, dest: memoryview, offset: int, *, cancel: threading.Event | None = None
    ) -> int:
        """Fill ``dest`` from file ``offset`` on, in ``block_bytes`` requests.

        Stops at end of file (or when ``cancel`` is set); returns the bytes read.
        Short reads are retried; whether an early end of file is an error is the
        caller's call (see :meth:`read_exact`). With ``alignment > 1``, ``dest``,
        ``offset`` and ``len(dest)`` must be aligned, and every request issued stays
        aligned: a short read that stops off the alignment ends the loop at end of
        file, and mid-file is read again from the last aligned byte.
        """
        done = 0
        total = len(dest)
        align = self.alignment
        stalled_at = -1
        while done < total and not (cancel is not None and cancel.is_set()):
            n = min(self.block_bytes, total - done)
            got = self._pread(dest[done : done + n], offset + done)
            if got == 0:
                break
            done += got
            if got == n or done % align == 0:
                continue
            # Short and off the alignment: the next O_DIRECT request from here would
            # fail with EINVAL. At end of file every byte there is has arrived.
            if offset + done >= os.fstat(self.fd).st_size:
                break
            # Mid-file (some network and FUSE file systems cut reads short): keep the
            # aligned part and read the partial block again.
            restart = done - done % align
            if restart == stalled_at:
                raise ReadError(
                    f"direct reads at offset {offset + restart} keep returning less than the "
                    f"{align}-byte alignment mid-file ({got} bytes); this file system cuts "
                    "O_DIRECT reads short: load with read_mode='buffered'",
                    path=self.path,
                )
            if not self._realign_logged:
                self._realign_logged = True
                log.warning(
                    "%s: a direct read at offset %d returned %d bytes mid-file; reading "
                    "again from offset %d (logged once per file)",
                    self.path,
                    offset + done - got,
                    got,
                    offset + restart,
                )
            stalled_at = restart
            done = restart
        return done

    def read_exact(
        self, dest: memoryview, offset: int, expected: int, *, cancel: threading.Event | None = None
    ) -> None:
        """Like :meth:`read_into`, but the first ``expected`` bytes must all arrive."""
        got = self.read_into(dest, offset, cancel=cancel)
        if got < expected and not (cancel is not None and cancel.is_set()):
            raise CheckpointError(
                f"file ended at byte {offset + got} while {offset + expected} were expected; "
                "it was truncated or replaced while loading",
                path=self.path,
            )

    def _pread(self, dest: memoryview, offset: int) -> int:
        try:
            return os.preadv(self.fd, [dest], offset)
        except InterruptedError:
            return self._pread(dest, offset)
        except OSError as e:
            raise ReadError(
                f"read of {len(dest)} bytes at offset {offset} failed: {e.strerror or e}",
                path=self.path,
            ) from e

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ReadBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# stat.filemode's type letter → words for the message.
_KINDS = {
    "d": "a folder",
    "p": "a FIFO (named pipe)",
    "c": "a character device",
    "b": "a block device",
    "s": "a socket",
}


def require_regular(mode: int, path: str, *, what: str = "file to read") -> None:
    """Raise :class:`~nostall.CheckpointError` unless ``mode`` (an ``st_mode``) is a
    regular file: a FIFO blocks ``open()`` until a writer appears, and a device such
    as ``/dev/zero`` never ends."""
    if stat.S_ISREG(mode):
        return
    kind = _KINDS.get(stat.filemode(mode)[0], "a special file")
    raise CheckpointError(
        f"the {what} is {kind}, not a regular file; nostall reads checkpoints only from "
        "regular files (a pipe or a device can block or never end): point at the file "
        "itself, or copy the data into a regular file first",
        path=path,
    )


def open_error(path: str, e: OSError) -> ReadError:
    what = "permission denied" if e.errno == errno.EACCES else (e.strerror or str(e))
    return ReadError(f"cannot open for reading: {what}", path=path)
