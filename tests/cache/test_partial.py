"""Partial residency in the model cache (issue #32): a pipeline that cannot fit the
device tier whole is served with its largest component resident in part, the other
blocks streamed from the host tier through a ring each call; images equal the fully
resident pipeline's bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import nostall
from nostall.cache.partial import explain, least_pipeline_bytes
from nostall.errors import BudgetExceeded

from cache_support import reference as _reference
from cache_support import run


@functools.cache
def reference(store, name, device="cpu"):
    """diffusers' image of ``name`` (cache_support.reference), once per store and device."""
    return _reference(store, name, device=device)


KB = 1 << 10


def _sizes(store, tmp_path, name, device="cpu"):
    """Each component's slot bytes when resident whole."""
    with nostall.ModelCache(store, device=device, cache_dir=tmp_path / "sizes") as c:
        with c.use(name):
            pass
        return {r.role: c._tier.slots[d].size for d, r in _digests(c, name).items()}


def _budget(store, tmp_path, name, device="cpu"):
    """A device tier too small for ``name`` even with its encoders and VAE streamed: its
    denoiser must stream too (a quarter of the way from the least it can be served in
    to all of it). Worked out once per store and pipeline (the suite's time)."""
    return _budget_of(store, name, device)


@functools.cache
def _budget_of(store, name, device):
    with nostall.ModelCache(store, device=device, cache_dir=False) as c:
        with c.use(name):
            pass
        whole, least = c.stats().gpu_bytes, least_pipeline_bytes(c, name)
    assert least is not None and least < whole
    return least + (whole - least) // 4


def _digests(cache, name):
    return {c.digest: c for c in cache.store.entry(name).weights}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name, big", [("flux", "transformer"), ("sdxl", "unet")])
def test_a_pipeline_larger_than_the_tier_streams_its_largest_component_bit_equal(
    store, tmp_path, name, big, device
):
    sizes = _sizes(store, tmp_path, name, device)
    budget = _budget(store, tmp_path, name, device)
    with nostall.ModelCache(
        store, device=device, gpu_budget=budget, host_budget=64 << 20, cache_dir=tmp_path
    ) as cache:
        want = reference(store, name, device=device)
        for _ in range(2):  # the second call: the ring's buffers recycled across calls
            with cache.use(name) as pipe:
                out = run(pipe, name, device=device)
            np.testing.assert_array_equal(out, want)
        row = next(c for c in cache.reports[0].components if c.role == big)
        assert row.streamed > 0 and row.nbytes < sizes[big]
        s = cache.stats()
        assert s.gpu_bytes <= s.gpu_budget
        inst = next(i for insts in cache._modules._by_arch.values() for i in insts if i.partial)
        ring = inst.partial.ring
        assert ring.copied_bytes > 0 and inst.partial.plan.streamed_bytes > 0
        # it streamed from the host tier's copy, which it holds
        assert inst.partial.host is not None and inst.digest in cache._host.resident()


def test_a_streamed_component_leaves_cleanly_and_the_next_switch_is_whole(store, tmp_path):
    budget = _budget(store, tmp_path, "sdxl")
    with nostall.ModelCache(
        store, device="cpu", gpu_budget=budget, host_budget=64 << 20, cache_dir=tmp_path
    ) as cache:
        with cache.use("sdxl") as pipe:
            run(pipe, "sdxl")
        unet = next(i for insts in cache._modules._by_arch.values() for i in insts if i.partial)
        block = unet.partial.host
        with cache.use("flux") as pipe:  # fits whole: sdxl's UNet leaves for it
            np.testing.assert_array_equal(run(pipe, "flux"), reference(store, "flux"))
        assert unet.partial is None and block.holders == 0  # the ring let its block go
        assert all(c.streamed == 0 for c in cache.last_report.components)
        assert explain(cache, "flux") == []  # (switch --explain: resident whole)
        with cache.use("sdxl") as pipe:  # and back, streamed again
            np.testing.assert_array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))
        assert any(c.streamed for c in cache.last_report.components)


def test_without_stream_a_pipeline_larger_than_the_tier_is_refused(store, tmp_path):
    budget = _budget(store, tmp_path, "flux")
    with (
        nostall.ModelCache(
            store, device="cpu", gpu_budget=budget, stream=False, cache_dir=tmp_path
        ) as cache,
        pytest.raises(BudgetExceeded),
        cache.use("flux"),
    ):
        pass


def test_a_budget_too_small_even_to_stream_is_refused_naming_what_does_not_fit(store, tmp_path):
    c = nostall.ModelCache(store, device="cpu", gpu_budget=400 * KB, cache_dir=tmp_path)
    refused = pytest.raises(BudgetExceeded, match=r"flux needs .* at least .*transformer_blocks")
    with c, refused, c.use("flux"):
        pass
    # the tiny SD3's transformer is one block (and its position embedding): it cannot
    # stream, so SD3 can never be served under half its size
    with nostall.ModelCache(store, device="cpu", cache_dir=tmp_path / "sizes") as c:
        assert least_pipeline_bytes(c, "sd3") is None
        with c.use("sd3"):
            pass
        whole = c.stats().gpu_bytes
    c = nostall.ModelCache(store, device="cpu", gpu_budget=whole // 2, cache_dir=tmp_path)
    with c, pytest.raises(BudgetExceeded, match=r"sd3 needs .* at least"), c.use("sd3"):
        pass


def test_a_host_tier_that_cannot_hold_the_streamed_part_is_a_typed_error(
    store, tmp_path, monkeypatch
):
    budget = _budget(store, tmp_path, "sdxl")
    c = nostall.ModelCache(store, device="cpu", gpu_budget=budget, cache_dir=tmp_path)
    # (the smallest pool is 2 MiB, more than the tiny UNet: its admission says no instead)
    monkeypatch.setattr(c._host, "admit", lambda *a, **kw: False)
    with c:
        with pytest.raises(BudgetExceeded, match="host tier") as info, c.use("sdxl"):
            pass
        assert info.value.tier == "host"
        assert not c._tier.slots  # the switch's new slots were given back


def test_compiled_blocks_stream_without_recompiling(store, tmp_path):
    from torch._dynamo.utils import counters

    budget = _budget(store, tmp_path, "sdxl")
    c = nostall.ModelCache(store, device="cpu", gpu_budget=budget, cache_dir=tmp_path)
    with c, c.use("sdxl") as pipe:
        streamed = next(p for p in explain(c, "sdxl") if p["role"] == "unet")["blocks"]
        mods = dict(pipe.unet.named_modules())
        before = counters["stats"]["unique_graphs"]
        # regional compilation, as compile_repeated_blocks does (one block: the others
        # would compile the same way, only slower)
        mods[streamed[-1]].compile(backend="aot_eager")
        first = run(pipe, "sdxl")
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > before  # (compiled, for real)
        second = run(pipe, "sdxl")
        assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    want = reference(store, "sdxl")
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, want)


def test_threads_calling_one_streamed_pipeline_at_once_each_get_the_right_image(store, tmp_path):
    import threading

    budget = _budget(store, tmp_path, "sdxl")
    want = reference(store, "sdxl")
    got, errors = [], []
    with nostall.ModelCache(store, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:

        def one():
            try:
                with c.use("sdxl") as pipe:
                    got.append(run(pipe, "sdxl"))
            except Exception as e:  # (reported below)
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert any(r.components and any(x.streamed for x in r.components) for r in c.reports)
    assert not errors and len(got) == 3
    for image in got:  # (their blocks share the ring's buffers: one call at a time)
        np.testing.assert_array_equal(image, want)


def test_an_fp8_denoiser_streams_its_fp8_blocks_bit_equal(store, tmp_path):
    from cache_support import fp8_reference

    dst = tmp_path / "models"
    dst.mkdir()
    nostall.quantize(store / "sdxl", dst / "sdxl8")
    want, parts = fp8_reference(dst / "sdxl8", "sdxl")
    assert "unet" in parts
    budget = _budget(dst, tmp_path, "sdxl8")
    with nostall.ModelCache(dst, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:
        for _ in range(2):
            with c.use("sdxl8") as pipe:
                np.testing.assert_array_equal(run(pipe, "sdxl"), want)
        plan = next(p for p in explain(c, "sdxl8") if p["role"] == "unet")
        assert plan["streamed_blocks"] > 0
        mods = dict(pipe.unet.named_modules())
        streamed = [p for n in plan["blocks"] for p in mods[n].parameters()]
        assert any(p.dtype == torch.float8_e4m3fn for p in streamed)  # FP8 weights stream


def test_what_its_calls_took_is_measured_and_its_next_plan_predicts_with_it(store, tmp_path):
    budget = _budget(store, tmp_path, "sdxl")
    with nostall.ModelCache(store, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:
        with c.use("sdxl") as pipe:
            for _ in range(2):  # 4 denoiser calls: the first three timed, block by block
                run(pipe, "sdxl")
        first = next(p for p in explain(c, "sdxl") if p["role"] == "unet")
        assert first["predicted_call_s"] is None  # (nothing measured before its first plan)
        assert first["measured_period_s"] > 0
        c.evict("gpu")  # it leaves; what it took is kept for its next plan
        assert set(next(iter(c._modules.timings.values()))["block_s"]) >= set(first["blocks"])
        with c.use("sdxl") as pipe:
            np.testing.assert_array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))
        again = next(p for p in explain(c, "sdxl") if p["role"] == "unet")
        assert again["predicted_call_s"] > 0  # the cost model's, from the measured blocks


def test_the_next_plan_streams_the_blocks_in_the_order_a_call_ran_them(store, tmp_path):
    # a UNet registers mid_block.attentions before mid_block.resnets and runs resnets.0,
    # attentions.0, resnets.1: streamed in the registered order, a block is not there in
    # time every call; the plan after a measured residency follows the order seen
    budget = _budget(store, tmp_path, "sdxl")

    def misses_per_call(c):
        with c.use("sdxl") as pipe:
            run(pipe, "sdxl")  # (warm: the cold ring's misses)
            ring = next(
                i.partial.ring for a in c._modules._by_arch.values() for i in a if i.partial
            )
            before = ring.misses
            run(pipe, "sdxl")
            return (ring.misses - before) / 2, next(
                p for p in explain(c, "sdxl") if p["role"] == "unet"
            )["blocks"]

    with nostall.ModelCache(store, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:
        first, streamed = misses_per_call(c)
        assert {"mid_block.attentions.0", "mid_block.resnets.0"} <= set(streamed)
        assert first > 0
        c.evict("gpu")
        second, streamed = misses_per_call(c)
        assert second == 0
        assert streamed.index("mid_block.resnets.0") < streamed.index("mid_block.attentions.0")
