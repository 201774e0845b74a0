"""The async pipeline on a GPU: stream/event ordering and buffer reuse."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from nostall.video import AsyncFramePipeline, NullSink, SyncFramePipeline, decode_to_file
from nostall.video.sinks import FrameSink

pytestmark = pytest.mark.cuda


class Keep(FrameSink):
    _requires_frames = False

    def __init__(self, delay: float = 0.0):
        super().__init__()
        self.delay = delay
        self.values: list[int] = []
        self.uniform = True

    def _start(self, height, width):
        pass

    def _write(self, frames):
        if self.delay:
            time.sleep(self.delay)
        for f in frames:
            self.values.append(int(f[0, 0, 0]))
            self.uniform &= bool((f == f[0, 0, 0]).all())

    def _finish(self):
        pass

    def _discard(self):
        pass


def slow_gpu_chunks(n: int, *, spin_cycles: int = 2_000_000):
    """Chunks whose value is only known after a long kernel: a copy that does not wait
    for the compute stream would read stale bytes."""
    for i in range(n):
        torch.cuda._sleep(spin_cycles)  # keeps the compute stream busy
        t = 1 if i == 0 else 4
        yield torch.full((t, 32, 48, 3), i % 251, dtype=torch.uint8, device="cuda")


def test_copies_wait_for_compute_and_buffers_are_not_overwritten_early():
    sink = Keep(delay=0.01)  # slow host side: every buffer is reused while copies queue up
    with AsyncFramePipeline(device="cuda", convert=lambda c: c) as pipe:
        stats = pipe.run(slow_gpu_chunks(40), sink)
    expect = [0] + [i for i in range(1, 40) for _ in range(4)]
    assert sink.values == expect
    assert sink.uniform
    assert stats.frames == len(expect)


def test_host_buffers_are_page_locked_and_device_memory_stays_bounded():
    torch.cuda.synchronize()
    with AsyncFramePipeline(device="cuda", convert=lambda c: c) as pipe:
        pipe.run(slow_gpu_chunks(3, spin_cycles=1000), NullSink())
        assert all(b is not None and b.tensor.is_pinned() for b in pipe._buffers.host)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        pipe.run(slow_gpu_chunks(60, spin_cycles=1000), NullSink())
        peak = torch.cuda.max_memory_allocated() - base
    chunk = 4 * 32 * 48 * 3
    assert peak < 8 * chunk  # two device buffers + a chunk in flight, not 60 chunks


def test_sync_and_async_agree_on_a_real_wan_decode(tmp_path):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=32, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    vae = vae.to("cuda").eval()
    z = torch.randn(1, 16, 6, 16, 24, device="cuda")
    decode_to_file(vae, z, tmp_path / "a.npy")
    decode_to_file(vae, z, tmp_path / "s.npy", sync=True)
    a, s = np.load(tmp_path / "a.npy"), np.load(tmp_path / "s.npy")
    assert a.shape == (21, 128, 192, 3)
    assert np.array_equal(a, s)


def test_sync_pipeline_on_gpu():
    sink = Keep()
    with SyncFramePipeline(device="cuda", convert=lambda c: c) as pipe:
        pipe.run(slow_gpu_chunks(5, spin_cycles=1000), sink)
    assert sink.values == [0] + [i for i in range(1, 5) for _ in range(4)]


def test_back_to_back_submits_share_buffers_without_mixing_videos():
    """Video 2's kernels start while video 1's last copies and close are pending: its
    chunks reuse the same device/host buffers, which must not bleed between videos."""

    class SlowClose(Keep):
        def _finish(self):
            time.sleep(0.2)

    def video(offset: int, n: int):
        for chunk in slow_gpu_chunks(n):
            yield chunk + offset  # distinct values per video

    sinks = [SlowClose(delay=0.005), Keep(delay=0.005)]
    with AsyncFramePipeline(device="cuda", convert=lambda c: c) as pipe:
        futures = [pipe.submit(video(100 * k, 12), s) for k, s in enumerate(sinks)]
        stats = [f.result(timeout=60) for f in futures]
    for k, sink in enumerate(sinks):
        assert sink.values == [100 * k] + [100 * k + i for i in range(1, 12) for _ in range(4)]
        assert sink.uniform
    assert stats[0].close_s >= 0.2 and stats[1].frames == 45


def test_submit_decode_on_gpu_equals_decode_to_file(tmp_path):
    from diffusers import AutoencoderKLWan

    from nostall.video import submit_decode

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=32, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    vae = vae.to("cuda").eval()
    zs = [torch.randn(1, 16, 5, 16, 24, device="cuda") for _ in range(3)]
    with AsyncFramePipeline(device="cuda") as pipe:
        futures = [
            submit_decode(vae, z, tmp_path / f"b{i}.npy", pipeline=pipe) for i, z in enumerate(zs)
        ]
        [f.result(timeout=120) for f in futures]
    for i, z in enumerate(zs):
        decode_to_file(vae, z, tmp_path / f"r{i}.npy", sync=True)
        assert np.array_equal(np.load(tmp_path / f"b{i}.npy"), np.load(tmp_path / f"r{i}.npy"))
