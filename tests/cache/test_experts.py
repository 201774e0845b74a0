"""Wan 2.2's two experts under budgets that hold both, or one at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nostall
from nostall.errors import BudgetExceeded, UnsupportedError

MB = 1 << 20


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    from nostall.synthetic import write_store

    folder = tmp_path_factory.mktemp("wan22")
    write_store(folder, ("wan22",))
    return folder


def _call(pipe, steps: int = 6, **kw):
    g = torch.Generator("cpu").manual_seed(3)
    return pipe(prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=steps,
                max_sequence_length=16, generator=g, output_type="np", **kw).frames  # fmt: skip


@pytest.fixture(scope="module")
def reference(wan22):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(wan22 / "wan22"))
    pipe.set_progress_bar_config(disable=True)
    calls = {"transformer": 0, "transformer_2": 0}
    for role in calls:
        getattr(pipe, role).register_forward_pre_hook(
            lambda m, a, role=role: calls.__setitem__(role, calls[role] + 1)
        )
    frames = _call(pipe)
    assert calls["transformer"] and calls["transformer_2"]  # the boundary is inside
    return frames, calls


def _sizes(wan22, tmp_path):
    with nostall.ModelCache(wan22, device="cpu", cache_dir=tmp_path) as c:
        with c.use("wan22") as pipe:
            pipe.set_progress_bar_config(disable=True)
            _call(pipe, steps=1)
        return None, {r.role: r.nbytes for rep in c.reports for r in rep.components}


def test_both_experts_fit_the_second_is_prefetched_and_frames_equal(wan22, reference, tmp_path):
    with nostall.ModelCache(wan22, device="cpu", cache_dir=tmp_path) as c:
        with c.use("wan22") as pipe:
            pipe.set_progress_bar_config(disable=True)
            entered = c.last_report
            frames = _call(pipe)
            assert pipe.nostall_experts.current == "transformer_2"
            boundary = pipe.nostall_experts.reports
        assert np.array_equal(frames, reference[0])
        # the entry's report: every component but the second expert, in one row each
        roles = [r.role for r in entered.components]
        assert "transformer" in roles and "transformer_2" not in roles
        assert any(r.prefetch and "transformer_2" in [x.role for x in r.components]
                   for r in c.reports)  # fmt: skip
        assert len(boundary) == 1 and boundary[0].moved_bytes == 0  # it was there already
        assert pipe.transformer is None and pipe.transformer_2 is None  # the block ended
        # a second block moves nothing
        with c.use("wan22") as pipe:
            again = _call(pipe)
        assert c.last_report.moved_bytes == 0
        assert np.array_equal(again, reference[0])


def test_one_expert_at_a_time_switches_at_the_boundary(wan22, reference, tmp_path):
    _, rows = _sizes(wan22, tmp_path / "sizes")
    expert = rows["transformer"]
    rest = sum(n for role, n in rows.items() if not role.startswith("transformer"))
    budget = rest + expert + expert // 2  # room for one expert, not two
    with nostall.ModelCache(wan22, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:
        with c.use("wan22") as pipe:
            pipe.set_progress_bar_config(disable=True)
            seen = []
            pipe.nostall_experts.on_swap(lambda role, m: seen.append(role))
            frames = _call(pipe)
            (switch,) = pipe.nostall_experts.reports
            assert switch.moved_bytes == expert
            assert any("transformer" in e for e in switch.evicted)  # the first one left
            assert seen == ["transformer_2"]
            # a second call in the block starts again from the first expert
            assert np.array_equal(_call(pipe), reference[0])
            assert seen == ["transformer_2", "transformer", "transformer_2"]
            assert c.stats().gpu_bytes <= budget
        assert np.array_equal(frames, reference[0])
        assert not any(r.prefetch and r.moved_bytes for r in c.reports)  # no room for it


def test_a_user_callback_still_runs_and_a_callback_object_keeps_its_inputs(wan22, reference,
                                                                           tmp_path):  # fmt: skip
    from diffusers.callbacks import PipelineCallback

    class Count(PipelineCallback):
        tensor_inputs = ("latents", "prompt_embeds")

        def __init__(self):
            super().__init__(cutoff_step_ratio=None, cutoff_step_index=100)
            self.steps = []

        def callback_fn(self, pipeline, step_index, timesteps, callback_kwargs):
            assert "prompt_embeds" in callback_kwargs
            self.steps.append(step_index)
            return {}

    steps = []
    cache = nostall.ModelCache(wan22, device="cpu", cache_dir=tmp_path)
    with cache, cache.use("wan22") as pipe:
        frames = _call(pipe, callback_on_step_end=lambda p, i, t, k: steps.append(i) or {})
        counted = Count()
        again = _call(pipe, callback_on_step_end=counted)
    assert steps == list(range(6)) and counted.steps == list(range(6))
    assert np.array_equal(frames, reference[0]) and np.array_equal(again, reference[0])


def test_leaving_an_expert_out_uses_the_pipeline_as_given(wan22, tmp_path):
    cache = nostall.ModelCache(wan22, device="cpu", cache_dir=tmp_path)
    with cache, cache.use("wan22", without=["transformer_2"]) as pipe:
        assert pipe.transformer is not None and pipe.transformer_2 is None
        assert getattr(pipe, "nostall_experts", None) is None


def _pages(n: int) -> int:
    return -(-n // 4096) * 4096  # a slot is whole pages


def test_a_tier_holding_one_expert_only_without_the_text_encoder_encodes_first(wan22, reference,
                                                                               tmp_path):  # fmt: skip
    # a bf16 A14B on a 48 GB card: 11.4 GB of UMT5 and a 28.6 GB expert do not fit together
    _, rows = _sizes(wan22, tmp_path / "sizes")
    vae, text, expert = (_pages(rows[r]) for r in ("vae", "text_encoder", "transformer"))
    budget = vae + expert + text // 2
    assert budget < vae + expert + text and budget >= vae + text
    from diffusers import DiffusionPipeline

    ref = DiffusionPipeline.from_pretrained(str(wan22 / "wan22"))
    with torch.no_grad():
        embeds, negative = ref.encode_prompt("a cat", max_sequence_length=16, device="cpu")
    with nostall.ModelCache(wan22, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:
        with c.use("wan22") as pipe:
            pipe.set_progress_bar_config(disable=True)
            assert pipe.nostall_experts.text == ("text_encoder",)
            entered = {r.role for r in c.last_report.components}
            assert entered == {"vae", "text_encoder"}  # no expert yet
            encodes = []
            pipe.text_encoder.register_forward_pre_hook(lambda m, a: encodes.append(1))
            frames = _call(pipe)
            assert pipe.text_encoder is None  # it left after encoding
            first, second = pipe.nostall_experts.reports
            assert any("text_encoder" in e for e in first.evicted)  # the first expert took its room
            assert any("transformer" in e for e in second.evicted)
            assert c.stats().gpu_bytes <= budget
            # a second call brings the text encoder back, then the first expert
            seen = []
            pipe.nostall_experts.on_swap(lambda role, m: seen.append(role))
            assert np.array_equal(_call(pipe), reference[0])
            assert seen == ["text_encoder", "transformer", "transformer_2"]
            # a call with its own embeddings does not bring it back
            seen.clear()
            g = torch.Generator("cpu").manual_seed(3)
            own = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, height=16, width=16,
                       num_frames=5, num_inference_steps=6, generator=g, output_type="np").frames  # fmt: skip
            assert seen == ["transformer", "transformer_2"]
            assert np.array_equal(own, reference[0])
        assert np.array_equal(frames, reference[0]) and len(encodes) == 4  # (and negative)


def test_a_tier_holding_both_experts_only_without_the_text_encoder_prefetches(wan22, reference,
                                                                             tmp_path):  # fmt: skip
    # an FP8 A14B on a 48 GB card: both experts fit once UMT5 has encoded and left
    _, rows = _sizes(wan22, tmp_path / "sizes")
    vae, text, expert = (_pages(rows[r]) for r in ("vae", "text_encoder", "transformer"))
    budget = vae + 2 * expert + text // 2
    with nostall.ModelCache(wan22, device="cpu", gpu_budget=budget, cache_dir=tmp_path) as c:
        with c.use("wan22") as pipe:
            pipe.set_progress_bar_config(disable=True)
            assert pipe.nostall_experts.text == ("text_encoder",)
            frames = _call(pipe)
            _, second = pipe.nostall_experts.reports
            assert second.moved_bytes == 0 and not second.evicted  # prefetched: nothing moved
            assert any(r.prefetch and r.moved_bytes == rows["transformer_2"] for r in c.reports)
            assert c.stats().gpu_bytes <= budget
            assert np.array_equal(_call(pipe), reference[0])  # again: the encoder comes back
        assert np.array_equal(frames, reference[0])
    # with room for everything, the text encoder stays for the block
    roomy = nostall.ModelCache(wan22, device="cpu", gpu_budget=budget + text, cache_dir=tmp_path)
    with roomy, roomy.use("wan22") as pipe:
        assert pipe.nostall_experts.text == ()


def test_a_budget_without_room_for_one_expert_and_loras_are_refused(wan22, tmp_path):
    _, rows = _sizes(wan22, tmp_path / "sizes")
    vae, expert = _pages(rows["vae"]), _pages(rows["transformer"])
    small = vae + expert - 4096  # not one expert beside the VAE, even without the text encoder
    with nostall.ModelCache(wan22, device="cpu", gpu_budget=small, cache_dir=tmp_path) as c:
        with pytest.raises(BudgetExceeded), c.use("wan22"):
            pass
        assert c.stats().gpu_bytes <= small
    cache = nostall.ModelCache(wan22, device="cpu", cache_dir=tmp_path)
    with (
        cache,
        pytest.raises(UnsupportedError, match="two-expert"),
        cache.use("wan22", loras={"x": 1}),
    ):
        pass


def test_a_block_ended_before_the_boundary_leaves_no_expert_protected(wan22, tmp_path):
    cache = nostall.ModelCache(wan22, device="cpu", cache_dir=tmp_path)
    with cache:
        with cache.use("wan22"):  # (a job cancelled before its first step)
            pass
        second = cache.store.entry("wan22").components["transformer_2"].digest
        assert any(r.prefetch and r.expert for r in cache.reports)  # it was prefetched
        assert second not in cache._protected  # so a later switch may evict it
        assert cache.evict() > 0 and cache.stats().gpu_bytes == 0


@pytest.fixture(scope="module")
def wan22_deep(tmp_path_factory):
    """A tiny Wan 2.2 whose experts have four blocks (the tiny store's have one: nothing
    to stream)."""
    import diffusers

    from nostall.synthetic import tiny

    folder = tmp_path_factory.mktemp("wan22deep")
    torch.manual_seed(6)
    high, low = (tiny._wan_transformer(num_layers=4) for _ in range(2))
    diffusers.WanPipeline(
        **tiny._wan21_shared(),
        transformer=high,
        transformer_2=low,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        boundary_ratio=0.875,
    ).save_pretrained(folder / "wan22")
    return folder


def test_experts_larger_than_the_tier_beside_the_rest_stream_and_frames_equal(wan22_deep, tmp_path):
    from diffusers import DiffusionPipeline

    from nostall.cache.partial import least_pipeline_bytes

    ref = DiffusionPipeline.from_pretrained(str(wan22_deep / "wan22"))
    ref.set_progress_bar_config(disable=True)
    want = _call(ref)
    with nostall.ModelCache(wan22_deep, device="cpu", cache_dir=tmp_path) as c:
        least = least_pipeline_bytes(c, "wan22", experts=("transformer", "transformer_2"))
    # an expert cannot sit whole beside the VAE even with the text encoder gone
    with nostall.ModelCache(wan22_deep, device="cpu", gpu_budget=150_000, cache_dir=tmp_path) as c:
        assert least < c._tier.budget
        for _ in range(2):
            with c.use("wan22") as pipe:
                pipe.set_progress_bar_config(disable=True)
                np.testing.assert_array_equal(_call(pipe), want)
        rows = {r.role: r for rep in c.reports for r in rep.components}
        assert rows["transformer"].streamed > 0 and rows["transformer_2"].streamed > 0
    c = nostall.ModelCache(wan22_deep, device="cpu", gpu_budget=least // 2)
    with c, pytest.raises(BudgetExceeded, match="larger expert"), c.use("wan22"):
        pass
