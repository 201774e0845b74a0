"""Switch prices: bytes to move per tier over the rates switches measured, from where a
pipeline's bytes are now (the device, the pinned host tier, or disk)."""

from __future__ import annotations

import pytest

from nostall.serve.prices import SwitchPrices, placement

MB = 1 << 20


def test_rates_are_learned_per_tier_and_a_switch_is_priced_from_its_bytes():
    p = SwitchPrices(host_bps=10e9, disk_bps=1e9, fixed_s=0.1, alpha=0.5)
    assert p.seconds(host=0, disk=0) == 0.0  # nothing to move: nothing to pay
    assert p.seconds(host=10e9, disk=1e9) == pytest.approx(0.1 + 1.0 + 1.0)  # the priors
    p.observe(
        {
            "total_s": 1.3,
            "components": [
                {"tier": "host", "nbytes": 20e9, "copy_s": 0.3, "read_s": 0.0},
                {"tier": "host", "nbytes": 10e9, "copy_s": 0.3, "read_s": 0.0},  # 50 GB/s
                {"tier": "disk", "nbytes": 3e9, "copy_s": 0.2, "read_s": 0.6},  # the read
                {"tier": "gpu", "nbytes": 9e9, "copy_s": 0.0, "read_s": 0.0},  # not moved
            ],
        }
    )
    assert p.rates == {"host": pytest.approx(50e9), "disk": pytest.approx(5e9)}
    assert p.fixed_s == pytest.approx(0.1)  # 1.3 s less 0.6 + 0.6 of moving
    assert p.seconds(host=25e9, disk=0) == pytest.approx(0.1 + 0.5)
    # later switches move the averages by alpha
    p.observe({"total_s": 0.3, "components": [{"tier": "host", "nbytes": 5e9, "copy_s": 0.25}]})
    assert p.rates["host"] == pytest.approx(0.5 * 20e9 + 0.5 * 50e9)
    assert p.fixed_s == pytest.approx(0.5 * 0.05 + 0.5 * 0.1)
    before = dict(p.rates)
    p.observe({"total_s": 0.0, "components": []})  # a switch that moved nothing
    p.observe({"components": [{"tier": "host", "nbytes": 0, "copy_s": 0.0}]})
    assert p.rates == before


def test_placement_follows_the_pipeline_from_disk_to_the_device_and_the_host_tier(store):
    from nostall.cache import ModelCache

    with ModelCache(store, device="cpu", gpu_budget=64 * MB, host_budget=256 * MB) as cache:
        total = sum(c.nbytes for c in cache.store.entry("sdxl").distinct_weights())
        assert placement(cache, "sdxl") == (0, total)  # never read: all on disk
        with cache.use("sdxl"):
            pass
        assert placement(cache, "sdxl") == (0, 0)  # on the device: a switch moves nothing
        cache.evict("gpu")
        assert placement(cache, "sdxl") == (total, 0)  # kept in the pinned host tier
        vae = cache.store.entry("sdxl").components["vae"].nbytes
        assert placement(cache, "sdxl", ("vae",)) == (total - vae, 0)
        where = cache.stats().components
        assert placement(cache, "sdxl", where=where) == (total, 0)
