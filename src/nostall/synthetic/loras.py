"""Random LoRA files for synthetic pipelines: a seeded low-rank adapter on every usual target
layer of a pipeline folder, written in the key format diffusers' ``load_lora_weights`` reads.

:func:`write_lora` reads the folder's ``model_index.json`` and component configs, builds the
denoiser (and with ``text_encoder=True`` the CLIP text encoders) on the ``meta`` device to find
the target ``nn.Linear`` layers, draws ``A`` (rank × in) and ``B`` (out × rank) from a seeded
normal distribution and writes one safetensors file. ``B`` is not zero, so the adapter changes
what the pipeline draws. Nothing of the base weights is read: a tiny store and a real-size one
take the same path.

Two key formats:

* ``peft``, what ``pipe.save_lora_weights`` writes: ``transformer.<module>.lora_A.weight`` and
  ``.lora_B.weight`` (``unet.`` for SDXL, ``text_encoder.`` / ``text_encoder_2.`` for the
  text encoders, whose modules are spelled ``text_model.encoder.layers.…`` as every file in the
  wild has them). ``alpha`` goes where diffusers reads it back for this format: the header's
  ``lora_adapter_metadata`` entry, a JSON object of ``<component>.r``, ``<component>.lora_alpha``
  and ``<component>.target_modules`` that diffusers turns into each component's ``LoraConfig``.
  Without ``alpha`` there is no such entry and diffusers takes ``lora_alpha = r`` (scale 1).
* ``kohya`` (SDXL), what kohya-ss/sd-scripts writes: ``lora_unet_<sgm module>.lora_down.weight``,
  ``.lora_up.weight`` and a scalar ``.alpha`` per layer, UNet modules under the original
  (SGM) block names, ``input_blocks_4_1_transformer_blocks_0_attn1_to_q``, which diffusers maps
  back to ``down_blocks.1.attentions.0…`` from the UNet's config; text encoders as
  ``lora_te1_text_model_encoder_layers_0_self_attn_q_proj`` (``lora_te2_`` for the second).

>>> import nostall.synthetic, tempfile
>>> store = nostall.synthetic.write_store(tempfile.mkdtemp(), ("sdxl",))  # doctest: +SKIP
>>> nostall.synthetic.write_lora(store["sdxl"], "/tmp/a.safetensors", fmt="kohya")  # doctest: +SKIP
{'path': '/tmp/a.safetensors', 'format': 'kohya', 'rank': 4, 'alpha': 4.0, 'layers': 48, ...}
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nostall.errors import ArgumentError, InternalError, UnsupportedError

__all__ = ["CLIP_TARGETS", "FLUX_TARGETS", "FORMATS", "UNET_TARGETS", "write_lora"]

FORMATS = ("peft", "kohya")

FLUX_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "proj_mlp",
    "proj_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
UNET_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
    "proj_in",
    "proj_out",
)
CLIP_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


@dataclass(frozen=True)
class _Family:
    """Where a pipeline class keeps what a LoRA adapts."""

    denoiser: str  # the component folder: "transformer" or "unet"
    text_encoders: tuple[str, ...]  # the CLIP text encoders diffusers loads LoRA layers into
    targets: tuple[str, ...]  # default suffixes of the denoiser's target layers
    scope: str  # a denoiser layer is a target only inside what this regex matches
    formats: tuple[str, ...]


_BLOCKS = r"(single_)?transformer_blocks\.\d+\."
# UNet LoRAs adapt the transformer inside each attention block, never the resnets.
_ATTENTIONS = r"(down_blocks\.\d+|mid_block|up_blocks\.\d+)\.attentions\.\d+\."
_FAMILIES = {
    "FluxPipeline": _Family("transformer", ("text_encoder",), FLUX_TARGETS, _BLOCKS, ("peft",)),
    "StableDiffusion3Pipeline": _Family(
        "transformer", ("text_encoder", "text_encoder_2"), FLUX_TARGETS, _BLOCKS, ("peft",)
    ),
    "StableDiffusionXLPipeline": _Family(
        "unet", ("text_encoder", "text_encoder_2"), UNET_TARGETS, _ATTENTIONS, FORMATS
    ),
}
_CLIP_LAYERS = r"text_model\.encoder\.layers\.\d+\."
# kohya-ss names the text encoders by position: lora_te1_ (CLIP-L), lora_te2_ (OpenCLIP-G).
_KOHYA_PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def write_lora(
    pipeline: str | os.PathLike,
    out: str | os.PathLike,
    *,
    rank: int = 4,
    alpha: float | None = None,
    text_encoder: bool = False,
    fmt: str = "peft",
    seed: int = 0,
    std: float = 0.05,
    targets: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write a random LoRA for the pipeline folder ``pipeline`` to the file ``out``.

    Every ``nn.Linear`` of the denoiser whose qualified name ends with one of ``targets`` gets
    an adapter: by default the attention, feed-forward and (FLUX) single-block projections
    inside the transformer blocks, or inside the UNet's attention blocks for SDXL (see
    ``FLUX_TARGETS`` and ``UNET_TARGETS``). ``text_encoder=True`` also adapts the CLIP text
    encoders' ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``fc1`` and ``fc2``.

    ``A`` and ``B`` are float32, drawn from ``N(0, std²)`` by one generator seeded with
    ``seed``, layer after layer in module order (denoiser, then text encoders), so the same
    arguments give the same tensors (safetensors orders the header's metadata as it likes)
    and the two formats the same values. ``alpha`` (default
    ``rank``) scales the adapter by ``alpha / rank`` when loaded. The file is written under a
    temporary name beside ``out`` and renamed into place.

    Returns ``{"path", "format", "rank", "alpha", "layers", "bytes", "components"}``:
    ``layers`` counts the adapted layers of all components, ``components`` names them in
    order, ``alpha`` is the effective one.

    >>> write_lora("/tmp/store/flux", "/tmp/flux-lora.safetensors")  # doctest: +SKIP
    {'path': '/tmp/flux-lora.safetensors', 'format': 'peft', 'rank': 4, 'alpha': 4.0, ...}
    """
    folder = os.fspath(pipeline)
    path = os.fspath(out)
    family, index = _family(folder)
    cls = index["_class_name"]
    _check(rank=rank, alpha=alpha, std=std, seed=seed, fmt=fmt, family=family, pipeline=cls)
    suffixes = _targets(targets, family)
    if os.path.isdir(path):
        raise ArgumentError(f"out={path!r} is a folder; pass a file name", field="out")

    layers: dict[str, dict[str, tuple[int, int]]] = {}
    denoiser = _meta_model(folder, family.denoiser, index)
    layers[family.denoiser] = _linears(denoiser, suffixes, family.scope)
    if not layers[family.denoiser]:
        raise ArgumentError(
            f"no nn.Linear of {folder}/{family.denoiser} ends with any of {list(suffixes)}; "
            f"the defaults for this pipeline are {list(family.targets)}",
            field="targets",
        )
    if text_encoder:
        for name in family.text_encoders:
            model = _meta_model(folder, name, index)
            layers[name] = _linears(model, CLIP_TARGETS, _CLIP_LAYERS, clip=True)

    tensors = _draw(layers, rank=rank, seed=seed, std=std)
    effective = float(rank if alpha is None else alpha)
    if fmt == "peft":
        metadata = {"format": "pt"}
        if alpha is not None:
            metadata["lora_adapter_metadata"] = _peft_metadata(layers, rank, alpha)
        tensors = {f"{c}.{m}.lora_{ab}.weight": t for (c, m, ab), t in tensors.items()}
    else:
        tensors = _kohya(tensors, _config(folder, family.denoiser), effective)
        metadata = {
            "format": "pt",
            "ss_network_module": "networks.lora",
            "ss_network_dim": str(rank),
            "ss_network_alpha": str(effective),
        }
    size = _save(tensors, metadata, path)
    return {
        "path": path,
        "format": fmt,
        "rank": rank,
        "alpha": effective,
        "layers": sum(len(v) for v in layers.values()),
        "bytes": size,
        "components": list(layers),
    }


def _family(folder: str) -> tuple[_Family, dict[str, Any]]:
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise ArgumentError(
            f"{folder!r} is not a diffusers pipeline folder: it has no model_index.json; "
            "pass a folder written by write_store or save_pretrained",
            field="pipeline",
        )
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise ArgumentError(
            f"cannot read {index_path!r} ({e}); pass a folder written by write_store or "
            "save_pretrained",
            field="pipeline",
        ) from e
    cls = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(cls, str):
        raise ArgumentError(
            f"{index_path!r} names no pipeline class (_class_name); pass a folder written by "
            "write_store or save_pretrained",
            field="pipeline",
        )
    if cls not in _FAMILIES:
        raise UnsupportedError(
            f"write_lora cannot write a LoRA for a {cls} ({folder!r}); it knows {sorted(_FAMILIES)}"
        )
    return _FAMILIES[cls], index


def _check(
    *,
    rank: int,
    alpha: float | None,
    std: float,
    seed: int,
    fmt: str,
    family: _Family,
    pipeline: str,
) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ArgumentError(f"rank={rank!r}; pass a positive int such as 4", field="rank")
    if alpha is not None and not (
        isinstance(alpha, int | float) and not isinstance(alpha, bool) and math.isfinite(alpha)
    ):
        raise ArgumentError(f"alpha={alpha!r}; pass a finite number or None", field="alpha")
    if alpha is not None and alpha <= 0:
        raise ArgumentError(f"alpha={alpha!r}; pass a positive number or None", field="alpha")
    if not (isinstance(std, int | float) and math.isfinite(std) and std > 0):
        raise ArgumentError(f"std={std!r}; pass a positive finite number", field="std")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentError(f"seed={seed!r}; pass an int", field="seed")
    if fmt not in family.formats:
        why = "" if fmt in FORMATS else f" (write_lora knows {list(FORMATS)})"
        raise ArgumentError(
            f"fmt={fmt!r} is not supported for a {pipeline}{why}; "
            f"choose one of {list(family.formats)}",
            field="fmt",
            allowed=family.formats,
        )


def _targets(targets: Sequence[str] | None, family: _Family) -> tuple[str, ...]:
    if targets is None:
        return family.targets
    if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets):
        raise ArgumentError(
            f"targets={targets!r}; pass a list of module name suffixes such as ['to_q', 'to_k']",
            field="targets",
        )
    if not targets:
        raise ArgumentError("targets is empty; pass None for the defaults", field="targets")
    return tuple(targets)


def _config(folder: str, component: str) -> dict[str, Any]:
    with open(os.path.join(folder, component, "config.json")) as f:
        return json.load(f)


def _meta_model(folder: str, component: str, index: dict[str, Any]) -> torch.nn.Module:
    """The component ``component`` of the pipeline at ``folder``, built on ``meta``: its
    layers' names and shapes, no memory and no weights read."""
    import importlib

    entry = index.get(component)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] and entry[1]):
        raise ArgumentError(
            f"the pipeline at {folder!r} has no {component!r} component in its model_index.json",
            field="pipeline",
        )
    library, cls_name = entry
    cls = getattr(importlib.import_module(library), cls_name)
    sub = os.path.join(folder, component)
    if not os.path.isfile(os.path.join(sub, "config.json")):
        raise ArgumentError(
            f"{sub!r} has no config.json; pass a folder written by write_store or save_pretrained",
            field="pipeline",
        )
    with torch.device("meta"):
        if library == "diffusers":
            return cls.from_config(cls.load_config(sub))
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(sub))


def _linears(
    model: torch.nn.Module, suffixes: Sequence[str], scope: str, *, clip: bool = False
) -> dict[str, tuple[int, int]]:
    """``name → (out, in)`` of each ``nn.Linear`` inside ``scope`` ending with a suffix."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        # transformers 5 flattened CLIPTextModel (no ``text_model.``; the WithProjection model
        # keeps it); LoRA files and diffusers' converters spell it, diffusers strips it.
        if clip and not name.startswith("text_model."):
            name = f"text_model.{name}"
        if re.match(scope, name) and any(name.endswith(f".{s}") for s in suffixes):
            found[name] = (module.out_features, module.in_features)
    return found


def _draw(
    layers: dict[str, dict[str, tuple[int, int]]], *, rank: int, seed: int, std: float
) -> dict[tuple[str, str, str], torch.Tensor]:
    """``(component, module, "A" | "B") → tensor``, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for component, modules in layers.items():
        for module, (n_out, n_in) in modules.items():
            out[component, module, "A"] = torch.randn(rank, n_in, generator=gen) * std
            out[component, module, "B"] = torch.randn(n_out, rank, generator=gen) * std
    return out


def _peft_metadata(layers: dict[str, dict[str, tuple[int, int]]], rank: int, alpha: float) -> str:
    """The ``lora_adapter_metadata`` entry: each component's ``LoraConfig`` arguments under
    ``<component>.``, as diffusers' ``save_lora_weights`` packs them."""
    packed: dict[str, Any] = {}
    for component, modules in layers.items():
        if component.startswith("text_encoder"):
            # Suffixes, not names: a flattened CLIPTextModel (transformers 5) has no
            # ``text_model.`` and peft matches ``target_modules`` against its own names.
            names = sorted({m.rsplit(".", 1)[1] for m in modules})
        else:
            names = sorted(modules)
        packed[f"{component}.r"] = rank
        packed[f"{component}.lora_alpha"] = alpha
        packed[f"{component}.target_modules"] = names
    return json.dumps(packed, indent=2, sort_keys=True)


def _sgm(module: str, layers_per_block: int) -> str:
    """A diffusers UNet module name spelled as the original SDXL (SGM) UNet spells it, the
    inverse of diffusers' ``_maybe_map_sgm_blocks_to_diffusers``."""
    slots = layers_per_block + 1  # per level: the resnet+attention pairs, then a resampler
    m = re.fullmatch(r"(down_blocks|up_blocks)\.(\d+)\.attentions\.(\d+)\.(.+)", module)
    if m and m[1] == "down_blocks":  # input_blocks.0 is conv_in
        return f"input_blocks.{1 + int(m[2]) * slots + int(m[3])}.1.{m[4]}"
    if m:
        return f"output_blocks.{int(m[2]) * slots + int(m[3])}.1.{m[4]}"
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)", module)
    if m:  # middle_block.0 and .2 are the resnets
        return f"middle_block.1.{m[1]}"
    raise InternalError(f"the UNet module {module!r} is outside the attention blocks")


def _kohya(
    tensors: dict[tuple[str, str, str], torch.Tensor], unet: dict[str, Any], alpha: float
) -> dict[str, torch.Tensor]:
    per_block = unet.get("layers_per_block")
    if not isinstance(per_block, int):
        raise UnsupportedError(
            f"layers_per_block={per_block!r} in the UNet config: the kohya (SGM) block "
            "numbering needs one int; write fmt='peft'"
        )
    out = {}
    for (component, module, ab), t in tensors.items():
        name = _sgm(module, per_block) if component == "unet" else module
        key = _KOHYA_PREFIX[component] + name.replace(".", "_")
        out[f"{key}.lora_{'down' if ab == 'A' else 'up'}.weight"] = t
        out[f"{key}.alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return out


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str) -> int:
    """Write ``tensors`` to ``path`` through a temporary file beside it; return its size."""
    from safetensors.torch import save_file

    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.partial")
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)  # a reader sees the old file or the whole new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return os.path.getsize(path)
