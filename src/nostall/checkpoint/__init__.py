"""Safetensors headers, shard indexes and component folders: what to read, and where."""

from nostall.checkpoint.dtypes import BITS, dtype_name, nbytes_of, to_torch
from nostall.checkpoint.header import FileIndex, TensorEntry, parse_header, read_header
from nostall.checkpoint.layout import Checkpoint, resolve

__all__ = [
    "BITS",
    "Checkpoint",
    "FileIndex",
    "TensorEntry",
    "dtype_name",
    "nbytes_of",
    "parse_header",
    "read_header",
    "resolve",
    "to_torch",
]
