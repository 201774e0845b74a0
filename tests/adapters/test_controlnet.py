"""A ControlNet attached to a cached base pipeline: diffusers' ControlNet pipeline over
the same resident modules, only the ControlNet's weights moved, images equal to the
pipeline diffusers builds from the same components."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from nostall import ModelCache
from nostall.errors import AdapterError, CheckpointError, UnknownModel


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from diffusers import ControlNetModel, UNet2DConditionModel

    from nostall.synthetic import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("controlnet-store")
    write_store(folder, ("sdxl", "flux"))
    unet = UNet2DConditionModel.from_pretrained(str(folder / "sdxl" / "unet"))
    torch.manual_seed(7)
    # one down-sampling in the conditioning embedding: the tiny VAE scales by 2
    cn = ControlNetModel.from_unet(
        unet, conditioning_channels=3, conditioning_embedding_out_channels=(8, 16)
    )
    with torch.no_grad():  # not zero-initialised: the control image must show
        for p in cn.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    cn.save_pretrained(str(folder / "controlnets" / "edges"))
    return folder


def _enter(block):
    with block:
        pass


def _control() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))


def _run(pipe, **kw):
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(2)
    return pipe(prompt="a house", height=32, width=32, num_inference_steps=2, generator=g,
                output_type="np", **kw).images[0]  # fmt: skip


def test_the_controlnet_pipeline_equals_diffusers_and_moves_only_the_controlnet(store):
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    cn = ControlNetModel.from_pretrained(str(store / "controlnets" / "edges"))
    ref_pipe = StableDiffusionXLControlNetPipeline.from_pretrained(
        str(store / "sdxl"), controlnet=cn
    )
    kw = {"image": _control(), "controlnet_conditioning_scale": 0.8}
    ref = _run(ref_pipe, **kw)
    with ModelCache(store, device="cpu") as cache:
        with cache.use("sdxl") as pipe:
            base = _run(pipe)
        with cache.use("sdxl", controlnet="edges") as pipe:
            assert type(pipe).__mro__[1] is StableDiffusionXLControlNetPipeline
            moved = {c.role: c.tier for c in cache.last_report.components}
            got = _run(pipe, **kw)
        with cache.use("sdxl") as plain:
            assert plain.unet is pipe.unet  # one module: the base never moved
            again = _run(plain)
    # the base components were resident: only the ControlNet came from the lower tiers
    assert {r for r, tier in moved.items() if tier not in ("gpu", "device")} == {"controlnet"}
    assert np.abs(got - ref).max() < 1e-5
    assert np.abs(got - base).max() > 1e-3  # the control shows
    assert np.array_equal(again, base)


def test_bad_controlnets_are_typed_errors(store, tmp_path):
    with ModelCache(store, device="cpu") as cache:
        with pytest.raises(UnknownModel, match="did you mean edges"):
            _enter(cache.use("sdxl", controlnet="egdes"))
        (tmp_path / "empty").mkdir()
        with pytest.raises(CheckpointError, match=r"config\.json"):
            _enter(cache.use("sdxl", controlnet=str(tmp_path / "empty")))
        with pytest.raises(AdapterError, match="FluxControlNetModel") as e:  # FLUX's only
            _enter(cache.use("flux", controlnet="edges"))
        assert e.value.field == "controlnet"
