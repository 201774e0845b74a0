"""FP8 weights in a built module: e4m3 storage, FP8 tensor cores where the GPU has them.

A checkpoint's FP8 weights (``<name>`` in ``float8_e4m3fn`` beside ``<name>_scale``)
are adopted as they are: the module holds half the bytes. Two layouts are read in that
form (nostall's, a float32 scale per output row, see :mod:`nostall.quant.fp8`; the
community's "scaled FP8" files, one scale per tensor, a ``scaled_fp8`` marker tensor and
per-layer ``input_scale`` tensors, both dropped) and torchao's flattened layout is
renamed into it first (:mod:`nostall.quant.layouts`).

Each such ``nn.Linear`` keeps its parameter names (``weight`` in e4m3, ``weight_scale``
a buffer) and gets nostall's FP8 forward (:func:`nostall.quant.linear.fp8_linear`):
FP8 tensor cores on CUDA GPUs of compute capability 8.9 or newer (activations
quantized per row in one kernel), the weight upcast per call elsewhere. The same
forward runs in ``load_model``'s modules and in the model cache's, so both give the
same bits. Which one ran is said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
import torch.nn as nn

from nostall.errors import CheckpointError
from nostall.quant.fp8 import SCALE_SUFFIX, dequantize
from nostall.quant.linear import fp8_linear

__all__ = ["fp8_compute", "install_fp8", "keep_in_fp32", "prepare_fp8", "split_fp8"]

log = logging.getLogger(__name__)
_FP8 = (torch.float8_e4m3fn,)
_DROPPED = ("scaled_fp8",)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        if plain[name].dim() != 2:
            raise CheckpointError(
                f"FP8 tensor {name!r} has shape {tuple(plain[name].shape)}; nostall reads FP8 "
                "linear weights (2-D) only",
                path=path,
                tensor=name,
            )
        if scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(
                f"scale of {name!r} is {scale.dtype}; FP8 scales are floating point "
                "(float32, bf16 or fp16): the file was written by a tool nostall does not know",
                path=path,
                tensor=name + SCALE_SUFFIX,
            )
        rows = plain[name].shape[0]
        if not (scale.numel() == 1 or (scale.numel() == rows and max(scale.shape) == rows)):
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
    """Mixed into the layer's own class: same module, same parameter names (the e4m3
    ``weight``, the ``weight_scale`` buffer), FP8 forward (:func:`fp8_linear`)."""

    _fp8_tensor_cores: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(
            x, self.weight, self.weight_scale, self.bias, tensor_cores=self._fp8_tensor_cores
        )


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
    from nostall.quant.kernels import triton_available

    how = "one Triton kernel" if triton_available() else "torch ops (no Triton: slower)"
    return "tensor-cores", f"scaled_mm on {device}, activations quantized per row by {how}"


def keep_in_fp32(module: nn.Module) -> tuple[str, ...]:
    """The model's ``_keep_in_fp32_modules`` (transformers and diffusers declare them):
    layers whose callers read their weight's dtype or need its precision (T5's ``wo``:
    its feed-forward casts activations to ``wo.weight.dtype``)."""
    return _declared_fp32(module.modules())


def _declared_fp32(modules: Iterable[nn.Module]) -> tuple[str, ...]:
    found: list[str] = []
    for sub in modules:
        found.extend(_own_attribute(sub, "_keep_in_fp32_modules") or ())
    return tuple(sorted(set(found)))


def _own_attribute(sub: nn.Module, attr: str) -> object:
    # getattr(sub, attr, None) without falling back on Module.__getattr__ (parameters,
    # buffers, submodules): raising its AttributeError for each of FLUX's ~1300 modules
    # that lack the attribute cost 4 ms.
    if hasattr(type(sub), attr) or attr in sub.__dict__:
        return getattr(sub, attr, None)
    return None


def _kept(name: str, patterns: tuple[str, ...]) -> bool:
    # transformers' own rule: a pattern names one dotted part of the parameter's name.
    parts = name.split(".")
    return any(p in parts for p in patterns)


def install_fp8(
    module: nn.Module,
    scales: Mapping[str, torch.Tensor],
    *,
    path: str | None = None,
    compute: str = "auto",
    dequantize_kept: bool = True,
) -> int:
    """Give every linear layer whose weight is FP8 its scale and its way to compute
    (``compute``: ``"auto"`` picks by :func:`fp8_compute`; ``"tensor-cores"`` or
    ``"upcast"`` force one); returns how many layers.

    Float32 scales become buffers as they are, unread (views, while the model cache may
    still be copying them; it casts scales to float32 on the way in); others are cast.

    A layer the model keeps in float32 (:func:`keep_in_fp32`) cannot run FP8: its
    caller casts activations to its weight's dtype. ``nostall quantize`` leaves those
    layers alone; a file from elsewhere that converted them gets them dequantized here
    into the model's dtype (``dequantize_kept``, reads the weights: ``load_model``), or
    a :class:`~nostall.CheckpointError` that says so (the model cache, whose weights
    may still be in flight). A scale on anything but an ``nn.Linear`` weight is a
    :class:`~nostall.CheckpointError`.
    """
    # One walk for all the layers: a get_submodule per weight cost FLUX's 494 layers
    # 12 ms. A name the walk does not list (a second name of a shared layer, or none)
    # is left to get_submodule, which finds it or raises as before.
    submodules = dict(module.named_modules())
    kept_patterns = _declared_fp32(submodules.values())  # keep_in_fp32(), same walk
    owners: list[nn.Linear] = []
    kept: list[tuple[str, nn.Linear, torch.Tensor]] = []
    for name, scale in scales.items():
        owner_name, _, attr = name.rpartition(".")
        owner = submodules.get(owner_name)
        if owner is None:
            owner = module.get_submodule(owner_name)
        if attr != "weight" or not isinstance(owner, nn.Linear):
            raise CheckpointError(
                f"FP8 tensor {name!r} is not a linear layer's weight "
                f"({type(owner).__name__}); nostall computes FP8 in nn.Linear only",
                path=path,
                tensor=name,
            )
        if _kept(name, kept_patterns):
            if not dequantize_kept:
                raise CheckpointError(
                    f"FP8 weight {name!r} is in a layer {type(module).__name__} keeps in "
                    f"float32 (_keep_in_fp32_modules={list(kept_patterns)}): its caller casts "
                    "activations to that weight's dtype, so it cannot compute in FP8. Convert "
                    "the original with nostall quantize (which keeps those layers), or load "
                    "this file with nostall.load_model (which dequantizes them)",
                    path=path,
                    tensor=name,
                )
            kept.append((name, owner, scale))
            continue
        if scale.dtype != torch.float32:
            scale = scale.float()  # reads it: the model cache casts on the way in instead
        owner.register_buffer("weight_scale", scale.reshape(-1), persistent=False)
        base = _base(type(owner))
        cls = _CLASSES.get(base)
        if cls is None:
            cls = _CLASSES[base] = type(f"FP8{base.__name__}", (_FP8Linear, base), {})
        owner.__class__ = cls
        owners.append(owner)
    if kept:
        _dequantize_kept(module, kept)
    if not owners:
        return len(kept)
    how, why = fp8_compute(owners[0].weight_scale.device)
    if compute != "auto":
        how, why = compute, f"asked for {compute}"
    cores = 0
    for owner in owners:
        rows, cols = owner.weight.shape
        # scaled_mm takes K and N in multiples of 16; quantize only writes such layers.
        owner._fp8_tensor_cores = how == "tensor-cores" and rows % 16 == 0 and cols % 16 == 0
        cores += owner._fp8_tensor_cores
    message = (
        f"FP8 weights: {cores} of {len(owners)} linear layers on FP8 tensor cores ({why}), "
        "the rest upcast per call"
        if how == "tensor-cores"
        else f"FP8 weights: linear layers keep e4m3 storage and upcast per call ({why})"
    )
    _say_once(message)
    return len(owners) + len(kept)


def _dequantize_kept(module: nn.Module, kept: list[tuple[str, nn.Linear, torch.Tensor]]) -> None:
    dtype = next(
        (p.dtype for p in module.parameters() if p.is_floating_point() and p.dtype.itemsize > 1),
        torch.float32,
    )
    extra = 0
    for _name, owner, scale in kept:
        w = dequantize(owner.weight.detach(), scale.reshape(-1), dtype)
        owner.weight = nn.Parameter(w, requires_grad=False)
        extra += w.numel() * (w.element_size() - 1)
    _say_once(
        f"FP8 weights: {len(kept)} linear layers that {type(module).__name__} keeps in full "
        f"precision were dequantized to {dtype} at load (+{extra / 1e9:.2f} GB); "
        "nostall quantize leaves those layers unconverted"
    )


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info("%s", message)


def _base(cls: type) -> type:
    """The layer's own class under nostall's FP8 mixin."""
    if issubclass(cls, _FP8Linear):
        return next(b for b in cls.__mro__[1:] if not issubclass(b, _FP8Linear))
    return cls
