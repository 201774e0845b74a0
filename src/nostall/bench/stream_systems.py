"""The systems ``nostall bench stream`` runs, one image or video each, and the probe that
times their denoiser: nostall resident whole (the reference), nostall resident in part
under the budget, diffusers' group offload (block level, on a stream, as its docs
recommend for speed) and diffusers' sequential CPU offload."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from nostall.stream.blocks import find_blocks
from nostall.stream.timing import BlockTimer

__all__ = ["PROMPT", "call", "diffusers_offloaded", "nostall_pipe", "probe", "sync"]

PROMPT = "a lighthouse on a cliff at dusk"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def probe(module: nn.Module, dev: torch.device) -> BlockTimer:
    """Times every call of ``module`` (a denoiser) and of each of its blocks
    (:class:`~nostall.stream.timing.BlockTimer`, all calls, not its first few)."""
    blocks = {b.name: b.module for b in find_blocks(module)}
    return BlockTimer(module, blocks, dev, calls=1 << 30)


def call(pipe: Any, part: dict, dev: torch.device, steps: int, seed: int = 7) -> np.ndarray:
    """One image (or video) of ``part``'s shape, as numpy; synchronised."""
    kw: dict[str, Any] = {
        "prompt": PROMPT,
        "height": part["height"],
        "width": part["width"],
        "num_inference_steps": steps,
        "generator": torch.Generator(device=dev.type).manual_seed(seed),
        "output_type": "np",
    }
    if part["kind"] == "video":
        kw["num_frames"] = part["frames"]
    else:
        kw["max_sequence_length"] = part["max_sequence_length"]
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        out = pipe(**kw)
    sync(dev)
    return np.asarray(out.frames[0] if part["kind"] == "video" else out.images[0])


def nostall_pipe(cache: Any, name: str) -> Any:
    """``cache``'s pipeline ``name`` held (a ``use()`` block entered; the caller exits it)."""
    block = cache.use(name)
    return block, block.__enter__()


def diffusers_offloaded(folder: str, kind: str, how: str, dev: torch.device) -> Any:
    """diffusers' own pipeline with its offloading: ``group`` (every model component
    offloaded block by block, ``use_stream=True``, ``record_stream=True``, as its docs
    recommend for speed) or ``sequential`` (``enable_sequential_cpu_offload``)."""
    from diffusers import DiffusionPipeline
    from diffusers.hooks import apply_group_offloading

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kwargs: dict[str, Any] = {"torch_dtype": dtype}
    if kind == "video":
        from diffusers import AutoencoderKLWan

        kwargs["vae"] = AutoencoderKLWan.from_pretrained(
            folder, subfolder="vae", torch_dtype=torch.float32
        )
    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    if how == "sequential":
        pipe.enable_sequential_cpu_offload(device=dev)
        return pipe
    stream = dev.type == "cuda"
    for _, module in pipe.components.items():
        if not isinstance(module, nn.Module):
            continue
        apply_group_offloading(
            module,
            onload_device=dev,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=stream,
            record_stream=stream,
        )
    return pipe


def release(*objs: Any) -> None:
    """Let go of pipelines and caches between systems (one system's memory at a time)."""
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
