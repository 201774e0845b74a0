"""Write a safetensors file one tensor at a time (bounded memory).

``safetensors.torch.save_file`` needs every tensor in memory at once; a 24 GB
checkpoint converted that way needs 24 GB of RAM. The format only needs the header
first: the names, dtypes and shapes (hence every byte range) are known before any
data is written, so :class:`StreamWriter` writes the header, then each tensor's bytes
in order, under a temporary name, ``<path>.partial``, that is renamed into place by
:meth:`close` (an error or :meth:`abort` leaves nothing under either name). The
temporary file is created exclusively: an existing ``<path>.partial`` (a leftover of a
killed run, or someone's file) is refused with :class:`~nostall.ArgumentError`, never
truncated or deleted. A failed write (disk full, ``EFBIG``) is a
:class:`~nostall.CheckpointError` naming ``path`` and the errno. The header follows the
library's own writer: JSON padded with spaces to a multiple of 8 bytes, data ranges
back to back in the declared order; ``safetensors.safe_open`` reads the result.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Mapping, Sequence

import torch

from nostall.errors import ArgumentError, CheckpointError
from nostall.store.dtypes import BITS, dtype_name

__all__ = ["StreamWriter"]

# What to do about a failed write, by errno; anything else gets all three hints.
_WRITE_FIXES = {
    errno.ENOSPC: "free disk space",
    getattr(errno, "EDQUOT", -1): "free space within the disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write to a file system that "
    "takes files this large",
    errno.EACCES: "check the folder's permissions",
    errno.EPERM: "check the folder's permissions",
    errno.EROFS: "write to a writable file system",
}


def describe_write_error(e: OSError) -> str:
    """The OS's words, the errno's name and the fix: ``"File too large (EFBIG); raise
    the file-size limit (ulimit -f) ..."``."""
    code = errno.errorcode.get(e.errno or 0)
    fix = _WRITE_FIXES.get(
        e.errno or 0, "check free disk space, the file-size limit (ulimit -f) and permissions"
    )
    return f"{e.strerror or e}" + (f" ({code})" if code else "") + f"; {fix}"


class StreamWriter:
    """``entries``: ``(name, dtype, shape)`` in the order the tensors will be written."""

    def __init__(
        self,
        path: str | os.PathLike,
        entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = os.fspath(path)
        self._tmp = self.path + ".partial"
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            if name in header or name == "__metadata__":
                raise ArgumentError(f"tensor {name!r} is declared twice for {self.path}")
            code = dtype_name(dtype)
            numel = 1
            for n in shape:
                numel *= int(n)
            nbytes = numel * BITS[code] // 8
            header[name] = {
                "dtype": code,
                "shape": [int(n) for n in shape],
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._next = 0
        self._created = False  # only a temporary file this writer created is removed
        try:
            # "xb": exclusive, so an existing .partial is neither truncated nor deleted.
            self._file = open(self._tmp, "xb")  # noqa: SIM115 (closed in close/abort)
            self._created = True
            self._file.write(len(raw).to_bytes(8, "little"))
            self._file.write(raw)
        except FileExistsError as e:
            raise ArgumentError(
                f"{self._tmp!r} exists: the output is written there before it is renamed "
                f"to {self.path!r}, and a file this writer did not create is not deleted "
                "(a leftover of an interrupted run, or yours); move or delete it, then run "
                "again"
            ) from e
        except OSError as e:
            self._discard()
            raise self._failed(e, "write") from e

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next declared tensor (CPU, contiguous or not)."""
        if self._next >= len(self._order):
            raise ArgumentError(f"{name!r}: every declared tensor of {self.path} is written")
        want, nbytes = self._order[self._next]
        if name != want:
            raise ArgumentError(f"{self.path}: expected tensor {want!r} next, got {name!r}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != nbytes:
            raise ArgumentError(
                f"{self.path}: tensor {name!r} has {data.numel()} bytes, {nbytes} declared"
            )
        try:
            self._file.write(memoryview(data.numpy()))
        except OSError as e:
            self.abort()
            raise self._failed(e, "write") from e
        self._next += 1

    def close(self) -> None:
        """Finish the file and rename it into place; all declared tensors must be written."""
        if self._next != len(self._order):
            missing = [n for n, _ in self._order[self._next :]]
            self.abort()
            raise ArgumentError(f"{self.path}: not written: {missing[:5]}")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
            self._created = False  # renamed: the .partial name is no longer ours
        except OSError as e:
            self._discard()
            raise self._failed(e, "finish") from e

    def abort(self) -> None:
        """Drop the partial file. Idempotent."""
        self._discard()

    def _failed(self, e: OSError, what: str) -> CheckpointError:
        return CheckpointError(
            f"cannot {what} the file: {describe_write_error(e)}, then write it again "
            f"(nothing was left under this name or {os.path.basename(self._tmp)!r})",
            path=self.path,
        )

    def _discard(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None and not f.closed:
            # close() flushes the buffer, which fails again on a full disk; the file is
            # being thrown away, so that second error says nothing new.
            with contextlib.suppress(OSError):
                f.close()
        if getattr(self, "_created", False):
            self._created = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
