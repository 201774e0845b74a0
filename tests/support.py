"""Helpers shared by the test modules (import as ``from support import ...``).

One tiny tensor dict covering every dtype and edge shape, reused everywhere.
"""

from __future__ import annotations

import re

import torch


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp64/32/16, bf16, both fp8s, every integer width, bool, a scalar, empty tensors."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": torch.randn(17, 9, generator=g),
        "f16": torch.randn(4, 4, 4, generator=g).to(torch.float16),
        "bf16": torch.randn(31, generator=g).to(torch.bfloat16),
        "f8_e4m3": torch.randn(6, 7, generator=g).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(13, generator=g).to(torch.float8_e5m2),
        "i64": torch.randint(-(2**40), 2**40, (5,), generator=g),
        "i32": torch.randint(-(2**30), 2**30, (3, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-300, 300, (11,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 8), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "scalar_i64": torch.tensor(-7),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
    }
    for name, dt in (("u16", "uint16"), ("u32", "uint32"), ("u64", "uint64")):
        if hasattr(torch, dt):
            out[name] = torch.randint(0, 60000, (7,), generator=g).to(getattr(torch, dt))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (compare bit for bit, NaN-safe, for dtypes without torch.equal)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for k, r in ref.items():
        t = got[k]
        assert t.dtype == r.dtype, k
        assert t.shape == r.shape, k
        assert torch.equal(bits(t), bits(r)), k


def make_sharded(folder, tensors, stem="model", shards=2):
    """Write ``tensors`` as ``shards`` files plus a ``<stem>.safetensors.index.json``."""
    import json

    from safetensors.torch import save_file

    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"{stem}-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    index = folder / f"{stem}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def skip_unless_read_mode_runs(mode: str, folder) -> None:
    """Skip unless files in ``folder`` can be read with ``mode`` as asked: ``"direct"``
    needs a file system that takes ``O_DIRECT`` (tmpfs and some overlay or FUSE mounts
    refuse it, and nostall would then read buffered: a case parametrised as "direct"
    must not silently test buffered reads). Probed with plain ``os`` calls."""
    import errno
    import mmap
    import os
    import tempfile

    import pytest

    if mode != "direct":
        return
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        pytest.skip("read mode 'direct' cannot run: this platform has no O_DIRECT")
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".o-direct-probe-")
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(4096))
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(probe, os.O_RDONLY | flag)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        pytest.skip(f"read mode 'direct' cannot run: {folder} refuses O_DIRECT ({e.strerror})")
    finally:
        buf.close()
        os.unlink(probe)


def squashed(text: str) -> str:
    """``text`` without whitespace or rich's box characters: what a console printed, as
    it reads whatever the terminal's width and the temporary paths' lengths wrapped."""
    return re.sub(r"[\s│╭╮╰╯─]+", "", text)


# ``python -m nostall.cli`` as the code of a process forked by the conftest's
# ``fork_python`` (``sys.argv[1:]``: the command's arguments).
CLI_MAIN = "import runpy; runpy.run_module('nostall.cli', run_name='__main__', alter_sys=True)"
