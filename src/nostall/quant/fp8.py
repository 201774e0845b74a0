"""nostall's FP8 scheme: which tensors, how they are scaled, how the file says so.

Linear weights (2-D floating tensors named ``*.weight`` whose both dimensions are
multiples of 16, the shapes FP8 GEMMs take) are stored as ``float8_e4m3fn`` with one
float32 scale per output row, ``<name>_scale`` of shape ``(out,)``, chosen so the row's
largest magnitude maps to 448 (e4m3's largest finite value):
``weight ≈ q.float() * scale[:, None]``. Everything else keeps its dtype: norms and
biases (not 2-D), convolutions (not 2-D), embeddings and the first and last
projections of the common diffusion and text-encoder layouts (by name, see
:data:`DEFAULT_SKIP`; their errors reach every token or every output pixel), and
shapes FP8 GEMMs cannot take. The file's ``__metadata__`` records the scheme under
:data:`METADATA_KEY`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Iterable

import torch

__all__ = [
    "DEFAULT_SKIP",
    "E4M3_MAX",
    "METADATA_KEY",
    "SCALE_SUFFIX",
    "dequantize",
    "model_rules",
    "quantize_weight",
    "skip_reason",
]

E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale"
METADATA_KEY = "nostall_quantization"
FORMAT = "nostall-fp8-e4m3-rowwise"

# Regular expressions matched (re.search) against tensor names (relative to the component).
# Embeddings, wherever they sit (CLIP nests its token embedding), and the model's own first
# and last projections of FLUX/SD3/SDXL/Wan transformers and UNets, T5/UMT5/CLIP
# encoders: those are top-level modules, so the names are anchored at the start (FLUX's
# 38 single blocks each have a "proj_out" of their own, 3.6 GB of its 23.8; those are
# ordinary linear layers and are quantized).
DEFAULT_SKIP: tuple[str, ...] = (
    r"(^|\.)(embed_tokens|embeddings?|shared|wte|wpe|token_embedding|position_embedding)\.",
    r"^(x_embedder|context_embedder|patch_embedding|patch_embed|pos_embed)\.",
    r"^(time_text_embed|time_embedding|time_embed|timestep_embedder|condition_embedder)\.",
    r"^(add_embedding|text_embedder|guidance_embedder)\.",
    r"^(proj_out|norm_out|lm_head|final_layer|conv_in|conv_out|head)\.",
    r"(^|\.)relative_attention_bias\.",  # T5's: an nn.Embedding (files without a config)
)

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def skip_reason(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    patterns: Iterable[str],
    kept: Iterable[str] = (),
    linears: Collection[str] | None = None,
) -> str | None:
    """Why ``name`` stays in its dtype (``None``: it is quantized). ``kept``: the
    model's ``_keep_in_fp32_modules`` (module names, one dotted part each); ``linears``:
    the ``nn.Linear`` weights of the model, when it could be built (see
    :func:`model_rules`; else names and shapes decide)."""
    if dtype not in _FLOATS:
        return f"dtype {dtype}"
    if len(shape) != 2 or not name.endswith(".weight"):
        return "not a 2-D .weight"
    if shape[0] % 16 or shape[1] % 16:
        return f"shape {tuple(shape)} is not a multiple of 16"
    if linears is not None and name not in linears:
        # e.g. T5's relative_attention_bias: a 2-D .weight of an nn.Embedding
        return "not an nn.Linear weight"
    parts = name.split(".")
    for m in kept:
        if m in parts:
            # transformers' rule; T5's feed-forward casts activations to wo.weight.dtype
            return f"the model keeps it in full precision ({m} in _keep_in_fp32_modules)"
    for p in patterns:
        if re.search(p, name):
            return f"skip list ({p})"
    return None


@functools.lru_cache(maxsize=32)
def model_rules(folder: str) -> tuple[tuple[str, ...], frozenset[str] | None]:
    """``(kept, linears)`` for a component folder, from the model its ``config.json``
    names, built on ``meta`` (nothing allocated): its ``_keep_in_fp32_modules`` and the
    names of its ``nn.Linear`` weights, the only tensors FP8 computes. ``((), None)`` when
    there is no model to build (a lone file): then names and shapes decide."""
    import torch.nn as nn

    from nostall.assemble import build_empty, resolve_model_class
    from nostall.errors import NostallError

    try:
        cls = resolve_model_class(folder)
        module = build_empty(cls, folder)
    except (NostallError, ImportError):
        return (), None
    kept = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    linears = frozenset(
        f"{n}.weight" if n else "weight"
        for n, m in module.named_modules()
        if isinstance(m, nn.Linear)
    )
    return kept, linears


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` in float8_e4m3fn, ``scale`` float32 per output row."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    # An all-zero row keeps scale 1 (q is zero either way; no division by zero).
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``q`` and ``scale`` stand for, in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def scheme_metadata(quantized: int, kept: int, source_dtypes: Iterable[str]) -> str:
    return json.dumps(
        {
            "format": FORMAT,
            "version": 1,
            "weight_dtype": "float8_e4m3fn",
            "scale": f"float32 per output row, '<name>{SCALE_SUFFIX}', weight = q * scale[:, None]",
            "quantized": quantized,
            "kept": kept,
            "source_dtypes": sorted(set(source_dtypes)),
        },
        sort_keys=True,
    )
