"""Model stores of random-weight diffusers pipelines: nothing is downloaded, ever.

``write_store(folder, pipelines, size="tiny")`` writes pipeline folders exactly as
``DiffusionPipeline.save_pretrained`` does (``model_index.json``, one folder per
component, safetensors weights, tokenizers, scheduler configs), so diffusers'
``from_pretrained`` and nostall's cache read the same files:

* ``tiny``: FLUX, SDXL, SD3 and Wan 2.1 architectures at a few MB, built as real
  pipelines (CPU, seconds) — the demo's store and CI's;
* ``full``: the real sizes (FLUX.1-dev 33.98 GB: transformer 23.78 in shards, T5-XXL
  9.79, CLIP-L 0.25, VAE 0.17; SDXL 6.94 GB in fp16), written tensor by tensor from
  random values drawn on a GPU — the switch benchmark's store.

Tokenizers are built offline from tiny vocabularies (byte-level BPE for CLIP, a
unigram vocabulary for T5): no machine here reaches a model hub, and the pipelines
only need token ids in range. Pipelines that share a component are written with the
same bytes, so the cache can tell that they share it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from nostall.synthetic.tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["PIPELINES", "write_store"]

PIPELINES = ("flux", "flux-b", "sdxl", "sd3", "wan")


CLIP_VOCAB = 514  # the tiny CLIP tokenizer's size
T5_VOCAB = 128


def _clip_config(hidden: int, layers: int, heads: int, positions: int, projection: int, **kw):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=kw.pop("vocab_size", CLIP_VOCAB),
        hidden_size=hidden,
        intermediate_size=kw.pop("intermediate_size", hidden * 4),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=positions,
        projection_dim=projection,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        **kw,
    )


def _t5_config(d_model: int, layers: int, heads: int, d_ff: int, **kw):
    from transformers import T5Config

    return T5Config(
        vocab_size=kw.pop("vocab_size", T5_VOCAB),
        d_model=d_model,
        d_kv=kw.pop("d_kv", d_model // heads),
        d_ff=d_ff,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=kw.pop("relative_attention_num_buckets", 8),
        **kw,
    )


def _tiny_vae(latent_channels: int, **kw):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 16],
        latent_channels=latent_channels,
        norm_num_groups=4,
        layers_per_block=1,
        **kw,
    )


def _tiny_flux(seed: int):
    import diffusers
    from transformers import CLIPTextModel, T5EncoderModel

    torch.manual_seed(0)  # the shared components: equal bytes in every FLUX-family store
    text_encoder = CLIPTextModel(_clip_config(32, 2, 4, 32, 32))
    text_encoder_2 = T5EncoderModel(_t5_config(32, 2, 4, 37))
    vae = _tiny_vae(
        4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    torch.manual_seed(seed)  # the transformer: a "fine-tune" per seed
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer(32),
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )


def _tiny_sdxl(seed: int):
    import diffusers
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64,
        norm_num_groups=4,
    )
    text_encoder = CLIPTextModel(_clip_config(32, 2, 4, 32, 32, hidden_act="gelu"))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(32, 2, 4, 32, 32, hidden_act="gelu"))
    return diffusers.StableDiffusionXLPipeline(
        vae=_tiny_vae(4, sample_size=32),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=clip_tokenizer(32),
        tokenizer_2=clip_tokenizer(32),
        unet=unet,
        scheduler=diffusers.EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            timestep_spacing="leading",
        ),
    )


def _tiny_sd3(seed: int):
    import diffusers
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    torch.manual_seed(seed)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    return diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=_tiny_vae(
            4,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ),
        text_encoder=CLIPTextModelWithProjection(_clip_config(32, 2, 4, 32, 32, hidden_act="gelu")),
        tokenizer=clip_tokenizer(32),
        text_encoder_2=CLIPTextModelWithProjection(
            _clip_config(32, 2, 4, 32, 32, hidden_act="gelu")
        ),
        tokenizer_2=clip_tokenizer(32),
        text_encoder_3=T5EncoderModel(_t5_config(32, 2, 4, 37)),
        tokenizer_3=t5_tokenizer(),
        transformer=transformer,
    )


def _tiny_wan(seed: int):
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=T5_VOCAB,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
        )
    )
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = diffusers.AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    return diffusers.WanPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


_TINY: dict[str, Callable[[], Any]] = {
    "flux": lambda: _tiny_flux(1),
    "flux-b": lambda: _tiny_flux(2),  # same architecture, other transformer weights, shared rest
    "sdxl": lambda: _tiny_sdxl(3),
    "sd3": lambda: _tiny_sd3(4),
    "wan": lambda: _tiny_wan(5),
}


def write_store(
    folder: str | os.PathLike,
    pipelines: tuple[str, ...] = ("flux", "flux-b", "sdxl"),
    *,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Write each named pipeline under ``folder``; return ``name → pipeline folder``.

    An existing pipeline folder written with the same size is reused.

    >>> write_store("/tmp/store", ("flux", "sdxl"))  # doctest: +SKIP
    {'flux': '/tmp/store/flux', 'sdxl': '/tmp/store/sdxl'}
    """
    import logging

    from nostall.errors import ArgumentError

    if size not in ("tiny", "full"):
        raise ArgumentError(f"size={size!r}; choose 'tiny' or 'full'")
    unknown = [p for p in pipelines if p not in _TINY]
    if unknown:
        raise ArgumentError(f"unknown pipelines {unknown}; choose from {list(_TINY)}")
    out = {}
    root = os.fspath(folder)
    os.makedirs(root, exist_ok=True)
    for name in pipelines:
        path = os.path.join(root, name)
        stamp = os.path.join(path, "nostall-store.json")
        out[name] = path
        if os.path.exists(stamp):
            with open(stamp) as f:
                if json.load(f) == {"size": size, "name": name}:
                    continue
        if progress is not None:
            progress(f"writing {size} {name} pipeline to {path}")
        if size == "tiny":
            # diffusers logs its own progress bars and warnings here; quiet them.
            logging.getLogger("diffusers").setLevel(logging.ERROR)
            pipe = _TINY[name]()
            pipe.save_pretrained(path, safe_serialization=True)
        else:
            from nostall.synthetic.full import write_full

            write_full(name, path, device=device, progress=progress)
        with open(stamp, "w") as f:
            json.dump({"size": size, "name": name}, f)
    return out
