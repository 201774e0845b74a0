"""``mode="exact"``: nostall's decoder forward must give ``vae.decode``'s bits (CPU, tiny VAEs)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

pytest.importorskip("diffusers")
from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module
from test_wan import _BUILDERS, _latents, _reference

from nostall.errors import ArgumentError, DegradedError, DeviceError
from nostall.video import exact as exact_mod
from nostall.video.exact import ExactDecoder, ExactState, unsupported_reason
from nostall.video.kernels import rms_silu_into
from nostall.video.wan import decode_chunks


@pytest.fixture(params=sorted(_BUILDERS))
def vae(request):
    return _BUILDERS[request.param]()


def _never_called(monkeypatch, vae):
    def refuse(x, feat_cache=None, feat_idx=None, first_chunk=False):
        raise AssertionError("exact mode called vae.decoder.forward")

    monkeypatch.setattr(vae.decoder, "forward", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 5])
def test_exact_mode_is_bit_identical_to_vae_decode(vae, dtype, t, monkeypatch):
    vae = vae.to(dtype)
    z = _latents(vae, t=t, h=3, w=5).to(dtype)
    ref = _reference(vae, z)
    _never_called(monkeypatch, vae)
    chunks = list(decode_chunks(vae, z, mode="exact"))
    assert [c.shape[2] for c in chunks] == [1] + [4] * (t - 1)
    out = torch.cat(chunks, dim=2)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out, ref)


@pytest.mark.parametrize("slicing", [False, True])
def test_exact_mode_batches(vae, slicing):
    vae.use_slicing = slicing
    z = _latents(vae, b=2, t=3)
    out = torch.cat(list(decode_chunks(vae, z, mode="exact")), dim=2)
    assert torch.equal(out, _reference(vae, z))


def test_interleaved_exact_generators_keep_their_own_buffers(vae):
    za, zb = _latents(vae, t=3, seed=1), _latents(vae, t=3, seed=2)
    ga, gb = decode_chunks(vae, za, mode="exact"), decode_chunks(vae, zb, mode="exact")
    a, b = [], []
    for ca, cb in zip(ga, gb, strict=True):
        a.append(ca)
        b.append(cb)
    assert torch.equal(torch.cat(a, 2), _reference(vae, za))
    assert torch.equal(torch.cat(b, 2), _reference(vae, zb))


def test_state_is_released_at_the_end_and_early_stop(vae, monkeypatch):
    states = []
    new = ExactState.__init__

    def spy(self):
        new(self)
        states.append(self)

    monkeypatch.setattr(ExactState, "__init__", spy)
    list(decode_chunks(vae, _latents(vae, t=3), mode="exact"))
    gen = decode_chunks(vae, _latents(vae, t=3), mode="exact")
    next(gen)
    assert states[1].history  # mid-video: the cached frames are there
    gen.close()
    for s in states:
        assert not s.history and not s.flat and not s.started


def test_unknown_mode_is_an_argument_error(vae):
    with pytest.raises(ArgumentError, match="exact"):
        decode_chunks(vae, _latents(vae), mode="fastest")


def test_a_decoder_exact_cannot_run_decodes_eagerly_and_says_so_once(vae, caplog):
    vae.decoder.nonlinearity = nn.GELU()  # the head: eager uses it, exact would not
    z = _latents(vae, t=2)
    ref = _reference(vae, z)
    exact_mod_warned = __import__("nostall.video.wan", fromlist=["_WARNED"])._WARNED
    exact_mod_warned.clear()
    with caplog.at_level(logging.WARNING, logger="nostall.video.wan"):
        out1 = torch.cat(list(decode_chunks(vae, z, mode="exact")), 2)
        out2 = torch.cat(list(decode_chunks(vae, z, mode="exact")), 2)
    assert torch.equal(out1, ref) and torch.equal(out2, ref)
    warnings = [r for r in caplog.records if "decoding eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "GELU" in warnings[0].getMessage()


def test_strict_refuses_a_decoder_exact_cannot_run_before_any_chunk(vae):
    vae.decoder.nonlinearity = nn.GELU()
    # Raised by the call itself, not at the first next(): no chunk is ever decoded.
    with pytest.raises(DegradedError, match="GELU") as info:
        decode_chunks(vae, _latents(vae, t=2), mode="exact", strict=True)
    assert info.value.requested == "mode='exact'" and info.value.fallback == "mode='eager'"


def test_unsupported_reasons_name_the_part(vae):
    assert unsupported_reason(vae.decoder, wan_module) is None
    vae.decoder.up_blocks[0]._hf_hook = object()  # what accelerate's offload attaches
    assert "offloaded" in unsupported_reason(vae.decoder, wan_module)
    del vae.decoder.up_blocks[0]._hf_hook
    norm = next(m for m in vae.decoder.modules() if isinstance(m, wan_module.WanRMS_norm))
    norm.bias = nn.Parameter(torch.zeros(1))
    assert "bias" in unsupported_reason(vae.decoder, wan_module)
    assert "no conv_in" in unsupported_reason(nn.Module(), wan_module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_silu_into_a_strided_view_equals_the_eager_chain(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 5, 7, generator=g).to(dtype).permute(0, 2, 1, 3, 4)  # strided
    x = x.permute(0, 2, 1, 3, 4)  # (2, 6, 3, 5, 7), memory order (b, t, c, h, w)
    gamma = (1 + 0.1 * torch.randn(6, generator=g)).to(dtype)
    norm = wan_module.WanRMS_norm(6, images=False).to(dtype)
    with torch.no_grad():
        norm.gamma.copy_(gamma.view(6, 1, 1, 1))
        ref = nn.SiLU()(norm(x))
    buf = torch.zeros(2, 6, 5, 7, 9, dtype=dtype)
    rms_silu_into(x, gamma, norm.scale, buf[:, :, 2:, 1:-1, 1:-1])
    assert torch.equal(buf[:, :, 2:, 1:-1, 1:-1], ref)
    assert buf[:, :, :2].abs().sum() == 0 and buf[..., 0, :].abs().sum() == 0


def test_exact_decoder_module_reuses_the_vae_weights(vae):
    dec = ExactDecoder(vae.decoder, wan_module)
    assert dec.decoder is vae.decoder
    before = {n: p.data_ptr() for n, p in vae.named_parameters()}
    list(decode_chunks(vae, _latents(vae, t=2), mode="exact"))
    assert {n: p.data_ptr() for n, p in vae.named_parameters()} == before
    assert exact_mod.ExactState().flat == {}


# ---- several devices: a pipeline of stages (CPU standing in for the GPUs) ----------


def _decode_split(vae, z, stages):
    from nostall.video.wan import _WanInternals

    internals = _WanInternals(vae, mode="exact")
    devices = [torch.device("cpu")] * stages
    internals._exact = ExactDecoder(vae.decoder, wan_module, devices=devices)
    state = internals.new_cache()
    x = vae.post_quant_conv(z)
    with torch.no_grad():
        return torch.cat(
            [
                internals.decode_frame(x[:, :, i : i + 1], state, first=i == 0)
                for i in range(z.shape[2])
            ],
            2,
        ), internals._exact


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_give_the_one_device_bits(vae, stages):
    z = _latents(vae, t=3)
    out, dec = _decode_split(vae, z, stages)
    assert len(dec.stages) == stages
    assert torch.equal(out, _reference(vae, z))
    # the later stages run copies of the user's modules, the first the user's own
    own = {id(m) for m in vae.decoder.modules()}
    assert all(id(m) in own for _, m in dec.stages[0][1])
    for _, part in dec.stages[1:]:
        for _, m in part:
            assert not any(id(x) in own for x in m.modules())


def test_split_points_balance_the_work_of_a_wan21_decoder():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan()  # the real Wan 2.1 layout, no memory
    steps = exact_mod._steps(vae.decoder, wan_module)
    costs = exact_mod._step_costs(vae.decoder, wan_module)
    assert len(costs) == 1 + len(steps)
    (cut,) = exact_mod.split_points(vae.decoder, wan_module, 2)
    loads = [sum(costs[: cut + 1]), sum(costs[cut + 1 :])]
    assert max(loads) / sum(loads) < 0.55
    # the 720p work (the last up block and the head) is on the second GPU
    assert all(m is not vae.decoder.up_blocks[-1].resnets[0] for _, m in steps[:cut])
    three = exact_mod.split_points(vae.decoder, wan_module, 3)
    assert len(three) == 2 and three[0] < three[1]


@pytest.mark.parametrize(
    "mode, devices, error, says",
    [
        ("eager", ["cuda:0", "cuda:1"], ArgumentError, "needs mode='exact'"),
        ("exact", ["cuda:0"], ArgumentError, "two or more"),
        ("exact", "cuda:0", ArgumentError, "two or more"),
        ("exact", ["cpu", "cpu"], DeviceError, "not a CUDA GPU"),
        ("exact", ["cuda:0", "gpu"], DeviceError, "not a device"),
    ],
)
def test_bad_devices_are_typed_errors_naming_the_device(vae, mode, devices, error, says):
    with pytest.raises(error, match=says):
        decode_chunks(vae, _latents(vae), mode=mode, devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_devices_that_do_not_exist_are_named():
    from nostall.video.wan import check_devices

    with pytest.raises(DeviceError, match=r"cuda:0 does not exist; 0 GPU"):
        check_devices(["cuda:0", "cuda:1"], None)
