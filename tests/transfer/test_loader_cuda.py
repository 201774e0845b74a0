"""GPU behaviour: pinned pool, copy-stream ordering, device views, dtype cast, ring reuse."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import nostall
from nostall.errors import ReadError
from nostall.store.base import ReadBackend
from nostall.transfer.loader import Loader

from support import assert_same, bits, sample_tensors, skip_unless_read_mode_runs

pytestmark = pytest.mark.cuda


@pytest.fixture
def big_file(tmp_path):
    t = sample_tensors()
    g = torch.Generator().manual_seed(2)
    t["big"] = torch.randn(3_000_000, generator=g)  # 12 MB: spans several slabs and ring slots
    t["big_bf16"] = torch.randn(1_000_001, generator=g).to(torch.bfloat16)
    path = tmp_path / "big.safetensors"
    save_file(t, str(path))
    return path


@pytest.fixture
def pool():
    with nostall.PinnedPool(64 << 20, slab_bytes=4 << 20) as p:  # small slabs: many registrations
        assert p.wait_pinned(timeout=60)
        yield p


def test_pool_memory_is_page_locked(pool):
    s = pool.stats()
    assert s.pinned == pool.capacity
    block = pool.allocate(6 << 20)
    assert block.tensor.is_pinned()
    src = block.tensor
    src.copy_(torch.randint(0, 255, (src.numel(),), dtype=torch.uint8))
    dst = torch.empty_like(src, device="cuda")
    for a, b in block.split(0, block.size):  # each copy inside one registration
        dst[a:b].copy_(src[a:b], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    block.release()


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_ring_path_equals_safetensors(big_file, mode):
    skip_unless_read_mode_runs(mode, big_file.parent)
    # 2 slots of 64 KiB for a 16 MB file: every slot is reused ~120 times, so a
    # missing event wait would overwrite bytes the copy engine has not read yet.
    with Loader(threads=4, read_mode=mode, ring_slots=2, ring_slot_bytes=64 << 10) as ld:
        result = ld.load(big_file, device="cuda")
    ref = load_file(str(big_file), device="cuda")
    assert_same(result.tensors, ref)
    assert result.stats.path == "ring" and result.stats.h2d_s > 0
    assert result.stats.read_mode == mode and result.stats.degraded == ()


def test_device_views_share_one_allocation(big_file):
    with Loader(threads=2) as ld:
        sd = ld.load(big_file, device="cuda").tensors
    storages = {t.untyped_storage().data_ptr() for t in sd.values() if t.numel()}
    assert len(storages) == 1
    assert all(t.device.type == "cuda" for t in sd.values())


def test_pool_read_then_hit_and_host_reuse_after_copy(big_file, pool):
    ref = load_file(str(big_file), device="cuda")
    with Loader(threads=4, chunk_bytes=1 << 20) as ld:
        first = ld.load(big_file, device="cuda", pool=pool)
        assert_same(first.tensors, ref)
        hit = ld.load(big_file, device="cuda", pool=pool)
        assert hit.stats.scenario == "memory-cache hit" and hit.stats.read_s == 0
        # Use on the current stream right away: the copy stream must already be waited for.
        total = sum(
            float(t.float().sum())
            for t in hit.tensors.values()
            if t.dtype.is_floating_point and t.numel() and t.dtype.itemsize > 1
        )
        expect = sum(
            float(t.float().sum())
            for t in ref.values()
            if t.dtype.is_floating_point and t.numel() and t.dtype.itemsize > 1
        )
        assert total == pytest.approx(expect, rel=1e-5)
        # Overwrite the host bytes: device tensors must not change (copies completed).
        pool.evict()
        junk = pool.allocate(pool.capacity - (2 << 20))
        junk.tensor.fill_(0xAB)
        torch.cuda.synchronize()
        assert_same(hit.tensors, ref)
        junk.release()


def test_dtype_cast_on_device(big_file):
    with Loader(threads=2) as ld:
        out = ld.load(big_file, device="cuda", dtype=torch.bfloat16)
    cpu = load_file(str(big_file))
    for k, t in cpu.items():
        if t.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
            assert out.tensors[k].dtype == torch.bfloat16
            assert torch.equal(out.tensors[k].cpu(), t.to(torch.bfloat16)), k
        else:
            assert torch.equal(bits(out.tensors[k]), bits(t)), k


def _peak_during(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("use_pool", [False, True])
def test_dtype_never_holds_two_copies_on_device(tmp_path, pool, use_pool):
    g = torch.Generator().manual_seed(5)
    bf16 = {f"w{i}": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(8)}
    path = tmp_path / "bf16.safetensors"
    save_file(bf16, str(path))
    kwargs = {"pool": pool} if use_pool else {}
    with Loader(threads=2) as ld:
        # Nothing changes dtype: one buffer of the checkpoint's size, no second copy.
        out, peak = _peak_during(
            lambda: ld.load(path, device="cuda", dtype=torch.bfloat16, **kwargs)
        )
        assert_same(out.tensors, {k: v.cuda() for k, v in bf16.items()})
        nbytes = 8 * (1 << 21)
        assert peak <= nbytes + (4 << 20), peak
        del out
        # fp32 → bf16: the target size plus tensors in flight, never fp32 + bf16 in full.
        fp32 = {k: v.float() for k, v in bf16.items()}
        path32 = tmp_path / "fp32.safetensors"
        save_file(fp32, str(path32))
        out, peak = _peak_during(
            lambda: ld.load(path32, device="cuda", dtype=torch.bfloat16, **kwargs)
        )
        assert_same(out.tensors, {k: v.cuda() for k, v in bf16.items()})
        assert peak < nbytes + 2 * nbytes, peak  # target 16 MiB + at most the fp32 in flight
        assert peak < 2 * nbytes + (6 << 20)


def test_failed_hit_on_gpu_gives_the_block_back(big_file, pool, monkeypatch):
    from nostall.transfer import loader as loader_mod

    with Loader(threads=2) as ld:
        ld.load(big_file, device="cuda", pool=pool)

        def oom(nbytes, dev):
            raise torch.OutOfMemoryError(f"injected: cannot allocate {nbytes} bytes on {dev}")

        real = loader_mod._target_buffer
        monkeypatch.setattr(loader_mod, "_target_buffer", oom)
        with pytest.raises(torch.OutOfMemoryError):
            ld.load(big_file, device="cuda", pool=pool)
        assert pool.stats().in_use == 0
        monkeypatch.setattr(loader_mod, "_target_buffer", real)
        hit = ld.load(big_file, device="cuda", pool=pool)
        assert hit.stats.scenario == "memory-cache hit"
        assert_same(hit.tensors, load_file(str(big_file), device="cuda"))


def test_read_error_on_gpu_load_leaves_loader_usable(big_file, pool, monkeypatch):
    real = ReadBackend._pread
    calls = [0]

    def pread(backend, dest, offset):
        calls[0] += 1
        if calls[0] == 7:
            raise ReadError("injected", path=backend.path)
        return real(backend, dest, offset)

    with Loader(
        threads=4, block_bytes=64 << 10, chunk_bytes=1 << 20, ring_slots=2, ring_slot_bytes=64 << 10
    ) as ld:
        monkeypatch.setattr(ReadBackend, "_pread", pread)
        with pytest.raises(ReadError):
            ld.load(big_file, device="cuda")
        calls[0] = 0
        with pytest.raises(ReadError):
            ld.load(big_file, device="cuda", pool=pool)
        assert pool.stats().blocks == 0
        monkeypatch.undo()
        assert_same(
            ld.load(big_file, device="cuda").tensors, load_file(str(big_file), device="cuda")
        )


def test_load_model_on_gpu_matches_from_pretrained(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from nostall.synthetic import make_checkpoint

    folder = str(tmp_path / "flux")
    make_checkpoint(folder, preset="tiny")
    ours = nostall.load_model(folder, device="cuda")
    ref = diffusers.FluxTransformer2DModel.from_pretrained(folder).to("cuda")
    sd, rsd = ours.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in rsd:
        assert sd[k].device.type == "cuda"
        assert torch.equal(sd[k], rsd[k]), k


def test_ring_is_pinned_once_per_loader(big_file):
    with Loader(threads=2) as ld:
        ld.prepare("cuda")
        ring = ld._owned.ring
        assert ring is not None and ring.pinned
        ld.load(big_file, device="cuda")
        ld.load(big_file, device="cuda")
        assert ld._owned.ring is ring
