"""Wan 2.2's two experts on a GPU: the boundary's switch ordered after the first
expert's kernels (one at a time), or prefetched on the copy stream (both fit); the
frames equal diffusers' with both experts resident."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nostall

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    from nostall.synthetic import write_store

    folder = tmp_path_factory.mktemp("wan22")
    write_store(folder, ("wan22",))
    return folder


def _call(pipe, **kw):
    g = torch.Generator("cuda").manual_seed(3)
    return pipe(prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=6,
                max_sequence_length=16, generator=g, output_type="np", **kw).frames  # fmt: skip


def _sizes(cache):
    from nostall.serve.budget import device_bytes  # (slots' sizes, alignment included)

    entry = cache.store.entry("wan22")
    return {c.role: device_bytes(c, None) for c in entry.distinct_weights()}


@pytest.mark.parametrize("room", ["one", "both"])
def test_the_boundary_switch_on_the_gpu_equals_diffusers(wan22, tmp_path, room):
    from diffusers import DiffusionPipeline

    ref_pipe = DiffusionPipeline.from_pretrained(str(wan22 / "wan22")).to("cuda")
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _call(ref_pipe)
    del ref_pipe
    with nostall.ModelCache(wan22, device="cuda", cache_dir=tmp_path / "probe") as probe:
        sizes = _sizes(probe)
    rest = sum(n for r, n in sizes.items() if not r.startswith("transformer"))
    budget = None if room == "both" else rest + sizes["transformer"] * 9 // 8  # one expert

    with nostall.ModelCache(wan22, device="cuda", gpu_budget=budget, cache_dir=tmp_path) as c:
        for _ in range(2):  # the second block starts from the first expert again
            with c.use("wan22") as pipe:
                pipe.set_progress_bar_config(disable=True)
                out = _call(pipe)
                (switch,) = pipe.nostall_experts.reports
            assert np.array_equal(out, ref)
            if room == "one":
                assert switch.moved_bytes > 0 and switch.evicted
            assert c.stats().gpu_bytes <= c.stats().gpu_budget
        if room == "both":
            assert switch.moved_bytes == 0  # prefetched, then resident
