"""``mode="exact"`` on the GPU: the fused kernel and the buffers give ``vae.decode``'s bits."""

from __future__ import annotations

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
    launches = []
    real = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda *a: launches.append(1) or real(*a))
    with torch.inference_mode():
        ref = vae.decode(z).sample
        out = torch.cat(list(decode_chunks(vae, z, mode="exact")), dim=2)
    assert launches, "the fused kernel did not run"
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
