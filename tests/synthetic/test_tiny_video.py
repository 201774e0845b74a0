"""The tiny Wan stores: every layout diffusers serves loads with ``from_pretrained`` and
generates on the CPU; Wan 2.2 A14B's two experts each denoise their side of the boundary
and both matter; TI2V's latents have 48 channels; I2V needs its image; the store lists
every component, and the cache serves the frames diffusers makes."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from nostall.store.catalog import Store
from nostall.synthetic import PIPELINES, VIDEO_PIPELINES, write_store

# The smallest frame each layout takes: VAE compression times the transformer's 2x2 patch.
SIZE = {"wan": 16, "wan22": 16, "wan22-ti2v": 32, "wan-i2v": 16, "wan22-i2v": 16}
I2V = ("wan-i2v", "wan22-i2v")
EXPERTS = {"wan22": 0.875, "wan22-i2v": 0.9}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    return write_store(tmp_path_factory.mktemp("video-store"), VIDEO_PIPELINES)


@pytest.fixture(scope="module")
def pipes(store):
    from diffusers import DiffusionPipeline

    out = {}
    for name, folder in store.items():
        out[name] = DiffusionPipeline.from_pretrained(folder)
        out[name].set_progress_bar_config(disable=True)
    return out


def _image(seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt_embeds(pipe, max_sequence_length: int) -> torch.Tensor:
    """The embeddings of "a cat" by the pipeline's text encoder, encoded as WanPipeline
    does. diffusers 0.42's WanImageToVideoPipeline calls ftfy unguarded (a NameError
    without it: huggingface/diffusers#12314); WanPipeline, with the same tokenizer and
    text encoder, does not."""
    from diffusers import WanPipeline

    parts = {k: pipe.components[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler")}
    with torch.no_grad():  # as in __call__: autograd picks other kernels, other bits
        return WanPipeline(**parts).encode_prompt(
            "a cat", do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
        )[0]


def generate(pipe, name: str, *, steps: int = 2, frames: int = 5, **kw):
    """``frames`` frames at the layout's smallest size in ``steps`` steps, fixed seed; the
    I2V layouts get an image, and prompt embeddings unless ``prompt=`` is given."""
    size = SIZE[name]
    args = dict(
        height=size,
        width=size,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        # Wan 2.1 I2V's attention reads the last 512 context tokens as text (hardcoded).
        max_sequence_length=512 if name == "wan-i2v" else 16,
    )
    args.update(kw)
    if name in I2V:
        args.setdefault("image", _image())
        if "prompt" not in args:
            args["prompt_embeds"] = _prompt_embeds(pipe, args["max_sequence_length"])
    else:
        args.setdefault("prompt", "a cat")
    return pipe(**args).frames


def test_video_layouts_are_not_written_by_default():
    # `nostall synthetic` writes all of PIPELINES when no --pipeline is given.
    assert set(VIDEO_PIPELINES) & set(PIPELINES) == {"wan"}


@pytest.mark.parametrize("name", VIDEO_PIPELINES)
def test_each_layout_generates_frames_and_latents(pipes, name):
    pipe = pipes[name]
    size = SIZE[name]
    frames = generate(pipe, name)
    assert frames.shape == (1, 5, size, size, 3)
    assert np.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    assert frames.std() > 0.01  # decoded noise, not a constant
    latents = generate(pipe, name, output_type="latent")
    scale = pipe.vae.config.scale_factor_spatial
    assert latents.shape == (1, pipe.vae.config.z_dim, 2, size // scale, size // scale)
    one = generate(pipe, name, frames=1)
    assert one.shape == (1, 1, size, size, 3)


@pytest.mark.parametrize(
    ("name", "cls", "two", "image_encoder", "expand"),
    [
        ("wan", "WanPipeline", False, False, False),
        ("wan22", "WanPipeline", True, False, False),
        ("wan22-ti2v", "WanPipeline", False, False, True),
        ("wan-i2v", "WanImageToVideoPipeline", False, True, False),
        ("wan22-i2v", "WanImageToVideoPipeline", True, False, False),
    ],
)
def test_each_layout_is_the_one_diffusers_ships(pipes, name, cls, two, image_encoder, expand):
    pipe = pipes[name]
    assert type(pipe).__name__ == cls
    assert (pipe.transformer_2 is not None) == two
    assert pipe.config.boundary_ratio == EXPERTS.get(name)
    assert pipe.config.expand_timesteps == expand
    if cls == "WanImageToVideoPipeline":
        assert (pipe.image_encoder is not None) == image_encoder
        assert (pipe.image_processor is not None) == image_encoder
        assert pipe.transformer.config.in_channels == 36
        # image_dim is what makes diffusers encode the image with CLIP (Wan 2.1 only)
        assert (pipe.transformer.config.image_dim is not None) == image_encoder


@pytest.mark.parametrize("name", EXPERTS)
def test_each_expert_denoises_its_side_of_the_boundary(pipes, name):
    pipe = pipes[name]
    seen = {"transformer": [], "transformer_2": []}
    hooks = [
        getattr(pipe, role).register_forward_pre_hook(
            lambda _, args, kwargs, role=role: seen[role].append(float(kwargs["timestep"][0])),
            with_kwargs=True,
        )
        for role in seen
    ]
    try:
        generate(pipe, name, steps=4, output_type="latent")
    finally:
        for h in hooks:
            h.remove()
    timesteps = [float(t) for t in pipe.scheduler.timesteps]
    boundary = EXPERTS[name] * pipe.scheduler.config.num_train_timesteps
    assert seen["transformer"] == [t for t in timesteps if t >= boundary]
    assert seen["transformer_2"] == [t for t in timesteps if t < boundary]
    assert seen["transformer"] and seen["transformer_2"]


@pytest.mark.parametrize("name", EXPERTS)
def test_the_second_expert_changes_the_video(pipes, name):
    pipe = pipes[name]
    # the same pipeline, its high-noise expert denoising every step
    one = type(pipe)(
        **{**pipe.components, "transformer_2": pipe.transformer},
        boundary_ratio=pipe.config.boundary_ratio,
    )
    one.set_progress_bar_config(disable=True)
    # four steps: the second expert takes sigma from 0.86 to 0 (with two steps, from 0.009)
    two = generate(pipe, name, steps=4, output_type="latent")
    same = generate(one, name, steps=4, output_type="latent")
    assert (two - same).abs().max() > 0.1


def test_ti2v_has_48_latent_channels_and_the_wan22_vae(pipes):
    pipe = pipes["wan22-ti2v"]
    vae = pipe.vae.config
    assert (vae.z_dim, vae.in_channels, vae.patch_size, vae.is_residual) == (48, 12, 2, True)
    assert vae.decoder_base_dim != vae.base_dim and len(vae.latents_mean) == 48
    latents = generate(pipe, "wan22-ti2v", output_type="latent")
    assert latents.shape == (1, 48, 2, 2, 2)  # 32x32 pixels: 16x VAE, one 2x2 patch
    assert generate(pipe, "wan22-ti2v", height=64, width=32).shape == (1, 5, 64, 32, 3)


@pytest.mark.parametrize("name", I2V)
def test_i2v_needs_its_image_and_follows_it(pipes, name):
    pipe = pipes[name]
    with pytest.raises(ValueError, match="image"):
        generate(pipe, name, image=None)
    first = generate(pipe, name, output_type="latent")
    other = generate(pipe, name, output_type="latent", image=_image(1))
    assert (first - other).abs().max() > 1e-3


@pytest.mark.parametrize("seq", [512, 16])
def test_wan_i2v_reads_the_image_tokens_only_after_512_text_tokens(pipes, seq):
    # diffusers' Wan attention takes the last 512 context tokens as text and the rest as
    # the image's: with shorter prompts the image's own key projection sees nothing.
    pipe = pipes["wan-i2v"]
    seen = []
    attn = pipe.transformer.blocks[0].attn2
    hook = attn.add_k_proj.register_forward_hook(lambda _, args, out: seen.append(args[0].shape))
    try:
        generate(pipe, "wan-i2v", output_type="latent", max_sequence_length=seq)
    finally:
        hook.remove()
    crop, patch = 32, pipe.image_encoder.config.patch_size
    tokens = (crop // patch) ** 2 + 1  # CLIP's patches and its class token
    assert [s[1] for s in seen] == [tokens if seq == 512 else 0] * 2


def test_wan_i2v_prompts_need_ftfy(pipes):
    try:
        import ftfy  # noqa: F401
    except ImportError:
        # diffusers 0.42 calls ftfy unguarded in WanImageToVideoPipeline (#12314)
        with pytest.raises(NameError, match="ftfy"):
            generate(pipes["wan22-i2v"], "wan22-i2v", prompt="a cat")
    else:
        frames = generate(pipes["wan22-i2v"], "wan22-i2v", prompt="a cat")
        assert frames.shape == (1, 5, 16, 16, 3)


@pytest.mark.parametrize("name", VIDEO_PIPELINES)
def test_the_store_lists_every_component(store, name):
    entry = Store(store, cache_dir=False).entry(name)
    weights = {c.role for c in entry.weights}
    roles = {"text_encoder", "transformer", "vae"}
    if name in EXPERTS:
        roles.add("transformer_2")
    if name == "wan-i2v":
        roles.add("image_encoder")
    assert weights == roles
    files = {r for r, c in entry.components.items() if c is not None and not c.weights}
    assert files == {"tokenizer", "scheduler"} | (
        {"image_processor"} if name == "wan-i2v" else set()
    )
    if name == "wan-i2v":  # as the Hub names it, whichever backend transformers builds
        assert entry.components["image_processor"].class_name == "CLIPImageProcessor"
    if name == "wan22-i2v":
        assert entry.components["image_encoder"] is None
        assert entry.components["image_processor"] is None
    assert entry.config["boundary_ratio"] == EXPERTS.get(name)
    assert entry.config["expand_timesteps"] == (name == "wan22-ti2v")


def test_the_layouts_share_wan_s_text_encoder_and_vae(store):
    s = Store(store, cache_dir=False)
    for name in VIDEO_PIPELINES:
        s.index_files(name)  # content digests: equal bytes, equal keys
    key = {n: {r: c.digest for r, c in s.entry(n).components.items() if c} for n in store}
    assert len({key[n]["text_encoder"] for n in VIDEO_PIPELINES}) == 1
    assert len({key[n]["vae"] for n in VIDEO_PIPELINES if n != "wan22-ti2v"}) == 1
    assert key["wan22-ti2v"]["vae"] != key["wan"]["vae"]
    transformers = [key[n][r] for n in VIDEO_PIPELINES for r in key[n] if "transformer" in r]
    assert len(set(transformers)) == len(transformers) == 7


def test_the_cache_serves_every_layout_as_diffusers_does(store, pipes, tmp_path):
    import nostall

    with nostall.ModelCache(store, device="cpu", cache_dir=tmp_path) as cache:
        for name in VIDEO_PIPELINES:
            with cache.use(name) as pipe:
                frames = generate(pipe, name)
                experts = getattr(pipe, "nostall_experts", None)
            roles = {c.role for c in cache.last_report.components}
            if name in ("wan22", "wan22-i2v"):  # its second expert: prefetched, then switched
                assert not cache.last_report.expert and "transformer_2" not in roles
                roles |= {c.role for r in experts.reports for c in r.components}
            assert roles == {c.role for c in cache.store.entry(name).weights}
            np.testing.assert_array_equal(frames, generate(pipes[name], name), err_msg=name)
