"""The model cache on a GPU: tier moves, in-place same-architecture switches under
torch.compile, prefetch overlapping compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nostall

from cache_support import reference, run

pytestmark = pytest.mark.cuda
MB = 1 << 20


def test_pipelines_on_gpu_equal_from_pretrained_across_tier_moves(store):
    with nostall.ModelCache(store, device="cuda", gpu_budget=2_000_000, host_budget=64 * MB) as c:
        refs = {}
        for name in ("flux", "sdxl", "flux", "sd3", "sdxl", "flux"):
            with c.use(name) as pipe:
                assert pipe.device.type == "cuda"
                out = run(pipe, name, device="cuda")
            if name not in refs:
                refs[name] = reference(store, name, device="cuda")
            assert np.array_equal(out, refs[name]), name
        tiers = [x.tier for r in c.reports for x in r.components]
        assert {"disk", "host", "gpu"} <= set(tiers)
        s = c.stats()
        assert s.gpu_bytes <= s.gpu_budget and s.host_bytes > 0


def test_same_architecture_switch_keeps_compiled_graphs(store):
    from torch._dynamo.utils import counters

    with nostall.ModelCache(store, device="cuda", gpu_budget=800_000, host_budget=64 * MB) as c:
        a = c.pipeline("flux")
        module = a.transformer
        module.compile(fullgraph=True)
        run(a, "flux", device="cuda")  # compiles
        run(a, "flux", device="cuda")
        graphs = counters["stats"]["unique_graphs"]
        ptrs = [p.data_ptr() for p in module.parameters()]
        b = c.pipeline("flux-b")
        assert any(x.in_place for x in c.last_report.components)
        assert b.transformer is module and [p.data_ptr() for p in module.parameters()] == ptrs
        out = run(b, "flux-b", device="cuda")
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
        ref = reference(store, "flux-b", device="cuda")
        np.testing.assert_allclose(out, ref, atol=2e-3)  # compiled vs eager kernels
        a = c.pipeline("flux")
        np.testing.assert_allclose(
            run(a, "flux", device="cuda"), reference(store, "flux", device="cuda"), atol=2e-3
        )
        assert counters["stats"]["unique_graphs"] == graphs


def test_prefetch_copies_overlap_the_running_compute(store):
    with nostall.ModelCache(store, device="cuda", gpu_budget=16 * MB, host_budget=64 * MB) as c:
        c.pipeline("sdxl")
        c.evict("gpu")  # sdxl in the host tier only
        with c.use("flux"):
            x = torch.randn(4096, 4096, device="cuda")
            torch.cuda.synchronize()
            for _ in range(400):  # about a second of work queued on the compute stream
                x = x @ x
                x = x / x.norm()
            future = c.prefetch("sdxl")
            report = future.result(30)
            busy = not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
        assert busy, "the prefetch waited for the compute stream instead of overlapping it"
        assert {x.tier for x in report.components} == {"host"}
        with c.use("sdxl") as pipe:
            assert {x.tier for x in c.last_report.components} == {"gpu"}
            assert np.array_equal(
                run(pipe, "sdxl", device="cuda"), reference(store, "sdxl", device="cuda")
            )


def test_a_block_fences_every_stream_its_pipeline_ran_on(store):
    # The block is entered here, its pipeline runs on a side stream, and it ends on
    # another thread: the next copy into its memory must wait for the side stream's
    # kernels too, not only for the stream current where the block ended.
    import threading

    with nostall.ModelCache(store, device="cuda", gpu_budget=16 * MB, host_budget=64 * MB) as c:
        side = torch.cuda.Stream()
        block = c.use("sdxl")
        pipe = block.__enter__()
        with torch.cuda.stream(side):
            out = run(pipe, "sdxl", device="cuda")
        leaving = threading.Thread(target=block.__exit__, args=(None, None, None))
        leaving.start()
        leaving.join(60)
        slots = [c._tier.slots[x.digest] for x in c.store.entry("sdxl").distinct_weights()]
        assert all(s.uses == 0 for s in slots)
        assert all(len(s.events) == 2 for s in slots)  # the side stream's and the default's
        torch.cuda.synchronize()
        assert np.array_equal(out, reference(store, "sdxl", device="cuda"))
