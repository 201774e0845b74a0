"""Storage → host memory: parallel ``preadv`` and ``O_DIRECT`` readers."""

from nostall.io.backends import BufferedBackend, DirectBackend, open_backend
from nostall.io.base import DEFAULT_BLOCK_BYTES, ReadBackend
from nostall.io.reader import ParallelReader, ReadHandle, ReadRequest, cpu_count

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "BufferedBackend",
    "DirectBackend",
    "ParallelReader",
    "ReadBackend",
    "ReadHandle",
    "ReadRequest",
    "cpu_count",
    "open_backend",
]
