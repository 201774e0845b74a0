"""FP8 weights in a built module: linear layers that keep e4m3 storage and upcast.

A checkpoint's FP8 weights (``<name>`` in ``float8_e4m3fn`` beside ``<name>_scale``)
are adopted as they are: the module holds half the bytes. Each such ``nn.Linear``
gets its scale as a buffer and computes ``x @ (q * scale)ᵀ`` in the input's dtype
(the weight is dequantized per call, as diffusers' layerwise casting does): right on
every device. Two layouts are read: nostall's (a float32 scale per output row, see
:mod:`nostall.quant.fp8`) and the community's "scaled FP8" files (one scale per
tensor, and a ``scaled_fp8`` marker tensor, which is dropped; so are per-layer
``input_scale`` tensors, which only FP8 activations would use).

FP8 tensor-core matmuls (torchao's float8 tensors over the same storage) are issue
#10's GPU step and not built yet: this upcasting path is what runs everywhere for now,
said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from nostall.errors import CheckpointError
from nostall.quant.fp8 import SCALE_SUFFIX, dequantize

__all__ = ["install_fp8", "split_fp8"]

log = logging.getLogger(__name__)
_FP8 = (torch.float8_e4m3fn,)
_DROPPED = ("scaled_fp8",)
_said = False


def split_fp8(
    tensors: Mapping[str, torch.Tensor], *, path: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(tensors for adopt, weight name → scale)``: scales and markers taken out;
    errors name ``path`` (the checkpoint) and the tensor."""
    plain = dict(tensors)
    scales: dict[str, torch.Tensor] = {}
    fp8 = [n for n, t in plain.items() if t.dtype in _FP8 and n not in _DROPPED]
    if not fp8:
        return plain, scales
    for name in fp8:
        scale = plain.pop(name + SCALE_SUFFIX, None)
        if scale is None:
            raise CheckpointError(
                f"FP8 weight {name!r} has no {name + SCALE_SUFFIX!r}: a layout nostall does "
                "not know (unscaled FP8 would be read wrong)",
                path=path,
                tensor=name,
            )
        if not (scale.numel() == 1 or scale.reshape(-1).shape[0] == plain[name].shape[0]):
            raise CheckpointError(
                f"scale of {name!r} has shape {tuple(scale.shape)}; expected one value or one "
                f"per output row ({plain[name].shape[0]})",
                path=path,
                tensor=name + SCALE_SUFFIX,
            )
        scales[name] = scale
    for name in list(plain):
        if name in _DROPPED or name.endswith(".input_scale"):
            del plain[name]
    return plain, scales


class _FP8Linear:
    """Mixed into the layer's own class: same module, weight upcast per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.weight, self.weight_scale, x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, w, bias)


_CLASSES: dict[type, type] = {}


def install_fp8(
    module: nn.Module, scales: Mapping[str, torch.Tensor], *, path: str | None = None
) -> int:
    """Give every linear layer whose weight is FP8 its scale and the upcasting forward;
    returns how many. A scale on anything but an ``nn.Linear`` weight is a
    :class:`~nostall.CheckpointError`."""
    global _said
    for name, scale in scales.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr != "weight" or not isinstance(owner, nn.Linear):
            raise CheckpointError(
                f"FP8 tensor {name!r} is not a linear layer's weight "
                f"({type(owner).__name__}); nostall computes FP8 in nn.Linear only",
                path=path,
                tensor=name,
            )
        owner.register_buffer("weight_scale", scale.float().reshape(-1), persistent=False)
        base = type(owner)
        if not issubclass(base, _FP8Linear):
            cls = _CLASSES.get(base)
            if cls is None:
                cls = _CLASSES[base] = type(f"FP8{base.__name__}", (_FP8Linear, base), {})
            owner.__class__ = cls
    if scales and not _said:
        _said = True
        log.info(
            "FP8 weights: linear layers keep e4m3 storage and upcast per call (FP8 "
            "tensor-core matmuls are not built yet)"
        )
    return len(scales)
