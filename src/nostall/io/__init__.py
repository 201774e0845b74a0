"""Storage → host memory: parallel ``preadv`` and ``O_DIRECT`` readers."""

from nostall.io.backends import BufferedBackend, DirectBackend, open_backend
from nostall.io.base import DEFAULT_BLOCK_BYTES, ReadBackend, backend, register_backend
from nostall.io.reader import Cancelled, ParallelReader, ReadHandle, ReadRequest

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "BufferedBackend",
    "Cancelled",
    "DirectBackend",
    "ParallelReader",
    "ReadBackend",
    "ReadHandle",
    "ReadRequest",
    "backend",
    "open_backend",
    "register_backend",
]
