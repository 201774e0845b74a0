from __future__ import annotations

import contextlib
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from nostall.checkpoint import BITS, nbytes_of, parse_header, read_header, to_torch
from nostall.errors import CheckpointError, ReadError


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
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        read_header(path)


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


def test_unreadable_file(tmp_path):
    with pytest.raises(ReadError):
        read_header(tmp_path)  # a directory: open() fails with EISDIR


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
