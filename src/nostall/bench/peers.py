"""The loaders nostall is measured against, each called the way its users call it.

Every method takes the component folder and the device and returns what it
loaded (a state dict or a module), after the device has finished the copies.
Peers that are not installed are reported as skipped, never silently dropped.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nostall.synthetic.checkpoints import WEIGHTS

__all__ = ["PEERS", "Method", "missing_requirement"]


@dataclass(frozen=True)
class Method:
    """A way to load the checkpoint. ``needs`` lists the modules it imports."""

    name: str
    run: Callable[[str, torch.device], Any]
    needs: tuple[str, ...] = ()
    cuda_only: bool = False
    # Keep the caching allocator's blocks between runs (a worker that swaps models of
    # one size reuses device memory); by default each run starts from empty_cache().
    keep_allocator: bool = False


def missing_requirement(method: Method, device: torch.device) -> str | None:
    """Why ``method`` cannot run here, or ``None``."""
    if method.cuda_only and device.type != "cuda":
        return "needs a CUDA device"
    for mod in method.needs:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return None


def _safetensors(folder: str, device: torch.device):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, WEIGHTS), device=str(device))


def _diffusers_to(folder: str, device: torch.device):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device)


def _diffusers_device_map(folder: str, device: torch.device):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(
        folder, torch_dtype=torch.bfloat16, device_map=str(device)
    )


def _fastsafetensors(folder: str, device: torch.device):
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), device=str(device), nogds=True)
    try:
        loader.add_filenames({0: [os.path.join(folder, WEIGHTS)]})
        buffers = loader.copy_files_to_device()
        try:
            # Its tensors are views of a buffer freed by close(): keep clones, as a
            # caller that outlives the loader must.
            return {k: buffers.get_tensor(k).clone() for k in loader.get_keys()}
        finally:
            buffers.close()
    finally:
        loader.close()


def _runai(folder: str, device: torch.device):
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(os.path.join(folder, WEIGHTS))
        for name, tensor in streamer.get_tensors():
            out[name] = tensor.to(device)
    return out


PEERS: tuple[Method, ...] = (
    Method("safetensors load_file", _safetensors, ("safetensors",)),
    Method("diffusers from_pretrained + .to", _diffusers_to, ("diffusers",)),
    Method("diffusers device_map", _diffusers_device_map, ("diffusers",)),
    Method("fastsafetensors (no GDS)", _fastsafetensors, ("fastsafetensors",), cuda_only=True),
    Method("runai-model-streamer + .to", _runai, ("runai_model_streamer",)),
)
