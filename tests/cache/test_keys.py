"""Keys from the digest index: a row that lies never makes two sets of files one copy;
honest copies share after one proving read; a claim nothing contests costs nothing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import nostall
from nostall.cache import Store
from nostall.store.digest_index import DigestIndex

from cache_support import reference, run

MB = 1 << 20


@pytest.fixture(scope="module")
def refs(store):
    return {name: reference(store, name) for name in ("flux", "flux-b")}


def _cache(store, index, *, sized=True):
    """``sized``: budgets from the store, which scans every pipeline at start (as a
    service does): every claim is known before the first read. Else budgets given, and
    pipelines scanned at their first switch."""
    budgets = {} if sized else {"gpu_budget": 64 * MB, "host_budget": 64 * MB}
    return nostall.ModelCache(store, device="cpu", cache_dir=index, **budgets)


def _transformer_file(store, name):
    (f,) = Store(store, cache_dir=False).entry(name).components["transformer"].checkpoint.files
    return f


@pytest.mark.parametrize("sized", [True, False], ids=["scanned-at-start", "scanned-lazily"])
@pytest.mark.parametrize("liar", ["flux-b", "flux"])
def test_a_row_claiming_another_transformers_digest_serves_its_own_bytes(
    store, tmp_path, refs, liar, sized, caplog
):
    """flux and flux-b have transformers of one architecture whose bytes differ. The
    index row of ``liar``'s transformer claims the other's digest, in a row whose
    checksum holds (what a buggy version, or an index copied from another machine,
    writes). Before, both were served as one copy: flux-b drew flux's images, or flux
    flux-b's."""
    other = "flux" if liar == "flux-b" else "flux-b"
    Store(store, cache_dir=tmp_path).index_files("flux")
    Store(store, cache_dir=tmp_path).index_files("flux-b")
    lying, honest = _transformer_file(store, liar), _transformer_file(store, other)
    index = DigestIndex(tmp_path)
    truth = index.get(lying.identity)
    index.put(lying.identity, lying.path, index.get(honest.identity))
    index.close()
    caplog.set_level(logging.WARNING, logger="nostall.cache")
    with _cache(store, tmp_path, sized=sized) as cache:  # a new process: it knows every row
        for name in ("flux", "flux-b", "flux"):
            with cache.use(name) as pipe:
                assert np.array_equal(run(pipe, name), refs[name]), name
        a, b = (cache.store.entry(n).components["transformer"] for n in ("flux", "flux-b"))
        assert a.digest != b.digest
        if sized:  # the equal copies: one, once both were hashed
            for role in ("text_encoder", "text_encoder_2", "vae"):
                assert cache.store.entry("flux").components[role].digest == (
                    cache.store.entry("flux-b").components[role].digest
                )
    said = [r.getMessage() for r in caplog.records if "the row was wrong" in r.getMessage()]
    if sized or liar == "flux-b":  # its transformer was hashed as it was read
        assert len(said) == 1 and lying.path in said[0], said
        assert DigestIndex(tmp_path).get(lying.identity) == truth  # repaired
    else:
        # flux was read before flux-b contested its claim: served from its own bytes,
        # it shares nothing until its next read from disk proves it
        assert said == []


def test_honest_copies_share_after_one_proving_read_and_a_lone_claim_costs_nothing(
    store, tmp_path, refs
):
    for name in ("flux", "flux-b", "sdxl"):
        Store(store, cache_dir=tmp_path).index_files(name)
    with _cache(store, tmp_path) as cache:
        cache.pipeline("sdxl")
        assert not any(x.hashed for x in cache.last_report.components)  # nothing contests it
        cache.pipeline("flux")
        hashed = {x.role: x.hashed for x in cache.last_report.components}
        # flux-b's copies claim the same content: flux's are hashed as they are read
        # (no read of their own), its transformer (no copy elsewhere) is not
        assert hashed == {
            "text_encoder": True,
            "text_encoder_2": True,
            "transformer": False,
            "vae": True,
        }
        cache.pipeline("flux-b")
        tiers = {x.role: (x.tier, x.hashed) for x in cache.last_report.components}
        # the copies are read once, to prove their claim; the transformer is flux-b's own
        assert tiers == {
            "text_encoder": ("disk", True),
            "text_encoder_2": ("disk", True),
            "transformer": ("disk", False),
            "vae": ("disk", True),
        }
        with cache.use("flux-b") as pipe:
            assert cache.last_report.moved_bytes == 0  # one copy of each, resident
            assert np.array_equal(run(pipe, "flux-b"), refs["flux-b"])
        shared = [d for d, c in cache.stats().components.items() if len(c["pipelines"]) == 2]
        assert len(shared) == 3
