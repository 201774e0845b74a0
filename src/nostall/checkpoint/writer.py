"""Write a safetensors file one tensor at a time (bounded memory).

``safetensors.torch.save_file`` needs every tensor in memory at once; a 24 GB
checkpoint converted that way needs 24 GB of RAM. The format only needs the header
first: the names, dtypes and shapes (hence every byte range) are known before any
data is written, so :class:`StreamWriter` writes the header, then each tensor's bytes
in order, under a temporary name that is renamed into place by :meth:`close` (an
error or :meth:`abort` leaves nothing under either name). The header follows the
library's own writer: JSON padded with spaces to a multiple of 8 bytes, data ranges
back to back in the declared order; ``safetensors.safe_open`` reads the result.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence

import torch

from nostall.checkpoint.dtypes import BITS, dtype_name
from nostall.errors import ArgumentError, CheckpointError

__all__ = ["StreamWriter"]


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
        try:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in close/abort)
            self._file.write(len(raw).to_bytes(8, "little"))
            self._file.write(raw)
        except OSError as e:
            self._discard()
            raise CheckpointError(f"cannot write: {e.strerror or e}", path=self._tmp) from e

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
            raise CheckpointError(f"cannot write: {e.strerror or e}", path=self._tmp) from e
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
        except OSError as e:
            self._discard()
            raise CheckpointError(f"cannot finish: {e.strerror or e}", path=self.path) from e

    def abort(self) -> None:
        """Drop the partial file. Idempotent."""
        self._discard()

    def _discard(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None and not f.closed:
            f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
