"""The published layouts of the real-size pipelines :mod:`nostall.synthetic.full` writes:
FLUX.1-dev, SDXL (and two fine-tunes of it), SD3-medium and the Wan 2.1 / 2.2
text-to-video pipelines, each module built on ``meta`` from its published config.

:data:`LAYOUTS`: pipeline name -> a function returning ``(pipeline class name, role ->
module on meta, the pipeline's other files and options, dtypes)``, ``dtypes`` one dtype
or role -> dtype. Which of them share components, and how they are written, is
:mod:`nostall.synthetic.full`'s business.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["LAYOUTS", "Dtypes", "Layout", "t5_xxl", "umt5_xxl"]


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
        "force_zeros_for_empty_prompt": True,  # a pipeline option, as the Hub's folder has it
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


def _wan_transformer(heads: int, ffn_dim: int, layers: int):
    import diffusers

    # Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers and Wan2.2-T2V-A14B-Diffusers,
    # transformer/config.json: they differ only in width, FFN and depth.
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=ffn_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def umt5_xxl():
    """google/umt5-xxl's encoder (5.68 B parameters), Wan's text encoder; built where the
    caller's device context says (``meta`` for shapes only)."""
    from transformers import UMT5Config, UMT5EncoderModel

    # "gated-gelu" makes dense_act_fn gelu_new and is_gated_act True, as the published
    # config has them. The encoder's input embedding is ``shared`` (written once).
    # transformers 5 ties the T5 family's embeddings always and keeps the published
    # tie_word_embeddings=False as scale_decoder_outputs=False, a decoder setting.
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=256384,
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=24,
            num_heads=64,
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
        )
    )


_WAN_1_3B, _WAN_14B = (12, 8960, 30), (40, 13824, 40)  # heads, ffn_dim, layers


def _wan(
    transformers: dict[str, tuple[int, int, int]], flow_shift: float, **options: Any
) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, torch.dtype]]:
    """A Wan text-to-video pipeline: one transformer per role in ``transformers``, UMT5-XXL,
    the Wan 2.1 VAE, UniPC with ``flow_shift``, and the pipeline ``options``."""
    import diffusers

    with torch.device("meta"):
        modules = {role: _wan_transformer(*shape) for role, shape in transformers.items()}
        modules["text_encoder"] = umt5_xxl()
        modules["vae"] = diffusers.AutoencoderKLWan()  # its defaults are the Wan 2.1 VAE
    files = {
        "scheduler": diffusers.UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift
        ),
        "tokenizer": ("t5", 512),  # ids < 130, inside UMT5's 256384
        **options,
    }
    dtypes = {role: torch.bfloat16 for role in modules}
    dtypes["vae"] = torch.float32
    return "WanPipeline", modules, files, dtypes


Dtypes = torch.dtype | Mapping[str, torch.dtype]  # one for the pipeline, or role -> dtype
Layout = Callable[[], tuple[str, dict[str, Any], dict[str, Any], Dtypes]]
LAYOUTS: dict[str, Layout] = {
    "flux": _flux,
    "flux-b": _flux,
    "sdxl": _sdxl,
    "sdxl-b": _sdxl,
    "sdxl-c": _sdxl,
    "sd3": _sd3,
    # Wan 2.1 T2V at 480p (flow_shift 3.0; 5.0 is its 720p value)
    "wan-1.3b": functools.partial(_wan, {"transformer": _WAN_1_3B}, 3.0),
    "wan-14b": functools.partial(_wan, {"transformer": _WAN_14B}, 3.0),
    # Wan 2.2 T2V-A14B: the high-noise expert denoises t >= 875, the low-noise one the
    # rest; flow_shift 12.0 as in Wan2.2's wan_t2v_A14B config (sample_shift).
    "wan22-a14b": functools.partial(
        _wan,
        {"transformer": _WAN_14B, "transformer_2": _WAN_14B},
        12.0,
        boundary_ratio=0.875,
        expand_timesteps=False,
    ),
}
