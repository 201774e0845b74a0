"""LoadPlan's views: the tensors a load returns, as views of one flat buffer."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from nostall.store import resolve
from nostall.transfer.plan import LoadPlan

from support import assert_same


def _three_call_views(plan: LoadPlan, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """``LoadPlan.views`` as it was written first: a slice, a dtype view, a shape view."""
    out = {}
    for s in plan.slots:
        if s.numel == 0:
            out[s.name] = torch.empty(s.shape, dtype=s.target, device=flat.device)
        else:
            out[s.name] = flat[s.offset : s.offset + s.target_bytes].view(s.target).view(s.shape)
    return out


def _assert_same_views(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        t = got[name]
        assert (t.dtype, t.shape, t.stride()) == (r.dtype, r.shape, r.stride()), name
        assert t.is_contiguous(), name
        if r.numel():
            assert t.data_ptr() == r.data_ptr(), name
            assert t.untyped_storage().data_ptr() == r.untyped_storage().data_ptr(), name
            assert t.storage_offset() * t.itemsize == r.storage_offset() * r.itemsize, name


@pytest.fixture
def plan_file(tmp_path, tensors):
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("mirror_file", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 8, 3], ids=["own", "into-at-8", "into-at-3"])
def test_views_are_the_three_call_views(plan_file, tensors, mirror_file, dtype, start):
    # into= buffers may start anywhere in their storage; at an offset a dtype cannot
    # start at (3), every tensor takes the three calls and fails or succeeds as they do.
    plan = LoadPlan(resolve(plan_file), dtype, mirror_file=mirror_file)
    storage = torch.arange(start + plan.target_bytes + 64, dtype=torch.int64).to(torch.uint8)
    flat = storage[start : start + plan.target_bytes]
    try:
        ref = _three_call_views(plan, flat)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            plan.views(flat)
        return
    got = plan.views(flat)
    _assert_same_views(got, ref)
    flat.fill_(0x5A)  # the same memory: writes through the buffer show in both
    assert_same(got, ref)


def test_views_of_a_buffer_too_short_fail_as_before(plan_file):
    plan = LoadPlan(resolve(plan_file))
    flat = torch.zeros(plan.target_bytes + 4096, dtype=torch.uint8)[: plan.target_bytes - 8]
    with pytest.raises(RuntimeError):
        _three_call_views(plan, flat)
    # The storage holds the bytes, the buffer does not: still refused.
    with pytest.raises(RuntimeError):
        plan.views(flat)


def _misaligned_file(path) -> None:
    """Three u8 bytes, float32s at data offset 3 (no float view can start there), and
    bf16s at offset 20, after a byte of padding."""
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [3, 19]},
        "c": {"dtype": "BF16", "shape": [4], "data_offsets": [20, 28]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = bytes([1, 2, 3]) + torch.arange(4.0).numpy().tobytes() + b"\0"
    data += torch.arange(4.0).bfloat16().view(torch.int16).numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_source_views_of_misaligned_tensors_are_copies_with_the_file_values(tmp_path):
    path = tmp_path / "odd.safetensors"
    _misaligned_file(path)
    plan = LoadPlan(resolve(path), mirror_file=True)
    host = torch.zeros(plan.host_bytes, dtype=torch.uint8)
    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    host[: raw.numel()] = raw
    got = plan.source_views(host)
    assert_same(
        got,
        {
            "a": torch.tensor([1, 2, 3], dtype=torch.uint8),
            "b": torch.arange(4.0).view(2, 2),
            "c": torch.arange(4.0).bfloat16(),
        },
    )
    base = host.data_ptr()
    assert got["a"].data_ptr() - base == plan.slots[0].begin  # a view, where the file has it
    assert not base <= got["b"].data_ptr() < base + host.numel()  # a copy: misaligned
    assert got["c"].data_ptr() - base == plan.slots[2].begin


def test_source_views_are_views_of_the_host_buffer(plan_file, tensors):
    plan = LoadPlan(resolve(plan_file), mirror_file=True)
    host = torch.zeros(plan.host_bytes, dtype=torch.uint8)
    raw = torch.frombuffer(bytearray(plan_file.read_bytes()), dtype=torch.uint8)
    host[: raw.numel()] = raw
    got = plan.source_views(host)
    assert_same(got, tensors)
    for s in plan.slots:
        if s.end > s.begin:
            assert got[s.name].data_ptr() == host.data_ptr() + plan.host_base[s.file] + s.begin
