"""Real-size random pipeline folders: FLUX.1-dev and SDXL layouts, written offline.

The modules are built on ``meta`` from the published configs, and each tensor is
drawn on the GPU (N(0, 0.02), in the pipeline's dtype) and written into shards the
way ``save_pretrained`` names them, with the index beside them. Tied tensors (T5's
shared embedding) are written once, as ``save_pretrained`` does. Tokenizers are the
small offline ones of :mod:`nostall.synthetic.tokenizers`: the pipelines only need token ids
in range, and the weights dominate every byte count.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from typing import Any

import torch

from nostall.synthetic.tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["t5_xxl", "write_full", "write_weights"]

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


Layout = Callable[[], tuple[str, dict[str, Any], dict[str, Any], torch.dtype]]
_FULL: dict[str, Layout] = {
    "flux": _flux,
    "flux-b": _flux,
    "sdxl": _sdxl,
}
_SEEDS = {"flux": 1, "flux-b": 2, "sdxl": 3}


def write_full(
    name: str, folder: str, *, device: str | torch.device = "cuda", progress=None
) -> None:
    """Write the real-size random pipeline ``name`` (``flux``, ``flux-b``, ``sdxl``).

    ``flux-b`` shares every component but the transformer with ``flux`` (same bytes),
    as two FLUX fine-tunes in a service do.
    """
    import diffusers

    from nostall.errors import ArgumentError

    if name not in _FULL:
        raise ArgumentError(f"no full-size layout for {name!r}; choose from {sorted(_FULL)}")
    class_name, modules, files, dtype = _FULL[name]()
    os.makedirs(folder, exist_ok=True)
    index: dict[str, Any] = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    sibling = os.path.join(os.path.dirname(os.path.abspath(folder)), "flux")
    share = name == "flux-b" and os.path.exists(os.path.join(sibling, "nostall-store.json"))
    for role, module in modules.items():
        lib = "diffusers" if isinstance(module, diffusers.ModelMixin) else "transformers"
        index[role] = [lib, type(module).__name__]
        sub = os.path.join(folder, role)
        if share and role != "transformer":
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
        # Shared components get the same seed in every pipeline: the same bytes.
        seed = _SEEDS[name] if role in ("transformer", "unet") else zlib.crc32(role.encode())
        write_weights(module, sub, stem, dtype, device, seed, progress, f"{name}/{role}")
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


def write_weights(module, folder, stem, dtype, device, seed, progress, what) -> None:
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
            if dt.is_floating_point:
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
