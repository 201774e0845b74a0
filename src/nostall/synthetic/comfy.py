"""Wan pipelines laid out as the community ships them: ComfyUI's scaled-FP8 single files.

ComfyUI's Wan 2.1 / 2.2 transformers (``wan2.1_t2v_14B_fp8_scaled.safetensors`` and the
like) are one file each, in the original Wan key names (``blocks.0.self_attn.q.weight``,
``head.head.weight``), their block linears in e4m3 with one float32 scale per tensor
(``<layer>.scale_weight``), an input scale (``<layer>.scale_input``) and a
``scaled_fp8`` marker tensor. :func:`comfy_pipeline` writes a pipeline folder whose
transformers are such files (beside the diffusers ``config.json``, as a user puts a
downloaded file), from a diffusers pipeline folder; its other components are links to
the source's. nostall serves it as it is (:mod:`nostall.store.names`).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

from nostall.quant.fp8 import E4M3_MAX
from nostall.store import resolve, to_torch
from nostall.store.writer import StreamWriter

__all__ = ["TRANSFORMER_ROLES", "comfy_component", "comfy_pipeline", "original_wan_name"]

TRANSFORMER_ROLES = ("transformer", "transformer_2")
_LINEAR = re.compile(r"^blocks\.\d+\.(self_attn\.[qkvo]|cross_attn\.[qkvo]|ffn\.[02])\.weight$")

# diffusers' names -> Wan's, the inverse of diffusers' convert_wan_transformer_to_diffusers
# (applied in this order; norm2 and norm3 trade places).
_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("attn2", "cross_attn"),
    ("attn1", "self_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)


def original_wan_name(name: str) -> str:
    """A ``WanTransformer3DModel`` tensor's name in the original Wan layout."""
    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("proj_out."):
        return "head.head." + name.removeprefix("proj_out.")
    for ours, theirs in _TO_ORIGINAL:
        name = name.replace(ours, theirs)
    return name.replace(".scale_shift_table", ".modulation")


def comfy_component(src: str, dst: str, filename: str, *, fp8: bool = True) -> str:
    """Component folder ``dst``: ``src``'s ``config.json`` and its weights as one file
    ``filename`` in the original Wan names, block linears in ComfyUI's scaled FP8 (one
    scale per tensor) when ``fp8``. Returns the file's path."""
    ckpt = resolve(src)
    os.makedirs(dst, exist_ok=True)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    plan = []  # (source file, key, name in the output, quantized)
    entries = [("scaled_fp8", torch.float8_e4m3fn, (0,))] if fp8 else []
    for i, e in ckpt.entries():
        name = original_wan_name(e.name)
        quantized = fp8 and bool(_LINEAR.match(name))
        plan.append((ckpt.files[i].path, e.key, name, quantized))
        if quantized:
            stem = name.removesuffix("weight")
            entries += [
                (name, torch.float8_e4m3fn, e.shape),
                (stem + "scale_weight", torch.float32, ()),
                (stem + "scale_input", torch.float32, ()),
            ]
        else:
            entries.append((name, to_torch(e.dtype), e.shape))
    from safetensors import safe_open

    handles = {}
    try:
        for path in {p for p, *_ in plan}:
            handles[path] = safe_open(path, framework="pt")
        out = os.path.join(dst, filename)
        meta = {"format": "pt", "modelspec.architecture": "wan"}
        with StreamWriter(out, entries, meta) as w:
            if fp8:
                w.write("scaled_fp8", torch.zeros(0, dtype=torch.float8_e4m3fn))
            for path, key, name, quantized in plan:
                t = handles[path].get_tensor(key)
                if not quantized:
                    w.write(name, t)
                    continue
                w32 = t.float()
                scale = (w32.abs().amax() / E4M3_MAX).clamp(min=1e-12)
                w.write(name, (w32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
                w.write(name.removesuffix("weight") + "scale_weight", scale.reshape(()))
                w.write(name.removesuffix("weight") + "scale_input", torch.ones(()))
    finally:
        handles.clear()
    return out


def comfy_pipeline(src: str, dst: str) -> str:
    """Pipeline folder ``dst``: ``src``'s (a diffusers Wan pipeline folder) with each
    transformer as a ComfyUI scaled-FP8 single file, the other components linked."""
    with open(os.path.join(src, "model_index.json")) as f:
        index = json.load(f)
    os.makedirs(dst, exist_ok=True)
    shutil.copyfile(os.path.join(src, "model_index.json"), os.path.join(dst, "model_index.json"))
    for role, spec in index.items():
        if role.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        target = os.path.join(dst, role)
        if role in TRANSFORMER_ROLES:
            comfy_component(os.path.join(src, role), target, f"wan_{role}_fp8_scaled.safetensors")
        elif not os.path.lexists(target):
            source = os.path.realpath(os.path.join(src, role))
            os.symlink(os.path.relpath(source, os.path.realpath(dst)), target)  # moves with it
    return dst
