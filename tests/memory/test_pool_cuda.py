"""GPU behaviour of the pool: the right GPU registers, one pool feeds every GPU, teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.cuda

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_exit_while_pinning_does_not_abort():
    # The README's pattern: a pool starts pinning in the background, the script ends.
    # A daemon thread inside cudaHostRegister during CUDA's teardown aborted 1 run in 3.
    code = """
        import nostall
        pool = nostall.PinnedPool(8 << 30, slab_bytes=256 << 20)
        pool.wait_pinned(1 << 30)
    """
    for _ in range(5):
        out = _run(code)
        assert out.returncode == 0, out.stderr
        assert "terminate called" not in out.stderr


def test_dropped_pool_unregisters_its_memory():
    import gc

    import nostall

    pool = nostall.PinnedPool(64 << 20, slab_bytes=16 << 20)
    assert pool.wait_pinned(timeout=60)
    block = pool.allocate(16 << 20)
    t = block.tensor
    assert t.is_pinned()
    block.release()
    arena = pool.arena
    del pool, block
    gc.collect()
    assert arena._map is None
    assert not t.is_pinned()  # still mapped through the view, but no longer page-locked


@two_gpus
def test_pinning_for_gpu1_creates_no_context_on_gpu0(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1 << 20)}, str(path))
    out = _run(
        f"""
        import torch, nostall
        from nostall.transfer.loader import Loader
        pool = nostall.PinnedPool(256 << 20, slab_bytes=64 << 20, device="cuda:1")
        pool.wait_pinned()
        with Loader(threads=2) as ld:
            a = ld.load({str(path)!r}, device="cuda:1", pool=pool).tensors["w"]
            b = ld.load({str(path)!r}, device="cuda:1").tensors["w"]  # staging ring
            assert torch.equal(a, b) and a.device == torch.device("cuda:1")
        pool.close()
        print("ctx0", torch._C._cuda_hasPrimaryContext(0), "ctx1", torch._C._cuda_hasPrimaryContext(1))
        """
    )
    assert out.returncode == 0, out.stderr
    assert "ctx0 False ctx1 True" in out.stdout, out.stdout


@two_gpus
def test_one_pool_feeds_both_gpus(tmp_path):
    from safetensors.torch import load_file, save_file

    import nostall
    from nostall.transfer.loader import Loader

    g = torch.Generator().manual_seed(0)
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(4 << 20, generator=g), "b": torch.arange(10)}, str(path))
    ref = load_file(str(path))
    with (
        nostall.PinnedPool(128 << 20, slab_bytes=32 << 20, device="cuda:0") as pool,
        Loader(threads=2) as ld,
    ):
        pool.wait_pinned()
        first = ld.load(path, device="cuda:1", pool=pool)  # read, registered by GPU 0
        hit0 = ld.load(path, device="cuda:0", pool=pool)
        hit1 = ld.load(path, device="cuda:1", pool=pool)
        assert hit0.stats.scenario == hit1.stats.scenario == "memory-cache hit"
        for r, dev in ((first, 1), (hit0, 0), (hit1, 1)):
            for k, t in ref.items():
                assert r.tensors[k].device == torch.device("cuda", dev)
                assert torch.equal(r.tensors[k].cpu(), t)
