"""StreamWriter: a safetensors file written one tensor at a time, read back by safetensors."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from nostall.errors import ArgumentError, NostallError
from nostall.store.header import read_header
from nostall.store.writer import StreamWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "q": torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn),
        "i": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def test_round_trip_through_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    ts = _tensors()
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()]
    with StreamWriter(path, entries, {"k": "v"}) as w:
        for k, v in ts.items():
            w.write(k, v)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        for k, v in ts.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(
                got.view(torch.uint8), v.contiguous().view(torch.uint8)
            )
    header = read_header(path)  # nostall's own validator accepts it too
    assert [e.name for e in header.tensors] == list(ts)
    assert header.data_start % 8 == 0  # JSON padded as the library pads it


def test_order_sizes_and_completeness_are_enforced(tmp_path):
    path = tmp_path / "x.safetensors"
    w = StreamWriter(path, [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
    with pytest.raises(ArgumentError, match="expected tensor 'a'"):
        w.write("b", torch.zeros(3))
    with pytest.raises(ArgumentError, match="bytes"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(ArgumentError, match="not written"):
        w.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ArgumentError, match="twice"):
        StreamWriter(path, [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])


def test_an_error_inside_the_block_leaves_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError), StreamWriter(path, [("a", torch.float32, (2,))]):
        raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []
    with pytest.raises(NostallError):  # an unwritable place is a typed error
        StreamWriter(tmp_path / "no" / "x.safetensors", [("a", torch.float32, (2,))])
