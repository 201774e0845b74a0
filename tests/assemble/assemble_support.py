"""Tiny random-weight models for the assemble tests, built from configs (no hub).

Imported by name (``from assemble_support import ...``): a second conftest module
could not be imported unambiguously next to tests/conftest.py.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

# diffusers warns on every from_pretrained that accelerate is missing; that is
# the reference path's business, not ours.
logging.getLogger("diffusers").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*accelerate.*")


@dataclass(frozen=True)
class Spec:
    """How to make one tiny model and run it on a fixed input."""

    make: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, Any]]
    output: Callable[[Any], torch.Tensor]


def _flux() -> nn.Module:
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )


def _flux_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.randint(0, 4, (16, 3), generator=g).float(),
        "txt_ids": torch.zeros(8, 3),
    }


def _unet() -> nn.Module:
    return diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
    )


def _unet_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    return {
        "sample": torch.randn(1, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
    }


def _vae() -> nn.Module:
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
    )


def _vae_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"sample": torch.randn(1, 3, 16, 16, generator=g), "sample_posterior": False}


def _wan_vae() -> nn.Module:
    return diffusers.AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def _wan_vae_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(4)
    return {"sample": torch.randn(1, 3, 5, 16, 16, generator=g), "sample_posterior": False}


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    return transformers.T5EncoderModel(config)


def _clip() -> nn.Module:
    config = transformers.CLIPTextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    )
    return transformers.CLIPTextModel(config)


def _token_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"input_ids": torch.randint(3, 64, (2, 7), generator=g)}


def wan_transformer_config() -> dict[str, Any]:
    """A tiny WanTransformer3DModel: non-persistent rope buffers, _keep_in_fp32_modules."""
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 16,
        "freq_dim": 32,
        "ffn_dim": 32,
        "num_layers": 1,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 32,
    }


def _sample(out: Any) -> torch.Tensor:
    return out.sample


def _hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state


def _clip_out(out: Any) -> torch.Tensor:
    # pooler_output depends on the eos position, i.e. on the token ids path too.
    return torch.cat([out.last_hidden_state.flatten(), out.pooler_output.flatten()])


SPECS: dict[str, Spec] = {
    "flux": Spec(_flux, _flux_inputs, _sample),
    "unet": Spec(_unet, _unet_inputs, _sample),
    "vae": Spec(_vae, _vae_inputs, _sample),
    "wan_vae": Spec(_wan_vae, _wan_vae_inputs, _sample),
    "t5": Spec(_t5, _token_inputs, _hidden),
    "clip": Spec(_clip, _token_inputs, _clip_out),
}


@dataclass(frozen=True)
class Saved:
    """A tiny model saved with save_pretrained, and how to check it."""

    name: str
    folder: Path
    cls: type[nn.Module]
    spec: Spec

    def tensors(self) -> dict[str, torch.Tensor]:
        """All tensors of the saved checkpoint, shards merged."""
        out: dict[str, torch.Tensor] = {}
        for file in sorted(self.folder.glob("*.safetensors")):
            out.update(load_file(file))
        assert out, f"no safetensors in {self.folder}"
        return out

    def reference(self, **kwargs: Any) -> nn.Module:
        """The model as the library itself loads it."""
        return self.cls.from_pretrained(self.folder, **kwargs)  # type: ignore[attr-defined]


def save_model(name: str, folder: Path, *, seed: int = 0, **save_kwargs: Any) -> Saved:
    spec = SPECS[name]
    torch.manual_seed(seed)
    model = spec.make()
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)  # type: ignore[operator]
    return Saved(name, folder, type(model), spec)
