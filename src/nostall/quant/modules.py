"""FP8 weights in a built module: e4m3 storage, FP8 tensor cores where the GPU has them.

A checkpoint's FP8 weights (``<name>`` in ``float8_e4m3fn`` beside ``<name>_scale``)
are adopted as they are: the module holds half the bytes. Two layouts are read in that
form (nostall's, a float32 scale per output row, see :mod:`nostall.quant.fp8`; the
community's "scaled FP8" files, one scale per tensor, a ``scaled_fp8`` marker tensor and
per-layer ``input_scale`` tensors, both dropped) and torchao's flattened layout is
renamed into it first (:mod:`nostall.quant.layouts`).

Each such ``nn.Linear`` then computes in one of two ways, chosen once per load:

* **FP8 tensor cores** (CUDA GPUs of compute capability 8.9 or newer, with torchao):
  the weight parameter becomes torchao's ``Float8Tensor`` built directly over the loaded
  e4m3 view and its scales (``torch.utils.swap_tensors``: the same parameter object, no
  copy), and each call quantizes the activation per row and multiplies with
  ``torch._scaled_mm``. Layers whose dimensions are not multiples of 16 upcast instead.
* **Upcast per call** (CPU, older GPUs, no torchao): the scale becomes a buffer and the
  layer computes ``x @ (q * scale)ᵀ`` in the input's dtype, as diffusers' layerwise
  casting does.

Which one ran is said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from nostall.errors import CheckpointError
from nostall.quant.fp8 import SCALE_SUFFIX, dequantize

__all__ = ["fp8_compute", "install_fp8", "prepare_fp8", "split_fp8"]

log = logging.getLogger(__name__)
_FP8 = (torch.float8_e4m3fn,)
_DROPPED = ("scaled_fp8",)
_said: set[str] = set()


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


def prepare_fp8(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    path: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Any FP8 layout nostall reads → ``(tensors for adopt, weight name → scale)``."""
    from nostall.quant.layouts import from_torchao, is_torchao_layout

    if is_torchao_layout(tensors, metadata):
        tensors = from_torchao(tensors, metadata, path=path)
    return split_fp8(tensors, path=path)


def fp8_compute(device: torch.device) -> tuple[str, str]:
    """``("tensor-cores" | "upcast", why)`` for FP8 linear layers on ``device``."""
    if device.type != "cuda":
        return "upcast", f"no FP8 matmul on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return "upcast", f"{device} is compute capability {major}.{minor}; FP8 needs 8.9+"
    if not hasattr(torch, "_scaled_mm"):
        return "upcast", f"torch {torch.__version__} has no _scaled_mm"
    try:
        _torchao()
    except ImportError as e:
        return "upcast", f"torchao is not importable ({e}; pip install torchao)"
    return "tensor-cores", f"torchao Float8Tensor, per-row scaled_mm on {device}"


def _torchao():
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (
        Float8Tensor,
        QuantizeTensorToFloat8Kwargs,
    )

    return Float8Tensor, QuantizeTensorToFloat8Kwargs, PerRow, Float8MMConfig


def install_fp8(
    module: nn.Module,
    scales: Mapping[str, torch.Tensor],
    *,
    path: str | None = None,
    compute: str = "auto",
) -> int:
    """Give every linear layer whose weight is FP8 its scale and its way to compute
    (``compute``: ``"auto"`` picks by :func:`fp8_compute`; ``"tensor-cores"`` or
    ``"upcast"`` force one); returns how many layers. A scale on anything but an
    ``nn.Linear`` weight is a :class:`~nostall.CheckpointError`."""
    owners: list[nn.Linear] = []
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
        base = _base(type(owner))
        cls = _CLASSES.get(base)
        if cls is None:
            cls = _CLASSES[base] = type(f"FP8{base.__name__}", (_FP8Linear, base), {})
        owner.__class__ = cls
        owners.append(owner)
    if not owners:
        return 0
    how, why = fp8_compute(owners[0].weight_scale.device)
    if compute != "auto":
        how, why = compute, f"asked for {compute}"
    cores = 0
    if how == "tensor-cores":
        for owner in owners:
            rows, cols = owner.weight.shape
            if rows % 16 == 0 and cols % 16 == 0:
                _to_float8_tensor(owner)
                cores += 1
    message = (
        f"FP8 weights: {cores} of {len(owners)} linear layers on FP8 tensor cores ({why}), "
        "the rest upcast per call"
        if how == "tensor-cores"
        else f"FP8 weights: linear layers keep e4m3 storage and upcast per call ({why})"
    )
    if message not in _said:
        _said.add(message)
        log.info("%s", message)
    return len(owners)


def _base(cls: type) -> type:
    """The layer's own class under nostall's FP8 mixin."""
    if issubclass(cls, _FP8Linear):
        return next(b for b in cls.__mro__[1:] if not issubclass(b, _FP8Linear))
    return cls


def _to_float8_tensor(owner: nn.Linear) -> None:
    """Rebind ``owner.weight`` to a torchao ``Float8Tensor`` over the same e4m3 bytes and
    its scales; the layer returns to its own class (``F.linear`` dispatches to torchao)."""
    Float8Tensor, ActKwargs, PerRow, Float8MMConfig = _torchao()
    from torchao.quantization.granularity import PerTensor

    q = owner.weight.detach()
    rows, cols = q.shape
    s = owner.weight_scale
    # Views only: in the model cache this runs while the weights are still being copied.
    if s.numel() == rows:  # one scale per output row; activations quantized per row
        scale, block, act = s.reshape(rows, 1), [1, cols], PerRow()
    else:  # one scale per tensor (scaled-FP8 files); activations per tensor
        scale, block, act = s.reshape(1, 1), [rows, cols], PerTensor()
    dtype = owner.bias.dtype if owner.bias is not None else torch.bfloat16
    w = Float8Tensor(
        q,
        scale,
        block_size=block,
        mm_config=Float8MMConfig(use_fast_accum=True),
        act_quant_kwargs=ActKwargs(granularity=act),
        dtype=dtype,
    )
    new = nn.Parameter(w, requires_grad=False)
    try:
        torch.utils.swap_tensors(owner.weight, new)  # same Parameter object, new contents
    except RuntimeError:  # e.g. something holds a weak reference to it
        owner.weight = new
    owner.__class__ = _base(type(owner))
