"""The two read strategies: buffered ``preadv`` and ``O_DIRECT``."""

from __future__ import annotations

import errno
import logging
import mmap
import os

from nostall.errors import ArgumentError, DegradedError, UnsupportedBackend
from nostall.store.base import REMOTE_SUFFIX, ReadBackend, open_error

__all__ = ["BufferedBackend", "DirectBackend", "open_backend"]

log = logging.getLogger(__name__)


class BufferedBackend(ReadBackend):
    """Plain ``preadv`` through the page cache: the fast path when the file is cached,
    and it leaves the file cached for the next worker that restarts."""

    name = "buffered"

    def _open(self, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise open_error(path, e) from e
        if hasattr(os, "posix_fadvise"):
            # Whole-file sequential: the kernel doubles its readahead window.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd


class DirectBackend(ReadBackend):
    """``O_DIRECT`` reads: bypass the page cache (no double buffering of tens of GB,
    no eviction of other workers' files). Destination, offset and length must be
    4096-aligned; the caller reads whole aligned blocks and tolerates the short
    read at end of file."""

    name = "direct"
    alignment = 4096

    def _open(self, path: str) -> int:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            raise UnsupportedBackend("this platform has no O_DIRECT")
        try:
            return os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            if e.errno in (
                errno.EINVAL,
                errno.EOPNOTSUPP,
            ):  # EINVAL, EOPNOTSUPP: tmpfs, some FUSE/overlay mounts
                raise UnsupportedBackend(f"the file system refuses O_DIRECT ({e.strerror})") from e
            raise open_error(path, e) from e


def open_backend(path: str, mode: str, *, block_bytes: int, strict: bool = False) -> ReadBackend:
    """Open ``path`` with the strategy ``mode`` (``"buffered"``, ``"direct"``, ``"auto"``).

    ``"auto"`` is buffered (a page-cache hit is the common case in a service that
    restarts workers). ``"direct"`` is an explicit request: where the file system
    refuses it, the file is read buffered, the reason is logged, and the returned
    backend's ``degraded`` says so; with ``strict=True`` that raises
    :class:`~nostall.DegradedError` instead.

    >>> with open_backend("model.safetensors", "direct", block_bytes=2 << 20) as r:  # doctest: +SKIP
    ...     r.name, r.degraded
    ('direct', None)
    """
    if path.endswith(REMOTE_SUFFIX):
        # A mirror's stub: the bytes are in object storage (any read mode).
        from nostall.store.remote import RemoteBackend

        return RemoteBackend(path, block_bytes=block_bytes)
    if mode in ("auto", "buffered"):
        return BufferedBackend(path, block_bytes=block_bytes)
    if mode != "direct":
        raise ArgumentError(f"unknown read mode {mode!r}; choose 'auto', 'buffered' or 'direct'")
    try:
        reader = DirectBackend(path, block_bytes=block_bytes)
    except UnsupportedBackend as e:
        return _buffered_instead(path, e, block_bytes=block_bytes, strict=strict)
    try:
        _probe(reader)
    except UnsupportedBackend as e:
        reader.close()
        return _buffered_instead(path, e, block_bytes=block_bytes, strict=strict)
    except BaseException:
        reader.close()
        raise
    return reader


def _buffered_instead(
    path: str, why: UnsupportedBackend, *, block_bytes: int, strict: bool
) -> BufferedBackend:
    if strict:
        raise DegradedError(
            f"{path}: read_mode='direct' was asked for with strict=True, but {why}; load "
            "with read_mode='buffered' (or 'auto'), pass strict=False to read through the "
            "page cache and have the result say so, or keep the checkpoint on a file "
            "system that supports O_DIRECT (ext4, xfs; not tmpfs)",
            requested="read_mode='direct'",
            fallback="read_mode='buffered'",
            reason=str(why),
        ) from why
    log.warning("%s: direct I/O unavailable (%s); reading through the page cache", path, why)
    reader = BufferedBackend(path, block_bytes=block_bytes)
    reader.degraded = (
        f"{path}: read_mode='direct' was asked for, but {why}; it was read through the "
        "page cache (read_mode='buffered') instead"
    )
    return reader


def _probe(reader: DirectBackend) -> None:
    # Some mounts accept the O_DIRECT open and only refuse the first read (EINVAL).
    probe = mmap.mmap(-1, 4096)
    try:
        os.preadv(reader.fd, [probe], 0)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            raise UnsupportedBackend(f"O_DIRECT read refused ({e.strerror})") from e
        raise open_error(reader.path, e) from e
    finally:
        probe.close()
