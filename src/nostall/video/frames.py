"""Turn decoded video chunks into uint8 frames, on the device that decoded them.

Converting before the device-to-host copy moves 4x fewer bytes than copying fp32 and
converting on the CPU, and leaves the CPU free for encoding.

Example::

    for chunk in decode_chunks(vae, z):        # (1, 3, t, H, W) float in [-1, 1]
        frames = to_uint8_frames(chunk)        # uint8 (t, H, W, 3), same device
        sink.write(frames.cpu().numpy())
"""

from __future__ import annotations

import torch

from nostall.errors import ArgumentError

__all__ = ["to_uint8_frames"]


def to_uint8_frames(chunk: torch.Tensor) -> torch.Tensor:
    """Convert a ``(1, 3, t, H, W)`` chunk in ``[-1, 1]`` to contiguous uint8 ``(t, H, W, 3)``.

    The arithmetic replays diffusers' ``VideoProcessor.postprocess_video`` followed by
    ``numpy_to_pil`` step by step, so the bytes equal the PIL frames a diffusers pipeline
    returns: ``y = (x * 0.5 + 0.5).clamp(0, 1)`` in the chunk's dtype, then ``y`` in fp32,
    then ``round(y * 255)`` with round-half-to-even (torch and numpy agree on it).
    Values outside ``[-1, 1]`` saturate. Note that diffusers' ``export_to_video`` on
    ``output_type="np"`` frames truncates instead (``(y * 255).astype(uint8)``), so frames
    exported that way are up to one level darker than these.

    The result stays on the chunk's device; a batch of more than one video raises
    :class:`~nostall.ArgumentError` (convert ``chunk[i : i + 1]`` one at a time).

    Example::

        >>> chunk = torch.tensor([-1.0, 0.0, 1.0]).view(1, 3, 1, 1, 1)
        >>> to_uint8_frames(chunk)
        tensor([[[[  0, 128, 255]]]], dtype=torch.uint8)
    """
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"chunk must be a torch.Tensor, got {type(chunk).__name__}")
    shape = tuple(chunk.shape)
    if chunk.dim() != 5 or shape[1] != 3:
        raise ArgumentError(
            f"chunk must be (1, 3, t, H, W) as yielded by decode_chunks, got shape {shape}"
        )
    if shape[0] != 1:
        raise ArgumentError(
            f"chunk holds a batch of {shape[0]} videos (shape {shape}); to_uint8_frames "
            f"converts one video at a time: pass chunk[i : i + 1] for each video i"
        )
    if not chunk.is_floating_point():
        raise ArgumentError(f"chunk must be floating point in [-1, 1], got dtype {chunk.dtype}")

    x = chunk[0]  # (3, t, H, W)
    # Denormalise in the chunk's own dtype (as diffusers does), then widen: for bf16 chunks
    # the rounding of x * 0.5 + 0.5 happens in bf16 there too.
    y = x.mul(0.5).add_(0.5).clamp_(0.0, 1.0).float()
    y = y.mul_(255.0).round_().to(torch.uint8)  # uint8 (3, t, H, W)
    # Permute last: the layout copy then moves 1-byte rather than 4-byte elements.
    return y.permute(1, 2, 3, 0).contiguous()  # uint8 (t, H, W, 3)
