"""Random-weight checkpoints for benchmarks: nothing is downloaded, ever.

``flux`` is diffusers' ``FluxTransformer2DModel()`` with its default config
(23.78 GB in bf16, 1156 tensors) written as one safetensors file beside its
``config.json``, i.e. a diffusers component folder that ``from_pretrained`` and
nostall both read. ``tiny`` is the same architecture at a few MB, for CI.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from nostall.errors import ArgumentError

__all__ = ["PRESETS", "make_checkpoint"]

WEIGHTS = "diffusion_pytorch_model.safetensors"

# Overrides of FluxTransformer2DModel's defaults; ``flux`` keeps every default.
PRESETS: dict[str, dict] = {
    "flux": {},
    "tiny": {
        "patch_size": 1,
        "in_channels": 8,
        "num_layers": 1,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "axes_dims_rope": [4, 6, 6],
    },
}


def make_checkpoint(
    folder: str,
    *,
    preset: str = "flux",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Write a random ``FluxTransformer2DModel`` component folder; return the weights path.

    Values are drawn on ``device`` (a GPU makes 24 GB of random numbers in a
    second) and written tensor by tensor in one file. An existing folder written
    with the same preset, dtype and seed is reused.

    >>> path = make_checkpoint("/tmp/flux", preset="tiny")  # doctest: +SKIP
    """
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ArgumentError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    os.makedirs(folder, exist_ok=True)
    weights = os.path.join(folder, WEIGHTS)
    stamp = {"preset": preset, "dtype": str(dtype), "seed": seed}
    stamp_path = os.path.join(folder, "nostall-bench.json")
    if os.path.exists(weights) and os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return weights
    with torch.device("meta"):
        model = FluxTransformer2DModel(**PRESETS[preset])
    model.save_config(folder)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for i, (name, shape) in enumerate(shapes.items()):
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        tensors[name] = t.cpu()
        if progress is not None:
            progress(i + 1, len(shapes))
    tmp = weights + ".partial"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, weights)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return weights
