"""``mode="fast"`` on the CPU: the fallback to ``exact`` where it cannot run, and fast's
channels-last forward itself (forced onto the CPU, where its kernels run their eager
chains), close to ``vae.decode`` on tiny VAEs. The GPU half is in test_exact_cuda.py."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module
from test_wan import _BUILDERS, _latents, _reference

from nostall.errors import ArgumentError, DegradedError
from nostall.video import wan as wan_mod
from nostall.video.exact import ExactState, FastDecoder
from nostall.video.wan import decode_chunks


@pytest.fixture(params=sorted(_BUILDERS))
def vae(request):
    return _BUILDERS[request.param]()


def test_fast_without_a_gpu_runs_exact_and_says_so_once(vae, caplog):
    z = _latents(vae, t=3)
    wan_mod._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="nostall.video.wan"):
        a = torch.cat(list(decode_chunks(vae, z, mode="fast")), 2)
        b = torch.cat(list(decode_chunks(vae, z, mode="fast")), 2)
    ref = _reference(vae, z)
    assert torch.equal(a, ref) and torch.equal(b, ref)  # exact's bits
    said = [r.getMessage() for r in caplog.records if "mode='fast' needs" in r.getMessage()]
    assert len(said) == 1 and "CUDA GPU" in said[0] and "mode='exact'" in said[0]


def test_fast_without_a_gpu_with_strict_is_refused(vae):
    with pytest.raises(DegradedError, match="CUDA GPU") as info:
        decode_chunks(vae, _latents(vae, t=2), mode="fast", strict=True)
    assert info.value.requested == "mode='fast'" and info.value.fallback == "mode='exact'"


def _force_fast(monkeypatch):
    monkeypatch.setattr(wan_mod, "_fast_missing", lambda device: None)


@pytest.mark.parametrize("t", [1, 2, 5])
def test_fast_forward_is_close_to_vae_decode(vae, t, monkeypatch):
    _force_fast(monkeypatch)
    made = []
    real = FastDecoder.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(FastDecoder, "__init__", spy)
    z = _latents(vae, t=t, h=3, w=5)
    ref = _reference(vae, z)
    chunks = list(decode_chunks(vae, z, mode="fast"))
    assert made, "fast mode did not build its decoder"
    assert [c.shape[2] for c in chunks] == [1] + [4] * (t - 1)
    out = torch.cat(chunks, 2)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out - ref).abs().max().item()
    assert err < 1e-4, err  # fp32: only the summation order and conv algorithms differ
    assert not torch.equal(out, torch.zeros_like(out))


def test_fast_lays_its_buffers_out_channels_last(vae, monkeypatch):
    # (whether a conv's output is channels last is cuDNN's choice; CPU convs in fp32
    # answer in the default layout, which fast mode's fallbacks take as well)
    _force_fast(monkeypatch)
    dec = FastDecoder(vae.decoder, wan_module)
    state = ExactState()
    x = vae.post_quant_conv(_latents(vae, t=2))
    with torch.no_grad():
        for i in range(2):
            dec.forward(x[:, :, i : i + 1], state, first=i == 0)
    assert state.history and all(h.stride(1) == 1 for h in state.history.values())
    assert all(key[-1] is True for key in state.layout.values())
    assert all(
        w.is_contiguous(memory_format=torch.channels_last_3d)
        for w in dec._weights.values()
        if w.dim() == 5
    )


def test_fast_leaves_the_users_weights_alone(vae, monkeypatch):
    _force_fast(monkeypatch)
    before = {n: (p.data_ptr(), p.stride()) for n, p in vae.named_parameters()}
    list(decode_chunks(vae, _latents(vae, t=2), mode="fast"))
    assert {n: (p.data_ptr(), p.stride()) for n, p in vae.named_parameters()} == before
    # and eager decoding afterwards is unchanged
    z = _latents(vae, t=2, seed=3)
    assert torch.equal(torch.cat(list(decode_chunks(vae, z)), 2), _reference(vae, z))


def test_fast_over_devices_is_an_argument_error(vae):
    with pytest.raises(ArgumentError, match="needs mode='exact'"):
        decode_chunks(vae, _latents(vae), mode="fast", devices=["cuda:0", "cuda:1"])


def test_fast_missing_names_what_is_missing():
    assert "CUDA GPU" in wan_mod._fast_missing(torch.device("cpu"))
    assert "CUDA GPU" in wan_mod._fast_missing(None)


def test_fast_restores_the_cudnn_benchmark_flag(vae, monkeypatch):
    _force_fast(monkeypatch)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    list(decode_chunks(vae, _latents(vae, t=2), mode="fast"))
    assert torch.backends.cudnn.benchmark is False
