"""The LRU diffusers peer on the tiny store: components shared once, the device's budget
kept by evicting the least recently used components, and images as plain diffusers draws.

On a CPU a move is a no-op, so the bookkeeping is what these tests hold; the cuda test
holds the device memory and the pinned copies to it."""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image

from nostall.bench.serve_peer import PeerJob
from nostall.bench.serve_peer_lru import LruPeer
from nostall.errors import ArgumentError, ClosedError, UnknownModel

NAMES = ("flux", "flux-b", "sdxl", "sd3")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The tiny store; sd3's ``text_encoder_3`` linked to flux's ``text_encoder_2`` (the
    full-size store links those weights; the tiny one draws its own). The link exercises
    the same-folder rule, flux-b's equal copies the same-content rule."""
    from nostall.synthetic import write_store

    folders = write_store(tmp_path_factory.mktemp("lru-store"), NAMES)
    t5 = os.path.join(folders["sd3"], "text_encoder_3")
    for f in os.listdir(t5):
        os.remove(os.path.join(t5, f))
    os.rmdir(t5)
    os.symlink(os.path.join(folders["flux"], "text_encoder_2"), t5)
    return folders


@pytest.fixture(scope="module")
def peer(store):
    """Every pipeline loaded, a budget that holds them all (no evictions)."""
    p = LruPeer(store, device="cpu", budget_bytes=1 << 30)
    p.load()
    yield p
    p.close()


def _bytes(peer: LruPeer, *names: str) -> int:
    """Weight bytes of the union of ``names``' components (shared ones once)."""
    keys = {k for n in names for k in peer.uses[n]}
    return sum(peer.component_bytes[k] for k in keys)


def _job(name: str, seed: int = 0) -> PeerJob:
    # flux's tiny T5 has 16 positions; the others take the pipeline's default
    return PeerJob(name, "a cat", 32, 32, 2, seed, 16 if name.startswith("flux") else None)


def _reference(folder: str, job: PeerJob, device: str = "cpu") -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder).to(device)
    pipe.set_progress_bar_config(disable=True)
    kw = {} if job.max_sequence_length is None else {"max_sequence_length": job.max_sequence_length}
    g = torch.Generator(device=device).manual_seed(job.seed)
    image = pipe(prompt=job.prompt, height=job.height, width=job.width,
                 num_inference_steps=job.steps, generator=g, output_type="pil", **kw).images[0]  # fmt: skip
    return np.asarray(image)


def _png(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


def test_components_equal_on_disk_are_loaded_once(peer):
    flux, flux_b, sdxl, sd3 = (peer.pipes[n] for n in NAMES)
    for role in ("text_encoder", "text_encoder_2", "vae"):
        assert getattr(flux_b, role) is getattr(flux, role)
    assert flux_b.transformer is not flux.transformer  # its own bytes
    assert sd3.text_encoder_3 is flux.text_encoder_2
    assert sd3.vae is not flux.vae  # equal weights at full size, but its own config
    flux_modules = {id(m) for m in flux.components.values() if isinstance(m, torch.nn.Module)}
    assert not {id(m) for m in sdxl.components.values()} & flux_modules
    assert not set(peer.uses["sdxl"]) & set(peer.uses["flux"])
    assert set(peer.uses["flux-b"]) - set(peer.uses["flux"]) == {"flux-b/transformer"}
    # each component's CPU tensors are views of one buffer the peer owns, not the file
    for key, module in peer.modules.items():
        tensors = [*module.parameters(), *module.buffers()]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, key
        assert peer.component_bytes[key] == sum(
            t.nbytes for t in {t.data_ptr(): t for t in tensors}.values()
        )


def _run_lru(store, sizes: LruPeer, budget: int, sequence: tuple[str, ...]) -> LruPeer:
    p = LruPeer(
        {n: store[n] for n in ("flux", "flux-b", "sdxl")}, device="cpu", budget_bytes=budget
    )
    p.load()
    assert p.component_bytes == {k: sizes.component_bytes[k] for k in p.component_bytes}
    for name in sequence:
        before = dict(p.resident)
        p.switch(name)
        record = p.switches[-1]
        assert record["model"] == name
        assert set(p.uses[name]) <= set(p.resident)
        assert p.resident_bytes() <= budget
        assert not set(record["evicted"]) & set(p.uses[name])
        assert set(record["moved"]) == set(p.uses[name]) - set(before)
        assert record["moved"] == {k: p.component_bytes[k] for k in record["moved"]}
        assert record["moved_bytes"] == sum(p.component_bytes[k] for k in record["moved"])
        assert set(before) - set(record["evicted"]) | set(record["moved"]) == set(p.resident)
        assert list(p.resident)[-len(p.uses[name]) :] == list(p.uses[name])  # most recent
    return p


def test_lru_keeps_the_budget_evicting_the_least_recent_unused_component(store, peer):
    fluxes, sdxl = _bytes(peer, "flux", "flux-b"), _bytes(peer, "sdxl")
    # both fluxes fit together, sdxl beside them lacks one byte
    p = _run_lru(store, peer, fluxes + sdxl - 1, ("flux", "flux-b", "sdxl", "flux", "flux"))
    try:
        flux, flux_b, to_sdxl, back, again = p.switches
        assert flux["evicted"] == [] and flux["moved_bytes"] == _bytes(peer, "flux")
        # the shared text encoders and VAE are resident already: only the transformer moves
        assert flux_b["moved"] == {"flux-b/transformer": p.component_bytes["flux-b/transformer"]}
        assert flux_b["evicted"] == []
        # flux's transformer was the one component flux-b did not touch
        assert to_sdxl["evicted"] == ["flux/transformer"]
        assert to_sdxl["moved_bytes"] == sdxl
        # back to flux: its shared parts are recent, flux-b's transformer is the oldest unused
        assert back["evicted"] == ["flux-b/transformer"]
        assert list(back["moved"]) == ["flux/transformer"]
        assert again["moved_bytes"] == 0 and again["switch_s"] == 0.0
    finally:
        p.close()


def test_a_pipeline_that_fills_the_budget_evicts_every_other(store, peer):
    fluxes, sdxl = _bytes(peer, "flux", "flux-b"), _bytes(peer, "sdxl")
    p = _run_lru(store, peer, max(fluxes, sdxl), ("flux", "flux-b", "sdxl", "flux"))
    try:
        union = set(p.uses["flux"]) | set(p.uses["flux-b"])
        evicted = p.switches[2]["evicted"]
        assert sorted(evicted) == sorted(union)  # a shared component evicted once
        assert p.resident_bytes() == _bytes(peer, "flux")
    finally:
        p.close()


def test_a_pipeline_larger_than_the_budget_is_refused_at_load(store, peer):
    need = _bytes(peer, "sdxl")
    p = LruPeer({"flux": store["flux"], "sdxl": store["sdxl"]}, device="cpu", budget_bytes=need - 1)
    with pytest.raises(ArgumentError, match=rf"'sdxl'.*{need} bytes.*budget_bytes={need - 1}"):
        p.load()
    with pytest.raises(ClosedError):  # what it loaded is freed
        p.switch("flux")


def test_images_equal_plain_diffusers_after_evictions(store, peer):
    budget = max(_bytes(peer, "flux", "flux-b"), _bytes(peer, "sdxl"))
    p = LruPeer(
        {n: store[n] for n in ("flux", "flux-b", "sdxl")}, device="cpu", budget_bytes=budget
    )
    p.load()
    try:
        refs = {n: _reference(store[n], _job(n)) for n in ("flux", "flux-b", "sdxl")}
        for i, name in enumerate(("flux", "sdxl", "flux-b", "flux")):
            png, info = p.generate(_job(name), time.perf_counter())
            assert np.array_equal(_png(png), refs[name]), name
            assert info["order"] == i + 1
            assert set(info["phases"]) == {"queue", "switch", "run", "total"}
            assert {c["tier"] for c in info["components"]} <= {"host"}  # all in RAM
        # sdxl evicted flux's components, flux-b and flux brought them back
        assert p.switches[1]["evicted"] and p.switches[2]["evicted"]
    finally:
        p.close()


def test_beyond_its_host_budget_a_copy_is_read_from_the_store_again_and_draws_the_same(store, peer):
    names = ("flux", "sdxl")
    host = max(_bytes(peer, "flux"), _bytes(peer, "sdxl"))  # one pipeline's copies at a time
    p = LruPeer(
        {n: store[n] for n in names},
        device="cpu",
        budget_bytes=host,  # one pipeline on the "device"
        host_budget_bytes=host,
    )
    p.load()
    try:
        assert sum(p.on_cpu.values()) <= host  # the boot kept what fits
        refs = {n: _reference(store[n], _job(n)) for n in names}
        for name in ("flux", "sdxl", "flux", "sdxl"):
            png, info = p.generate(_job(name), time.perf_counter())
            assert np.array_equal(_png(png), refs[name]), name
            assert sum(p.on_cpu.values()) <= host, name
            read = p.switches[-1]["from_store"]
            tiers = {c["role"]: c["tier"] for c in info["components"]}
            assert {k for k, t in tiers.items() if t == "disk"} == set(read)
        # the second flux and sdxl found their copies gone and read them again
        assert p.switches[2]["from_store"] and p.switches[3]["from_store"]
    finally:
        p.close()
    with pytest.raises(ArgumentError, match="host_budget_bytes"):
        LruPeer({"flux": store["flux"]}, device="cpu", budget_bytes=1, host_budget_bytes=0)


def test_pinned_copies_need_a_cuda_device(store, peer):
    with pytest.raises(ArgumentError, match="pinned=False"):
        LruPeer(store, device="cpu", budget_bytes=1 << 30, pinned=True)
    with pytest.raises(ArgumentError, match="pinned"):
        peer.set_pinned(True)
    assert peer.mode == "lru-pageable"


def test_unknown_model_and_use_before_load_or_after_close(store, peer):
    with pytest.raises(UnknownModel):
        peer.switch("wan")
    p = LruPeer({"flux": store["flux"]}, device="cpu", budget_bytes=1 << 30)
    with pytest.raises(ClosedError, match="load"):
        p.switch("flux")
    p.load()
    p.close()
    p.close()  # twice is fine
    with pytest.raises(ClosedError):
        p.generate(_job("flux"), time.perf_counter())


def test_the_peer_app_answers_an_image_with_its_phases(store, peer):
    import base64

    import httpx

    from nostall.bench.serve_peer import create_peer_app
    from nostall.serve.local import BackgroundServer

    body = {"model": "sdxl", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 0}
    with BackgroundServer(create_peer_app(peer)) as server:
        r = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["nostall"]
    assert out["peer"] == "lru-pageable" and out["model"] == "sdxl"
    for phase in ("queue", "switch", "run", "total"):
        assert out["phases"][phase] >= 0
    image = _png(base64.b64decode(r.json()["data"][0]["b64_json"]))
    assert np.array_equal(image, _reference(store["sdxl"], _job("sdxl")))


@pytest.mark.cuda
def test_pinned_peer_on_cuda_keeps_its_budget_and_draws_as_pageable(store, peer):
    names = ("flux", "flux-b", "sdxl")
    budget = _bytes(peer, "flux", "flux-b") + _bytes(peer, "sdxl") - 1
    sequence = ("flux", "flux-b", "sdxl", "flux", "sdxl")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    p = LruPeer({n: store[n] for n in names}, device="cuda", budget_bytes=budget, pinned=True)
    p.load()
    try:
        assert p.mode == "lru-pinned"
        assert all(next(m.parameters()).is_pinned() for m in p.modules.values())
        copy = next(p.modules["flux/vae"].parameters()).data  # a CPU view, kept past close
        images = []
        for name in sequence:
            p.switch(name)
            tensors = sum(
                len({t.data_ptr() for t in (*m.parameters(), *m.buffers())})
                for m in (p.modules[k] for k in p.resident)
            )
            # the caching allocator rounds each tensor up to 512 bytes; the schedulers keep
            # their timesteps on the device between calls
            slack = 512 * tensors + (64 << 10)
            assert torch.cuda.memory_allocated() - base <= budget + slack, name
            png, _ = p.generate(_job(name), time.perf_counter())
            images.append(_png(png))
        assert any(s["evicted"] for s in p.switches)
        assert np.array_equal(images[0], _reference(store["flux"], _job("flux"), "cuda"))
        p.set_pinned(False)
        assert p.mode == "lru-pageable"
        assert not copy.is_pinned()
        for name, pinned_image in zip(sequence, images, strict=True):
            png, _ = p.generate(_job(name), time.perf_counter())
            assert np.array_equal(_png(png), pinned_image), name
        p.set_pinned(True)
        assert p.mode == "lru-pinned"
        png, _ = p.generate(_job("flux-b"), time.perf_counter())
        assert np.array_equal(_png(png), images[1])
        assert copy.is_pinned()
    finally:
        p.close()  # unregisters every buffer; an error from CUDA would raise here
    assert not copy.is_pinned()
