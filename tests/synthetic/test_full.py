"""The real-size store writer, run on tiny layouts (the real ones need a GPU and 41 GB)."""

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


@pytest.mark.parametrize("name", ["flux", "sdxl"])
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
    }[name]
    for role, gb in expected.items():
        assert abs(nbytes[role] / 1e9 - gb) / gb < 0.05, (role, nbytes[role])
    assert "scheduler" in files
