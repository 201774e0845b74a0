"""FP8 checkpoint layouts nostall reads, brought to one form before a module adopts them.

nostall's form (what :func:`nostall.quantize` writes, and what
:func:`nostall.quant.modules.split_fp8` takes): ``<name>`` in ``float8_e4m3fn`` beside
``<name>_scale`` (float32, one value per output row or one per tensor).

* The community's scaled-FP8 files use that form with one scale per tensor, a
  ``scaled_fp8`` marker tensor and ``input_scale`` tensors (dropped by ``split_fp8``);
  ComfyUI's own names (``scale_weight``, ``scale_input``, and a model's original key
  names) are read under these by the store (:mod:`nostall.store.names`).
* torchao's flattened tensor state dict (``torchao.prototype.safetensors``, what
  diffusers and transformers save for a ``quantize_``d model) stores a ``Float8Tensor``
  weight ``<module>.<attr>`` as ``<module>._<attr>_qdata`` and ``<module>._<attr>_scale``
  (float32 ``(out, 1)`` per row, or one value), described by a JSON entry under the
  weight's name in the file's ``__metadata__``, and lists every tensor in
  ``tensor_names``. :func:`from_torchao` renames those two tensors into nostall's form
  (views: nothing is copied). Block sizes other than per-row and per-tensor (e.g. 128 x
  128 blocks) and torchao tensor types other than ``Float8Tensor`` are refused with a
  :class:`~nostall.CheckpointError` naming the tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import torch

from nostall.errors import CheckpointError
from nostall.quant.fp8 import SCALE_SUFFIX

__all__ = ["from_torchao", "is_torchao_layout"]

_QDATA = re.compile(r"^(?:(.*)\.)?_([A-Za-z0-9_]+?)_qdata$")


def is_torchao_layout(names, metadata: Mapping[str, str]) -> bool:
    """Whether a checkpoint with these tensor names and metadata is torchao-flattened."""
    return "tensor_names" in metadata and any(_QDATA.match(n) for n in names)


def from_torchao(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    path: str | None = None,
) -> dict[str, torch.Tensor]:
    """``tensors`` with torchao's flattened ``Float8Tensor`` weights renamed into nostall's
    FP8 form; other tensors pass through."""
    out = dict(tensors)
    for flat in [n for n in tensors if _QDATA.match(n)]:
        owner, attr = _QDATA.match(flat).groups()
        name = f"{owner}.{attr}" if owner else attr
        scale_name = f"{owner}._{attr}_scale" if owner else f"_{attr}_scale"
        info = _describe(metadata, name, path)
        kind = info.get("_type")
        if kind != "Float8Tensor":
            raise CheckpointError(
                f"{name!r} is a torchao {kind} tensor; nostall reads torchao's Float8Tensor "
                "(e4m3 with per-row or per-tensor scales) only",
                path=path,
                tensor=name,
            )
        q = out.pop(flat)
        scale = out.pop(scale_name, None)
        if scale is None:
            raise CheckpointError(
                f"torchao FP8 weight {name!r} has {flat!r} but no {scale_name!r}",
                path=path,
                tensor=name,
            )
        if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
            raise CheckpointError(
                f"{flat!r} is {q.dtype} {tuple(q.shape)}; nostall reads 2-D float8_e4m3fn",
                path=path,
                tensor=flat,
            )
        block = list((info.get("_data") or {}).get("block_size") or [])
        rows, cols = q.shape
        if block == [1, cols] and scale.numel() == rows:
            scale = scale.reshape(rows)  # per output row
        elif block in ([rows, cols], []) and scale.numel() == 1:
            scale = scale.reshape(())  # one per tensor
        else:
            raise CheckpointError(
                f"{name!r}: torchao block size {block} with a scale of shape "
                f"{tuple(scale.shape)} (blockwise FP8); nostall reads per-row and per-tensor "
                "scales",
                path=path,
                tensor=scale_name,
            )
        out[name] = q
        out[name + SCALE_SUFFIX] = scale
    return out


def _describe(metadata: Mapping[str, str], name: str, path: str | None) -> dict:
    raw = metadata.get(name)
    if raw is None:
        raise CheckpointError(
            f"torchao-flattened tensor {name!r} has no description in the file's metadata",
            path=path,
            tensor=name,
        )
    try:
        info = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"the metadata entry of {name!r} is not JSON ({e})", path=path, tensor=name
        ) from e
    if not isinstance(info, dict):
        raise CheckpointError(f"the metadata entry of {name!r} is not an object", path=path)
    return info
