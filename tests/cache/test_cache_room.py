"""A switch whose own resident components cut the device tier into runs too short for
its largest missing one (a shared text encoder between the free runs a transformer
needs): those not in use leave too and everything is placed again, largest first,
instead of the switch failing with room to spare (issue #31's catalog run at 44 GB:
"cannot hold flux/transformer (23.80 GB): 0 B are in use, the largest free run is
14.28 GB")."""

from __future__ import annotations

import numpy as np
import pytest

import nostall
from nostall.errors import BudgetExceeded

from cache_support import reference, run

MB = 1 << 20


@pytest.fixture
def cache(store, tmp_path):
    with nostall.ModelCache(
        store, device="cpu", gpu_budget=64 * MB, host_budget=64 * MB, cache_dir=tmp_path
    ) as c:
        yield c


def _fragmented(cache, monkeypatch) -> list[list[str]]:
    """Placements fail while any of the switch's resident components stays where it is
    (as when they sit between the runs its largest component needs); the roles each
    placement was asked for."""
    place_all, asked = cache._place_all, []

    def fragmented(missing, keep, mode, evicted, *, sticky):
        roles = sorted(c.role for c, *_ in missing)
        asked.append(roles)
        if "vae" not in roles:  # the vae (and the encoders) stayed resident
            raise BudgetExceeded(
                "the largest free run is too short", tier="gpu", requested=1, budget=1, in_use=0
            )
        return place_all(missing, keep, mode, evicted, sticky=sticky)

    monkeypatch.setattr(cache, "_place_all", fragmented)
    return asked


def test_the_switchs_own_idle_components_are_placed_again_with_the_missing_one(
    store, cache, monkeypatch
):
    with cache.use("flux"):
        pass
    transformer = next(c for c in cache.store.entry("flux").weights if c.role == "transformer")
    cache._evict_slot(cache._tier.slots[transformer.digest])  # only it left the device
    asked = _fragmented(cache, monkeypatch)
    with cache.use("flux") as pipe:
        out = run(pipe, "flux")
    # sticky, then best fit (both with the transformer alone), then all of them again
    assert asked[:2] == [["transformer"], ["transformer"]]
    assert asked[2] == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    report = cache.last_report
    assert {c.role: c.tier for c in report.components}["vae"] == "host"  # moved again
    assert np.array_equal(out, reference(store, "flux"))
    assert cache.stats().gpu_bytes == sum(c.nbytes for c in report.components)


def test_a_prefetch_is_not_worth_moving_resident_components_for(store, cache, monkeypatch):
    with cache.use("flux"):
        pass
    transformer = next(c for c in cache.store.entry("flux").weights if c.role == "transformer")
    cache._evict_slot(cache._tier.slots[transformer.digest])
    _fragmented(cache, monkeypatch)
    with pytest.raises(BudgetExceeded):
        cache.prefetch("flux").result(timeout=60)
