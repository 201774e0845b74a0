"""The real-size store writer, run on tiny layouts (the real ones need a GPU and 47 GB);
the real layouts built on ``meta``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")


def _tiny_flux_layout():
    import diffusers

    from nostall.synthetic import tiny as stores

    pipe_cls, dtype = "FluxPipeline", torch.bfloat16
    pipe = stores._tiny_flux(1)
    modules = {
        r: getattr(pipe, r) for r in ("transformer", "text_encoder", "text_encoder_2", "vae")
    }
    modules = {r: m.to("meta") for r, m in modules.items()}
    files = {
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(),
        "tokenizer": ("clip", 32),
        "tokenizer_2": ("t5", 512),
    }
    return pipe_cls, modules, files, dtype


def _tiny_sd3_layout():
    import diffusers

    from nostall.synthetic import tiny as stores

    pipe = stores._tiny_sd3(1)  # its T5 and VAE have the tiny FLUX's layouts
    roles = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
    modules = {r: getattr(pipe, r).to("meta") for r in roles}
    files = {
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        "tokenizer": ("clip", 32),
        "tokenizer_2": ("clip", 32),
        "tokenizer_3": ("t5", 512),
    }
    return "StableDiffusion3Pipeline", modules, files, torch.bfloat16


def test_written_pipelines_load_with_diffusers_and_share_components(tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline

    from nostall.cache import Store
    from nostall.synthetic import full as fullstores

    monkeypatch.setattr(
        fullstores, "_FULL", {"flux": _tiny_flux_layout, "flux-b": _tiny_flux_layout}
    )
    monkeypatch.setattr(fullstores, "_SHARD", 100_000)  # several shards per component
    for name in ("flux", "flux-b"):
        fullstores.write_full(name, str(tmp_path / name), device="cpu")
    assert (
        tmp_path / "flux" / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    ).exists()
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "flux"), torch_dtype=torch.bfloat16)
    out = pipe(
        prompt="a cat",
        num_inference_steps=1,
        height=32,
        width=32,
        max_sequence_length=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all()
    import nostall

    with nostall.ModelCache(tmp_path, device="cpu", gpu_budget=8 << 20, host_budget=64 << 20) as c:
        ours = c.pipeline("flux")  # every component resolves its class from its folder
        got = ours(
            prompt="a cat",
            num_inference_steps=1,
            height=32,
            width=32,
            max_sequence_length=16,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images
        assert np.isfinite(got).all() and got.shape == out.shape
    store = Store(tmp_path, cache_dir=tmp_path / "idx")
    a, b = store.entry("flux"), store.entry("flux-b")
    # separate files (no nostall-store.json beside them, so no symlinks): equal bytes are
    # one component once they have been hashed, not before
    assert a.components["vae"].digest != b.components["vae"].digest
    for name in ("flux", "flux-b"):
        store.index_files(name)
    a, b = store.entry("flux"), store.entry("flux-b")
    assert a.components["vae"].digest == b.components["vae"].digest
    assert a.components["text_encoder_2"].digest == b.components["text_encoder_2"].digest
    assert a.components["transformer"].digest != b.components["transformer"].digest


def test_sd3_beside_flux_links_t5_and_the_vae_weights_and_runs(tmp_path, monkeypatch):
    import json
    import os

    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    import nostall
    from nostall.cache import Store
    from nostall.synthetic import full as fullstores
    from nostall.synthetic import write_store

    monkeypatch.setattr(fullstores, "_FULL", {"flux": _tiny_flux_layout, "sd3": _tiny_sd3_layout})
    said = []
    write_store(tmp_path, ("flux", "sd3"), size="full", device="cpu", progress=said.append)
    assert any("sd3/text_encoder_3: linked to flux/text_encoder_2" in line for line in said)
    for role, flux_role in (("text_encoder_3", "text_encoder_2"), ("vae", "vae")):
        sub = tmp_path / "sd3" / role
        assert not sub.is_symlink() and (sub / "config.json").exists()  # its own config
        weights = [f for f in os.listdir(sub) if f.endswith(".safetensors")]
        assert weights and all((sub / f).is_symlink() for f in weights)
        for f in weights:
            assert (sub / f).resolve() == (tmp_path / "flux" / flux_role / f).resolve()
    # SD3's VAE scaling, FLUX's VAE weights
    assert (
        json.loads((tmp_path / "sd3" / "vae" / "config.json").read_text())["scaling_factor"]
        == 1.5035
    )
    assert not (
        tmp_path / "sd3" / "transformer" / "diffusion_pytorch_model.safetensors"
    ).is_symlink()
    vae = load_file(str(tmp_path / "sd3" / "vae" / "diffusion_pytorch_model.safetensors"))
    norm = vae["decoder.conv_norm_out.weight"]
    assert torch.equal(norm, torch.ones_like(norm))  # normalisation: scale 1, shift 0
    assert torch.equal(vae["decoder.conv_norm_out.bias"], torch.zeros_like(norm))
    assert vae["decoder.conv_out.weight"].float().std() > 0.01  # the rest drawn
    kw = dict(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np")
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "sd3"), torch_dtype=torch.bfloat16)
    a = pipe(**kw, generator=torch.Generator().manual_seed(0)).images
    b = pipe(**kw, generator=torch.Generator().manual_seed(1)).images
    assert np.isfinite(a).all() and a.shape == (1, 32, 32, 3)
    assert np.abs(a - b).mean() > 0.02  # seeds tell apart in the image (5 levels of 255)
    with nostall.ModelCache(tmp_path, device="cpu", gpu_budget=8 << 20, host_budget=64 << 20) as c:
        got = c.pipeline("sd3")(**kw, generator=torch.Generator().manual_seed(0)).images
        assert np.array_equal(got, a)
    # linked files are one component to the store at once (no hashing needed): one copy
    # of T5 and of the VAE in a cache's tiers
    store = Store(tmp_path, cache_dir=tmp_path / "idx")
    flux, sd3 = store.entry("flux"), store.entry("sd3")
    assert sd3.components["text_encoder_3"].digest == flux.components["text_encoder_2"].digest
    assert sd3.components["vae"].digest == flux.components["vae"].digest


def test_the_footprint_counts_shared_components_once():
    from nostall.synthetic import full as fullstores

    fp = fullstores.footprint(("flux", "sdxl", "sd3"))
    p = fp["pipelines"]
    total = {n: sum(roles.values()) for n, roles in p.items()}
    shared = p["sd3"]["text_encoder_3"] + p["sd3"]["vae"]
    assert p["sd3"]["text_encoder_3"] == p["flux"]["text_encoder_2"]
    assert fp["disk_bytes"] == fp["distinct_bytes"] == sum(total.values()) - shared
    assert fp["separate_bytes"] == sum(total.values())
    assert 46e9 < fp["disk_bytes"] < 47e9  # what the one-H200 host's 64 GiB disk must take
    alone = fullstores.footprint(("sd3",))  # no FLUX beside: its own files, same bytes
    assert alone["disk_bytes"] == total["sd3"]


def test_a_disk_without_room_is_refused_naming_the_numbers(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from nostall.errors import ArgumentError
    from nostall.synthetic import full as fullstores

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64e9, 59e9, 5e9))
    with pytest.raises(ArgumentError, match=r"need 6\.9 GB and its disk has 5\.0 GB free"):
        fullstores.check_room(str(tmp_path / "store"), ("sdxl",))
    assert fullstores.check_room(str(tmp_path / "store"), ("sdxl",), written=("sdxl",)) == 0
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64e9, 0, 64e9))
    assert 6.9e9 < fullstores.check_room(str(tmp_path), ("sdxl",)) < 7e9


@pytest.mark.parametrize("name", ["flux", "sdxl", "sd3"])
def test_real_layouts_build_on_meta_with_the_published_sizes(name):
    from nostall.synthetic import full as fullstores

    _, modules, files, dtype = fullstores._FULL[name]()
    nbytes = {
        role: sum(
            t.numel() for t in {id(t): t for t in m.state_dict(keep_vars=True).values()}.values()
        )
        * dtype.itemsize
        for role, m in modules.items()
    }
    assert all(p.is_meta for m in modules.values() for p in m.parameters())
    expected = {  # GB, the layouts the issue names
        "flux": {"transformer": 23.8, "text_encoder_2": 9.5, "text_encoder": 0.25, "vae": 0.17},
        "sdxl": {"unet": 5.14, "text_encoder_2": 1.39, "text_encoder": 0.25, "vae": 0.17},
        # SD3-medium: a 2.03B-parameter transformer, CLIP-L and CLIP-G with projections
        "sd3": {"transformer": 4.17, "text_encoder_3": 9.5, "text_encoder_2": 1.39,
                "text_encoder": 0.25, "vae": 0.17},
    }[name]  # fmt: skip
    for role, gb in expected.items():
        assert abs(nbytes[role] / 1e9 - gb) / gb < 0.05, (role, nbytes[role])
    assert "scheduler" in files
    if name == "sd3":
        c = modules["transformer"].config
        published = dict(num_layers=24, attention_head_dim=64, num_attention_heads=24,
                         joint_attention_dim=4096, caption_projection_dim=1536,
                         pos_embed_max_size=192, patch_size=2, in_channels=16)  # fmt: skip
        assert {k: c[k] for k in published} == published
        assert modules["vae"].config.latent_channels == 16
        assert modules["text_encoder"].config.projection_dim == 768  # with a projection
        assert set(files) >= {"tokenizer", "tokenizer_2", "tokenizer_3"}
