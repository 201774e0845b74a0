"""Running the tiny pipelines the same way in every test."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def run(pipe, name: str, *, device: str = "cpu") -> np.ndarray:
    """Two denoising steps at 32x32 (5 frames of 16x16 for Wan), fixed seed."""
    g = torch.Generator(device=device).manual_seed(0)
    kw = dict(prompt="a cat", num_inference_steps=2, generator=g, output_type="np")
    if name == "wan":
        return pipe(height=16, width=16, num_frames=5, max_sequence_length=16, **kw).frames
    if name.startswith("flux"):
        kw["max_sequence_length"] = 16
    return pipe(height=32, width=32, **kw).images


def reference(folder, name: str, *, device: str = "cpu") -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder / name)).to(device)
    pipe.set_progress_bar_config(disable=True)
    return run(pipe, name, device=device)


def switches(store, *names: str, device: str = "cpu", tier: str = "shared:t") -> list:
    """What a worker of ``host_tier=tier`` does: switch to each pipeline named, in order;
    per switch ``[name, {role: tier}, sha256 of the image's bytes]``."""
    import nostall

    rows = []
    with nostall.ModelCache(store, device=device, host_tier=tier) as cache:
        for name in names:
            with cache.use(name) as pipe:
                image = run(pipe, name, device=device)
            tiers = {c.role: c.tier for c in cache.last_report.components}
            rows.append([name, tiers, hashlib.sha256(image.tobytes()).hexdigest()])
    return rows


def fp8_reference(folder, name, dtype=None):
    """The FP8 pipeline as nostall.load_model builds each FP8 component (upcast on CPU)."""
    import os

    from diffusers import DiffusionPipeline

    import nostall
    from nostall.store import resolve

    parts = {}
    for sub in sorted(os.listdir(folder)):
        path = os.path.join(folder, sub)
        try:
            ckpt = resolve(path)
        except Exception:
            continue
        if any(e.dtype.startswith("F8") for _, e in ckpt.entries()):
            parts[sub] = nostall.load_model(path, dtype=dtype)
    pipe = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=dtype, **parts)
    pipe.set_progress_bar_config(disable=True)
    return run(pipe, name), set(parts)
