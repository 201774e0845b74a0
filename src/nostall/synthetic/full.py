"""Real-size random pipeline folders: FLUX.1-dev, SDXL and SD3-medium layouts, written
offline.

The modules are built on ``meta`` from the published configs, and each tensor is
drawn on the GPU (N(0, 0.02), in the pipeline's dtype) and written into shards the
way ``save_pretrained`` names them, with the index beside them. Tied tensors (T5's
shared embedding) are written once, as ``save_pretrained`` does. Tokenizers are the
small offline ones of :mod:`nostall.synthetic.tokenizers`: the pipelines only need token ids
in range, and the weights dominate every byte count.

The VAEs' normalisation layers get scale 1 and shift 0, as trained ones have them near:
with N(0, 0.02) there too, every decoded image came out 128 ± 1 grey whatever the
latents, and a benchmark could not tell one request's image from another's. With them,
images of different seeds differ by about 50 levels on average.

Components with the same layout, dtype and seed are the same bytes in every pipeline
(one digest, one copy in a cache's tiers); :func:`write_full` links them to the sibling
``flux`` pipeline's files where it is written beside (``flux-b``: everything but the
transformer; ``sd3``: T5-XXL and the 16-channel VAE's weights), so the disk holds them
once. :func:`footprint` says what a set of pipelines takes on disk and in memory, and
:func:`check_room` refuses a folder whose disk cannot take them.

SD3-medium is written in bf16, not the published fp16: its pipeline concatenates the
CLIP and T5 embeddings, so all its encoders must share one dtype, and in bf16 its
T5-XXL is FLUX's (9.5 GB saved on disk and in every tier; the layout and shapes are the
published ones).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from typing import Any

import torch

from nostall.synthetic.tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["check_room", "footprint", "t5_xxl", "write_full", "write_weights"]

_SHARD = 10 * 10**9  # diffusers' and transformers' max_shard_size="10GB"


def _clip_l(projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=77,
        projection_dim=768,
        hidden_act="quick_gelu",
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _clip_g():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=20,
            max_position_embeddings=77,
            projection_dim=1280,
            hidden_act="gelu",
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        )
    )


def t5_xxl():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=32128,
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=24,
            num_heads=64,
            feed_forward_proj="gated-gelu",
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            is_gated_act=True,
        )
    )


def _vae(latent_channels: int, **kw):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=latent_channels,
        norm_num_groups=32,
        sample_size=1024,
        **kw,
    )


def _flux() -> tuple[str, dict[str, Any], dict[str, Any], torch.dtype]:
    import diffusers

    with torch.device("meta"):  # shapes only: the weights are drawn tensor by tensor
        modules = {
            "transformer": diffusers.FluxTransformer2DModel(guidance_embeds=True),
            "text_encoder": _clip_l(),
            "text_encoder_2": t5_xxl(),
            "vae": _vae(
                16,
                scaling_factor=0.3611,
                shift_factor=0.1159,
                use_quant_conv=False,
                use_post_quant_conv=False,
            ),
        }
    files = {
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256,
            base_shift=0.5,
            max_image_seq_len=4096,
            max_shift=1.15,
            shift=3.0,
            use_dynamic_shifting=True,
        ),
        "tokenizer": ("clip", 77),
        "tokenizer_2": ("t5", 512),
    }
    return "FluxPipeline", modules, files, torch.bfloat16


def _sdxl() -> tuple[str, dict[str, Any], dict[str, Any], torch.dtype]:
    import diffusers

    with torch.device("meta"):
        modules = _sdxl_modules()
    files = {
        "scheduler": diffusers.EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
        ),
        "tokenizer": ("clip", 77),
        "tokenizer_2": ("clip", 77),
    }
    return "StableDiffusionXLPipeline", modules, files, torch.float16


def _sdxl_modules() -> dict[str, Any]:
    import diffusers

    unet = diffusers.UNet2DConditionModel(
        sample_size=128,
        in_channels=4,
        out_channels=4,
        block_out_channels=[320, 640, 1280],
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        layers_per_block=2,
        attention_head_dim=[5, 10, 20],
        cross_attention_dim=2048,
        transformer_layers_per_block=[1, 2, 10],
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
        norm_num_groups=32,
    )
    return {
        "unet": unet,
        "text_encoder": _clip_l(),
        "text_encoder_2": _clip_g(),
        "vae": _vae(4, scaling_factor=0.13025),
    }


def _sd3() -> tuple[str, dict[str, Any], dict[str, Any], torch.dtype]:
    import diffusers

    with torch.device("meta"):
        modules = {
            # stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json
            "transformer": diffusers.SD3Transformer2DModel(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                num_layers=24,
                attention_head_dim=64,
                num_attention_heads=24,
                joint_attention_dim=4096,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                out_channels=16,
                pos_embed_max_size=192,
            ),
            "text_encoder": _clip_l(projection=True),
            "text_encoder_2": _clip_g(),
            "text_encoder_3": t5_xxl(),
            "vae": _vae(
                16,
                scaling_factor=1.5305,
                shift_factor=0.0609,
                use_quant_conv=False,
                use_post_quant_conv=False,
            ),
        }
    files = {
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        "tokenizer": ("clip", 77),
        "tokenizer_2": ("clip", 77),
        "tokenizer_3": ("t5", 512),
    }
    return "StableDiffusion3Pipeline", modules, files, torch.bfloat16


Layout = Callable[[], tuple[str, dict[str, Any], dict[str, Any], torch.dtype]]
_FULL: dict[str, Layout] = {
    "flux": _flux,
    "flux-b": _flux,
    "sdxl": _sdxl,
    "sd3": _sd3,
}
_SEEDS = {"flux": 1, "flux-b": 2, "sdxl": 3, "sd3": 4}
# role -> FLUX's role with the same layout and dtype: drawn with FLUX's seed (the same
# bytes) and linked to FLUX's files when FLUX is written beside.
_SHARED_WITH_FLUX = {
    "flux-b": {r: r for r in ("text_encoder", "text_encoder_2", "vae")},
    "sd3": {"text_encoder_3": "text_encoder_2", "vae": "vae"},
}
_MARGIN = 2 * 10**9  # disk left free beside a store: indexes, logs, the page of a shard


def _nbytes(module, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each distinct tensor (tied ones once) as written in ``dtype``."""
    out, seen = {}, set()
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[key] = t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return out


def footprint(names: tuple[str, ...]) -> dict[str, Any]:
    """What the real-size pipelines ``names`` take, computed on ``meta`` (nothing drawn).

    ``pipelines``: name → role → bytes; ``disk_bytes``: the files, a component shared
    with ``flux`` counted once when ``flux`` is among ``names``; ``distinct_bytes``: the
    components of distinct bytes (what a model cache's host tier holds for all of them);
    ``separate_bytes``: every pipeline's components counted for it (what plain diffusers
    pipelines held side by side in memory take).

    >>> footprint(("sdxl",))["disk_bytes"] / 1e9  # doctest: +SKIP
    6.94...
    """
    from nostall.errors import ArgumentError

    bad = [n for n in names if n not in _FULL]
    if bad:
        raise ArgumentError(f"no full-size layout for {bad}; choose from {sorted(_FULL)}")
    pipelines: dict[str, dict[str, int]] = {}
    disk: dict[tuple[str, str], int] = {}
    distinct: dict[tuple, int] = {}
    for name in names:
        _, modules, _, dtype = _FULL[name]()
        shared = _SHARED_WITH_FLUX.get(name, {})
        pipelines[name] = {}
        for role, module in modules.items():
            n = sum(_nbytes(module, dtype).values())
            pipelines[name][role] = n
            home = ("flux", shared[role]) if role in shared and "flux" in names else (name, role)
            disk[home] = n
            # same bytes: FLUX's seed for a shared role, the role's own seed otherwise
            seed = _SEEDS[name] if role in ("transformer", "unet") else shared.get(role, role)
            distinct[(type(module).__name__, str(dtype), seed, n)] = n
    return {
        "pipelines": pipelines,
        "disk_bytes": sum(disk.values()),
        "distinct_bytes": sum(distinct.values()),
        "separate_bytes": sum(sum(p.values()) for p in pipelines.values()),
    }


def check_room(folder: str, names: tuple[str, ...], written: tuple[str, ...] = ()) -> int:
    """Bytes the pipelines ``names`` not in ``written`` will add under ``folder``;
    :class:`~nostall.ArgumentError` when its disk has less free (with a 2 GB margin),
    naming both numbers."""
    import shutil

    from nostall.errors import ArgumentError

    todo = tuple(n for n in names if n not in written)
    if not todo:
        return 0
    every = footprint(tuple(names))
    done = footprint(tuple(n for n in names if n in written))["disk_bytes"] if written else 0
    need = every["disk_bytes"] - done
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if need + _MARGIN > free:
        raise ArgumentError(
            f"{folder}: the real-size {', '.join(todo)} pipelines need {need / 1e9:.1f} GB "
            f"and its disk has {free / 1e9:.1f} GB free (a {_MARGIN / 1e9:.0f} GB margin "
            "kept); free space there or write the store on a disk with room"
        )
    return need


def write_full(
    name: str, folder: str, *, device: str | torch.device = "cuda", progress=None
) -> None:
    """Write the real-size random pipeline ``name`` (``flux``, ``flux-b``, ``sdxl``,
    ``sd3``).

    ``flux-b`` shares every component but the transformer with ``flux`` (same bytes),
    as two FLUX fine-tunes in a service do; ``sd3`` shares T5-XXL and the VAE's weights
    with it. Where ``flux`` is written beside, they are links to its files.
    """
    import diffusers

    from nostall.errors import ArgumentError

    if name not in _FULL:
        raise ArgumentError(f"no full-size layout for {name!r}; choose from {sorted(_FULL)}")
    class_name, modules, files, dtype = _FULL[name]()
    os.makedirs(folder, exist_ok=True)
    index: dict[str, Any] = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    sibling = os.path.join(os.path.dirname(os.path.abspath(folder)), "flux")
    shared = _SHARED_WITH_FLUX.get(name, {})
    beside = bool(shared) and os.path.exists(os.path.join(sibling, "nostall-store.json"))
    for role, module in modules.items():
        lib = "diffusers" if isinstance(module, diffusers.ModelMixin) else "transformers"
        index[role] = [lib, type(module).__name__]
        sub = os.path.join(folder, role)
        if beside and name == "flux-b" and role in shared:  # the whole folder: same config
            if not os.path.islink(sub):
                os.symlink(os.path.join(sibling, role), sub)
            continue
        os.makedirs(sub, exist_ok=True)
        if lib == "diffusers":
            module.save_config(sub)
            stem = "diffusion_pytorch_model"
        else:
            module.config.torch_dtype = dtype
            # What save_pretrained records and loaders read to find the class.
            module.config.architectures = [type(module).__name__]
            module.config.save_pretrained(sub)
            stem = "model"
        if beside and role in shared:  # its own config (SD3's VAE scaling), FLUX's weights
            _link_weights(os.path.join(sibling, shared[role]), sub)
            if progress is not None:
                progress(f"  {name}/{role}: linked to flux/{shared[role]}'s files")
            continue
        # Shared components get the same seed in every pipeline: the same bytes.
        seed_role = shared.get(role, role)
        seed = _SEEDS[name] if role in ("transformer", "unet") else zlib.crc32(seed_role.encode())
        unit = _norm_keys(module) if role == "vae" else frozenset()
        write_weights(module, sub, stem, dtype, device, seed, progress, f"{name}/{role}", unit)
    for role, obj in files.items():
        sub = os.path.join(folder, role)
        if isinstance(obj, tuple):
            kind, length = obj
            tok = clip_tokenizer(length) if kind == "clip" else t5_tokenizer(length)
            tok.save_pretrained(sub)
            index[role] = ["transformers", "CLIPTokenizer" if kind == "clip" else "T5TokenizerFast"]
        else:
            obj.save_pretrained(sub)
            index[role] = ["diffusers", type(obj).__name__]
    if class_name == "StableDiffusionXLPipeline":
        index["force_zeros_for_empty_prompt"] = True
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)


def _norm_keys(module) -> frozenset[str]:
    """The state-dict keys of ``module``'s GroupNorm and LayerNorm scales and shifts."""
    keys = set()
    for prefix, m in module.named_modules():
        if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)):
            keys |= {f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)}
    return frozenset(keys)


def _link_weights(source: str, folder: str) -> None:
    """Link ``source``'s weight files (shards and index) into ``folder``."""
    for f in sorted(os.listdir(source)):
        if f.endswith((".safetensors", ".safetensors.index.json")):
            dst = os.path.join(folder, f)
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.path.join(source, f), dst)


def write_weights(
    module, folder, stem, dtype, device, seed, progress, what, unit: frozenset[str] = frozenset()
) -> None:
    """Draw and write ``module``'s tensors; the keys in ``unit`` (normalisation layers)
    as scale 1 (``*.weight``) and shift 0 (``*.bias``)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    entries = []
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied: save_pretrained writes it once
            continue
        seen.add(id(t))
        entries.append((key, tuple(t.shape), dtype if t.is_floating_point() else t.dtype))
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for e in entries:
        n = e[2].itemsize
        for d in e[1]:
            n *= d
        if shards[-1] and size + n > _SHARD:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    gen = torch.Generator(device=device).manual_seed(seed % (2**31))
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = (
            f"{stem}.safetensors"
            if len(shards) == 1
            else f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for key, shape, dt in shard:
            if key in unit:
                fill = 1.0 if key.endswith(".weight") else 0.0
                tensors[key] = torch.full(shape, fill, dtype=dt)
            elif dt.is_floating_point:
                t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
                tensors[key] = t.to(dt).cpu()
            else:
                tensors[key] = torch.zeros(shape, dtype=dt)
            weight_map[key] = fname
            total += tensors[key].numel() * tensors[key].element_size()
        tmp = os.path.join(folder, fname + ".partial")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(folder, fname))
        del tensors
        if progress is not None:
            progress(f"  {what}: shard {k + 1}/{len(shards)}")
    if len(shards) > 1:
        with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
