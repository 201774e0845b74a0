"""The store stage: where weights live and how their bytes reach host memory.

Safetensors headers, shard indexes and component folders (what to read, and where), the
parallel ``preadv`` / ``O_DIRECT`` readers and ranged GETs from object storage (how), and
the catalog of pipeline folders with each component's content key (:mod:`.catalog`).
"""

from nostall.store.backends import BufferedBackend, DirectBackend, open_backend
from nostall.store.base import DEFAULT_BLOCK_BYTES, ReadBackend
from nostall.store.dtypes import BITS, dtype_name, nbytes_of, to_torch
from nostall.store.header import FileIndex, TensorEntry, parse_header, read_header
from nostall.store.layout import Checkpoint, resolve
from nostall.store.reader import ParallelReader, ReadHandle, ReadRequest, cpu_count

__all__ = [
    "BITS",
    "DEFAULT_BLOCK_BYTES",
    "BufferedBackend",
    "Checkpoint",
    "DirectBackend",
    "FileIndex",
    "ParallelReader",
    "ReadBackend",
    "ReadHandle",
    "ReadRequest",
    "TensorEntry",
    "cpu_count",
    "dtype_name",
    "nbytes_of",
    "open_backend",
    "parse_header",
    "read_header",
    "resolve",
    "to_torch",
]
