"""A short denoising run of a diffusers pipeline on a fixed prompt, latents out: what
``nostall switch`` runs after each switch to show the pipeline works, and what the
switch benchmark times."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["denoise"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def denoise(
    pipe: Any, name: str, *, steps: int, res: int, dev: torch.device, on_step=None
) -> float:
    """A short denoising run (latents out, no VAE decode); seconds, synchronised."""
    kw: dict[str, Any] = dict(
        prompt="a lighthouse at dusk",
        num_inference_steps=steps,
        height=res,
        width=res,
        output_type="latent",
        generator=torch.Generator(device=dev.type).manual_seed(0),
    )
    if name.startswith("flux"):
        kw["max_sequence_length"] = 64
    if on_step is not None:
        kw["callback_on_step_end"] = on_step
    pipe.set_progress_bar_config(disable=True)
    _sync(dev)
    t = time.perf_counter()
    with torch.inference_mode():
        pipe(**kw)
    _sync(dev)
    return time.perf_counter() - t
