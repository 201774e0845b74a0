"""to_uint8_frames must produce exactly the bytes diffusers' PIL output holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nostall.errors import ArgumentError
from nostall.video.frames import to_uint8_frames


def _diffusers_uint8(chunk: torch.Tensor) -> np.ndarray:
    """uint8 (t, H, W, 3) via diffusers' own VideoProcessor, as WanPipeline returns it."""
    video_processor = pytest.importorskip("diffusers.video_processor")
    frames = video_processor.VideoProcessor().postprocess_video(chunk, output_type="pil")[0]
    return np.stack([np.asarray(im) for im in frames])


def _exact_ties() -> tuple[torch.Tensor, list[int]]:
    """fp32 x in [-1, 1] with (x * 0.5 + 0.5) * 255 == k + 0.5 exactly, and their k."""
    f32 = np.float32
    xs, ks = [], []
    for k in range(255):
        y = f32((k + 0.5) / 255)
        for direction in (-1, 1):
            cand = y
            for _ in range(4):
                x = cand * f32(2) - f32(1)
                if (x * f32(0.5) + f32(0.5)) * f32(255) == f32(k + 0.5):
                    xs.append(x)
                    ks.append(k)
                    break
                cand = np.nextafter(cand, f32(direction * 10), dtype=f32)
            else:
                continue
            break
    return torch.from_numpy(np.array(xs, dtype=f32)), ks


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    # Random values, values that land exactly between two levels after scaling (where
    # rounding choices differ), the endpoints, and out-of-range values that must saturate.
    g = torch.Generator().manual_seed(0)
    ties, _ = _exact_ties()
    edges = torch.tensor([-1.0, 1.0, 0.0, -1.5, 1.5, -1e-8, 1 + 1e-7, -1 - 1e-7])
    rand = torch.rand(3 * 4 * 8 * 8 - ties.numel() - edges.numel(), generator=g) * 2.4 - 1.2
    flat = torch.cat([ties, edges, rand]).to(dtype)
    return flat[torch.randperm(flat.numel(), generator=g)].view(1, 3, 4, 8, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_diffusers_postprocess_bytes(dtype):
    chunk = _hard_values(dtype)  # (1, 3, t, H, W)
    ours = to_uint8_frames(chunk)
    assert ours.dtype == torch.uint8
    assert tuple(ours.shape) == (4, 8, 8, 3)
    assert ours.is_contiguous()
    np.testing.assert_array_equal(ours.numpy(), _diffusers_uint8(chunk))


def test_layout_and_rounding_of_known_values():
    # Channel c of frame f at pixel (y, x) must land at out[f, y, x, c].
    chunk = torch.zeros(1, 3, 2, 1, 2)
    chunk[0, 0, 1, 0, 1] = 1.0  # red, frame 1, x=1
    chunk[0, 2, 0, 0, 0] = -1.0  # blue, frame 0, x=0
    out = to_uint8_frames(chunk)
    assert out.tolist() == [
        [[[128, 128, 0], [128, 128, 128]]],
        [[[128, 128, 128], [255, 128, 128]]],
    ]


def test_exact_ties_round_half_to_even():
    # Like numpy's round in diffusers: k + 0.5 goes to the even neighbour, not always up.
    xs, ks = _exact_ties()
    assert len(ks) > 100 and {k % 2 for k in ks} == {0, 1}
    xs = xs[: len(xs) // 3 * 3]  # (3 * n,) -> (1, 3, 1, 1, n)
    out = to_uint8_frames(xs.view(1, 3, 1, 1, -1))  # (1, 1, n, 3)
    got = out[0, 0].T.flatten().tolist()
    assert got == [k + (k % 2) for k in ks[: len(got)]]


def test_does_not_modify_the_chunk():
    chunk = _hard_values(torch.float32)
    before = chunk.clone()
    to_uint8_frames(chunk)
    assert torch.equal(chunk, before)


@pytest.mark.parametrize(
    ("chunk", "pattern"),
    [
        (torch.zeros(2, 3, 1, 4, 4), r"batch of 2.*chunk\[i : i \+ 1\]"),
        (torch.zeros(3, 1, 4, 4), r"\(1, 3, t, H, W\).*\(3, 1, 4, 4\)"),
        (torch.zeros(1, 4, 1, 4, 4), r"\(1, 3, t, H, W\).*\(1, 4, 1, 4, 4\)"),
        (torch.zeros(1, 3, 1, 4, 4, dtype=torch.uint8), r"floating point.*torch\.uint8"),
    ],
)
def test_rejects_bad_chunks(chunk, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        to_uint8_frames(chunk)
