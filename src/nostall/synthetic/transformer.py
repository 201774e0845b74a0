"""A random FLUX.1-dev transformer folder (``full``: 23.8 GB in bf16; ``tiny``: a few MB)
and one denoising step's inputs for it: what the FP8 benchmark, the demo and the FP8
tests run."""

from __future__ import annotations

import os

import torch

from nostall.synthetic.full import write_weights

__all__ = ["safetensors_bytes", "step_inputs", "write_transformer"]


def safetensors_bytes(folder: str) -> int:
    """Bytes of the ``.safetensors`` files directly in ``folder``."""
    return sum(
        os.path.getsize(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.endswith(".safetensors")
    )


def _module(size: str):
    import diffusers

    if size == "full":
        with torch.device("meta"):
            return diffusers.FluxTransformer2DModel(guidance_embeds=True)
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=128,
        pooled_projection_dim=64,
        axes_dims_rope=(8, 12, 12),
        guidance_embeds=True,
    )


def write_transformer(folder: str, size: str, device: torch.device, progress=None) -> str:
    """A random FLUX transformer folder (config + bf16 safetensors) at ``folder``."""
    module = _module(size)
    os.makedirs(folder, exist_ok=True)
    module.save_config(folder)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    write_weights(
        module,
        folder,
        "diffusion_pytorch_model",
        torch.bfloat16,
        gen_device,
        1,
        progress,
        "transformer",
    )
    return folder


def step_inputs(
    module, size: str, dev: torch.device, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict:
    """One denoising step's inputs in ``dtype``: 1024x1024 (64x64 latent patches = 4096
    tokens), 512 text tokens (``tiny``: 256 and 32)."""
    cfg = module.config
    tokens, text = (4096, 512) if size == "full" else (256, 32)
    side = int(tokens**0.5)
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    img_ids = torch.zeros(side, side, 3, device=dev)
    img_ids[..., 1] = torch.arange(side, device=dev)[:, None]
    img_ids[..., 2] = torch.arange(side, device=dev)[None, :]
    inputs = {
        "hidden_states": randn(1, tokens, cfg.in_channels),
        "encoder_hidden_states": randn(1, text, cfg.joint_attention_dim),
        "pooled_projections": randn(1, cfg.pooled_projection_dim),
        "timestep": torch.full((1,), 0.5, device=dev, dtype=dtype),
        "img_ids": img_ids.reshape(-1, 3).to(dtype),
        "txt_ids": torch.zeros(text, 3, device=dev, dtype=dtype),
        "return_dict": False,
    }
    if cfg.guidance_embeds:  # FLUX.1-dev's distilled guidance
        inputs["guidance"] = torch.full((1,), 3.5, device=dev, dtype=dtype)
    return inputs
