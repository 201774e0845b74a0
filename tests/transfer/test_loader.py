from __future__ import annotations

import gc
import json
import os
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import nostall
from nostall.errors import (
    CheckpointError,
    ClosedError,
    DegradedError,
    DeviceError,
    PoolExhausted,
    ReadError,
)
from nostall.store.backends import DirectBackend
from nostall.store.base import ReadBackend, UnsupportedBackend
from nostall.transfer.loader import Loader

from support import (
    assert_same,
    bits,
    make_sharded,
    sample_tensors,
    skip_unless_read_mode_runs,
)


@pytest.fixture
def loader():
    with Loader(threads=3, block_bytes=4096, chunk_bytes=8192) as ld:
        yield ld


@pytest.fixture
def pool():
    with nostall.PinnedPool(64 << 20, slab_bytes=2 << 20, pin=False) as p:
        p.wait_pinned()
        yield p


@pytest.fixture
def big_file(tmp_path):
    # Bigger than a slab of the pool fixture, so copies and reads cross slab edges.
    t = sample_tensors()
    g = torch.Generator().manual_seed(1)
    t["big"] = torch.randn(700_000, generator=g)  # 2.8 MB
    path = tmp_path / "big.safetensors"
    save_file(t, str(path))
    return path


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_equal_to_safetensors_every_dtype(loader, ckpt_file, mode):
    skip_unless_read_mode_runs(mode, ckpt_file.parent)
    loader.read_mode = mode
    result = loader.load(ckpt_file)
    assert_same(result.tensors, load_file(str(ckpt_file)))
    assert result.metadata == {"format": "pt", "origin": "test"}
    s = result.stats
    assert s.scenario == "read" and s.path == "host"
    assert s.read_mode == mode and s.degraded == ()  # the backend the case is named for
    assert s.nbytes == sum(t.numel() * t.element_size() for t in result.tensors.values())


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_pool_read_then_memory_cache_hit(loader, pool, big_file, mode):
    skip_unless_read_mode_runs(mode, big_file.parent)
    loader.read_mode = mode
    ref = load_file(str(big_file))
    first = loader.load(big_file, pool=pool)
    assert first.stats.scenario == "read" and first.stats.path == "pool"
    assert first.stats.read_mode == mode and first.stats.degraded == ()
    assert_same(first.tensors, ref)
    second = loader.load(big_file, pool=pool)
    assert second.stats.scenario == "memory-cache hit" and second.stats.read_s == 0
    assert_same(second.tensors, ref)
    # CPU tensors from the pool own their memory: never views of the cached block
    assert first.tensors["big"].data_ptr() != second.tensors["big"].data_ptr()
    s = pool.stats()
    assert s.blocks == 1 and s.in_use == 0 and s.cached > 0


def _refuse_direct(monkeypatch):
    def refuse(self, path):
        raise UnsupportedBackend("the file system refuses O_DIRECT (test)")

    monkeypatch.setattr(DirectBackend, "_open", refuse)


@pytest.mark.parametrize("use_pool", [False, True])
def test_refused_direct_reads_buffered_and_the_stats_say_so(ckpt_file, pool, monkeypatch, use_pool):
    _refuse_direct(monkeypatch)
    with Loader(threads=2, read_mode="direct") as ld:
        result = ld.load(ckpt_file, pool=pool if use_pool else None)
    assert_same(result.tensors, load_file(str(ckpt_file)))
    s = result.stats
    assert s.read_mode == "buffered" and len(s.degraded) == 1
    said = s.degraded[0]
    assert str(ckpt_file) in said and "read_mode='direct'" in said and "(test)" in said


def test_refused_direct_with_strict_raises_and_keeps_nothing(ckpt_file, pool, monkeypatch):
    _refuse_direct(monkeypatch)
    with Loader(threads=2, read_mode="direct", strict=True) as ld:
        with pytest.raises(DegradedError, match="strict=True") as info:
            ld.load(ckpt_file, pool=pool)
        assert info.value.fallback == "read_mode='buffered'"
        assert pool.stats().in_use == 0 and pool.stats().cached == 0
        # Where direct I/O runs, the same strict loader loads (tmp_path may be tmpfs, which
        # refuses O_DIRECT: open without the flag instead).
        monkeypatch.setattr(DirectBackend, "_open", lambda self, p: os.open(p, os.O_RDONLY))
        result = ld.load(ckpt_file)
    assert result.stats.read_mode == "direct" and result.stats.degraded == ()
    assert_same(result.tensors, load_file(str(ckpt_file)))


def test_cpu_loads_through_a_pool_cannot_change_the_cache(loader, pool, big_file):
    # A LoRA fuse or an optimizer step on a loaded tensor must not reach the cached bytes.
    ref = load_file(str(big_file))
    first = loader.load(big_file, pool=pool).tensors
    first["big"].add_(1.0)
    first["i64"].zero_()
    second = loader.load(big_file, pool=pool)
    assert second.stats.scenario == "memory-cache hit"
    assert_same(second.tensors, ref)
    second.tensors["f32"].mul_(0)
    assert_same(loader.load(big_file, pool=pool).tensors, ref)
    assert torch.equal(first["big"], ref["big"] + 1.0)  # the caller's change is kept


def _wait_for_the_file_clock_to_pass(folder, ns: int) -> None:
    """Return once a file written in ``folder`` gets a ctime after ``ns``: file times tick
    coarsely (a kernel jiffy), and a rewrite within the same tick keeps the ctime that
    identifies the old bytes."""
    probe = folder / ".clock-probe"
    deadline = time.monotonic() + 5
    while True:
        probe.write_bytes(b"x")
        if probe.stat().st_ctime_ns > ns:
            break
        assert time.monotonic() < deadline, f"the file clock stayed at {ns} ns for 5 s"
    probe.unlink()


def test_rewrite_in_place_restoring_mtime_is_not_served_stale(loader, pool, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(1000)}, str(path))
    loader.load(path, pool=pool)
    st = os.stat(path)
    _wait_for_the_file_clock_to_pass(tmp_path, st.st_ctime_ns)
    new = tmp_path / "new.safetensors"
    save_file({"w": torch.ones(1000)}, str(new))
    with open(path, "r+b") as f:  # same inode, same size
        f.write(new.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # rsync -t / touch -r
    st2 = os.stat(path)
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    result = loader.load(path, pool=pool)
    assert result.stats.scenario == "read"
    assert torch.equal(result.tensors["w"], torch.ones(1000))


def test_failed_hit_gives_the_block_back(loader, pool, big_file, monkeypatch):
    from nostall.transfer import loader as loader_mod

    loader.load(big_file, pool=pool)
    real = loader_mod._target_buffer

    def oom(nbytes, dev):
        raise torch.OutOfMemoryError(f"injected: cannot allocate {nbytes} bytes")

    monkeypatch.setattr(loader_mod, "_target_buffer", oom)
    with pytest.raises(torch.OutOfMemoryError):
        loader.load(big_file, pool=pool)
    s = pool.stats()
    assert s.in_use == 0 and s.cached > 0  # not held forever, and still cached
    monkeypatch.setattr(loader_mod, "_target_buffer", real)
    again = loader.load(big_file, pool=pool)
    assert again.stats.scenario == "memory-cache hit"
    assert_same(again.tensors, load_file(str(big_file)))


def _storages(tensors):
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors.values()
        if t.numel()
    }


def test_dtype_that_changes_nothing_copies_nothing(loader, pool, tmp_path):
    g = torch.Generator().manual_seed(3)
    ref = {f"w{i}": torch.randn(256, 257, generator=g).to(torch.bfloat16) for i in range(4)}
    ref["step"] = torch.tensor(7)
    path = tmp_path / "bf16.safetensors"
    save_file(ref, str(path))
    nbytes = sum(t.numel() * t.element_size() for t in ref.values())
    for kwargs in ({}, {"pool": pool}, {"pool": pool}):
        out = loader.load(path, dtype=torch.bfloat16, **kwargs).tensors
        assert_same(out, ref)
        storages = _storages(out)
        assert len(storages) == 1  # views of one buffer, not a second copy
        assert next(iter(storages.values())) < nbytes + 8192


@pytest.mark.parametrize("use_pool", [False, True])
def test_dtype_casts_only_what_changes_and_never_holds_two_copies(
    loader, pool, tmp_path, monkeypatch, use_pool
):
    from nostall.transfer import loader as loader_mod

    g = torch.Generator().manual_seed(4)
    ref = {
        "keep": torch.randn(300, 301, generator=g).to(torch.bfloat16),
        "cast": torch.randn(512, 1024, generator=g),  # 2 MiB of fp32, crosses chunks
        "ids": torch.arange(1000),
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "keep_fp32": torch.randn(17, generator=g),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(ref, str(path))
    released = []
    real = loader_mod.release_pages
    monkeypatch.setattr(
        loader_mod, "release_pages", lambda t, a, b: released.append(b - a) or real(t, a, b)
    )
    dtype = {"keep": torch.bfloat16, "cast": torch.bfloat16, "keep_fp32": torch.float32}
    kwargs = {"pool": pool} if use_pool else {}
    out = loader.load(path, dtype=dtype, **kwargs).tensors
    assert out["cast"].dtype == torch.bfloat16
    assert torch.equal(bits(out["cast"]), bits(ref["cast"].to(torch.bfloat16)))
    for k in ("keep", "ids", "f8", "keep_fp32"):
        assert torch.equal(bits(out[k]), bits(ref[k])) and out[k].dtype == ref[k].dtype
    target = sum(t.numel() * t.element_size() for t in ref.values()) - ref["cast"].numel() * 2
    if use_pool:
        storages = _storages(out)
        assert len(storages) == 1 and next(iter(storages.values())) < target + 8192
    else:
        # The fp32 bytes of the cast tensor were given back once it was cast.
        assert sum(released) >= ref["cast"].numel() * 4 - 2 * 4096


def test_changed_file_is_not_served_from_cache(loader, pool, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(10)}, str(path))
    loader.load(path, pool=pool)
    _wait_for_the_file_clock_to_pass(tmp_path, os.stat(path).st_ctime_ns)
    save_file({"w": torch.ones(10)}, str(path))
    result = loader.load(path, pool=pool)
    assert result.stats.scenario == "read"
    assert torch.equal(result.tensors["w"], torch.ones(10))


def test_sharded_checkpoint(loader, tmp_path, tensors):
    index = make_sharded(tmp_path, tensors, shards=3)
    assert_same(loader.load(index).tensors, tensors)


def test_dtype_cast_keeps_fp8_and_integers(loader, ckpt_file, tensors):
    out = loader.load(ckpt_file, dtype=torch.bfloat16).tensors
    for k, t in tensors.items():
        if t.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
            assert out[k].dtype == torch.bfloat16
            assert torch.equal(out[k], t.to(torch.bfloat16))
        else:
            assert out[k].dtype == t.dtype
            assert torch.equal(bits(out[k]), bits(t))
    with pytest.raises(ValueError, match="cast target"):
        loader.load(ckpt_file, dtype=torch.int8)


def test_misaligned_tensor_is_copied_not_viewed(loader, tmp_path):
    # A writer that does not pad the header leaves the data section at an odd offset.
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
    header += b" " * ((2 - len(header)) % 8 + 8)  # 8 + len(header) ≡ 2 (mod 4)
    assert (8 + len(header)) % 4 == 2
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    w = loader.load(path).tensors["w"]
    assert torch.equal(w, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert w.data_ptr() % 4 == 0


def test_empty_checkpoint(loader, tmp_path):
    path = tmp_path / "empty.safetensors"
    save_file({}, str(path))
    assert loader.load(path).tensors == {}


def failing_after(n: int):
    """A ``ReadBackend._pread`` whose n-th system call fails, as a disk error would."""
    real = ReadBackend._pread
    calls = [0]

    def pread(backend, dest, offset):
        calls[0] += 1
        if calls[0] == n:
            raise ReadError(f"injected EIO at offset {offset}", path=backend.path)
        return real(backend, dest, offset)

    return pread


def test_read_error_returns_every_pool_block(loader, pool, big_file, monkeypatch):
    monkeypatch.setattr(ReadBackend, "_pread", failing_after(20))
    t = time.perf_counter()
    with pytest.raises(ReadError, match="injected EIO") as info:
        loader.load(big_file, pool=pool)
    assert time.perf_counter() - t < 1.0
    assert info.value.path == str(big_file)
    s = pool.stats()
    assert s.blocks == 0 and s.free == pool.capacity and pool.cached_keys() == []
    monkeypatch.undo()
    # the loader and pool still work, and the half-read bytes were not cached
    r = loader.load(big_file, pool=pool)
    assert r.stats.scenario == "read"
    assert_same(r.tensors, load_file(str(big_file)))


def test_truncated_file_fails_fast_and_clean(loader, pool, big_file):
    raw = big_file.read_bytes()
    big_file.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="outside the data section") as info:
        loader.load(big_file, pool=pool)
    assert info.value.path == str(big_file) and info.value.tensor is not None
    assert pool.stats().blocks == 0


def test_pool_too_small_is_a_clear_error(loader, big_file):
    with nostall.PinnedPool(2 << 20, pin=False) as small:
        with pytest.raises(PoolExhausted, match="cannot hold"):
            loader.load(big_file, pool=small)
        assert small.stats().blocks == 0


def test_unsupported_torch_dtype(loader, tmp_path):
    header = json.dumps({"w": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    path = tmp_path / "f6.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0")
    with pytest.raises(CheckpointError, match="no torch equivalent") as info:
        loader.load(path)
    assert info.value.tensor == "w"


def test_cuda_without_gpu_is_a_device_error(loader, ckpt_file):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="device='cpu'"):
        loader.load(ckpt_file, device="cuda")
    with pytest.raises(DeviceError, match="not supported"):
        loader.load(ckpt_file, device="meta")
    with pytest.raises(DeviceError):
        loader.load(ckpt_file, device="gpu7")


def test_closed_loader_and_pool(ckpt_file, pool):
    ld = Loader(threads=1)
    ld.close()
    with pytest.raises(ClosedError):
        ld.load(ckpt_file)
    pool.close()
    with Loader(threads=1) as ld2, pytest.raises(ClosedError):
        ld2.load(ckpt_file, pool=pool)


def test_cpu_tensors_outlive_everything(ckpt_file, tensors):
    with Loader(threads=2) as ld:
        out = ld.load(ckpt_file).tensors
    gc.collect()
    assert_same(out, tensors)


def test_top_level_load_state_dict(ckpt_file, tensors):
    assert_same(nostall.load_state_dict(ckpt_file), tensors)
    assert_same(nostall.load_state_dict(os.fspath(ckpt_file), device="cpu"), tensors)


@pytest.mark.parametrize("use_pool", [False, True])
def test_start_into_a_caller_buffer_under_a_key(loader, pool, big_file, use_pool):
    from nostall.errors import ArgumentError
    from nostall.transfer.plan import LoadPlan

    ref = load_file(str(big_file))
    need = LoadPlan(nostall.store.resolve(big_file)).target_bytes
    buf = torch.full((need + 100,), 0xEE, dtype=torch.uint8)
    kwargs = {"pool": pool, "key": ("component", 1)} if use_pool else {}
    pending = loader.start(big_file, into=buf, **kwargs)
    result = pending.wait()
    assert pending.wait() is result  # idempotent
    assert_same(result.tensors, ref)
    ptrs = {t.untyped_storage().data_ptr() for t in result.tensors.values() if t.numel()}
    assert ptrs == {buf.data_ptr()}  # the tensors view the caller's buffer
    if use_pool:
        assert pool.cached_keys() == [("component", 1)]
        again = loader.start(big_file, into=buf, **kwargs)
        assert again.scenario == "memory-cache hit"
        assert_same(again.wait().tensors, ref)
    with pytest.raises(ArgumentError, match="needs"):
        loader.start(big_file, into=buf[:10])
    with pytest.raises(ArgumentError, match="uint8"):
        loader.start(big_file, into=buf.view(torch.int16))


def test_tensors_back_to_back_on_both_sides_are_one_copy(tmp_path):
    from nostall.store import resolve
    from nostall.transfer.plan import Copy, LoadPlan

    # Sizes that are multiples of 256 bytes, after one odd tensor that shifts the file's
    # offsets off the alignment: the plan must still merge the aligned run.
    tensors = {"a_odd": torch.zeros(3), **{f"w{i}": torch.randn(64, 64) for i in range(5)}}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    plan = LoadPlan(resolve(path))
    f = plan.checkpoint.files[0]
    pieces = list(plan.pieces(0, 0, f.data_end))
    assert not plan.packed
    assert all(isinstance(p, Copy) for p in pieces)
    assert len(pieces) < len(tensors)  # merged, not one copy per tensor
    assert sum(p.hi - p.lo for p in pieces) == sum(t.numel() * 4 for t in tensors.values())
    # Copy the file through the merged pieces into the GPU-style layout, on the CPU.
    from nostall.transfer.copy import HostCopy, Transfer

    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    flat = torch.full((plan.target_bytes,), 0xEE, dtype=torch.uint8)
    moves = Transfer(plan, HostCopy(), flat)
    moves.begin()
    moves.land(0, 0, f.data_end, raw[: f.data_end])
    moves.finish()
    assert_same(plan.views(flat), tensors)


# ---- content digests and files that change -------------------------------------------


@pytest.mark.parametrize("route", ["pool", "host"])
def test_reads_hash_every_byte_as_they_land(loader, pool, big_file, route):
    from nostall.store import resolve
    from nostall.store.digest import hash_file_data

    (f,) = resolve(big_file).files
    want = hash_file_data(str(big_file), f.data_start, f.data_end)
    kw = {"pool": pool} if route == "pool" else {}
    r = loader.start(big_file, digest=True, **kw)
    assert r.digests == [want]
    assert_same(r.wait().tensors, load_file(str(big_file)))
    if route == "pool":  # a memory-cache hit reads (and hashes) nothing
        assert loader.start(big_file, pool=pool, digest=True).digests is None
    assert loader.start(big_file).digests is None  # only when asked


def test_a_file_replaced_after_its_header_was_read_is_never_read(loader, pool, big_file):
    from nostall.errors import FileChanged
    from nostall.store import resolve

    ckpt = resolve(big_file)
    t = load_file(str(big_file))
    t["big"] = t["big"] + 1
    save_file(t, str(big_file) + ".new")
    os.replace(str(big_file) + ".new", big_file)  # same name, new file
    with pytest.raises(FileChanged, match="since its header was read") as info:
        loader.load(ckpt, pool=pool)
    assert info.value.path == str(big_file)
    assert pool.stats().blocks == 0 and pool.cached_keys() == []


def test_a_file_rewritten_while_it_is_read_is_an_error_not_mixed_bytes(
    loader, pool, big_file, monkeypatch
):
    from nostall.errors import FileChanged
    from nostall.store.digest import DataHasher

    real = DataHasher.feed
    done = []

    def feed_and_rewrite(self, offset, data):
        real(self, offset, data)
        if not done:  # a writer appends to the file in the middle of the load
            done.append(1)
            with open(big_file, "ab") as f:
                f.write(b"\0" * 4096)

    monkeypatch.setattr(DataHasher, "feed", feed_and_rewrite)
    with pytest.raises(FileChanged, match="while it was read"):
        loader.start(big_file, pool=pool, digest=True)
    assert pool.stats().blocks == 0 and pool.cached_keys() == []  # nothing half-read kept


def test_a_loader_nobody_closed_joins_its_readers_when_collected(ckpt_file):
    loader = Loader(threads=2)
    loader.load(ckpt_file)
    owned = loader._owned
    del loader
    gc.collect()
    assert (owned.reader, owned.remote, owned.ring) == (None, None, None)
