"""LoRA files read into per-layer low-rank factors and scales, in any format diffusers
converts (diffusers/PEFT keys, kohya sd-scripts, the community FLUX formats), and checked
against the modules they adapt.

The file is read and validated by nostall (:func:`nostall.api.load_state_dict`: a truncated
or malformed file is a :class:`~nostall.errors.CheckpointError` naming it); diffusers'
own converter for the pipeline's class (``<Pipeline>.lora_state_dict``) turns the keys
into diffusers/PEFT names. A file that is a LoRA of no pipeline of that class (another
base's LoRA, a format diffusers does not convert, no LoRA at all) is an
:class:`~nostall.errors.AdapterError` naming the file and its first layer, or, where no key
looks like a LoRA factor, the first few keys and their count: never every key. The scale
of each layer follows PEFT's rules: ``alpha / r``
(``alpha / sqrt(r)`` with rsLoRA), ``alpha`` from the file's adapter metadata
(``lora_adapter_metadata``: ``lora_alpha``, ``alpha_pattern``), else from its alpha
tensors (kohya), else ``r`` (scale 1).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.api import load_state_dict
from nostall.errors import AdapterError, CheckpointError, InternalError, UnsupportedError

__all__ = ["Lora", "LoraLayer", "check_fits", "read_lora", "submodule"]

# the pipeline roles a LoRA may adapt, as diffusers prefixes their keys
ROLES = ("transformer", "unet", "text_encoder", "text_encoder_2", "text_encoder_3")
_KEY = re.compile(
    r"^(?P<role>" + "|".join(ROLES) + r")\.(?P<module>.+)\.lora_(?P<ab>A|B)\.(?P<what>weight|bias)$"
)
# A LoRA factor's key in the formats diffusers converts, before conversion: PEFT's
# ``lora_A.weight``, kohya's ``lora_down.weight``, diffusers' older ``lora.down.weight``,
# ``to_q_lora.down.weight`` and ``lora_linear_layer.down.weight``, XLabs' ``proj_lora1.down.weight``.
_FACTOR = re.compile(
    r"[._]?lora(?:[._]?(?:A|B|down|up)|_linear_layer\.(?:down|up)|\d+\.(?:down|up))"
    r"\.(?:weight|bias)$"
)
_SHOWN = 3  # keys a message shows of a file that is no LoRA


@dataclass(frozen=True)
class LoraLayer:
    """One adapted layer: ``W += weight * scale * up @ down`` (a convolution: over its
    kernel), and ``bias += weight * scale * bias`` when the LoRA has one."""

    role: str  # the pipeline component: transformer, unet, text_encoder, ...
    module: str  # its qualified name inside that component
    down: torch.Tensor  # A: (r, in) or (r, in, kh, kw)
    up: torch.Tensor  # B: (out, r) or (out, r, 1, 1)
    scale: float
    bias: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def delta(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``scale * up @ down`` in the base weight's shape, computed in ``dtype`` on
        ``device`` (the factors move there first: they are small, the product is not)."""
        down, up = self.down.to(device, dtype), self.up.to(device, dtype)
        if down.ndim == 2:
            return (up @ down) * self.scale
        # convolutions: a (r, in, kh, kw) kernel then a 1x1 (out, r): one (out, in, kh, kw)
        d = (up.flatten(1) @ down.flatten(1)).view(up.shape[0], *down.shape[1:])
        return d * self.scale


@dataclass(frozen=True)
class Lora:
    """A LoRA file as layers (:class:`LoraLayer`), for one pipeline class."""

    name: str
    path: str
    pipeline_class: str
    layers: tuple[LoraLayer, ...]
    # the one pinned block every factor views, for a LoRA the shelf keeps (one copy
    # moves them all: nostall.adapters.upload); None for a LoRA read into its own tensors
    flat: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(sorted({x.role for x in self.layers}))

    @property
    def nbytes(self) -> int:
        return sum(
            x.down.nbytes + x.up.nbytes + (x.bias.nbytes if x.bias is not None else 0)
            for x in self.layers
        )


def _pipeline_class(name: str) -> Any:
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "lora_state_dict"):
        raise UnsupportedError(
            f"{name} takes no LoRA in this diffusers ({diffusers.__version__}): it has no "
            "lora_state_dict converter"
        )
    return cls


def _metadata(path: str) -> dict[str, Any]:
    """The file's ``lora_adapter_metadata`` (diffusers writes PEFT's LoraConfig there,
    each key prefixed with its component), or ``{}``."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"its lora_adapter_metadata is not JSON ({e})", path=path) from e
    if not isinstance(meta, dict):
        raise CheckpointError("its lora_adapter_metadata is not a JSON object", path=path)
    return meta


def _pattern(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: the first key that matches
    the end of the module's name at a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def read_lora(
    path: str | os.PathLike,
    pipeline_class: str,
    *,
    name: str | None = None,
    unet_config: dict[str, Any] | None = None,
) -> Lora:
    """The LoRA at ``path`` as layers for ``pipeline_class`` (diffusers' class name, as
    in ``model_index.json``); ``unet_config``: the base's UNet config, which diffusers
    needs to map kohya's SGM block names (``input_blocks_4_1``) to its own.
    Raises :class:`~nostall.errors.CheckpointError` for a file that is not a readable
    safetensors file or whose layers lack a factor, :class:`~nostall.errors.AdapterError`
    for one that is no LoRA of ``pipeline_class`` (naming its first layer, never listing
    every key), :class:`~nostall.errors.UnsupportedError` for a kind nostall cannot fuse
    (DoRA)."""
    path = os.fspath(path)
    cls = _pipeline_class(pipeline_class)
    tensors = load_state_dict(path, device="cpu")  # validated: typed errors
    meta = _metadata(path)
    if any("lora_magnitude_vector" in k or "dora_scale" in k for k in tensors) or any(
        k.endswith("use_dora") and v for k, v in meta.items()
    ):
        raise UnsupportedError(f"{path}: a DoRA adapter; nostall fuses plain LoRA only")
    factors = sorted(k for k in tensors if _FACTOR.search(k))
    if not factors:
        raise AdapterError(
            f"{path}: no key of it is a LoRA factor in a format nostall reads (diffusers/PEFT "
            "'<layer>.lora_A.weight', kohya '<layer>.lora_down.weight', the community FLUX "
            f"formats diffusers converts): it holds {_keys(tensors)}. Is it a LoRA? (LoKr and "
            "LoHa adapters are not supported)",
            path=path,
        )
    try:
        out = cls.lora_state_dict(dict(tensors), **_kwargs(cls, unet_config))
    except (ValueError, KeyError, IndexError, RuntimeError, AttributeError) as e:
        # diffusers' message lists every key it could not convert (12 kB for a tiny SDXL
        # LoRA, megabytes for a real one): its start says why, the first layer says where.
        why = _clip(f"{type(e).__name__}: {' '.join(str(e).split())}", 120)
        raise _another_base(path, cls.__name__, factors, f"refuses it ({why})") from e
    sd, alphas = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    sd = _to_peft(sd)
    if not any(_KEY.match(k) for k in sd):
        raise _another_base(path, cls.__name__, factors, "dropped every key of it")
    layers = _layers(path, cls.__name__, sd, alphas or {}, meta)
    return Lora(name or os.path.basename(path), path, pipeline_class, tuple(layers))


def _another_base(path: str, pipeline_class: str, factors: list[str], what: str) -> AdapterError:
    first = _layer_of(factors[0])
    return AdapterError(
        f"{path}: diffusers' {pipeline_class} converter {what}: no layer of a {pipeline_class}; "
        f"its first layer is {first!r}, of {len(factors):,} factor tensors: a LoRA for another "
        "base model?",
        path=path,
        layer=first,
    )


def _layer_of(key: str) -> str:
    """The layer a factor's key belongs to: the key without its factor suffix."""
    m = _FACTOR.search(key)
    return _clip(key[: m.start()] if m else key.removesuffix(".alpha"), 160)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _keys(tensors) -> str:
    """``N tensors, the first 3: 'a', 'b', 'c', …``: a file's keys, bounded."""
    names = sorted(tensors)
    shown = ", ".join(repr(_clip(k, 100)) for k in names[:_SHOWN])
    more = ", …" if len(names) > _SHOWN else ""
    return f"{len(names):,} tensors, the first {min(len(names), _SHOWN)}: {shown}{more}"


def _kwargs(cls: Any, unet_config: dict[str, Any] | None) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.lora_state_dict).parameters
    out: dict[str, Any] = {"return_alphas": True} if "return_alphas" in params else {}
    if unet_config is not None:
        out["unet_config"] = unet_config  # (read from **kwargs by the SD/SDXL converters)
    return out


def _to_peft(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' older key names as PEFT's ``lora_A`` / ``lora_B``, per component as
    diffusers converts them when it loads: the denoiser's (``.processor.to_q_lora.down``,
    ``.lora.down``: what kohya files convert to) and the text encoders'
    (``lora_linear_layer``, ``to_out_lora``); alphas kept."""
    from diffusers.utils.state_dict_utils import (
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    out: dict[str, torch.Tensor] = {}
    for role in ROLES:
        part = {k: v for k, v in sd.items() if k.startswith(f"{role}.")}
        if not part or all(".lora_A." in k or ".lora_B." in k for k in part):
            out.update(part)
        elif role.startswith("text_encoder"):
            lora = {k: v for k, v in part.items() if not k.endswith(".alpha")}
            out.update(convert_state_dict_to_peft(lora))
            out.update({k: v for k, v in part.items() if k.endswith(".alpha")})
        else:
            out.update(convert_unet_state_dict_to_peft(part))
    out.update({k: v for k, v in sd.items() if not k.startswith(tuple(f"{r}." for r in ROLES))})
    return out


def _layers(
    path: str,
    pipeline_class: str,
    sd: dict[str, torch.Tensor],
    alphas: dict[str, Any],
    meta: dict[str, Any],
) -> list[LoraLayer]:
    strays = sorted(k for k in sd if _KEY.match(k) is None and not k.endswith(".alpha"))
    if strays:
        first = _layer_of(strays[0])
        raise AdapterError(
            f"{path}: its first layer that no component of a {pipeline_class} has is "
            f"{first!r} ({len(strays):,} of its {len(sd):,} converted tensors fit none): a "
            "LoRA for another base model, or a format diffusers does not convert",
            path=path,
            layer=first,
        )
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        m = _KEY.match(key)
        if m is not None:  # (else an alpha: read from ``alphas``)
            slot = f"{m['ab']}.{m['what']}"
            parts.setdefault((m["role"], m["module"]), {})[slot] = t
    if not parts:
        raise InternalError(f"{path}: no LoRA layer left after read_lora found one")
    # alphas from alpha tensors (kohya): per module, the most common one by default
    by_module: dict[tuple[str, str], float] = {}
    for key, v in alphas.items():
        k = key.removesuffix(".alpha")
        value = float(v.item() if torch.is_tensor(v) else v)
        for role, module in parts:
            for name in (f"{role}.{module}", module):
                if k == name or k.startswith(name + "."):
                    by_module[(role, module)] = value
    common = Counter(by_module.values()).most_common(1)[0][0] if by_module else None
    layers = []
    for (role, module), p in sorted(parts.items()):
        if "A.weight" not in p or "B.weight" not in p:
            raise CheckpointError(
                f"layer {role}.{module} has {sorted(p)} but a LoRA layer needs both A and B",
                path=path,
                tensor=f"{role}.{module}",
            )
        down, up = p["A.weight"], p["B.weight"]
        r = int(down.shape[0])
        if up.shape[1] != r:
            raise CheckpointError(
                f"layer {role}.{module}: A has rank {r} and B takes {up.shape[1]}",
                path=path,
                tensor=f"{role}.{module}",
            )
        rslora = bool(meta.get(f"{role}.use_rslora", False))
        alpha = _pattern(meta.get(f"{role}.alpha_pattern") or {}, module)
        if alpha is None:
            alpha = by_module.get((role, module))
        if alpha is None:
            alpha = meta.get(f"{role}.lora_alpha", common if common is not None else r)
        scale = float(alpha) / (math.sqrt(r) if rslora else r)
        layers.append(LoraLayer(role, module, down, up, scale, p.get("B.bias")))
    return layers


def submodule(component: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """``component``'s submodule ``name``, as diffusers finds it: LoRA files spell CLIP's
    layers ``text_model.encoder…``, which transformers 5 dropped from ``CLIPTextModel``
    (not from ``CLIPTextModelWithProjection``); ``None`` if it has none."""
    for n in (name, name.removeprefix("text_model.")):
        try:
            return component.get_submodule(n)
        except AttributeError:
            continue
    return None


def check_fits(lora: Lora, components: dict[str, torch.nn.Module]) -> None:
    """Raise :class:`~nostall.errors.AdapterError` naming the LoRA and its first layer
    that the pipeline's ``components`` (role → module) lack or that does not fit (a LoRA
    for another base: other shapes)."""
    who = repr(lora.name) if lora.name == lora.path else f"{lora.name!r} ({lora.path})"
    # A component the pipeline lacks says more than a layer missing from one it has (an
    # SDXL LoRA on FLUX: the UNet, not the first CLIP layer that FLUX's T5 lacks).
    for x in lora.layers:
        if x.role not in components:
            raise AdapterError(
                f"LoRA {who} adapts {x.role}, which this pipeline does not have (it has "
                f"{', '.join(sorted(components))}); its first layer there is "
                f"{x.role}.{x.module}: a LoRA for another architecture?",
                path=lora.path,
                layer=f"{x.role}.{x.module}",
            )
    for x in lora.layers:
        weight = getattr(submodule(components[x.role], x.module), "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise AdapterError(
                f"LoRA {who}: its first layer the base lacks is "
                f"{x.role}.{x.module}; a LoRA for another architecture?",
                path=lora.path,
                layer=f"{x.role}.{x.module}",
            )
        want = tuple(weight.shape)
        if x.down.ndim == 2:
            have = (int(x.up.shape[0]), int(x.down.shape[1]))
        else:
            have = (int(x.up.shape[0]), *(int(s) for s in x.down.shape[1:]))
        if have != want:
            raise AdapterError(
                f"LoRA {who} does not fit this base: its first mismatching layer is "
                f"{x.role}.{x.module}, {have} against the base's {want} (a LoRA for "
                "another model or size?)",
                path=lora.path,
                layer=f"{x.role}.{x.module}",
                shapes=(have, want),
            )


def adaptable(pipe: Any) -> dict[str, torch.nn.Module]:
    """The modules of ``pipe`` a LoRA may adapt, by role (:data:`ROLES`)."""
    return {r: m for r in ROLES if isinstance(m := getattr(pipe, r, None), torch.nn.Module)}
