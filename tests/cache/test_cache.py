from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import nostall
from nostall.errors import ArgumentError, BudgetExceeded, ClosedError, UnknownModel

from cache_support import fp8_reference, reference, run

MB = 1 << 20


@pytest.fixture
def cache(store, tmp_path):
    # A digest index of its own: what the cache knows does not depend on earlier tests.
    with nostall.ModelCache(
        store, device="cpu", gpu_budget=64 * MB, host_budget=64 * MB, cache_dir=tmp_path
    ) as c:
        yield c


def _tiers(report):
    return {c.role: c.tier for c in report.components}


def _wait_for(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # the poll's interval: the condition, not the time, decides


def _waits_for_room(caplog):
    return lambda: any("waits for room" in r.getMessage() for r in caplog.records)


def test_images_equal_from_pretrained_across_switches_and_back(store, cache):
    refs = {}
    for name in ("flux", "sdxl", "flux", "flux-b", "sd3", "wan", "flux"):
        with cache.use(name) as pipe:
            out = run(pipe, name)
        if name not in refs:
            refs[name] = reference(store, name)
        assert np.array_equal(out, refs[name]), name
        assert type(pipe).__name__ == cache.store.entry(name).class_name
    first, back = [r for r in cache.reports if r.pipeline == "flux"][::2][:2]
    assert set(_tiers(first).values()) == {"disk"}
    assert set(_tiers(back).values()) == {"device"}  # still resident: nothing moved


def test_a_pipeline_sharing_components_moves_only_what_differs(cache):
    for name in ("flux", "flux-b"):
        cache.store.index_files(name)  # digests known ahead (nostall index)
    cache.pipeline("flux")
    report = cache.pipeline("flux-b") and cache.last_report
    assert _tiers(report) == {
        "text_encoder": "device",
        "text_encoder_2": "device",
        "transformer": "disk",
        "vae": "device",
    }
    assert report.moved_bytes == report.components[2].nbytes
    assert not any(c.hashed for c in report.components)
    s = cache.stats()
    shared = [d for d, c in s.components.items() if c["pipelines"] == ["flux", "flux-b"]]
    assert len(shared) == 3


def test_equal_copies_share_once_their_first_reads_have_hashed_them(cache):
    # flux-b's T5, CLIP and VAE are separate files with flux's bytes. Unread, nothing says
    # they are equal: the first switch reads and hashes them; from then on one copy serves.
    cache.pipeline("flux")
    first = cache.pipeline("flux-b") and cache.last_report
    assert set(_tiers(first).values()) == {"disk"}
    assert all(c.hashed for c in first.components)
    a, b = cache.store.entry("flux"), cache.store.entry("flux-b")
    for role in ("text_encoder", "text_encoder_2", "vae"):
        assert a.components[role].digest == b.components[role].digest
    assert a.components["transformer"].digest != b.components["transformer"].digest
    assert all(c.exact for c in b.weights)
    dupes = {c.digest for c in first.components if c.role != "transformer"}
    assert not dupes & cache._host.resident()  # the duplicates left the host tier
    again = cache.pipeline("flux-b") and cache.last_report
    assert again.moved_bytes == 0 and not any(c.hashed for c in again.components)


def test_same_architecture_switch_copies_in_place(store):
    # A device tier that holds one FLUX-family pipeline: flux-b's transformer must go
    # into flux's transformer module and memory.
    with nostall.ModelCache(
        store, device="cpu", gpu_budget=800_000, host_budget=64 * MB, watermark=1.0
    ) as c:
        a = c.pipeline("flux")
        module = a.transformer
        ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
        b = c.pipeline("flux-b")
        row = next(x for x in c.last_report.components if x.role == "transformer")
        assert row.in_place and row.tier == "disk"
        assert b.transformer is module  # the same module object: compiled graphs survive
        assert {n: p.data_ptr() for n, p in module.named_parameters()} == ptrs
        assert np.array_equal(run(b, "flux-b"), reference(store, "flux-b"))
        with pytest.raises(ClosedError, match="switched out"):
            run(a, "flux")  # its transformer holds flux-b's weights now
        a = c.pipeline("flux")
        assert c.last_report.components[2].tier == "host"  # back from the host tier
        assert np.array_equal(run(a, "flux"), reference(store, "flux"))


def test_budgets_are_bytes_and_never_exceeded(store):
    with nostall.ModelCache(store, device="cpu", gpu_budget=3 * MB, host_budget=6 * MB) as c:
        for name in ("flux", "sdxl", "sd3", "wan", "flux-b", "sdxl", "flux"):
            c.pipeline(name)
            s = c.stats()
            assert s.gpu_bytes <= s.gpu_budget
            assert s.host_bytes <= s.host_budget
            tiers = {d: x["tier"] for d, x in s.components.items()}
            entry = c.store.entry(name)
            assert all(tiers[x.digest] == "gpu" for x in entry.weights)  # what runs is there
        assert set(tiers.values()) <= {"gpu", "host", "disk"}
        assert "disk" in tiers.values() or "host" in tiers.values()


def test_in_use_components_are_never_evicted_and_other_threads_wait(store, caplog):
    caplog.set_level("INFO", logger="nostall.cache")
    # Room for SDXL (1.6 MB) or FLUX (0.7 MB), not both.
    with nostall.ModelCache(
        store, device="cpu", gpu_budget=2_000_000, host_budget=64 * MB, wait_s=30
    ) as c:
        with c.use("sdxl") as pipe:
            # Same thread, no room without evicting what it holds: refused at once.
            with pytest.raises(BudgetExceeded, match="in use") as info:
                c.pipeline("flux")
            assert info.value.tier == "gpu" and info.value.in_use > 0
            assert np.array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))
            got = []
            t = threading.Thread(target=lambda: got.append(c.pipeline("flux")))
            t.start()
            _wait_for(_waits_for_room(caplog), "the other thread to wait for room")
            assert not got  # waits for the room sdxl holds
            assert np.array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))
        t.join(20)
        assert got and np.array_equal(run(got[0], "flux"), reference(store, "flux"))


def test_a_use_block_left_on_another_thread_is_not_the_entering_threads_hold(store, caplog):
    # asyncio.to_thread may enter a use() block on one worker thread and leave it on
    # another. Counted per thread id, the entering thread kept the count: a later switch
    # there took another caller's hold for its own and refused at once, instead of
    # waiting for it to end.
    caplog.set_level("INFO", logger="nostall.cache")
    with (
        nostall.ModelCache(
            store, device="cpu", gpu_budget=2_000_000, host_budget=64 * MB, wait_s=60
        ) as c,
        ThreadPoolExecutor(1) as entering,  # one thread: the same one enters and switches
    ):
        block = c.use("sdxl")
        entering.submit(block.__enter__).result(60)
        leaving = threading.Thread(target=block.__exit__, args=(None, None, None))
        leaving.start()
        leaving.join(60)
        assert all(s.uses == 0 for s in c._tier.slots.values())
        with c.use("sdxl") as pipe:  # this thread holds SDXL now; FLUX needs its room
            flux = entering.submit(c.pipeline, "flux")
            _wait_for(lambda: flux.done() or _waits_for_room(caplog)(), "the switch to wait")
            assert not flux.done(), flux.exception()
            assert np.array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))
        assert np.array_equal(run(flux.result(60), "flux"), reference(store, "flux"))


def test_use_blocks_entered_and_left_through_asyncio_to_thread(store, cache):
    async def one(name):
        block = cache.use(name)
        pipe = await asyncio.to_thread(block.__enter__)
        try:
            return await asyncio.to_thread(run, pipe, name)
        finally:
            await asyncio.to_thread(block.__exit__, None, None, None)

    async def main():
        return await asyncio.gather(*(one(n) for n in ("sdxl", "flux", "sdxl", "flux")))

    outs = asyncio.run(main())
    refs = {n: reference(store, n) for n in ("sdxl", "flux")}
    assert all(np.array_equal(o, refs[n]) for o, n in zip(outs, ("sdxl", "flux") * 2, strict=True))
    assert all(s.uses == 0 for s in cache._tier.slots.values()) and len(cache._holds) == 0


def test_a_working_set_larger_than_the_host_tier_does_not_cycle(store):
    # Host tier for two of three pipelines (pool blocks are 2 MiB granules: flux and
    # sdxl take 8 MiB each, sd3 10), device tier for one: plain LRU would miss on every
    # switch of a flux → sdxl → sd3 loop.
    with nostall.ModelCache(store, device="cpu", gpu_budget=2_000_000, host_budget=18 * MB) as c:
        for _ in range(4):
            for name in ("flux", "sdxl", "sd3"):
                c.pipeline(name)
        last = list(c.reports)[-6:]
        served = [t for r in last for t in _tiers(r).values()]
        assert served.count("host") >= len(served) // 3
        # Switch back after N one-off models: the regular one is still in the host tier.
        c.pipeline("wan")
        c.pipeline("flux-b")
        c.pipeline("flux")
        assert "disk" not in _tiers(c.last_report).values()


def test_concurrent_requests_for_one_model_load_it_once(store, cache):
    barrier = threading.Barrier(6)
    out = []

    def go():
        barrier.wait()
        with cache.use("sdxl") as pipe:
            out.append(run(pipe, "sdxl"))

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ref = reference(store, "sdxl")
    assert len(out) == 6 and all(np.array_equal(o, ref) for o in out)
    disk = [c for r in cache.reports for c in r.components if c.tier == "disk"]
    assert len(disk) == 4  # each of sdxl's four weights components read once


def test_many_threads_switching_at_once(store):
    names = ("flux", "flux-b", "sdxl", "sd3")
    refs = {n: reference(store, n) for n in names}
    errors, done = [], []
    with nostall.ModelCache(
        store, device="cpu", gpu_budget=4 * MB, host_budget=24 * MB, wait_s=60
    ) as c:

        def worker(seed):
            rng = random.Random(seed)
            try:
                for _ in range(6):
                    name = rng.choice(names)
                    with c.use(name) as pipe:
                        assert np.array_equal(run(pipe, name), refs[name]), name
                    done.append(name)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert len(done) == 36
        assert all(s.uses == 0 for s in c._tier.slots.values())  # every use ended
        pool = c._host.pool.stats()
        assert pool.in_use == 0  # no block left held
        assert c.stats().gpu_bytes <= 4 * MB


def test_prefetch_moves_the_next_pipeline_and_protects_it(store, cache):
    with cache.use("flux") as pipe:
        future = cache.prefetch("sdxl")
        out = run(pipe, "flux")
        report = future.result(30)
    assert report.prefetch and set(_tiers(report).values()) == {"disk"}
    assert np.array_equal(out, reference(store, "flux"))
    with cache.use("sdxl") as pipe:
        assert set(_tiers(cache.last_report).values()) == {"device"}
        assert np.array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))
    with pytest.raises(UnknownModel):
        cache.prefetch("nope")


def test_resident_says_whether_a_switch_would_move_nothing(store):
    with nostall.ModelCache(store, device="cpu", gpu_budget=2_000_000, host_budget=64 * MB) as c:
        assert not c.resident("flux")
        c.pipeline("flux")
        assert c.resident("flux") and not c.resident("sdxl")
        assert not c.resident("wan") and not c.resident("wan", without=["text_encoder"])
        with c.use("wan", without=["text_encoder", "transformer"]):
            assert c.resident("wan", without=["text_encoder", "transformer"])
            assert not c.resident("wan")
        c.pipeline("sdxl")  # 2 MB hold sdxl (1.6 MB) alone: flux's transformer left
        assert c.resident("sdxl") and not c.resident("flux")
        with pytest.raises(UnknownModel):
            c.resident("nope")


def test_prefetch_without_room_fails_its_future_not_the_running_pipeline(store):
    with (
        nostall.ModelCache(store, device="cpu", gpu_budget=2_000_000, host_budget=64 * MB) as c,
        c.use("sdxl") as pipe,
    ):
        future = c.prefetch("flux")
        with pytest.raises(BudgetExceeded, match="prefetch never evicts"):
            future.result(30)
        assert np.array_equal(run(pipe, "sdxl"), reference(store, "sdxl"))


def test_stats_evict_and_close(store):
    c = nostall.ModelCache(store, device="cpu", gpu_budget=64 * MB, host_budget=64 * MB)
    c.pipeline("flux")
    s = c.stats()
    assert s.gpu_bytes > 0 and s.host_bytes > 0
    assert {x["tier"] for x in s.components.values()} == {"gpu"}
    assert c.evict("gpu") > 0
    assert {x["tier"] for x in c.stats().components.values()} == {"host"}
    assert c.evict("all") > 0 and c.stats().host_bytes == 0
    with pytest.raises(ArgumentError):
        c.evict("disk")
    pipe = c.pipeline("flux")
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.pipeline("flux")
    with pytest.raises(ClosedError):
        run(pipe, "flux")


def test_prepare_builds_modules_and_loads_tokenizers_at_boot(store, monkeypatch):
    import nostall.cache.modules as modules_mod
    import nostall.cache.pipelines as pipelines_mod

    with nostall.ModelCache(store, device="cpu", gpu_budget=64 * MB, host_budget=64 * MB) as c:
        c.prepare("flux", "sdxl")
        assert c.stats().gpu_bytes == 0  # no weights moved

        def refuse(*a, **k):
            raise AssertionError("built on the request path")

        monkeypatch.setattr(modules_mod, "build_instance", refuse)
        monkeypatch.setattr(pipelines_mod, "_load_files", refuse)
        with c.use("flux") as pipe:
            out = run(pipe, "flux")
        report = c.last_report
        assert {x.tier for x in report.components} == {"disk"}
        assert all(x.build_s < 0.05 for x in report.components)  # only adoption left
        assert np.array_equal(out, reference(store, "flux"))
        with pytest.raises(UnknownModel):
            c.prepare("flux", "nope")


def test_a_component_back_at_its_offset_builds_no_views(store, cache, monkeypatch):
    # Thousands of views per pipeline hold the GIL beside the running inference when a
    # prefetch brings a component back where its module already points.
    from nostall.transfer.plan import LoadPlan

    cache.pipeline("flux")
    cache.evict("gpu")
    calls = []
    real = LoadPlan.views
    monkeypatch.setattr(LoadPlan, "views", lambda self, flat: calls.append(1) or real(self, flat))
    with cache.use("flux") as pipe:
        out = run(pipe, "flux")
    assert {x.tier for x in cache.last_report.components} == {"host"}
    assert calls == []
    assert np.array_equal(out, reference(store, "flux"))


def _cpu_scaled_mm_takes_row_scales() -> bool:
    import torch

    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
            out_dtype=torch.bfloat16,
        )  # fmt: skip
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("compute", ["upcast", "tensor-cores"])
def test_an_fp8_pipeline_is_served_as_load_model_builds_it(store, tmp_path, compute, monkeypatch):
    import shutil

    import torch

    from nostall.quant import modules as quant_modules

    # the CPU's _scaled_mm stands in for a capable GPU's; it takes bf16 activations
    kw = {"dtype": torch.bfloat16} if compute == "tensor-cores" else {}
    if compute == "tensor-cores" and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
    monkeypatch.setattr(quant_modules, "fp8_compute", lambda device: (compute, "test"))

    dst = tmp_path / "models"
    dst.mkdir()
    nostall.quantize(os.path.join(store, "flux"), dst / "flux8")
    shutil.copytree(os.path.join(store, "sdxl"), dst / "sdxl")
    ref, fp8_parts = fp8_reference(dst / "flux8", "flux", **kw)
    assert "transformer" in fp8_parts
    # room for one pipeline at a time: every switch evicts, so flux8 is re-bound
    with nostall.ModelCache(dst, device="cpu", gpu_budget=2 * MB, host_budget=64 * MB, **kw) as c:
        for name in ("flux8", "sdxl", "flux8", "flux8"):
            with c.use(name) as pipe:
                out = run(pipe, "flux" if name == "flux8" else name)
                if name == "flux8":
                    assert np.array_equal(out, ref)
                    q = pipe.transformer.transformer_blocks[0].attn.to_q
                    assert q.weight.dtype == torch.float8_e4m3fn
                    assert q._fp8_tensor_cores == (compute == "tensor-cores")
                elif not kw:  # (the bf16 run's sdxl has no fp32 reference)
                    assert np.array_equal(out, reference(store, "sdxl"))
            c.evict("gpu")  # the next flux8 is bound again from the host tier
        tiers = [{x.tier for x in r.components} for r in c.reports]
        assert "host" in tiers[2]  # flux8 came back from the host tier (rebound)
        sizes = {x.role: x.nbytes for x in c.reports[0].components}
    bf16 = nostall.ModelCache(store, device="cpu", gpu_budget=64 * MB, host_budget=64 * MB)
    with bf16:
        bf16.pipeline("flux")
        full = {x.role: x.nbytes for x in bf16.reports[0].components}
    assert sizes["transformer"] < 0.6 * full["transformer"]


def test_a_switch_never_walks_the_process_page_tables(store, monkeypatch):
    # /proc/self/smaps costs 0.1-0.3 s per read in a GPU process mapping tens of GB; the
    # host tier's admission once read it four times per page-cache switch (2.4 s FLUX
    # switches where 1.3 s was possible).
    import nostall.memory.pool as pool_mod

    calls = []
    monkeypatch.setattr(pool_mod, "hugepage_bytes", lambda *a: calls.append(a))
    with nostall.ModelCache(store, device="cpu", gpu_budget=24 * MB, host_budget=64 * MB) as c:
        for name in ("flux", "sdxl", "flux"):
            with c.use(name):
                pass
        assert {x.tier for x in c.reports[0].components} == {"disk"}
        assert calls == []
        c._host.pool.stats()  # the full snapshot still counts huge pages
        assert len(calls) == 1


def test_the_default_host_budget_is_what_the_store_needs(store, tmp_path, monkeypatch):
    # It was half the machine's memory: 13.4 GB for a 7 MB store.
    import nostall.cache.cache as cache_mod
    from nostall.cache import Store
    from nostall.cache.host import store_bytes

    s = Store(store, cache_dir=tmp_path)
    need = store_bytes(s, 1 << 40)
    with nostall.ModelCache(s, device="cpu", gpu_budget=64 * MB) as c:
        assert c.stats().host_budget == need < 64 * MB
        for name in s.names():
            c.pipeline(name)
        c.evict("gpu")
        for name in s.names():  # the whole store stayed in the host tier
            c.pipeline(name)
            assert set(_tiers(c.last_report).values()) <= {"host", "device"}
    monkeypatch.setattr(cache_mod, "memory_limit", lambda: (8 * MB, "cgroup"))
    with nostall.ModelCache(s, device="cpu", gpu_budget=64 * MB) as c:
        assert c.stats().host_budget == 4 * MB  # never more than half the memory limit


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's statm")
def test_a_cpu_cache_commits_no_memory_up_front(store):
    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    with nostall.ModelCache(store, device="cpu", gpu_budget=1 << 30, host_budget=1 << 30) as c:
        c.prepare("sdxl")  # takes the device tier, waits for the host tier's "pinning"
        assert resident() - before < 256 * MB  # not the 2 GiB of the two budgets


def test_a_cache_takes_a_store_or_shares_its_folders(store, tmp_path):
    from nostall.cache import Store

    s = Store(store, cache_dir=tmp_path)
    kw = dict(device="cpu", gpu_budget=64 * MB, host_budget=64 * MB)
    with nostall.ModelCache(s, **kw) as c:
        assert c.store is s
        with pytest.raises(ArgumentError, match="variant"):
            nostall.ModelCache(s, variant="fp16", **kw)
    index = tmp_path / "index"
    with (
        nostall.ModelCache(store, cache_dir=index, **kw) as a,
        nostall.ModelCache({"sdxl": store / "sdxl"}, cache_dir=index, **kw) as b,
        nostall.ModelCache(store, cache_dir=index, **kw) as again,
    ):
        assert a.store is again.store is Store.shared(store, cache_dir=index)
        assert b.store is not a.store and b.names() == ["sdxl"]


def test_a_budget_smaller_than_a_component_is_a_typed_error(store):
    with nostall.ModelCache(store, device="cpu", gpu_budget=MB // 2, host_budget=64 * MB) as c:
        with pytest.raises(BudgetExceeded, match="flux needs") as info:
            c.pipeline("flux")
        assert info.value.requested > info.value.budget or info.value.tier == "gpu"
    with pytest.raises(ArgumentError):
        nostall.ModelCache(store, device="cpu", gpu_budget=0)


def test_a_pipeline_without_its_text_encoders_moves_none_and_takes_embeddings(store, cache):
    from diffusers import DiffusionPipeline

    full = DiffusionPipeline.from_pretrained(str(store / "flux"))
    with torch.no_grad():
        t5, pooled, _ = full.encode_prompt("a cat", prompt_2=None, max_sequence_length=16)
    encoders = ["text_encoder", "text_encoder_2"]
    with cache.use("flux", without=encoders) as pipe:
        assert pipe.text_encoder is None and pipe.text_encoder_2 is None
        assert pipe.tokenizer is not None  # only weights components are left out
        g = torch.Generator().manual_seed(0)
        out = pipe(prompt_embeds=t5, pooled_prompt_embeds=pooled, height=32, width=32,
                   num_inference_steps=2, generator=g, output_type="np").images  # fmt: skip
    report = cache.last_report
    assert set(_tiers(report)) == {"transformer", "vae"} and report.left_out == tuple(encoders)
    assert "left out: text_encoder, text_encoder_2" in str(report.table().caption)
    assert np.array_equal(out, reference(store, "flux"))  # the same image as the whole pipeline
    assert {c["roles"][0] for c in cache.stats().components.values()} == {"transformer", "vae"}
    # the whole pipeline afterwards moves the encoders only, and is another object
    with cache.use("flux") as whole:
        assert whole.text_encoder is not None and whole is not pipe
    assert _tiers(cache.last_report) == {
        "text_encoder": "disk", "text_encoder_2": "disk", "transformer": "device", "vae": "device"
    }  # fmt: skip
    # a prefetch may leave them out too; names are checked before anything moves
    assert cache.prefetch("sdxl", without="text_encoder_2").result().left_out == ("text_encoder_2",)
    with pytest.raises(ArgumentError, match=r"without=\['tokenizer'\].*has \["):
        cache.pipeline("flux", without=["tokenizer"])
    with pytest.raises(ArgumentError, match="no weights component"):
        cache.prefetch("flux", without=["text_encoder_9"])


def test_a_file_rewritten_in_place_between_switches_is_served_new(store, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from nostall.store import resolve

    shutil.copytree(store / "flux", tmp_path / "s" / "flux")
    with nostall.ModelCache(
        tmp_path / "s", device="cpu", gpu_budget=64 * MB, host_budget=64 * MB, cache_dir=tmp_path
    ) as c:
        with c.use("flux") as pipe:
            before = run(pipe, "flux")
        (f,) = resolve(tmp_path / "s" / "flux" / "transformer").files
        t = load_file(f.path)
        t = {k: v * 1.5 if v.is_floating_point() else v for k, v in t.items()}
        save_file(t, f.path + ".tmp", metadata=f.metadata)
        with open(f.path, "r+b") as out, open(f.path + ".tmp", "rb") as new:
            out.write(new.read())  # in place: same inode, same size
        with c.use("flux") as pipe:
            after = run(pipe, "flux")
        tiers = {x.role: (x.tier, x.hashed) for x in c.last_report.components}
        assert tiers["transformer"] == ("disk", True) and tiers["vae"][0] == "device"
        assert not np.array_equal(after, before)
        assert np.array_equal(after, reference(tmp_path / "s", "flux"))
        w = pipe.transformer.transformer_blocks[0].attn.to_q.weight
        assert torch.equal(w, t["transformer_blocks.0.attn.to_q.weight"])


@pytest.mark.slow
def test_the_digest_index_spares_a_new_process_the_hashing(cache, store, tmp_path, fork_python):
    import json

    cache.pipeline("sdxl")  # ``cache`` hashes into tmp_path, its own digest index
    first = {x.role: x.hashed for x in cache.last_report.components}
    assert first and all(first.values())
    code = (
        "import json, sys, nostall\n"
        "c = nostall.ModelCache(sys.argv[1], device='cpu', gpu_budget=64 << 20,"
        " host_budget=64 << 20, cache_dir=sys.argv[2])\n"
        "c.pipeline('sdxl')\n"
        "r = c.last_report\n"
        "print(json.dumps({x.role: [x.digest, x.tier, x.hashed] for x in r.components}))\n"
    )
    # A process of its own, forked from one that has imported diffusers (the conftest's).
    p = fork_python(code, str(store), str(tmp_path), stderr=True)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    second = json.loads(out.strip().splitlines()[-1])
    assert second.keys() == first.keys()
    assert not any(hashed for _, _, hashed in second.values())
    # the new process served them under their content digests from the start
    s = nostall.cache.Store(store, cache_dir=tmp_path).entry("sdxl")
    assert {c.role: c.digest[:12] for c in s.weights} == {r: d for r, (d, _, _) in second.items()}
    assert all(c.exact for c in s.weights)


def test_a_bf16_wan_as_stored_equals_diffusers_in_bf16_with_its_fp32_modules(tmp_path):
    """diffusers' from_pretrained(torch_dtype=bf16) keeps Wan's time embedder and norms in
    float32 (_keep_in_fp32_modules); the cache's as-stored load must do the same, or the
    frames drift (43 levels apart at real size on an H200 before this)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    from nostall.synthetic import write_store

    write_store(tmp_path, ("wan",))
    folder = tmp_path / "wan"
    pipe = WanPipeline.from_pretrained(str(folder))
    for role in ("transformer", "text_encoder"):  # stored in bf16, as published
        getattr(pipe, role).to(torch.bfloat16).save_pretrained(str(folder / role))
    vae = AutoencoderKLWan.from_pretrained(str(folder), subfolder="vae", torch_dtype=torch.float32)
    ref = WanPipeline.from_pretrained(str(folder), vae=vae, torch_dtype=torch.bfloat16)
    ref.set_progress_bar_config(disable=True)
    kw = dict(prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=4,
              max_sequence_length=16, output_type="np")  # fmt: skip
    want = ref(**kw, generator=torch.Generator().manual_seed(0)).frames
    cache = nostall.ModelCache(tmp_path, device="cpu", cache_dir=tmp_path / "idx")
    with cache, cache.use("wan") as ours:
        t = ours.transformer
        assert next(t.condition_embedder.time_embedder.parameters()).dtype == torch.float32
        assert t.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
        got = ours(**kw, generator=torch.Generator().manual_seed(0)).frames
    assert np.array_equal(got, want)
