"""Request rules read from pipeline configs: the tiny store's pipelines, and real-size
FLUX.1-dev, SD3-medium and SDXL configs; each refusal names its field and what it allows."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nostall.errors import ArgumentError
from nostall.serve.bodies import ControlRef, ImageBody, parse
from nostall.serve.requests import (
    ImageRules,
    Limits,
    RuleBook,
    check_image,
    check_video,
    image_rules,
    video_rules,
)

_VAE_8 = {"block_out_channels": [128, 256, 512, 512]}  # 3 halvings: scale 8


def _image(body: dict, rules, limits=None) -> dict:
    """``check_image`` of ``body`` (a JSON body less its model), typed as a server types it."""
    return check_image(parse(ImageBody, {"model": rules.model, **body}), rules, limits or Limits())


def _component(tmp_path, role, cls, config=None, max_length=None):
    folder = tmp_path / role
    folder.mkdir(parents=True)
    if max_length is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": max_length}))
    key = json.dumps(config).encode() if config is not None else b""
    return SimpleNamespace(class_name=cls, folder=str(folder), config_key=key)


def _entry(tmp_path, name, cls, **components):
    return SimpleNamespace(name=name, class_name=cls, components=components)


@pytest.fixture
def real(tmp_path):
    """Store entries shaped as real FLUX.1-dev, SD3-medium and SDXL (configs only)."""
    flux = _entry(
        tmp_path / "flux", "flux", "FluxPipeline",
        vae=_component(tmp_path / "flux", "vae", "AutoencoderKL", _VAE_8),
        transformer=_component(tmp_path / "flux", "transformer", "FluxTransformer2DModel",
                               {"patch_size": 1}),
        tokenizer=_component(tmp_path / "flux", "tokenizer", "CLIPTokenizer", max_length=77),
        tokenizer_2=_component(tmp_path / "flux", "tokenizer_2", "T5Tokenizer", max_length=512),
    )  # fmt: skip
    sd3 = _entry(
        tmp_path / "sd3", "sd3", "StableDiffusion3Pipeline",
        vae=_component(tmp_path / "sd3", "vae", "AutoencoderKL", _VAE_8),
        transformer=_component(tmp_path / "sd3", "transformer", "SD3Transformer2DModel",
                               {"patch_size": 2, "pos_embed_max_size": 192}),
        tokenizer=_component(tmp_path / "sd3", "tokenizer", "CLIPTokenizer", max_length=77),
        tokenizer_3=_component(tmp_path / "sd3", "tokenizer_3", "T5Tokenizer", max_length=1e30),
    )  # fmt: skip
    sdxl = _entry(
        tmp_path / "sdxl", "sdxl", "StableDiffusionXLPipeline",
        vae=_component(tmp_path / "sdxl", "vae", "AutoencoderKL", _VAE_8),
        unet=_component(tmp_path / "sdxl", "unet", "UNet2DConditionModel", {"sample_size": 128}),
        tokenizer=_component(tmp_path / "sdxl", "tokenizer", "CLIPTokenizer", max_length=77),
    )  # fmt: skip
    return {"flux": flux, "sd3": sd3, "sdxl": sdxl}


def test_real_size_rules_come_from_the_configs(real):
    flux = image_rules(real["flux"], Limits())
    assert (flux.multiple, flux.min_side, flux.max_side) == (16, 16, 2048)  # VAE 8 × 2×2 packing
    assert flux.max_sequence_length == 512 and flux.negative_prompt and flux.kind == "image"
    sd3 = image_rules(real["sd3"], Limits(max_side=4096))
    assert (sd3.multiple, sd3.max_side) == (16, 3072)  # 192 positions × patch 2 × VAE 8
    assert "pos_embed_max_size 192" in sd3.why_max
    assert sd3.max_sequence_length == 512  # diffusers' own cap; the T5 tokenizer has none
    assert image_rules(real["sd3"], Limits()).max_side == 2048  # the worker's cap is lower
    sdxl = image_rules(real["sdxl"], Limits())
    assert sdxl.multiple == 8 and sdxl.max_sequence_length is None


def test_the_tiny_stores_rules(store):
    from nostall.cache import Store

    book = RuleBook(Store.shared(store), Limits())
    sd3 = book.image("sd3")
    assert (sd3.multiple, sd3.max_side) == (8, 192)  # 96 positions × patch 1 × VAE 2
    assert book.image("flux").max_sequence_length == 512
    assert book.image("sdxl").max_sequence_length is None
    assert book.image("wan").kind == "video"
    assert book.image("sd3") is sd3  # read once while the files stay as they are
    assert book.video("wan").wan and not book.video("flux").wan
    assert (book.video("wan").z_dim, book.video("wan").spatial) == (16, 8)
    assert book.serving("image", ["flux", "wan", "sd3"]) == ["flux", "sd3"]
    assert book.serving("video", ["flux", "wan"]) == ["wan"]


def test_the_largest_side_accepted_is_the_largest_diffusers_runs(store):
    """The rule is the pipeline's own limit: SD3 runs at the largest side the rules
    accept, and its own check refuses the next multiple."""
    from diffusers import DiffusionPipeline

    from nostall.cache import Store

    rules = RuleBook(Store.shared(store), Limits()).image("sd3")
    top, over = rules.max_side, rules.max_side + rules.multiple
    ok = _image({"prompt": "a cat", "size": f"16x{top}"}, rules)
    assert ok["height"] == top
    with pytest.raises(ArgumentError) as e:
        _image({"prompt": "a cat", "size": f"16x{over}"}, rules)
    assert e.value.field == "size" and e.value.allowed["max"] == top
    pipe = DiffusionPipeline.from_pretrained(str(store / "sd3"))
    pipe.set_progress_bar_config(disable=True)
    pipe(prompt="a cat", height=top, width=16, num_inference_steps=1, output_type="np")
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        pipe(prompt="a cat", height=over, width=16, num_inference_steps=1, output_type="np")


_FLUX = ImageRules("flux", "FluxPipeline", multiple=16, min_side=16, max_side=2048,
                   max_steps=150, max_sequence_length=512)  # fmt: skip
_SDXL = ImageRules("sdxl", "StableDiffusionXLPipeline", multiple=8, min_side=16,
                   max_side=2048, max_steps=150, max_sequence_length=None)  # fmt: skip


@pytest.mark.parametrize(
    "rules, body, field, says",
    [
        (_FLUX, {"size": "1000x1024"}, "size", "multiple of 16"),
        (_FLUX, {"size": "4096x1024"}, "size", "in [16, 2048]"),
        (_FLUX, {"size": "big"}, "size", "WIDTHxHEIGHT"),
        (_FLUX, {"steps": 0}, "steps", "[1, 150]"),
        (_FLUX, {"max_sequence_length": 600}, "max_sequence_length", "[1, 512]"),
        (_SDXL, {"max_sequence_length": 77}, "max_sequence_length", "takes no"),
        (_FLUX, {"seed": -1}, "seed", "seed=-1"),
        (_FLUX, {"guidance": float("nan")}, "guidance", "[0, 50.0]"),
        (_FLUX, {"prompt": "  "}, "prompt", "give 1 to 4000"),
        (_FLUX, {"n": 2}, "n", "only 1"),
    ],
)
def test_each_refusal_names_the_field_and_what_it_allows(rules, body, field, says):
    with pytest.raises(ArgumentError) as e:
        _image({"prompt": "a cat", **body}, rules)
    assert e.value.field == field and says in str(e.value), str(e.value)
    if field in ("size", "steps"):
        assert e.value.allowed and "max" in e.value.allowed


@pytest.mark.parametrize(
    "body, field, says",
    [
        ({"size": 1024}, "size", "valid string (got 1024)"),
        ({"steps": "28"}, "steps", "valid integer (got '28')"),
        ({"steps": 28.0}, "steps", "valid integer (got 28.0)"),
        ({"steps": True}, "steps", "valid integer (got True)"),
        ({"max_sequence_length": "77"}, "max_sequence_length", "valid integer"),
        ({"max_sequence_length": 77.9}, "max_sequence_length", "valid integer"),
        ({"seed": False}, "seed", "valid integer"),
        ({"guidance": "7"}, "guidance", "valid number"),
        ({"prompt": 5}, "prompt", "valid string"),
        ({"negative_prompt": ["a"]}, "negative_prompt", "valid string"),
        ({"loras": [{"name": "a", "weight": 1}]}, "loras.0.weight", "Extra inputs"),
        ({"sampler": "euler"}, "sampler", "Extra inputs"),
    ],
)
def test_a_body_of_the_wrong_types_is_refused_naming_the_field(body, field, says):
    """The types are pydantic's to check, once (:mod:`nostall.serve.bodies`); a Python
    caller's dict gets the same ArgumentError an HTTP client's 422 says."""
    with pytest.raises(ArgumentError) as e:
        parse(ImageBody, {"model": "flux", "prompt": "a cat", **body})
    assert e.value.field == field and says in str(e.value), str(e.value)


def test_a_video_pipeline_is_refused_on_the_images_endpoint():
    wan = ImageRules("wan", "WanPipeline", 8, 16, 2048, 150, kind="video")
    with pytest.raises(ArgumentError, match="video pipeline") as e:
        _image({"prompt": "a cat"}, wan)
    assert e.value.field == "model"


def test_a_good_body_gives_the_job_fields():
    body = {"prompt": "a cat", "size": "512x768", "steps": 4, "seed": 7, "guidance": 3,
            "max_sequence_length": 77}  # fmt: skip
    out = _image(body, _FLUX)
    assert out == {
        "prompt": "a cat", "width": 512, "height": 768, "steps": 4, "seed": 7,
        "guidance": 3.0, "negative_prompt": None, "max_sequence_length": 77,
    }  # fmt: skip
    assert 0 <= _image({"prompt": "a"}, _FLUX)["seed"] < 2**31


@pytest.fixture
def wan(store):
    from nostall.cache import Store

    return video_rules(Store.shared(store).entry("wan"))


@pytest.mark.parametrize(
    "latents, field, says",
    [
        (torch.zeros(2, 16, 3, 4, 4), "latents", "a batch of 2"),
        (torch.zeros(1, 4, 3, 4, 4), "latents", "4 channels; wan's VAE takes 16"),
        (torch.zeros(16, 3, 4, 4), "latents", "give (1, 16, T, h, w)"),
        (torch.zeros(1, 16, 0, 4, 4), "latents", "an empty dimension"),
        (torch.zeros(1, 16, 3, 4, 4, dtype=torch.int32), "latents", "floating-point"),
        (torch.full((1, 16, 3, 4, 4), float("nan")), "latents", "NaN or infinite"),
        (torch.zeros(1, 16, 42, 4, 4), "latents", "makes 165 frames"),  # 1 + 4·41 > 161
        (torch.zeros(1, 16, 2, 96, 161), "latents", "1288x768"),  # > 1280×720 pixels
    ],
)
def test_latents_are_checked_before_queueing(wan, latents, field, says):
    with pytest.raises(ArgumentError) as e:
        check_video(latents, wan, Limits(), fps=16.0, mode="eager")
    assert e.value.field == field and says in str(e.value), str(e.value)


def test_a_decode_names_model_mode_and_fps(wan, store):
    from nostall.cache import Store

    z = torch.zeros(1, 16, 3, 4, 4)
    check_video(z, wan, Limits(), fps=16, mode="exact")  # fine
    flux = video_rules(Store.shared(store).entry("flux"))
    with pytest.raises(ArgumentError, match="not a Wan VAE") as e:
        check_video(z, flux, Limits(), fps=16, mode="eager")
    assert e.value.field == "model"
    with pytest.raises(ArgumentError) as e:
        check_video(z, wan, Limits(), fps=16, mode="turbo")
    assert e.value.field == "mode" and "exact" in e.value.allowed
    for fps in (0, -1, 1000, True, "16"):
        with pytest.raises(ArgumentError) as e:
            check_video(z, wan, Limits(), fps=fps, mode="eager")
        assert e.value.field == "fps"


@pytest.mark.parametrize(
    "kw", [{"max_side": 0}, {"max_steps": -1}, {"min_side": 4096}, {"max_video_frames": True}]
)
def test_bad_limits_are_refused(kw):
    with pytest.raises(ArgumentError):
        Limits(**kw)


def _png_declaring(width: int, height: int) -> bytes:
    """A few hundred bytes of PNG whose header declares ``width`` x ``height`` pixels (a
    decompression bomb's header; its pixels are never there to decode)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("side", [9000, 40000])  # under PIL's own bomb cap, and beyond it
def test_a_control_image_declaring_another_size_is_refused_from_its_header(side, monkeypatch):
    import base64

    from PIL import Image

    from nostall.serve.requests import check_controlnet

    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self.size))
    image = base64.b64encode(_png_declaring(side, side)).decode()
    with pytest.raises(ArgumentError) as e:
        check_controlnet(ControlRef(name="edges", image=image), ["edges"], (512, 512), Limits())
    assert e.value.field == "controlnet.image" and e.value.allowed == "512x512"
    assert f"{side}x{side}" in str(e.value) or "too many pixels" in str(e.value)
    assert decoded == []  # refused from the header: not a pixel decoded
