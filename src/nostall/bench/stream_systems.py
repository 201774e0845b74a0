"""The systems ``nostall bench stream`` runs, one image or video each, and the probe that
times their denoiser: nostall resident whole (the reference), nostall resident in part
under the budget, diffusers' group offload (block level, on a stream, as its docs
recommend for speed) and diffusers' sequential CPU offload."""

from __future__ import annotations

import gc
import itertools
import time
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from nostall.stream.blocks import find_blocks

__all__ = ["PROMPT", "Probe", "call", "diffusers_offloaded", "nostall_pipe", "sync"]

PROMPT = "a lighthouse on a cliff at dusk"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Probe:
    """Times every call of ``module`` (a denoiser) and of each of its blocks, on the
    device's clock (CUDA events; the CPU's ``perf_counter`` elsewhere)."""

    def __init__(self, module: nn.Module, dev: torch.device):
        self.dev = dev
        self.calls: list[tuple[Any, Any]] = []
        self.blocks = [b.name for b in find_blocks(module)]
        self._block_marks: dict[str, list[tuple[Any, Any]]] = {n: [] for n in self.blocks}
        self._hooks = []
        mods = dict(module.named_modules())
        self._watch(module, self.calls)
        for name in self.blocks:
            self._watch(mods[name], self._block_marks[name])

    def _mark(self) -> Any:
        if self.dev.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _watch(self, m: nn.Module, into: list) -> None:
        start: list[Any] = []

        def before(mod, args):
            start.append(self._mark())

        def after(mod, args, out):
            into.append((start.pop(), self._mark()))

        self._hooks += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self.dev.type == "cuda" else b - a

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def figures(self) -> dict[str, Any]:
        """Per call of the denoiser: its seconds and the period from one call's start to
        the next one's (medians, the first call left out: a cold ring, a first launch);
        each block's median seconds per call."""
        sync(self.dev)
        calls = self.calls[1:] if len(self.calls) > 1 else self.calls
        period = [self._seconds(a[0], b[0]) for a, b in itertools.pairwise(calls)]
        blocks = {}
        for name, marks in self._block_marks.items():
            marks = marks[1:] if len(marks) > 1 else marks
            blocks[name] = (
                float(np.median([self._seconds(a, b) for a, b in marks])) if marks else 0.0
            )
        return {
            "calls": len(self.calls),
            "call_s": float(np.median([self._seconds(a, b) for a, b in calls])) if calls else None,
            "period_s": float(np.median(period)) if period else None,
            "block_s": blocks,
        }


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
