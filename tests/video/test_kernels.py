"""The decoder kernels' contracts on the CPU (their eager fallbacks) and the row layout
that decides when the Triton copy runs. The Triton paths are checked bit for bit on the
GPU (test_exact_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nostall.video import kernels


def _padded(c=3, t=4, h=5, w=6, cl=False):
    if cl:
        return torch.zeros(1, t, h, w, c).permute(0, 4, 1, 2, 3)
    return torch.zeros(1, c, t, h, w)


@pytest.mark.parametrize("cl", [False, True])
def test_history_slices_are_rows(cl):
    buf = _padded(cl=cl)
    hist = _padded(t=2, cl=cl)
    rows = kernels._rows(hist, buf[:, :, :2])
    assert rows is not None
    n, count, s_row, d_row = rows
    assert n * count == hist.numel()
    if cl:  # channels last: the first two frames are one contiguous run
        assert count == 1
    else:  # one run of two frames per channel, the channels a buffer apart
        assert (count, n, s_row, d_row) == (3, 2 * 5 * 6, 2 * 5 * 6, 4 * 5 * 6)


def test_an_interior_view_is_not_rows():
    buf = _padded()
    assert kernels._rows(buf[:, :, 2:, 1:-1, 1:-1].clone(), buf[:, :, 2:, 1:-1, 1:-1]) is None
    assert kernels._rows(torch.zeros(2, 3), torch.zeros(3, 2)) is None


def test_copy_into_copies():
    src = torch.randn(1, 3, 2, 5, 6)
    buf = _padded()
    kernels.copy_into(buf[:, :, :2], src)
    assert torch.equal(buf[:, :, :2], src) and buf[:, :, 2:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_helpers_match_eager(dtype):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(1, 4, 2, 3, 5, generator=g).to(dtype)
    h = torch.randn(1, 4, 2, 3, 5, generator=g).to(dtype)
    b = torch.randn(4, generator=g).to(dtype)
    ref = y + b.view(1, -1, 1, 1, 1)
    assert torch.equal(kernels.add_bias_(y.clone(), b), ref)
    assert torch.equal(kernels.bias_residual(y.clone(), b, h), ref + h)
    assert torch.equal(kernels.add_bias_(y.clone(), None), y)


def test_channels_last_norm_with_a_pending_bias_matches_the_eager_chain():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 2, 3, 4, generator=g).contiguous(memory_format=torch.channels_last_3d)
    b = torch.randn(6, generator=g)
    gamma = 1 + 0.1 * torch.randn(6, generator=g)
    out = torch.zeros(1, 2, 5, 6, 6).permute(0, 4, 1, 2, 3)[:, :, :, 1:-1, 1:-1]
    kernels.rms_silu_cl_into(x, gamma, 6**0.5, out, b)
    xb = x + b.view(1, -1, 1, 1, 1)
    ref = F.silu(F.normalize(xb, dim=1) * 6**0.5 * gamma.view(-1, 1, 1, 1))
    torch.testing.assert_close(out, ref)


def test_nearest_2x_is_recognised_only_for_doubling():
    import torch.nn as nn

    from nostall.video.exact import _nearest_2x

    assert _nearest_2x(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"))
    assert _nearest_2x(nn.Upsample(scale_factor=2, mode="nearest"))
    assert not _nearest_2x(nn.Upsample(scale_factor=(2.0, 2.0), mode="bilinear"))
    assert not _nearest_2x(nn.Upsample(scale_factor=3, mode="nearest"))
    assert not _nearest_2x(nn.Upsample(size=(4, 4), mode="nearest"))


def test_upsample_kernel_declines_where_it_cannot_run():
    x = torch.randn(1, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    assert kernels.upsample2x_cl(x) is None  # CPU: the caller interpolates
