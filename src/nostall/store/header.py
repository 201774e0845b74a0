"""Parse and validate the header of one safetensors file.

The format: 8 bytes little-endian header length ``N``, then ``N`` bytes of JSON,
then the data section. The JSON maps each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the data section) and may
carry ``"__metadata__"``: a ``str → str`` map. We check everything a reader
relies on before a single byte of data is read, so that a malformed file fails
fast with the file and tensor named, instead of crashing a copy later.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import struct
from dataclasses import dataclass, field

from nostall.errors import CheckpointError, ReadError
from nostall.store.base import REMOTE_SUFFIX
from nostall.store.digest import FileIdentity
from nostall.store.dtypes import BITS, nbytes_of
from nostall.store.files import open_regular, parse_json

__all__ = [
    "MAX_HEADER_BYTES",
    "FileIndex",
    "TensorEntry",
    "parse_header",
    "read_header",
]

# safetensors refuses headers above 100 MB; a larger length is a corrupt file,
# and refusing it keeps a bad length from allocating gigabytes.
MAX_HEADER_BYTES = 100_000_000

# torch keeps sizes, strides and element counts in int64 and checks them even for
# an empty tensor: torch.empty([0, 2**63]) cannot unpack the size, torch.empty([2**40,
# 2**40, 0]) raises "Storage size calculation overflowed" and torch.empty([0, 2**62, 2])
# "Stride calculation overflowed". A shape whose non-zero dimensions multiply to at
# most this passes all three (checked against torch 2.14 by test_header).
_MAX_INT64 = 2**63 - 1

# Shapes and offsets in messages: a corrupt header can hold thousands of 4300-digit numbers.
_short = reprlib.Repr()
_short.maxlist = 8
_short.maxlong = 40


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives inside a file.

    Attributes:
        name: the tensor's key.
        dtype: the safetensors dtype name (``"BF16"``).
        shape: the tensor's shape; ``()`` for a scalar.
        begin: offset of its first byte, counted from the start of the *file*.
        end: offset one past its last byte, counted from the start of the file.
        stored: the tensor's key in the file, where it is read under another name
            (:mod:`nostall.store.names`); ``None`` when ``name`` is that key.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    stored: str | None = None

    @property
    def key(self) -> str:
        """The tensor's key in the file (what ``safetensors.safe_open`` reads it by)."""
        return self.stored or self.name

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileIndex:
    """The validated header of one safetensors file.

    Attributes:
        path: the file.
        file_size: its size in bytes when the header was read.
        data_start: file offset of the data section (``8 + header length``).
        data_end: file offset one past the last tensor byte (``<= file_size``).
        tensors: entries in file order (ascending ``begin``).
        metadata: the ``__metadata__`` map, empty when absent.
        identity: the file's identity when its header was read (``fstat`` of the same
            descriptor); a load compares it before and after reading the data, so a
            file replaced or rewritten meanwhile is an error, never mixed bytes.
    """

    path: str
    file_size: int
    data_start: int
    data_end: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] = field(default_factory=dict)
    identity: FileIdentity | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def data_bytes(self) -> int:
        return self.data_end - self.data_start


def read_header(path: str | os.PathLike) -> FileIndex:
    """Read and validate the header of the safetensors file at ``path``.

    Raises :class:`~nostall.CheckpointError` naming the file (and the tensor) for
    anything malformed, :class:`~nostall.ReadError` when the OS refuses the read.

    >>> index = read_header("model.safetensors")  # doctest: +SKIP
    >>> index.tensors[0].name, index.data_bytes  # doctest: +SKIP
    ('proj.weight', 23782131712)
    """
    path = os.fspath(path)
    stub = path + REMOTE_SUFFIX
    if path.endswith(".safetensors") and not os.path.exists(path) and os.path.isfile(stub):
        return _read_stub_header(stub)
    try:
        with open_regular(path, what="safetensors file") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"file is {size} bytes, too short to hold the 8-byte header length; "
                    "it is truncated or not a safetensors file",
                    path=path,
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"header length {n} bytes goes beyond the file ({size} bytes) or the "
                    f"{MAX_HEADER_BYTES}-byte limit; the file is truncated or not safetensors",
                    path=path,
                )
            raw = f.read(n)
    except OSError as e:
        raise ReadError(f"cannot read the header: {e.strerror or e}", path=path) from e
    if len(raw) != n:
        raise CheckpointError(f"header is cut short: read {len(raw)} of {n} bytes", path=path)
    return dataclasses.replace(
        parse_header(raw, file_size=size, path=path), identity=FileIdentity.of(st)
    )


def _read_stub_header(stub: str) -> FileIndex:
    """The FileIndex of a remote weight file, from its mirror stub (a JSON document whose
    ``head`` is the object's first ``8 + header length`` bytes, hex)."""
    try:
        with open_regular(stub, what="remote stub") as f:
            st = os.fstat(f.fileno())
            doc = parse_json(
                f.read(),
                what="remote stub",
                fix="open the s3:// URL again to rebuild the mirror",
                path=stub,
            )
        head = bytes.fromhex(doc["head"])
        size = int(doc["size"])
    except OSError as e:
        raise ReadError(f"cannot read the remote stub: {e.strerror or e}", path=stub) from e
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"remote stub lacks a field ({e}); open the s3:// URL again to rebuild the mirror",
            path=stub,
        ) from e
    return dataclasses.replace(
        parse_header(head[8:], file_size=size, path=stub), identity=FileIdentity.of(st)
    )


def parse_header(raw: bytes, *, file_size: int, path: str = "<bytes>") -> FileIndex:
    """Validate a header's JSON bytes against a file of ``file_size`` bytes.

    >>> raw = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    >>> parse_header(raw, file_size=8 + len(raw) + 8).tensors[0].end - 8 - len(raw)
    8
    """
    data_start = 8 + len(raw)
    doc = parse_json(
        raw,
        what="header",
        fix="the file is corrupt or not safetensors; download or save it again",
        path=path,
    )
    if not isinstance(doc, dict):
        raise CheckpointError(f"header must be a JSON object, got {type(doc).__name__}", path=path)

    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError("__metadata__ must map strings to strings", path=path)

    data_size = file_size - data_start
    entries = [_entry(name, info, data_start, data_size, path) for name, info in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    # Zero-byte tensors may share an offset with anything; only real bytes can collide.
    previous: TensorEntry | None = None
    for e in entries:
        if e.nbytes == 0:
            continue
        if previous is not None and e.begin < previous.end:
            raise CheckpointError(
                f"bytes [{e.begin - data_start}, {e.end - data_start}) overlap tensor "
                f"{previous.name!r} at [{previous.begin - data_start}, "
                f"{previous.end - data_start}); the header is corrupt",
                path=path,
                tensor=e.name,
            )
        previous = e
    data_end = max((e.end for e in entries), default=data_start)
    return FileIndex(
        path=path,
        file_size=file_size,
        data_start=data_start,
        data_end=data_end,
        tensors=tuple(entries),
        metadata=dict(metadata),
    )


def _entry(name: str, info: object, data_start: int, data_size: int, path: str) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError("entry must be a JSON object", path=path, tensor=name)
    missing = {"dtype", "shape", "data_offsets"} - info.keys()
    if missing:
        raise CheckpointError(f"entry lacks {sorted(missing)}", path=path, tensor=name)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in BITS:
        raise CheckpointError(
            f"unknown dtype {_short.repr(dtype)}; safetensors defines {', '.join(BITS)}",
            path=path,
            tensor=name,
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(
            f"shape {_short.repr(shape)} must be a list of non-negative integers",
            path=path,
            tensor=name,
        )
    _check_int64(shape, path, name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise CheckpointError(
            f"data_offsets {_short.repr(offsets)} must be [begin, end], non-negative integers",
            path=path,
            tensor=name,
        )
    begin, end = offsets
    if begin > end or end > data_size:
        raise CheckpointError(
            f"data_offsets [{_short.repr(begin)}, {_short.repr(end)}) fall outside the data "
            f"section of {data_size} bytes; the file is truncated or its header is corrupt",
            path=path,
            tensor=name,
        )
    shape_t = tuple(shape)
    expected = nbytes_of(dtype, shape_t)
    if expected is None or expected != end - begin:
        raise CheckpointError(
            f"{dtype} {_short.repr(shape)} needs {expected} bytes but data_offsets "
            f"[{begin}, {end}) hold {end - begin}",
            path=path,
            tensor=name,
        )
    return TensorEntry(name, dtype, shape_t, data_start + begin, data_start + end)


def _check_int64(shape: list[int], path: str, name: str) -> None:
    product = 1
    for d in shape:
        if d > _MAX_INT64:
            raise CheckpointError(
                f"shape {_short.repr(shape)} has a dimension of {_short.repr(d)}, beyond the "
                "2**63 - 1 that torch can hold; the header is corrupt: download or save the "
                "file again",
                path=path,
                tensor=name,
            )
        if d:
            product *= d
            if product > _MAX_INT64:
                raise CheckpointError(
                    f"the non-zero dimensions of shape {_short.repr(shape)} multiply to more "
                    "than 2**63 - 1, past torch's int64 sizes and strides (even an empty "
                    "tensor of this shape may not build); the header is corrupt: download or "
                    "save the file again",
                    path=path,
                    tensor=name,
                )


def _is_count(x: object) -> bool:
    # bool is an int subclass in Python; `true` in a shape is corruption, not 1.
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
