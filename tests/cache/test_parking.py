"""Parking (cache.parked()): inside a pipeline call, at a step boundary, the paused
pipeline leaves the device for another pipeline that does not fit beside it, comes back
into the very modules the call holds, and the call's output is the one it would have
had run straight through (issue #31: preemption when the paused pipeline must leave)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nostall
from nostall.errors import BudgetExceeded

from cache_support import reference, run

KB = 1 << 10


def _cache(store, tmp_path, device="cpu"):
    # one of the tiny FLUX pipelines (~700 kB of slots) fits, not two: flux-b's own
    # encoders, transformer and VAE cannot sit beside flux's
    return nostall.ModelCache(
        store, device=device, gpu_budget=800 * KB, host_budget=64 << 20, cache_dir=tmp_path
    )


@pytest.fixture
def cache(store, tmp_path):
    with _cache(store, tmp_path) as c:
        yield c


def _flux(pipe, at_step, inside, device):
    """flux's two-step run at 32x32 (as cache_support.run), ``inside(step)`` called at
    the end of step ``at_step``."""
    g = torch.Generator(device=device).manual_seed(0)

    def on_step(p, i, t, kw):
        if i == at_step:
            inside(i)
        return kw

    return pipe(
        prompt="a cat",
        num_inference_steps=2,
        generator=g,
        output_type="np",
        height=32,
        width=32,
        max_sequence_length=16,
        callback_on_step_end=on_step,
    ).images


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_paused_call_parks_runs_another_pipeline_and_goes_on_bit_equal(store, tmp_path, device):
    with _cache(store, tmp_path, device) as cache:
        _park_and_go_on(store, cache, device)


def _park_and_go_on(store, cache, device):
    straight = reference(store, "flux", device=device)
    other_ref = reference(store, "flux-b", device=device)
    got: dict = {}
    with cache.use("flux") as pipe:
        modules = {r: getattr(pipe, r) for r in ("transformer", "vae", "text_encoder")}

        def inside(step):
            # beside the held pipeline: no room
            with pytest.raises(BudgetExceeded), cache.use("flux-b"):
                pass
            with cache.parked() as nbytes:
                got["parked"] = nbytes
                with cache.use("flux-b") as other:
                    # the paused call's modules are kept for it: none is lent to flux-b
                    # (copying flux-b's transformer into flux's would change the call)
                    assert not any(getattr(other, r) is m for r, m in modules.items())
                    got["other"] = run(other, "flux-b", device=device)
                got["evicted"] = cache.last_report.evicted
            got["back"] = cache.last_report

        out = _flux(pipe, 0, inside, device)
        assert all(getattr(pipe, r) is m for r, m in modules.items())  # the same modules
    assert got["parked"] > 600 * KB  # all four of flux's components could leave
    assert any("flux/" in e for e in got["evicted"])  # and some did, for flux-b
    back = got["back"]
    assert back.pipeline == "flux" and not back.prefetch
    assert {c.tier for c in back.components} >= {"host"}  # brought back from the host tier
    np.testing.assert_array_equal(got["other"], other_ref)
    np.testing.assert_array_equal(out, straight)
    # nothing is held any more, and either pipeline switches in as usual
    assert not any(c["in_use"] for c in cache.stats().components.values())
    with cache.use("flux-b") as p:
        np.testing.assert_array_equal(run(p, "flux-b", device=device), other_ref)
    assert not any(i.parked for insts in cache._modules._by_arch.values() for i in insts)


def test_parking_with_nothing_held_parks_nothing(cache):
    with cache.parked() as nbytes:
        assert nbytes == 0


def test_a_pipeline_with_a_lora_fused_in_is_not_parked(store, cache, tmp_path):
    from nostall.synthetic import write_lora

    path = tmp_path / "l.safetensors"
    write_lora(store / "flux", path, rank=4)
    with cache.use("flux", loras={str(path): 0.8}), cache.parked() as nbytes:
        assert nbytes == 0  # its weights are not the host tier's copies: it stays
        with pytest.raises(BudgetExceeded), cache.use("flux-b"):
            pass


def test_when_the_way_back_fails_the_paused_call_fails_and_its_end_gives_nothing_twice(
    store, cache, monkeypatch
):
    switch = cache._switch

    def no_way_back(name, **kw):
        if kw.get("resume") is not None:
            raise BudgetExceeded("held elsewhere", tier="gpu", requested=1, budget=1, in_use=1)
        return switch(name, **kw)

    with pytest.raises(BudgetExceeded, match="held elsewhere"), cache.use("flux"):
        monkeypatch.setattr(cache, "_switch", no_way_back)
        with cache.parked(), cache.use("flux-b"):
            pass
    monkeypatch.setattr(cache, "_switch", switch)
    assert all(s.uses == 0 for s in cache._tier.slots.values())
    with cache.use("flux") as pipe:
        np.testing.assert_array_equal(run(pipe, "flux"), reference(store, "flux"))
