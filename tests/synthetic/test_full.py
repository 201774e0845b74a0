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


def _tiny_wan_layout(experts: int, flow_shift: float, **options):
    """The tiny Wan layouts of :mod:`nostall.synthetic.tiny` in full.py's shape: bf16 but a
    float32 VAE, UniPC, one transformer or two experts."""
    import diffusers

    from nostall.synthetic import tiny as stores

    pipe = stores._tiny_wan22(6) if experts == 2 else stores._tiny_wan(5)
    roles = (*("transformer", "transformer_2")[:experts], "text_encoder", "vae")
    modules = {r: getattr(pipe, r).to("meta") for r in roles}
    files = {
        "scheduler": diffusers.UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift
        ),
        "tokenizer": ("t5", 512),
        **options,
    }
    dtypes = {r: torch.bfloat16 for r in roles} | {"vae": torch.float32}
    return "WanPipeline", modules, files, dtypes


_TINY_WAN = {
    "wan-14b": lambda: _tiny_wan_layout(1, 3.0),
    "wan22-a14b": lambda: _tiny_wan_layout(2, 12.0, boundary_ratio=0.875, expand_timesteps=False),
}


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.iterdir()):
        if f.name.endswith(".safetensors"):
            out.update(load_file(str(f)))
    return out


def test_wan22_beside_wan_14b_links_the_encoder_and_vae_and_has_two_own_experts(
    tmp_path, monkeypatch
):
    import json
    import os

    from diffusers import WanPipeline

    import nostall
    from nostall.store.catalog import Store
    from nostall.synthetic import full as fullstores

    monkeypatch.setattr(fullstores, "_FULL", _TINY_WAN)
    monkeypatch.setattr(fullstores, "_SHARD", 20_000)  # several shards per component
    store, shm = tmp_path / "store", tmp_path / "shm"
    said: list[str] = []
    # wan22-a14b first: the writer puts wan-14b, the sibling it links to, before it
    paths = fullstores.write_full_store(
        store,
        ("wan22-a14b", "wan-14b"),
        device="cpu",
        progress=said.append,
        elsewhere={"transformer_2": str(shm)},
    )
    assert list(paths) == ["wan22-a14b", "wan-14b"]
    wan22, wan14 = store / "wan22-a14b", store / "wan-14b"
    for role in ("text_encoder", "vae"):
        assert (wan22 / role).is_symlink() and (wan22 / role).resolve() == wan14 / role
        assert any(f"wan22-a14b/{role}: linked to wan-14b/{role}" in line for line in said)
    # its own experts: real files, drawn from their own seeds
    assert not any(p.is_symlink() for p in (wan22 / "transformer").iterdir())
    high, low = _weights(wan22 / "transformer"), _weights(wan22 / "transformer_2")
    mine = _weights(wan14 / "transformer")
    key = "blocks.0.attn1.to_q.weight"
    assert not torch.equal(high[key], low[key]) and not torch.equal(high[key], mine[key])
    assert high[key].dtype == torch.bfloat16
    # transformer_2's weights on the other "disk", linked; its config in the pipeline
    away = shm / "wan22-a14b" / "transformer_2"
    shards = sorted(f for f in os.listdir(away) if f.endswith(".safetensors"))
    assert len(shards) > 1 and (away / "diffusion_pytorch_model.safetensors.index.json").exists()
    for f in [*shards, "diffusion_pytorch_model.safetensors.index.json"]:
        assert (wan22 / "transformer_2" / f).is_symlink()
        assert (wan22 / "transformer_2" / f).resolve() == away / f
    config = wan22 / "transformer_2" / "config.json"
    assert config.exists() and not config.is_symlink()
    assert not (shm / "wan-14b").exists()  # wan-14b has no transformer_2
    index = json.loads((wan22 / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["expand_timesteps"] is False
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["tokenizer"] == ["transformers", "T5TokenizerFast"]
    sched = json.loads((wan22 / "scheduler" / "scheduler_config.json").read_text())
    assert sched["_class_name"] == "UniPCMultistepScheduler" and sched["flow_shift"] == 12.0
    assert sched["use_flow_sigmas"] and sched["prediction_type"] == "flow_prediction"
    vae = _weights(wan14 / "vae")
    norm = vae["decoder.norm_out.gamma"]  # WanRMS_norm: scale 1, as GroupNorm gets
    assert norm.dtype == torch.float32 and torch.equal(norm, torch.ones_like(norm))
    assert vae["decoder.conv_out.weight"].float().std() > 0.01  # the rest drawn

    pipe = WanPipeline.from_pretrained(str(wan22))
    assert pipe.config.boundary_ratio == 0.875
    got = {k: v.to(torch.bfloat16) for k, v in pipe.transformer_2.state_dict().items()}
    assert all(torch.equal(got[k], low[k]) for k in low)
    # 4 steps with flow_shift 12: the last below t = 875, the low-noise expert's
    kw = dict(prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=4,
              guidance_scale=1.0, max_sequence_length=16, output_type="np")  # fmt: skip
    calls = []
    pipe.transformer_2.register_forward_pre_hook(lambda *_: calls.append(1))
    want = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    assert want.shape == (1, 5, 16, 16, 3) and np.isfinite(want).all() and len(calls) == 1
    with nostall.ModelCache(store, device="cpu", cache_dir=tmp_path / "idx") as cache:
        with cache.use("wan22-a14b") as ours:
            frames = ours(**kw, generator=torch.Generator().manual_seed(0)).frames
            assert ours.nostall_experts.current == "transformer_2"
        # the low-noise expert: read from its linked shards (prefetched, or at the boundary)
        moved = [r for r in cache.reports if r.expert and r.moved_bytes]
        assert {c.role for r in moved for c in r.components} == {"transformer_2"}
    np.testing.assert_array_equal(frames, want)  # the linked shards, read as diffusers reads
    # linked folders are one component to the store without hashing; the experts are not
    s = Store(store, cache_dir=tmp_path / "idx")
    a, b = s.entry("wan-14b"), s.entry("wan22-a14b")
    for role in ("text_encoder", "vae"):
        assert a.components[role].digest == b.components[role].digest
    experts = {b.components[r].digest for r in ("transformer", "transformer_2")}
    assert len(experts | {a.components["transformer"].digest}) == 3
    # written once: a second call keeps both pipelines
    mtime = (wan22 / "model_index.json").stat().st_mtime_ns
    fullstores.write_full_store(store, ("wan-14b", "wan22-a14b"), device="cpu")
    assert (wan22 / "model_index.json").stat().st_mtime_ns == mtime


def test_bad_elsewhere_values_are_refused_naming_them(tmp_path, monkeypatch):
    from nostall.errors import ArgumentError
    from nostall.synthetic import full as fullstores

    monkeypatch.setattr(fullstores, "_FULL", _TINY_WAN)
    with pytest.raises(ArgumentError, match=r"\['transformer_3'\].*give one of"):
        fullstores.write_full_store(tmp_path, ("wan22-a14b",), elsewhere={"transformer_3": "x"})
    with pytest.raises(
        ArgumentError, match=r"\['transformer_2'\], a role with no weights in \['wan-14b'\]"
    ):
        fullstores.write_full("wan-14b", str(tmp_path / "w"), elsewhere={"transformer_2": "x"})
    (tmp_path / "file").write_text("")
    with pytest.raises(ArgumentError, match=r"elsewhere transformer_2=.*file/d.*cannot create"):
        fullstores.write_full_store(
            tmp_path / "s", ("wan22-a14b",), elsewhere={"transformer_2": str(tmp_path / "file/d")}
        )
    assert not (tmp_path / "s").exists()  # refused before anything was written


def test_the_room_of_each_filesystem_is_checked_with_what_goes_there(tmp_path, monkeypatch):
    import os
    import shutil
    from collections import namedtuple

    from nostall.errors import ArgumentError
    from nostall.synthetic import full as fullstores

    disk, shm = str(tmp_path / "store"), str(tmp_path / "shm")
    os.makedirs(disk), os.makedirs(shm)
    usage = namedtuple("usage", "total used free")
    free = {disk: 64e9, shm: 24e9}
    monkeypatch.setattr(fullstores, "_filesystem", lambda p: 2 if p == shm else 1)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: usage(0, 0, free[shm if "shm" in p else disk])
    )
    fp = fullstores.footprint(("wan22-a14b",))["pipelines"]["wan22-a14b"]
    with pytest.raises(ArgumentError) as e:
        fullstores.check_room(disk, ("wan22-a14b",))  # 69 GB on a 64 GB disk
    assert "wan22-a14b pipelines need 69.0 GB and its disk has 64.0 GB free" in str(e.value)
    with pytest.raises(
        ArgumentError, match=r"shm: the transformer_2 files need 28\.6 GB and its disk has 24\.0"
    ):
        fullstores.check_room(disk, ("wan22-a14b",), elsewhere={"transformer_2": shm})
    free[shm] = 40e9
    need = fullstores.check_room(disk, ("wan22-a14b",), elsewhere={"transformer_2": shm})
    assert need == sum(fp.values())
    # one filesystem: the two folders' bytes are counted together
    monkeypatch.setattr(fullstores, "_filesystem", lambda p: 1)
    with pytest.raises(ArgumentError, match=r"store and .*shm: .* need 69\.0 GB"):
        fullstores.check_room(disk, ("wan22-a14b",), elsewhere={"transformer_2": shm})


def test_the_wan_footprints_have_the_published_sizes_and_share_umt5_and_the_vae():
    from nostall.synthetic import full as fullstores

    names = ("wan-1.3b", "wan-14b", "wan22-a14b")
    fp = fullstores.footprint(names)
    p = fp["pipelines"]
    # parameters x 2 bytes (bf16): Wan2.1-T2V-14B's transformer has 14.288 B, 1.3B's
    # 1.419 B, umt5-xxl's encoder 5.68 B (its embedding once); the VAE float32
    for got, params, itemsize in (
        (p["wan-14b"]["transformer"], 14.288e9, 2),
        (p["wan-1.3b"]["transformer"], 1.419e9, 2),
        (p["wan-14b"]["text_encoder"], 5.681e9, 2),
        (p["wan-14b"]["vae"], 126.9e6, 4),
    ):
        assert abs(got / (params * itemsize) - 1) < 0.01, got
    for name in names:
        assert p[name]["text_encoder"] == p["wan-14b"]["text_encoder"]
        assert p[name]["vae"] == p["wan-14b"]["vae"]
    assert p["wan22-a14b"]["transformer"] == p["wan22-a14b"]["transformer_2"]
    te, vae, t14 = p["wan-14b"]["text_encoder"], p["wan-14b"]["vae"], p["wan-14b"]["transformer"]
    # three 14B transformers (wan-14b's and two experts), one 1.3B, one UMT5, one VAE
    assert (
        fp["distinct_bytes"]
        == fp["disk_bytes"]
        == 3 * t14 + p["wan-1.3b"]["transformer"] + te + vae
    )
    pair = fullstores.footprint(("wan-14b", "wan22-a14b"))
    assert pair["distinct_bytes"] == pair["disk_bytes"] == 3 * t14 + te + vae
    alone = fullstores.footprint(("wan22-a14b",))  # its own files: two experts, one UMT5
    assert alone["disk_bytes"] == alone["distinct_bytes"] == 2 * t14 + te + vae
    assert fullstores._home("wan22-a14b", "vae", names) == ("wan-1.3b", "vae")


@pytest.mark.parametrize("name", ["wan-1.3b", "wan-14b", "wan22-a14b"])
def test_the_wan_layouts_have_the_published_configs(name):
    from nostall.synthetic import full as fullstores

    class_name, modules, files, dtypes = fullstores._FULL[name]()
    assert class_name == "WanPipeline"
    assert all(p.is_meta for m in modules.values() for p in m.parameters())
    experts = ("transformer", "transformer_2") if name == "wan22-a14b" else ("transformer",)
    assert set(modules) == {*experts, "text_encoder", "vae"}
    heads, ffn, layers = (12, 8960, 30) if name == "wan-1.3b" else (40, 13824, 40)
    published = dict(num_attention_heads=heads, ffn_dim=ffn, num_layers=layers,
                     attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                     freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                     eps=1e-6, rope_max_seq_len=1024)  # fmt: skip
    for role in experts:
        c = modules[role].config
        assert {k: c[k] for k in published} == published and tuple(c.patch_size) == (1, 2, 2)
    t5 = modules["text_encoder"].config
    assert (t5.vocab_size, t5.d_model, t5.d_ff, t5.num_layers, t5.num_heads) == (
        256384, 4096, 10240, 24, 64)  # fmt: skip
    assert t5.dense_act_fn == "gelu_new" and t5.is_gated_act
    # the published tie_word_embeddings False, which transformers 5 keeps as this (it ties
    # the T5 family's embeddings always; the encoder's input embedding is ``shared``)
    assert t5.scale_decoder_outputs is False
    assert dtypes["vae"] == torch.float32 and dtypes["transformer"] == torch.bfloat16
    s = files["scheduler"].config
    assert s.flow_shift == (12.0 if name == "wan22-a14b" else 3.0) and s.use_flow_sigmas
    assert files["tokenizer"] == ("t5", 512)
    assert files.get("boundary_ratio") == (0.875 if name == "wan22-a14b" else None)


def test_the_sdxl_fine_tunes_have_their_own_unet_and_sdxls_text_encoders_and_vae():
    from nostall.synthetic.full import footprint

    one, three = footprint(("sdxl",)), footprint(("sdxl", "sdxl-b", "sdxl-c"))
    unet = one["pipelines"]["sdxl"]["unet"]
    assert three["distinct_bytes"] == one["distinct_bytes"] + 2 * unet
    assert three["separate_bytes"] == 3 * one["distinct_bytes"]
    assert three["pipelines"]["sdxl-b"] == one["pipelines"]["sdxl"]
