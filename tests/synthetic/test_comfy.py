"""Wan pipelines whose transformers are ComfyUI's scaled-FP8 single files (original Wan
names beside diffusers' config.json) are served as they are: the frames equal diffusers'
pipeline with those FP8 weights dequantized, bit for bit, for Wan 2.1 and for Wan 2.2
A14B's two experts; a bf16 file in the original names quantizes to diffusers' names."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from safetensors import safe_open

from nostall.cache import ModelCache
from nostall.store import resolve
from nostall.synthetic import write_store
from nostall.synthetic.comfy import comfy_component, comfy_pipeline, original_wan_name

CALL = dict(prompt="a red fox", height=16, width=16, num_frames=5, num_inference_steps=4)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("comfy-store")
    paths = write_store(root, ("wan", "wan22"))
    for name in ("wan", "wan22"):
        comfy_pipeline(paths[name], paths[name] + "-comfy")
    return str(root)


def _frames(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        return pipe(**CALL, generator=g, output_type="np").frames[0]


def _dequantized_reference(store: str, name: str):
    """diffusers' own pipeline from the diffusers folder, each transformer's block linears
    replaced by the ComfyUI file's e4m3 values times their scale (what the file means)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(os.path.join(store, name))
    for role in ("transformer", "transformer_2"):
        module = getattr(pipe, role, None)
        if module is None:  # Wan 2.1 has no second expert
            continue
        path = os.path.join(store, f"{name}-comfy", role, f"wan_{role}_fp8_scaled.safetensors")
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            replaced = 0
            for param_name, param in module.named_parameters():
                key = original_wan_name(param_name)
                scale_key = key.removesuffix("weight") + "scale_weight"
                if scale_key not in keys:
                    continue
                q, s = f.get_tensor(key), f.get_tensor(scale_key)
                assert q.dtype == torch.float8_e4m3fn and s.numel() == 1
                param.data = (q.float() * s.float()).to(param.dtype)
                replaced += 1
        assert replaced >= 6 * len(module.blocks)  # q, k, v, o of both attentions, ffn
    return pipe


@pytest.mark.parametrize("name", ["wan", "wan22"])
def test_comfy_scaled_fp8_transformers_are_served_as_their_weights_mean(store, name):
    with open(os.path.join(store, f"{name}-comfy", "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "WanPipeline"
    folder = os.path.join(store, f"{name}-comfy", "transformer")
    assert sorted(os.listdir(folder)) == ["config.json", "wan_transformer_fp8_scaled.safetensors"]
    with ModelCache(store, device="cpu") as cache:
        with cache.use(f"{name}-comfy") as pipe:
            served = _frames(pipe)
        with cache.use(name) as pipe:
            bf16 = _frames(pipe)
    layout = resolve(folder).layout
    assert layout == "the original WanTransformer3DModel layout and ComfyUI's scaled FP8"
    np.testing.assert_array_equal(served, _frames(_dequantized_reference(store, name)))
    assert not np.array_equal(served, bf16)  # the FP8 weights are what was served


def _gemm_sized(folder) -> None:
    """A Wan transformer whose linears FP8 GEMMs take (dimensions multiples of 16)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    model.to(torch.bfloat16).save_pretrained(folder)


def test_a_bf16_file_in_the_original_names_quantizes_to_diffusers_names(tmp_path):
    import nostall

    _gemm_sized(tmp_path / "src")
    comfy_component(
        str(tmp_path / "src"), str(tmp_path / "orig"), "wan_bf16.safetensors", fp8=False
    )
    with safe_open(str(tmp_path / "orig" / "wan_bf16.safetensors"), "pt") as f:
        assert "blocks.0.self_attn.q.weight" in set(f.keys())
    a = nostall.load_model(str(tmp_path / "orig"), device="cpu")
    b = nostall.load_model(str(tmp_path / "src"), device="cpu")
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    report = nostall.quantize(str(tmp_path / "orig"), str(tmp_path / "fp8"))
    assert report.ratio < 0.9
    (out,) = [n for n in os.listdir(tmp_path / "fp8") if n.endswith(".safetensors")]
    with safe_open(str(tmp_path / "fp8" / out), "pt") as f:
        keys = set(f.keys())
    assert {"blocks.0.attn1.to_q.weight", "blocks.0.attn1.to_q.weight_scale"} <= keys
    assert not any("self_attn" in k for k in keys)
    nostall.load_model(str(tmp_path / "fp8"), device="cpu")  # served in diffusers' names


@pytest.mark.cuda
def test_comfy_fp8_runs_on_tensor_cores_as_the_same_weights_in_nostalls_names(tmp_path):
    from safetensors.torch import save_file

    import nostall

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need CUDA compute capability 8.9+")
    _gemm_sized(tmp_path / "src")
    comfy_component(str(tmp_path / "src"), str(tmp_path / "comfy"), "wan_fp8_scaled.safetensors")
    # The same bytes under diffusers' names and nostall's scale names.
    ckpt = resolve(str(tmp_path / "comfy"))
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_bytes((tmp_path / "src" / "config.json").read_bytes())
    with safe_open(ckpt.files[0].path, "pt") as f:
        tensors = {e.name: f.get_tensor(e.key) for e in ckpt.files[0].tensors}
    save_file(tensors, str(tmp_path / "ours" / "diffusion_pytorch_model.safetensors"))
    a = nostall.load_model(str(tmp_path / "comfy"), device="cuda")
    b = nostall.load_model(str(tmp_path / "ours"), device="cuda")
    on_cores = [m for m in a.modules() if getattr(m, "_fp8_tensor_cores", False)]
    assert len(on_cores) >= 6 * len(a.blocks)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4, 1, 8, 8, device="cuda", generator=g, dtype=torch.bfloat16)
    text = torch.randn(1, 8, 32, device="cuda", generator=g, dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    with torch.inference_mode():
        ya = a(x, t, text, return_dict=False)[0]
        yb = b(x, t, text, return_dict=False)[0]
    assert torch.isfinite(ya).all() and torch.equal(ya, yb)
