"""Chunked Wan VAE decoding must reproduce ``vae.decode`` bit for bit (CPU, tiny VAEs)."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402
from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module  # noqa: E402

from nostall.errors import ArgumentError, LatentsError, UnsupportedError  # noqa: E402
from nostall.video.wan import (  # noqa: E402
    check_latents,
    decode_chunks,
    denormalize,
    frame_count,
    vae_placement,
)


def _tiny_wan21() -> AutoencoderKLWan:
    # Diffusers' defaults (z_dim=16, 3 spatial + 2 temporal up-samplings), but narrow.
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return _saturating(vae)


def _tiny_wan22() -> AutoencoderKLWan:
    # The Wan 2.2 TI2V-5B VAE layout (vae/config.json: base_dim=160, decoder_base_dim=256,
    # z_dim=48, in/out_channels=12, patch_size=2, is_residual, 16x spatial), but narrow.
    torch.manual_seed(1)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=16,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        is_residual=True,
        latents_mean=torch.linspace(-0.3, 0.4, 48).tolist(),
        latents_std=torch.linspace(0.5, 2.5, 48).tolist(),
    )
    return _saturating(vae)


def _saturating(vae: AutoencoderKLWan) -> AutoencoderKLWan:
    # Random weights give outputs well inside [-1, 1]; scale the head up so the clamp in
    # vae.decode matters and a chunked path that forgot it would differ.
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(8.0)
    return vae.eval()


_BUILDERS = {"wan21": _tiny_wan21, "wan22": _tiny_wan22}


@pytest.fixture(params=sorted(_BUILDERS))
def vae(request: pytest.FixtureRequest) -> AutoencoderKLWan:
    return _BUILDERS[request.param]()


def _latents(vae: AutoencoderKLWan, b: int = 1, t: int = 3, h: int = 4, w: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, vae.config.z_dim, t, h, w, generator=g)  # (B, C, T, h, w)


def _reference(vae: AutoencoderKLWan, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z).sample  # (B, 3, F, H, W)


def _spy_decoder(monkeypatch: pytest.MonkeyPatch, vae: AutoencoderKLWan, *, fail_on_call=None):
    """Record the feat_cache list of each decoder call; optionally raise on call n."""
    seen: list[list] = []
    forward = vae.decoder.forward

    def spy(x, feat_cache=None, feat_idx=None, first_chunk=False):
        seen.append(feat_cache)
        if fail_on_call is not None and len(seen) == fail_on_call:
            raise RuntimeError("simulated decoder failure")
        return forward(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)

    monkeypatch.setattr(vae.decoder, "forward", spy)
    return seen


@pytest.mark.parametrize("t", [1, 2, 4])
def test_chunks_concatenate_to_vae_decode_bit_exactly(vae, t):
    z = _latents(vae, t=t)
    ref = _reference(vae, z)
    assert (ref.abs() == 1).any(), "fixture should saturate some pixels so the clamp is tested"

    chunks = list(decode_chunks(vae, z))

    assert [c.shape[2] for c in chunks] == [1] + [4] * (t - 1)
    assert sum(c.shape[2] for c in chunks) == frame_count(t) == ref.shape[2]
    out = torch.cat(chunks, dim=2)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out, ref)
    with torch.no_grad():
        assert torch.equal(out, vae.decode(z, return_dict=False)[0])


def test_bf16_vae_is_bit_exact_too(vae):
    vae = vae.to(torch.bfloat16)
    z = _latents(vae, t=2).to(torch.bfloat16)
    chunks = list(decode_chunks(vae, z))
    assert chunks[0].dtype == torch.bfloat16
    assert torch.equal(torch.cat(chunks, dim=2), _reference(vae, z))


def test_chunk_shapes_follow_vae_geometry(vae):
    z = _latents(vae, t=2, h=3, w=5)
    scale = vae.config.scale_factor_spatial  # 8 for Wan 2.1, 16 for the 2.2 5B VAE
    shapes = [tuple(c.shape) for c in decode_chunks(vae, z)]
    assert shapes == [(1, 3, 1, 3 * scale, 5 * scale), (1, 3, 4, 3 * scale, 5 * scale)]


@pytest.mark.parametrize("slicing", [False, True])
def test_batches_match_vae_decode_with_and_without_slicing(vae, slicing):
    vae.use_slicing = slicing
    z = _latents(vae, b=2, t=2)
    chunks = list(decode_chunks(vae, z))
    assert all(c.shape[0] == 2 for c in chunks)
    assert torch.equal(torch.cat(chunks, dim=2), _reference(vae, z))


def test_runs_without_autograd_and_leaves_grad_mode_alone(vae):
    z = _latents(vae, t=2).requires_grad_(True)
    for chunk in decode_chunks(vae, z):
        assert not chunk.requires_grad
        assert torch.is_grad_enabled()  # no_grad must not leak into the consumer


def test_generator_does_not_hold_a_dropped_chunk_while_decoding_the_next(vae, monkeypatch):
    # Device memory stays at one chunk only if the generator lets go of chunk i before it
    # decodes chunk i + 1 (the consumer has already moved chunk i to the host).
    alive_during_second_decode = []
    ref = None
    forward = vae.decoder.forward

    def spy(x, feat_cache=None, feat_idx=None, first_chunk=False):
        if ref is not None:
            alive_during_second_decode.append(ref() is not None)
        return forward(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)

    monkeypatch.setattr(vae.decoder, "forward", spy)
    gen = decode_chunks(vae, _latents(vae, t=3))
    first = next(gen)
    ref = weakref.ref(first)
    del first
    next(gen)
    gen.close()
    assert alive_during_second_decode == [False]


def test_feature_cache_released_when_consumer_stops_early(vae, monkeypatch):
    z = _latents(vae, t=3)
    expected = _reference(vae, z)
    seen = _spy_decoder(monkeypatch, vae)

    gen = decode_chunks(vae, z)
    next(gen)
    cache = seen[0]
    cached = [weakref.ref(c) for c in cache if isinstance(c, torch.Tensor)]
    assert cached, "the decoder should have cached activations after the first chunk"
    gen.close()

    assert all(c is None for c in cache)
    assert all(r() is None for r in cached)
    # Nothing stale survives: a fresh decode is unaffected.
    assert torch.equal(torch.cat(list(decode_chunks(vae, z)), dim=2), expected)


def test_feature_cache_released_when_decoder_raises(vae, monkeypatch):
    seen = _spy_decoder(monkeypatch, vae, fail_on_call=2)
    with pytest.raises(RuntimeError, match="simulated decoder failure") as excinfo:
        for _ in decode_chunks(vae, _latents(vae, t=3)):
            pass
    # excinfo keeps the traceback, and with it the generator's frame, alive: the cache
    # must have been emptied in place anyway.
    assert excinfo.value is not None
    assert not any(isinstance(c, torch.Tensor) for c in seen[0])


def test_interleaved_generators_on_one_vae_do_not_interfere(vae):
    z1, z2 = _latents(vae, t=3, seed=1), _latents(vae, t=3, seed=2)
    g1, g2 = decode_chunks(vae, z1), decode_chunks(vae, z2)
    out1, out2 = [], []
    for a, b in zip(g1, g2, strict=True):
        out1.append(a)
        out2.append(b)
    assert torch.equal(torch.cat(out1, dim=2), _reference(vae, z1))
    assert torch.equal(torch.cat(out2, dim=2), _reference(vae, z2))


def test_tiling_that_would_split_the_latents_is_refused(vae):
    vae.enable_tiling(
        tile_sample_min_height=32,
        tile_sample_min_width=32,
        tile_sample_stride_height=16,
        tile_sample_stride_width=16,
    )
    tile = 32 // vae.spatial_compression_ratio  # latent pixels per tile
    with pytest.raises(NotImplementedError, match="disable_tiling"):
        decode_chunks(vae, _latents(vae, t=2, h=tile + 1, w=tile))  # raised before next()
    # Latents within one tile: vae.decode does not tile either, so streaming is exact.
    z = _latents(vae, t=2, h=tile, w=tile)
    assert torch.equal(torch.cat(list(decode_chunks(vae, z)), dim=2), _reference(vae, z))


def test_offload_hook_runs_like_vae_decode(vae):
    calls = []

    class Hook:
        def pre_forward(self, module):
            calls.append(module)

    vae._hf_hook = Hook()
    gen = decode_chunks(vae, _latents(vae, t=2))
    next(gen)
    gen.close()
    assert calls == [vae]


def test_missing_unpatchify_is_reported_with_the_diffusers_version(monkeypatch):
    monkeypatch.delattr(wan_module, "unpatchify")
    vae22 = _tiny_wan22()
    with pytest.raises(UnsupportedError, match=rf"diffusers {diffusers.__version__}.*unpatchify"):
        decode_chunks(vae22, _latents(vae22))
    # The Wan 2.1 VAE has no patch_size, so it does not need unpatchify.
    vae21 = _tiny_wan21()
    z = _latents(vae21, t=2)
    assert torch.equal(torch.cat(list(decode_chunks(vae21, z)), dim=2), _reference(vae21, z))


def test_decoder_without_first_chunk(monkeypatch):
    # diffusers before Wan 2.2 support had no first_chunk argument.
    for build in (_tiny_wan21, _tiny_wan22):
        vae = build()
        z = _latents(vae, t=2)
        expected = _reference(vae, z)
        forward = vae.decoder.forward

        def old_forward(x, feat_cache=None, feat_idx=None, _forward=forward):
            return _forward(x, feat_cache=feat_cache, feat_idx=feat_idx)

        monkeypatch.setattr(vae.decoder, "forward", old_forward)
        if vae.config.is_residual:
            with pytest.raises(
                UnsupportedError, match=r"first_chunk.*diffusers|diffusers.*first_chunk"
            ):
                decode_chunks(vae, z)
        else:
            assert torch.equal(torch.cat(list(decode_chunks(vae, z)), dim=2), expected)


@pytest.mark.parametrize("call", [decode_chunks, check_latents, denormalize])
@pytest.mark.parametrize(
    ("other", "name"),
    [
        (torch.nn.Conv3d(16, 3, 1), r"torch\.nn\.modules\.conv\.Conv3d"),
        (object(), r"builtins\.object"),  # no .config.z_dim to read
        (torch.compile(torch.nn.Conv3d(16, 3, 1), backend="eager"), r"torch\.compile of .*Conv3d"),
    ],
)
def test_rejects_a_vae_that_is_not_wan(call, other, name):
    # The class is checked before vae.config is read, so even an object without a
    # config gets the nostall error naming what was found and what is supported.
    with pytest.raises(UnsupportedError, match=rf"AutoencoderKLWan.*got {name}"):
        call(other, torch.zeros(1, 16, 1, 2, 2))


def test_missing_diffusers_internals_are_unsupported_not_runtime_errors(monkeypatch):
    vae = _tiny_wan21()
    monkeypatch.delattr(wan_module, "WanCausalConv3d")
    with pytest.raises(UnsupportedError, match="WanCausalConv3d") as info:
        decode_chunks(vae, torch.zeros(1, 16, 1, 2, 2))
    assert not isinstance(info.value, RuntimeError)


# ---- torch.compile ---------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_compiled_vae_decodes_like_vae_decode():
    # torch.compile(vae) compiles vae.forward only: vae.decode through the wrapper runs
    # the plain decoder, and decode_chunks unwraps to the same module.
    vae = _tiny_wan21()
    z = _latents(vae, t=2)
    compiled = torch.compile(vae, backend="eager")
    assert not isinstance(compiled, AutoencoderKLWan)
    out = torch.cat(list(decode_chunks(compiled, z)), dim=2)
    assert torch.equal(out, _reference(vae, z))
    assert torch.equal(out, _reference(compiled, z))
    assert vae_placement(compiled) == (torch.device("cpu"), torch.float32)


@pytest.mark.timeout(300)
def test_compiled_decoder_is_called_like_vae_decode_calls_it():
    vae = _tiny_wan21()
    z = _latents(vae, t=2)
    expected = _reference(vae, z)
    calls = []
    plain_forward = vae.decoder.forward

    @functools.wraps(plain_forward)  # keeps the (x, feat_cache=, ...) signature
    def counting(*args, **kwargs):
        calls.append(kwargs.get("first_chunk"))
        return plain_forward(*args, **kwargs)

    vae.decoder.forward = counting
    vae.decoder = torch.compile(vae.decoder, backend="eager")  # forward is (*args, **kwargs)
    assert torch.equal(_reference(vae, z), expected)
    calls.clear()
    out = torch.cat(list(decode_chunks(vae, z)), dim=2)
    assert torch.equal(out, expected)
    assert calls == [True, False]  # went through the compiled module, one call per frame


# ---- dtype, device and values --------------------------------------------------------


def test_latents_of_another_dtype_are_refused_with_the_fix():
    vae = _tiny_wan21()
    z = _latents(vae, t=2).to(torch.bfloat16)
    fix = r"z\.to\(device='cpu', dtype=torch\.float32\)"
    with pytest.raises(
        LatentsError, match=rf"torch\.bfloat16 on cpu.*torch\.float32 on cpu.*{fix}"
    ):
        check_latents(vae, z)
    with pytest.raises(LatentsError, match=fix):
        decode_chunks(vae, z)
    check_latents(vae, z, placement=False)  # host-side check before z.to(...)


def test_latents_on_another_device_are_refused_with_the_fix():
    vae = _tiny_wan21()
    z = torch.zeros(1, 16, 2, 4, 4, device="meta")
    with pytest.raises(LatentsError, match=r"on meta.*on cpu.*z\.to\(device='cpu'"):
        decode_chunks(vae, z)


def test_offloaded_vae_is_compared_with_its_execution_device():
    class Hook:  # what accelerate's enable_model_cpu_offload attaches
        execution_device = torch.device("meta")

        def pre_forward(self, module):
            pass

    vae = _tiny_wan21()
    vae._hf_hook = Hook()
    assert vae_placement(vae) == (torch.device("meta"), torch.float32)
    with pytest.raises(LatentsError, match=r"float32 on meta"):
        check_latents(vae, _latents(vae))


@pytest.mark.parametrize("placement", [True, False])
def test_non_finite_latents_are_refused_with_the_count(placement):
    vae = _tiny_wan21()
    z = _latents(vae, t=2)
    z[0, 1, 0, 0, :3] = float("nan")
    z[0, 2, 1, 2, :2] = float("inf")
    pattern = r"5 non-finite values \(3 NaN, 2 inf\) out of 512"
    with pytest.raises(LatentsError, match=pattern):
        check_latents(vae, z, placement=placement)
    with pytest.raises(LatentsError, match=pattern):
        decode_chunks(vae, z)


@pytest.mark.parametrize(
    ("z", "pattern"),
    [
        (torch.zeros(16, 3, 4, 4), r"5-D .*\(B, 16, T, h, w\).*\(16, 3, 4, 4\).*unsqueeze"),
        (
            torch.zeros(1, 8, 3, 4, 4),
            r"8 channels.*z_dim=16.*\(1, 8, 3, 4, 4\).*\(B, 16, T, h, w\)",
        ),
        (torch.zeros(1, 16, 3, 4, 4, dtype=torch.int64), r"floating point.*torch\.int64"),
        (torch.zeros(1, 16, 0, 4, 4), r"no frames.*\(1, 16, 0, 4, 4\).*T >= 1"),
        (torch.zeros(1, 16, 2, 0, 4), r"empty.*\(1, 16, 2, 0, 4\)"),
        ([[0.0]], r"torch\.Tensor.*list"),
    ],
)
def test_check_latents_errors_name_the_shapes(z, pattern):
    vae = _tiny_wan21()
    with pytest.raises(LatentsError, match=pattern):
        check_latents(vae, z)
    with pytest.raises(LatentsError, match=pattern):
        decode_chunks(vae, z)  # checked eagerly, before the first next()


def test_check_latents_accepts_valid_latents():
    vae = _tiny_wan22().to(torch.bfloat16)
    assert check_latents(vae, torch.zeros(2, 48, 1, 3, 5, dtype=torch.bfloat16)) is None


def test_frame_count():
    assert [frame_count(t) for t in (1, 2, 3, 21)] == [1, 5, 9, 81]
    with pytest.raises(ArgumentError, match=">= 1"):
        frame_count(0)
    with pytest.raises(TypeError):
        frame_count(2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_denormalize_matches_wan_pipeline(vae, dtype):
    c = vae.config.z_dim
    latents = _latents(vae, t=2).to(dtype)
    # Verbatim from diffusers' WanPipeline.__call__, before vae.decode.
    latents_mean = (
        torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    )
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(
        latents.device, latents.dtype
    )
    expected = latents / latents_std + latents_mean

    out = denormalize(vae, latents)

    assert out.dtype == dtype and out.shape == latents.shape
    assert torch.equal(out, expected)
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), latents.float() * std + mean, atol=tol, rtol=tol)


def test_denormalize_rejects_mismatched_config_and_latents():
    # z_dim=48 but diffusers' default 16-value latents_mean/std.
    vae = AutoencoderKLWan(base_dim=4, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    with pytest.raises(LatentsError, match=r"z_dim=48.*16 and 16"):
        denormalize(vae, torch.zeros(1, 48, 1, 2, 2))
    with pytest.raises(LatentsError, match="channels"):
        denormalize(_tiny_wan21(), torch.zeros(1, 48, 1, 2, 2))
