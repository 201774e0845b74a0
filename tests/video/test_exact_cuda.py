"""``mode="exact"`` on the GPU: the fused kernel and the buffers give ``vae.decode``'s bits."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402

from nostall.video import kernels  # noqa: E402
from nostall.video.wan import decode_chunks  # noqa: E402


def _wan22():
    # The Wan 2.2 TI2V-5B VAE's config (diffusers' defaults for the rest).
    return AutoencoderKLWan(
        base_dim=160,
        decoder_base_dim=256,
        z_dim=48,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        is_residual=True,
    )


def _check(vae, z, monkeypatch):
    launches, biases = [], []
    real, real_bias = kernels._launch, kernels._launch_bias
    monkeypatch.setattr(kernels, "_launch", lambda *a: launches.append(1) or real(*a))
    monkeypatch.setattr(
        kernels,
        "_launch_bias",
        lambda *a, **k: biases.append(a[2] is not None) or real_bias(*a, **k),
    )
    with torch.inference_mode():
        ref = vae.decode(z).sample
        out = torch.cat(list(decode_chunks(vae, z, mode="exact")), dim=2)
    assert launches, "the fused kernel did not run"
    assert any(biases) and not all(biases), "the bias (+ residual) kernel did not run both ways"
    assert out.shape == ref.shape
    mismatches = int((out != ref).sum())
    assert mismatches == 0, f"{mismatches} of {ref.numel()} values differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_wan21_720p_is_bit_identical(dtype, monkeypatch):
    if not kernels.triton_available(torch.device("cuda")):
        pytest.fail("Triton is missing on a CUDA machine: the fused kernel cannot be tested")
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = AutoencoderKLWan().to(dtype).eval()
        z = torch.randn(1, 16, 3, 90, 160, dtype=dtype)
    _check(vae, z, monkeypatch)


def test_exact_wan22_is_bit_identical(monkeypatch):
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = _wan22().to(torch.bfloat16).eval()
        z = torch.randn(1, 48, 3, 44, 80, dtype=torch.bfloat16)  # 704x1280
    _check(vae, z, monkeypatch)


def test_two_gpus_give_the_one_gpu_bits(tmp_path):
    import numpy as np

    from nostall.video import decode_to_file

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        vae = AutoencoderKLWan().to(torch.bfloat16).eval()
        z = torch.randn(1, 16, 4, 90, 160, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = vae.decode(z).sample
        chunks = list(decode_chunks(vae, z, mode="exact", devices=["cuda:0", "cuda:1"]))
    assert {c.device for c in chunks} == {torch.device("cuda:1")}
    out = torch.cat([c.to("cuda:0") for c in chunks], dim=2)
    assert int((out != ref).sum()) == 0
    one = decode_to_file(vae, z, tmp_path / "one.npy", mode="exact")
    two = decode_to_file(vae, z, tmp_path / "two.npy", mode="exact", devices=["cuda:0", "cuda:1"])
    assert one.frames == two.frames == 13
    assert np.array_equal(np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy"))


# ---- fast mode -------------------------------------------------------------------


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return 10 * math.log10(4.0 / mse)


def test_fast_wan21_720p_is_within_half_a_db_of_bf16_eager_and_replays_a_graph(monkeypatch):
    import copy

    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: replays.append(1) or real(g))
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = AutoencoderKLWan().to(torch.bfloat16).eval()
        z = torch.randn(1, 16, 6, 90, 160, dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = vae.decode(z).sample
        vae32 = copy.deepcopy(vae).float()
        ref = vae32.decode(z.float()).sample
        del vae32
        fast = torch.cat(list(decode_chunks(vae, z, mode="fast")), dim=2)
    assert fast.shape == eager.shape and fast.dtype == eager.dtype
    # chunk 0 and 1 run as they are, chunk 2 is captured, chunks 2-5 replay
    assert len(replays) == 4
    eager_db, fast_db = _psnr(eager, ref), _psnr(fast, ref)
    assert fast_db >= eager_db - 0.5, (fast_db, eager_db)


def test_fast_recaptures_when_the_chunk_shape_changes():
    from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module

    from nostall.video.exact import ExactDecoder, ExactState, FastDecoder

    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = AutoencoderKLWan().to(torch.bfloat16).eval()
        z = torch.randn(1, 16, 9, 30, 40, dtype=torch.bfloat16)
    sizes = [1, 1, 1, 1, 2, 2, 1]  # latent frames per chunk: the shape changes twice
    with torch.inference_mode():
        x = vae.post_quant_conv(z)
        outs, graphs = {}, []
        for name, dec in (
            ("exact", ExactDecoder(vae.decoder, wan_module)),
            ("fast", FastDecoder(vae.decoder, wan_module)),
        ):
            state, start, chunks = ExactState(), 0, []
            for i, n in enumerate(sizes):
                chunks.append(dec.forward(x[:, :, start : start + n], state, first=i == 0).clone())
                start += n
                if name == "fast" and state.graph is not None:
                    graphs.append(state.graph[0])
            outs[name] = torch.cat(chunks, 2)
    assert len({id(g) for g in graphs}) == 2  # captured at 1 frame, again after 2 frames
    assert _psnr(outs["fast"], outs["exact"]) > 35


@pytest.mark.parametrize("channels", [96, 192, 384])
def test_upsample_kernel_equals_interpolate(channels):
    import torch.nn.functional as F

    x = torch.randn(4, channels, 45, 80, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    out = kernels.upsample2x_cl(x)
    assert out is not None and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, F.interpolate(x, scale_factor=2.0, mode="nearest-exact"))


def test_fast_wan22_is_within_half_a_db_of_bf16_eager(monkeypatch):
    import copy

    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: replays.append(1) or real(g))
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = _wan22().to(torch.bfloat16).eval()
        z = torch.randn(1, 48, 4, 44, 80, dtype=torch.bfloat16)  # 704x1280
    with torch.inference_mode():
        eager = vae.decode(z).sample
        vae32 = copy.deepcopy(vae).float()
        ref = vae32.decode(z.float()).sample
        del vae32
        fast = torch.cat(list(decode_chunks(vae, z, mode="fast")), dim=2)
    assert fast.shape == eager.shape
    assert len(replays) == 2  # chunks 2 and 3
    eager_db, fast_db = _psnr(eager, ref), _psnr(fast, ref)
    assert fast_db >= eager_db - 0.5, (fast_db, eager_db)
