from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from nostall.errors import CheckpointError, ReadError
from nostall.store import BITS, nbytes_of, parse_header, read_header, to_torch


def write_raw(path, header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length))
        f.write(raw)
        f.write(data)
    return str(path)


def test_reads_what_safetensors_writes(ckpt_file, tensors):
    index = read_header(ckpt_file)
    assert {e.name for e in index.tensors} == set(tensors)
    assert index.metadata == {"format": "pt", "origin": "test"}
    for e in index.tensors:
        t = tensors[e.name]
        assert e.shape == tuple(t.shape)
        assert to_torch(e.dtype) == t.dtype
        assert e.nbytes == t.numel() * t.element_size()
        assert index.data_start <= e.begin <= e.end <= index.data_end <= index.file_size
    begins = [e.begin for e in index.tensors]
    assert begins == sorted(begins)


def test_every_format_dtype_has_a_size():
    assert {
        "F8_E4M3",
        "F8_E5M2",
        "BOOL",
        "U8",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "F4",
    } <= BITS.keys()
    assert nbytes_of("F4", (3,)) is None  # 12 bits: not whole bytes
    assert nbytes_of("F4", (4,)) == 2
    assert nbytes_of("F6_E2M3", (4,)) == 3
    assert nbytes_of("BF16", ()) == 2  # scalar
    assert nbytes_of("F32", (0, 7)) == 0


def test_scalar_and_empty(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"s": torch.tensor(1.0), "e": torch.empty(0, 3)}, str(path))
    entries = {e.name: e for e in read_header(path).tensors}
    assert entries["s"].shape == () and entries["s"].nbytes == 4
    assert entries["e"].shape == (0, 3) and entries["e"].nbytes == 0


def _one(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        (_one(dtype="F33"), b"\0" * 8, "unknown dtype 'F33'"),
        (_one(dtype=["F32"]), b"\0" * 8, "unknown dtype"),  # unhashable: no TypeError
        (_one(shape=(3,)), b"\0" * 8, "needs 12 bytes"),
        (_one(offsets=(0, 16)), b"\0" * 8, "outside the data section"),
        (_one(offsets=(8, 4)), b"\0" * 8, "outside the data section"),
        (_one(shape=(-1,)), b"\0" * 8, "non-negative integers"),
        (_one(shape=(True,)), b"\0" * 8, "non-negative integers"),
        (_one(offsets=(0,)), b"\0" * 8, r"\[begin, end\]"),
        ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "lacks"),
        ({"t": 5}, b"", "must be a JSON object"),
        ([1, 2], b"", "must be a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", "strings to strings"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
    ],
)
def test_malformed_headers_name_file_and_tensor(tmp_path, header, data, match):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=match) as info:
        read_header(path)
    assert info.value.path == path
    assert path in str(info.value)
    if isinstance(header, dict) and "t" in header and isinstance(header["t"], dict):
        assert info.value.tensor == "t"


def test_not_json(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", b"{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(path)
    path = write_raw(tmp_path / "bad.safetensors", b'{"\xff": 1}')
    with pytest.raises(CheckpointError, match="not valid UTF-8"):
        read_header(path)


_LONG_INT = "1" * 5000  # past Python's 4300-digit limit for int(str)

HOSTILE_JSON = {
    "nested arrays": b"[" * 100_000 + b"]" * 100_000,
    "nested objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "nested shape": (
        b'{"t":{"dtype":"F32","data_offsets":[0,0],"shape":' + b"[" * 50_000 + b"]" * 50_000 + b"}}"
    ),
    "long int in shape": (
        b'{"t":{"dtype":"F32","data_offsets":[0,0],"shape":[0,' + _LONG_INT.encode() + b"]}}"
    ),
    "long int in metadata": b'{"__metadata__":{"a":' + _LONG_INT.encode() + b"}}",
    "long negative int": b'{"t":-' + _LONG_INT.encode() + b"}",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_hostile_json_is_a_checkpoint_error(tmp_path, case):
    # json.loads raises RecursionError / a bare ValueError here, not JSONDecodeError.
    path = write_raw(tmp_path / "bad.safetensors", HOSTILE_JSON[case])
    with pytest.raises(CheckpointError, match="header") as info:
        read_header(path)
    assert info.value.path == path
    assert isinstance(info.value.__cause__, (RecursionError, ValueError))
    assert "download or save it again" in str(info.value)
    assert len(str(info.value)) < 1000  # the 5000 digits are not echoed


# Shapes torch refuses even when a zero dimension makes the tensor empty (nbytes 0,
# so the data_offsets check alone lets them through).
OVERFLOWING_SHAPES = [
    [0, 2**70],
    [2**70, 0],
    [0, 2**63],
    [2**40, 2**40, 0],
    [0, 2**62, 2],
    [2**62, 2, 0],  # torch accepts this one; the rule is the product of non-zero dims
    [0, *([2**16] * 4)],
]


@pytest.mark.parametrize("shape", OVERFLOWING_SHAPES, ids=str)
def test_overflowing_shape_names_the_tensor(tmp_path, shape):
    path = write_raw(tmp_path / "bad.safetensors", _one(shape=shape, offsets=(0, 0)))
    with pytest.raises(CheckpointError, match=r"2\*\*63 - 1") as info:
        read_header(path)
    assert info.value.tensor == "t" and info.value.path == path


@pytest.mark.parametrize("dtype", ["F32", "U8", "F64", "BF16"])
@pytest.mark.parametrize(
    "shape",
    [[0, 2**63 - 1], [2**31, 2**31, 0], [0, 2**62, 1], [3, 0, 2**61], [2**32, 2**31 - 1, 0]],
)
def test_empty_shapes_at_the_limit_are_accepted_and_torch_builds_them(tmp_path, dtype, shape):
    path = write_raw(tmp_path / "ok.safetensors", _one(dtype=dtype, shape=shape, offsets=(0, 0)))
    (entry,) = read_header(path).tensors
    assert torch.empty(entry.shape, dtype=to_torch(dtype)).numel() == 0


_dims = st.sampled_from([0, 1, 3, 2**31, 2**32, 2**40, 2**61, 2**62, 2**63 - 1, 2**63, 2**64])


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(sorted(BITS)),
    shape=st.lists(_dims, min_size=1, max_size=4).map(lambda s: [*s, 0]),
    order=st.randoms(use_true_random=False),
)
def test_accepted_empty_shapes_never_fail_in_torch(dtype, shape, order):
    """A zero-size shape the header check accepts builds in torch (the loader makes
    zero-byte tensors with torch.empty); one it refuses breaks the int64 rule."""
    order.shuffle(shape)
    raw = json.dumps(_one(dtype=dtype, shape=shape, offsets=(0, 0))).encode()
    product = 1
    for d in shape:
        product *= d or 1
    try:
        parse_header(raw, file_size=8 + len(raw))
    except CheckpointError as e:
        assert e.tensor == "t"
        assert product > 2**63 - 1
        return
    assert product <= 2**63 - 1
    assert torch.empty(shape, dtype=to_torch(dtype) or torch.uint8).numel() == 0


def test_header_length_beyond_file(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", _one(), b"\0" * 8, length=10_000)
    with pytest.raises(CheckpointError, match="goes beyond the file"):
        read_header(path)


def test_absurd_header_length(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", b"{}", length=2**63)
    with pytest.raises(CheckpointError, match="goes beyond"):
        read_header(path)


def test_truncated_below_eight_bytes(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        read_header(path)


def test_truncated_data(ckpt_file):
    raw = ckpt_file.read_bytes()
    ckpt_file.write_bytes(raw[:-3])
    with pytest.raises(CheckpointError, match="outside the data section"):
        read_header(ckpt_file)


def test_unreadable_file(ckpt_file, monkeypatch):
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if os.fspath(path) == str(ckpt_file):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    # Tests run as root, whom chmod does not stop.
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ReadError, match="Permission denied") as info:
        read_header(ckpt_file)
    assert info.value.path == str(ckpt_file)


def _special_files(tmp_path):
    """Paths of a FIFO, /dev/zero, /dev/urandom, a socket and a folder, by kind."""
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    out = {"FIFO": fifo, "folder": tmp_path / "dir.safetensors"}
    out["folder"].mkdir()
    for dev in ("/dev/zero", "/dev/urandom"):
        if os.path.exists(dev):
            out["character device " + dev] = Path(dev)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "s.safetensors"))
    sock.close()
    out["socket"] = tmp_path / "s.safetensors"
    return out


@pytest.mark.timeout(10)
def test_special_files_are_refused_without_opening(tmp_path):
    # Before the check, open() on the FIFO blocked forever waiting for a writer.
    for kind, path in _special_files(tmp_path).items():
        with pytest.raises(CheckpointError, match="not a regular file") as info:
            read_header(path)
        assert info.value.path == str(path)
        assert kind.split()[0].lower() in str(info.value).lower()


def test_zero_byte_tensors_may_share_offsets(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    path = write_raw(tmp_path / "ok.safetensors", header, b"\0" * 8)
    assert len(read_header(path)) == 2


_dtypes = st.sampled_from(sorted(BITS))
_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(st.tuples(_dtypes, _shapes, st.integers(0, 3)), min_size=0, max_size=6),
    slack=st.integers(-3, 3),
)
def test_parser_accepts_exactly_the_consistent_headers(specs, slack):
    """Lay tensors out back to back (with random gaps); a consistent header parses and
    round-trips its offsets; a data section cut short or a wrong size is refused."""
    header, offset, expect_ok = {}, 0, True
    for i, (dtype, shape, gap) in enumerate(specs):
        n = nbytes_of(dtype, tuple(shape))
        if n is None:
            expect_ok = False
            n = 1
        offset += gap
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    data_size = offset + slack
    if data_size < 0:
        return
    if slack < 0 and any(v["data_offsets"][1] > data_size for v in header.values()):
        expect_ok = False
    file_size = 8 + len(raw) + data_size
    if expect_ok:
        index = parse_header(raw, file_size=file_size)
        got = {
            e.name: (e.begin - index.data_start, e.end - index.data_start) for e in index.tensors
        }
        assert got == {k: tuple(v["data_offsets"]) for k, v in header.items()}
        assert index.data_end <= file_size
    else:
        with pytest.raises(CheckpointError):
            parse_header(raw, file_size=file_size)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(raw):
    with contextlib.suppress(CheckpointError):
        parse_header(raw, file_size=8 + len(raw) + 64)
