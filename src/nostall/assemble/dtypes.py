"""Which dtype ``from_pretrained(torch_dtype=...)`` would give each tensor.

Loading "in bf16" does not mean every tensor in bf16: both libraries keep
listed modules in float32 (``_keep_in_fp32_modules``), with different rules.
A loader that casts before :func:`~nostall.assemble.adopt` needs the same
per-tensor answer to produce the same model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn as nn

from nostall.assemble.resolve import library_of

__all__ = ["target_dtypes"]


def _names(module: nn.Module, attr: str) -> list[str]:
    return sorted(set(getattr(module, attr, None) or ()))


def target_dtypes(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Map each floating-point parameter/persistent buffer name to its load dtype.

    Mirrors ``from_pretrained(torch_dtype=dtype)`` (diffusers) and
    ``from_pretrained(dtype=dtype)`` (transformers). Names absent from the result
    (integer buffers, say) keep the checkpoint's dtype.

    * diffusers: float32 for names with a ``_keep_in_fp32_modules`` entry as
      one dotted component (e.g. Wan's ``time_embedder``), ``dtype`` otherwise;
    * transformers: float32 for names matching ``_keep_in_fp32_modules`` when
      ``dtype`` is float16 (T5's ``wo``: not for bfloat16) or
      ``_keep_in_fp32_modules_strict`` when it is float16 or bfloat16; otherwise
      the dtype the empty module gave the parameter, so build the module with
      ``build_empty(..., dtype=dtype)`` first; parameters whose class fixes
      their dtype keep it, as in transformers;
    * anything else: ``dtype``.

    Example (a one-layer T5 built from a config dict; a checkpoint folder works the same)::

        >>> from transformers import T5EncoderModel
        >>> from nostall.assemble import build_empty
        >>> config = {"vocab_size": 32, "d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 1, "num_heads": 2}
        >>> module = build_empty(T5EncoderModel, config, dtype=torch.float16)
        >>> target_dtypes(module, torch.float16)["encoder.block.0.layer.1.DenseReluDense.wo.weight"]
        torch.float32
        >>> tensors = {k: torch.zeros(t.shape) for k, t in module.state_dict().items()}
        >>> tensors = {k: t.to(target_dtypes(module, torch.float16).get(k, t.dtype)) for k, t in tensors.items()}
        >>> tensors["shared.weight"].dtype
        torch.float16
    """
    library = library_of(type(module))
    # keep_vars: the module's own (meta) tensors, whose dtype is what we read.
    entries = {
        name: t for name, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()
    }
    fp32 = torch.float32
    if library == "diffusers":
        keep = set(_names(module, "_keep_in_fp32_modules"))
        return {name: fp32 if keep.intersection(name.split(".")) else dtype for name in entries}
    if library == "transformers":
        globs = []
        if dtype == torch.float16:
            globs += _names(module, "_keep_in_fp32_modules")
        if dtype in (torch.float16, torch.bfloat16):
            globs += _names(module, "_keep_in_fp32_modules_strict")
        # transformers matches these as globs searched anywhere in the name.
        pattern = re.compile("|".join(g.replace("*", ".*") for g in globs)) if globs else None
        return {
            name: fp32 if pattern is not None and pattern.search(name) else t.dtype
            for name, t in entries.items()
        }
    return dict.fromkeys(entries, dtype)


def as_stored_dtypes(module: nn.Module, stored: Mapping[str, str]) -> dict[str, torch.dtype] | None:
    """The load dtypes of a module loaded as stored (no ``dtype``): each tensor in the
    checkpoint's dtype (``stored``: name → safetensors dtype, ``"BF16"``), except a
    diffusers module's ``_keep_in_fp32_modules`` stored in 16 bits, in float32, as
    ``from_pretrained(torch_dtype=<the stored dtype>)`` loads them (Wan's time embedder
    and norms). ``None`` when nothing differs from the checkpoint.

        >>> from diffusers import WanTransformer3DModel
        >>> from nostall.assemble import build_empty
        >>> m = build_empty(WanTransformer3DModel, dict(num_attention_heads=1, attention_head_dim=8,
        ...     in_channels=4, out_channels=4, text_dim=8, freq_dim=8, ffn_dim=8, num_layers=1))
        >>> out = as_stored_dtypes(m, dict.fromkeys(m.state_dict(), "BF16"))
        >>> out["condition_embedder.time_embedder.linear_1.weight"], len(out) < len(m.state_dict())
        (torch.float32, True)
    """
    if library_of(type(module)) != "diffusers":
        return None
    keep = set(_names(module, "_keep_in_fp32_modules"))
    if not keep:  # FLUX: nothing to look for in its 1654 names
        return None
    out = {
        name: torch.float32
        for name, d in stored.items()
        if d in ("F16", "BF16") and keep.intersection(name.split("."))
    }
    return out or None
