"""Random LoRA files load into diffusers pipelines: every written layer adapted, the image
changed, the kohya and PEFT files of one seed equal, ``alpha`` honoured, bad arguments named."""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from nostall.errors import ArgumentError
from nostall.synthetic import write_lora, write_store

RANK = 4


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    return write_store(tmp_path_factory.mktemp("lora-store"), ("flux", "sdxl"))


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers():
    # transformers logs a load report of the base weights each text encoder adapter
    # "misses"; they are the base model's, loaded long before.
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _pipe(folder: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe) -> np.ndarray:
    kw = dict(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np")
    if type(pipe).__name__ == "FluxPipeline":
        kw["max_sequence_length"] = 16
    return pipe(generator=torch.Generator().manual_seed(0), **kw).images  # (1, 32, 32, 3)


def _with_lora(folder: str, path: str, weight: float | None = None):
    pipe = _pipe(folder)
    pipe.load_lora_weights(path, adapter_name="a")
    if weight is not None:
        pipe.set_adapters(["a"], [weight])
    return pipe


@pytest.fixture(scope="module")
def base(store) -> dict[str, np.ndarray]:
    return {name: _image(_pipe(folder)) for name, folder in store.items()}


def _lora_layers(module: torch.nn.Module) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


@pytest.mark.parametrize(
    ("name", "fmt", "text_encoder"),
    [
        ("flux", "peft", False),
        ("flux", "peft", True),
        ("sdxl", "peft", False),
        ("sdxl", "peft", True),
        ("sdxl", "kohya", True),
    ],
)
def test_every_written_layer_is_adapted_and_changes_the_image(
    store, base, tmp_path, name, fmt, text_encoder
):
    info = write_lora(
        store[name], tmp_path / "a.safetensors", fmt=fmt, text_encoder=text_encoder, rank=RANK
    )
    denoiser = "unet" if name == "sdxl" else "transformer"
    encoders = {"flux": ["text_encoder"], "sdxl": ["text_encoder", "text_encoder_2"]}[name]
    assert info["components"] == [denoiser] + (encoders if text_encoder else [])
    assert (info["format"], info["rank"], info["alpha"]) == (fmt, RANK, float(RANK))
    assert info["bytes"] == os.path.getsize(info["path"])
    assert os.listdir(tmp_path) == ["a.safetensors"]  # no temporary file left beside it

    pipe = _with_lora(store[name], info["path"])
    per_component = {c: _lora_layers(getattr(pipe, c)) for c in info["components"]}
    assert sum(len(v) for v in per_component.values()) == info["layers"]
    assert per_component[denoiser], "the denoiser got no LoRA layer"
    for layers in per_component.values():
        for layer in layers:
            assert layer.r["a"] == RANK and layer.scaling["a"] == 1.0
            assert layer.lora_B["a"].weight.abs().max() > 0  # B is drawn, not zero
    if not text_encoder:
        assert list(per_component) == [denoiser]
        assert not _lora_layers(pipe.text_encoder)
    assert np.abs(_image(pipe) - base[name]).max() > 1e-3


def test_peft_keys_shapes_and_dtype(store, tmp_path):
    from safetensors import safe_open

    info = write_lora(store["flux"], tmp_path / "f.safetensors", text_encoder=True, rank=3)
    with safe_open(info["path"], "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}  # alpha None: no adapter metadata, scale 1
        a = f.get_tensor("transformer.transformer_blocks.0.attn.to_q.lora_A.weight")
        b = f.get_tensor("transformer.transformer_blocks.0.attn.to_q.lora_B.weight")
    assert a.dtype == b.dtype == torch.float32
    assert a.shape == (3, 32) and b.shape == (32, 3)  # (rank, in), (out, rank)
    assert len(keys) == 2 * info["layers"]
    assert "text_encoder.text_model.encoder.layers.1.mlp.fc2.lora_B.weight" in keys
    # The single block's proj_out is a target; the model's final proj_out is not.
    assert "transformer.single_transformer_blocks.0.proj_out.lora_A.weight" in keys
    assert "transformer.proj_out.lora_A.weight" not in keys


def test_kohya_keys_use_the_sgm_block_names(store, tmp_path):
    from safetensors import safe_open

    info = write_lora(store["sdxl"], tmp_path / "k.safetensors", fmt="kohya", text_encoder=True)
    with safe_open(info["path"], "pt") as f:
        keys = set(f.keys())
        alpha = f.get_tensor("lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.alpha")
    assert len(keys) == 3 * info["layers"]  # down, up, alpha
    assert alpha.shape == () and alpha.item() == RANK
    # down_blocks.1.attentions.0 of a UNet with layers_per_block=1 is input_blocks.3.1.
    assert "lora_unet_input_blocks_3_1_proj_in.lora_down.weight" in keys
    assert "lora_unet_output_blocks_1_1_transformer_blocks_0_ff_net_2.lora_up.weight" in keys
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in keys
    assert "lora_te2_text_model_encoder_layers_1_mlp_fc1.lora_up.weight" in keys


@pytest.mark.parametrize("alpha", [None, 3.0 * RANK])
def test_sdxl_kohya_and_peft_files_of_one_seed_draw_the_same_image(store, tmp_path, alpha):
    images = []
    for fmt in ("peft", "kohya"):
        path = tmp_path / f"{fmt}.safetensors"
        write_lora(store["sdxl"], path, fmt=fmt, text_encoder=True, alpha=alpha, seed=7)
        images.append(_image(_with_lora(store["sdxl"], str(path))))
    np.testing.assert_allclose(images[0], images[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "fmt"), [("flux", "peft"), ("sdxl", "peft"), ("sdxl", "kohya")])
def test_alpha_scales_the_adapter_as_an_adapter_weight_does(store, tmp_path, name, fmt):
    plain = write_lora(store[name], tmp_path / "1.safetensors", fmt=fmt, text_encoder=True)
    double = write_lora(
        store[name], tmp_path / "2.safetensors", fmt=fmt, text_encoder=True, alpha=2 * RANK
    )
    assert double["alpha"] == 2.0 * RANK
    weighted = _image(_with_lora(store[name], plain["path"], weight=2.0))
    scaled = _image(_with_lora(store[name], double["path"]))
    np.testing.assert_allclose(scaled, weighted, rtol=0, atol=1e-5)
    # ... and is not ignored: scale 1 draws another image.
    assert np.abs(_image(_with_lora(store[name], plain["path"])) - scaled).max() > 1e-3


def test_diffusers_reads_alpha_back_where_it_is_written(store, tmp_path):
    from types import SimpleNamespace

    from diffusers import FluxPipeline, StableDiffusionXLPipeline, UNet2DConditionModel

    path = write_lora(store["flux"], tmp_path / "f.safetensors", alpha=8.0)["path"]
    state, alphas, meta = FluxPipeline.lora_state_dict(
        path, return_alphas=True, return_lora_metadata=True
    )
    assert alphas == {}  # the PEFT format carries alpha in the header only
    assert (meta["transformer.lora_alpha"], meta["transformer.r"]) == (8.0, RANK)
    assert sorted(meta["transformer.target_modules"]) == sorted(
        k.removeprefix("transformer.").removesuffix(".lora_A.weight")
        for k in state
        if k.endswith("lora_A.weight")
    )

    path = write_lora(store["sdxl"], tmp_path / "k.safetensors", fmt="kohya", alpha=8.0)["path"]
    config = SimpleNamespace(
        **UNet2DConditionModel.load_config(os.path.join(store["sdxl"], "unet"))
    )
    state, alphas = StableDiffusionXLPipeline.lora_state_dict(path, unet_config=config)
    assert set(alphas.values()) == {8.0} and len(alphas) == len(state) // 2
    assert "unet.down_blocks.1.attentions.0.proj_in.lora.down.weight" in state


def test_same_seed_same_tensors_other_seed_other_tensors(store, tmp_path):
    from safetensors.torch import load_file

    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for path, seed in zip(paths, (5, 5, 6), strict=True):
        write_lora(store["sdxl"], path, fmt="kohya", seed=seed)
    first, again, other = (load_file(p) for p in paths)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first if not k.endswith(".alpha"))


def test_targets_choose_the_layers(store, tmp_path):
    info = write_lora(store["flux"], tmp_path / "q.safetensors", targets=["to_q", "to_k"])
    assert info["layers"] == 4  # one double and one single block, two layers each
    with pytest.raises(ArgumentError, match="no_such_layer"):
        write_lora(store["flux"], tmp_path / "x.safetensors", targets=["no_such_layer"])


def test_unknown_and_unsupported_formats_are_named(store, tmp_path):
    out = tmp_path / "x.safetensors"
    with pytest.raises(ArgumentError, match=r"'diffusers-old'.*'peft'") as e:
        write_lora(store["sdxl"], out, fmt="diffusers-old")
    assert "kohya" in str(e.value) and e.value.field == "fmt"
    with pytest.raises(ArgumentError, match=r"'kohya'.*FluxPipeline.*\['peft'\]"):
        write_lora(store["flux"], out, fmt="kohya")
    assert not out.exists()


def test_a_folder_that_is_no_pipeline_is_named(store, tmp_path):
    empty = tmp_path / "not-a-pipeline"
    empty.mkdir()
    for folder in (empty, tmp_path / "missing", os.path.join(store["sdxl"], "unet")):
        with pytest.raises(ArgumentError, match=re.escape(os.path.basename(folder))):
            write_lora(folder, tmp_path / "x.safetensors")


@pytest.mark.parametrize(
    "bad",
    [{"rank": 0}, {"rank": 2.0}, {"alpha": 0}, {"alpha": float("nan")}, {"std": 0}, {"seed": "1"}],
)
def test_bad_arguments_raise_argument_error(store, tmp_path, bad):
    (field,) = bad
    with pytest.raises(ArgumentError) as e:
        write_lora(store["flux"], tmp_path / "x.safetensors", **bad)
    assert e.value.field == field
