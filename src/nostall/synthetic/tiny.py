"""Model stores of random-weight diffusers pipelines: nothing is downloaded, ever.

``write_store(folder, pipelines, size="tiny")`` writes pipeline folders exactly as
``DiffusionPipeline.save_pretrained`` does (``model_index.json``, one folder per
component, safetensors weights, tokenizers, scheduler configs), so diffusers'
``from_pretrained`` and nostall's cache read the same files:

* ``tiny``: FLUX, SDXL, SD3 and Wan 2.1 architectures at a few MB, built as real
  pipelines (CPU, seconds) — the demo's store and CI's — and every Wan layout
  diffusers serves (``VIDEO_PIPELINES``, below);
* ``full``: the real sizes (FLUX.1-dev 33.98 GB: transformer 23.78 in shards, T5-XXL
  9.79, CLIP-L 0.25, VAE 0.17; SDXL 6.94 GB in fp16), written tensor by tensor from
  random values drawn on a GPU — the switch benchmark's store.

Tokenizers are built offline from tiny vocabularies (byte-level BPE for CLIP, a
unigram vocabulary for T5): no machine here reaches a model hub, and the pipelines
only need token ids in range. Pipelines that share a component are written with the
same bytes, so the cache can tell that they share it.

``VIDEO_PIPELINES``: the Wan layouts, as diffusers' own Hub folders lay them out, each
generating a few frames on the CPU in well under a second:

* ``wan``: Wan 2.1 T2V (``WanPipeline``); 16x16 pixels and up, in steps of 16;
* ``wan22``: Wan 2.2 T2V-A14B: ``transformer`` for the high-noise steps, ``transformer_2``
  after ``boundary_ratio`` (0.875, in ``model_index.json``); sizes as ``wan``;
* ``wan22-ti2v``: Wan 2.2 TI2V-5B: 48 latent channels, the Wan 2.2 VAE (16x spatial, pixels
  folded 2x2), a timestep per token (``expand_timesteps``); 32x32 and up, in steps of 32;
* ``wan-i2v``: Wan 2.1 I2V (``WanImageToVideoPipeline``): a CLIP image encoder and its
  processor; call it with ``image=`` and ``max_sequence_length=512`` (diffusers' Wan
  attention takes the last 512 context tokens as text, the rest as image tokens);
* ``wan22-i2v``: Wan 2.2 I2V-A14B: two experts (``boundary_ratio`` 0.9), no image encoder.

Frames: ``4k + 1`` (1, 5, 9, ...). They share ``wan``'s text encoder and tokenizer, and
(but for TI2V) its VAE, byte for byte. Not in ``PIPELINES``, which ``nostall synthetic``
writes by default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from nostall.synthetic.tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["PIPELINES", "VIDEO_PIPELINES", "write_store"]

PIPELINES = ("flux", "flux-b", "sdxl", "sd3", "wan")
VIDEO_PIPELINES = ("wan", "wan22", "wan22-ti2v", "wan-i2v", "wan22-i2v")


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


def _wan_transformer(**overrides):
    """The tiny Wan DiT (one block, two heads of 12), drawn from the global generator as
    seeded by the caller; ``overrides`` change its config (channels, image conditioning)."""
    import diffusers

    config = dict(
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
    return diffusers.WanTransformer3DModel(**{**config, **overrides})


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
    transformer = _wan_transformer()
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


_WAN_SEED = 5


def _wan21_shared() -> dict[str, Any]:
    """What every other Wan layout takes from Wan 2.1 T2V, as the Hub folders do: the
    UMT5 text encoder and its tokenizer, and (but for TI2V) the Wan 2.1 VAE. They are
    ``wan``'s own, byte for byte, so the cache holds one copy for all of them."""
    wan = _tiny_wan(_WAN_SEED)
    return {"tokenizer": wan.tokenizer, "text_encoder": wan.text_encoder, "vae": wan.vae}


def _wan_experts(seed: int, **overrides):
    """Wan 2.2 A14B's two experts: one architecture, two draws. The first denoises the
    high-noise steps (``t >= boundary_ratio * 1000``), the second the rest."""
    torch.manual_seed(seed)
    high = _wan_transformer(**overrides)
    torch.manual_seed(seed + 1)
    low = _wan_transformer(**overrides)
    return high, low


def _tiny_wan22(seed: int):
    """Wan 2.2 T2V-A14B: two experts split at ``boundary_ratio`` 0.875 (its value in
    diffusers' conversion script, registered in ``model_index.json``)."""
    import diffusers

    high, low = _wan_experts(seed)
    return diffusers.WanPipeline(
        **_wan21_shared(),
        transformer=high,
        transformer_2=low,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        boundary_ratio=0.875,
    )


# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: per-channel statistics of the 48 latents.
_WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
_WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip


def _tiny_wan22_ti2v(seed: int):
    """Wan 2.2 TI2V-5B: one 48-channel transformer with a timestep per token
    (``expand_timesteps``) over the Wan 2.2 VAE. That VAE keeps the real one's switches
    at a few channels: residual blocks, a decoder wider than the encoder, pixels folded
    2x2 into 12 channels (``patch_size``), 16x spatial and 4x temporal compression."""
    import diffusers

    shared = _wan21_shared()
    torch.manual_seed(seed)
    transformer = _wan_transformer(in_channels=48, out_channels=48)
    vae = diffusers.AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=_WAN22_LATENTS_MEAN,
        latents_std=_WAN22_LATENTS_STD,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_temporal=4,
        scale_factor_spatial=16,
    )
    return diffusers.WanPipeline(
        tokenizer=shared["tokenizer"],
        text_encoder=shared["text_encoder"],
        vae=vae,
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        expand_timesteps=True,
    )


_CLIP_HIDDEN = 16  # the tiny image encoder's width: the I2V transformer's image_dim


def _tiny_wan_i2v(seed: int):
    """Wan 2.1 I2V: a CLIP vision encoder (its second-to-last hidden states, 17 tokens
    of a 32x32 crop) read by extra key/value projections in every cross-attention
    (``added_kv_proj_dim`` = the transformer's width); 36 input channels: 16 of noise,
    4 of mask, 16 of the encoded first frame."""
    import diffusers
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    shared = _wan21_shared()
    torch.manual_seed(seed)
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=_CLIP_HIDDEN,
            intermediate_size=32,
            projection_dim=_CLIP_HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    # added_kv_proj_dim: the transformer's width (2 heads of 12), as 5120 is the 14B's
    transformer = _wan_transformer(in_channels=36, image_dim=_CLIP_HIDDEN, added_kv_proj_dim=24)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return diffusers.WanImageToVideoPipeline(
        **shared,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def _tiny_wan22_i2v(seed: int):
    """Wan 2.2 I2V-A14B: two 36-channel experts split at ``boundary_ratio`` 0.9, and no
    image encoder (the first frame enters through the latents only)."""
    import diffusers

    high, low = _wan_experts(seed, in_channels=36)
    return diffusers.WanImageToVideoPipeline(
        **_wan21_shared(),
        transformer=high,
        transformer_2=low,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        boundary_ratio=0.9,
    )


def _tiny_sdxl_tune(seed: int):
    """An SDXL fine-tune: ``sdxl``'s text encoders and VAE (the same bytes), a UNet of the
    same architecture drawn from ``seed``."""
    import diffusers

    pipe = _tiny_sdxl(3)
    torch.manual_seed(seed)
    pipe.register_modules(unet=diffusers.UNet2DConditionModel.from_config(pipe.unet.config))
    return pipe


_TINY: dict[str, Callable[[], Any]] = {
    "flux": lambda: _tiny_flux(1),
    "flux-b": lambda: _tiny_flux(2),  # same architecture, other transformer weights, shared rest
    "sdxl": lambda: _tiny_sdxl(3),
    "sdxl-b": lambda: _tiny_sdxl_tune(12),  # catalog fine-tunes: their own UNet, sdxl's rest
    "sdxl-c": lambda: _tiny_sdxl_tune(13),
    "sd3": lambda: _tiny_sd3(4),
    "wan": lambda: _tiny_wan(_WAN_SEED),
    "wan22": lambda: _tiny_wan22(6),  # experts drawn from seeds 6 and 7
    "wan22-ti2v": lambda: _tiny_wan22_ti2v(8),
    "wan-i2v": lambda: _tiny_wan_i2v(9),
    "wan22-i2v": lambda: _tiny_wan22_i2v(10),  # experts drawn from seeds 10 and 11
}


# Classes whose name save_pretrained records as transformers built them here, and the name
# the Hub's folders carry: transformers 5 without torchvision builds CLIPImageProcessor as
# its PIL backend (CLIPImageProcessorPil), and diffusers records that; the Hub's Wan 2.1
# I2V folders name CLIPImageProcessor, which loads as either backend.
_HUB_NAMES = {("transformers", "CLIPImageProcessorPil"): ["transformers", "CLIPImageProcessor"]}


def _hub_class_names(path: str) -> None:
    """Give ``path``'s ``model_index.json`` the class names the Hub's folders use."""
    index = os.path.join(path, "model_index.json")
    with open(index) as f:
        config = json.load(f)
    renamed = {
        k: _HUB_NAMES[tuple(v)]
        for k, v in config.items()
        if isinstance(v, list) and len(v) == 2 and tuple(v) in _HUB_NAMES
    }
    if not renamed:
        return
    tmp = f"{index}.tmp"
    with open(tmp, "w") as f:
        json.dump({**config, **renamed}, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, index)


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
    if size == "full":  # siblings first, links, the room checked (nostall.synthetic.full)
        from nostall.synthetic.full import write_full_store

        return write_full_store(folder, tuple(pipelines), device=device, progress=progress)
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
        # diffusers logs its own progress bars and warnings here; quiet them.
        logging.getLogger("diffusers").setLevel(logging.ERROR)
        pipe = _TINY[name]()
        pipe.save_pretrained(path, safe_serialization=True)
        _hub_class_names(path)
        with open(stamp, "w") as f:
            json.dump({"size": size, "name": name}, f)
    return out
