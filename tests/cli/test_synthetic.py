"""``nostall synthetic``: a store of random-weight pipelines to try everything on."""

from __future__ import annotations

import json

import pytest
from cli_support import runner, usage_error

from nostall.cli import app


def test_synthetic_writes_a_store_the_other_commands_take(tmp_path):
    store = tmp_path / "store"
    result = runner.invoke(app, ["synthetic", str(store), "--pipeline", "sdxl"])
    assert result.exit_code == 0, result.output
    index = json.loads((store / "sdxl" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert "nostall switch --models" in result.output
    switched = runner.invoke(app, ["switch", "--models", str(store), "--device", "cpu", "sdxl"])
    assert switched.exit_code == 0, switched.output
    # A folder that holds files is written into only when asked; what is there is kept.
    again = runner.invoke(app, ["synthetic", str(store), "--pipeline", "sdxl"])
    usage_error(again, "already holds files; pass --overwrite")
    mtime = (store / "sdxl" / "model_index.json").stat().st_mtime_ns
    kept = runner.invoke(app, ["synthetic", str(store), "--pipeline", "sdxl", "--overwrite"])
    assert kept.exit_code == 0, kept.output
    assert (store / "sdxl" / "model_index.json").stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--size", "8k"], "Invalid value for --size: '8k' is not one of tiny, full"),
        (["--pipeline", "flux-dev"], "'flux-dev' is not one of flux, flux-b, sdxl, sd3, wan"),
        (["--device", "tpu"], "'tpu' is not a device"),
        (["--size", "full", "--pipeline", "wan22"], "'wan22' is not one of flux, flux-b, "
         "sdxl, sdxl-b, sdxl-c, sd3, wan-1.3b, wan-14b, wan22-a14b"),
        (["--elsewhere", "transformer_2"], "'transformer_2' is not ROLE=DIR"),
        (["--layout", "gguf"], "'gguf' is not one of diffusers, comfy"),
        (["--pipeline", "sdxl", "--layout", "comfy"], "add a Wan --pipeline"),
        (["--elsewhere", "vae=/x"], "only full-size weights go elsewhere; add --size full"),
        (["--size", "full", "--elsewhere", "vae=/a", "--elsewhere", "vae=/b"],
         "'vae' is given twice"),
        (["--size", "full", "--pipeline", "wan-14b", "--elsewhere", "transformer_2=/x"],
         "elsewhere names ['transformer_2'], a role with no weights in ['wan-14b']"),
    ],
)  # fmt: skip
def test_bad_synthetic_options_are_usage_errors(tmp_path, args, says):
    result = runner.invoke(app, ["synthetic", str(tmp_path / "store"), *args])
    usage_error(result, says)
    assert not (tmp_path / "store").exists()


def test_comfy_layout_writes_wan_as_the_community_ships_it_and_it_is_served(tmp_path):
    store = tmp_path / "store"
    result = runner.invoke(app, ["synthetic", str(store), "--pipeline", "wan", "--layout", "comfy"])
    assert result.exit_code == 0, result.output
    assert "wan-comfy:" in result.output
    files = sorted(p.name for p in (store / "wan-comfy" / "transformer").iterdir())
    assert files == ["config.json", "wan_transformer_fp8_scaled.safetensors"]
    assert (store / "wan-comfy" / "vae").is_symlink()
    switched = runner.invoke(
        app, ["switch", "--models", str(store), "--device", "cpu", "wan-comfy"]
    )
    assert switched.exit_code == 0, switched.output


def test_a_file_is_not_a_store(tmp_path):
    (tmp_path / "f").write_text("")
    usage_error(runner.invoke(app, ["synthetic", str(tmp_path / "f")]), "is not a folder")


def test_full_size_wan22_puts_an_expert_elsewhere(tmp_path, monkeypatch):
    import diffusers
    import torch

    from nostall.synthetic import full as fullstores
    from nostall.synthetic import tiny

    def layout():  # the tiny Wan 2.2 A14B in the real layout's place
        pipe = tiny._tiny_wan22(6)
        roles = ("transformer", "transformer_2", "text_encoder", "vae")
        modules = {r: getattr(pipe, r).to("meta") for r in roles}
        files = {"scheduler": diffusers.UniPCMultistepScheduler(), "tokenizer": ("t5", 512),
                 "boundary_ratio": 0.875}  # fmt: skip
        return "WanPipeline", modules, files, torch.bfloat16

    monkeypatch.setattr(fullstores, "_FULL", {"wan22-a14b": layout})
    store, away = tmp_path / "store", tmp_path / "shm"
    args = ["synthetic", str(store), "--size", "full", "--pipeline", "wan22-a14b",
            "--elsewhere", f"transformer_2={away}", "--device", "cpu"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    weights = store / "wan22-a14b" / "transformer_2" / "diffusion_pytorch_model.safetensors"
    assert weights.is_symlink()
    assert weights.resolve() == away / "wan22-a14b" / "transformer_2" / weights.name
    assert "transformer_2: files in" in result.output
    assert json.loads((store / "wan22-a14b" / "nostall-store.json").read_text()) == {
        "size": "full",
        "name": "wan22-a14b",
    }
