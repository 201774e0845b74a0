"""The recipes that put pipeline prompt embeddings together from service answers."""

from __future__ import annotations

import torch

from nostall.serve.prompts import remote_prompt_embeds


def _fake(calls):
    def encode(encoder, text, max_length, layer):
        calls.append((encoder, text, max_length, layer))
        width = {"m/text_encoder": 3, "m/text_encoder_2": 5, "m/text_encoder_3": 10}[encoder]
        length = max_length or 4
        key = "last_hidden_state" if layer is None else "hidden_state"
        return {key: torch.full((1, length, width), float(len(text))),
                "pooled": torch.full((1, width), -1.0)}  # fmt: skip

    return encode


def test_sdxl_encodes_an_empty_negative_when_the_pipeline_would():
    roles = {"text_encoder", "text_encoder_2", "unet", "vae"}
    calls = []
    out = remote_prompt_embeds(_fake(calls), "m", "StableDiffusionXLPipeline", roles, "abc")
    assert set(out) == {"prompt_embeds", "pooled_prompt_embeds"}  # zeros: the pipeline's
    assert out["prompt_embeds"].shape == (1, 4, 8) and out["pooled_prompt_embeds"].shape == (1, 5)
    assert [c[3] for c in calls] == [-2, -2]
    calls.clear()
    out = remote_prompt_embeds(_fake(calls), "m", "StableDiffusionXLPipeline", roles, "abc",
                               zeros_for_empty_negative=False)  # fmt: skip
    assert "negative_prompt_embeds" in out and [c[1] for c in calls] == ["abc", "abc", "", ""]


def test_sd3_pads_clip_to_t5_and_stacks_it_above():
    roles = {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer"}
    calls = []
    out = remote_prompt_embeds(_fake(calls), "m", "StableDiffusion3Pipeline", roles, "ab",
                               max_sequence_length=6)  # fmt: skip
    pe = out["prompt_embeds"]
    assert pe.shape == (1, 4 + 6, 10)  # CLIP's 77 (4 here) tokens above T5's 6
    assert (pe[0, :4, :8] == 2).all() and (pe[0, :4, 8:] == 0).all()  # 3 + 5 padded to 10
    assert (pe[0, 4:] == 2).all()
    assert out["pooled_prompt_embeds"].shape == (1, 8)
    assert [c[1] for c in calls] == ["ab"] * 3 + [""] * 3  # SD3's default negative is ""


def test_pipelines_the_service_cannot_encode_for_are_local():
    calls = []
    assert remote_prompt_embeds(_fake(calls), "m", "WanPipeline", {"text_encoder"}, "x") is None
    # SD3 without T5 (the pipeline pads zeros itself): local too
    roles = {"text_encoder", "text_encoder_2", "transformer"}
    assert remote_prompt_embeds(_fake(calls), "m", "StableDiffusion3Pipeline", roles, "x") is None
    assert calls == []


def test_embeddings_take_the_encoders_dtype_or_else_the_denoisers():
    from types import SimpleNamespace

    from nostall.serve.prompts import apply

    e = {"prompt_embeds": torch.ones(1, 2, 3), "negative_prompt_embeds": torch.ones(1, 2, 3)}
    kw = {"prompt": "x", "negative_prompt": "y", "height": 8}
    bf16 = SimpleNamespace(dtype=torch.bfloat16)
    apply(kw, e, SimpleNamespace(text_encoder=None, transformer=bf16), "cpu")
    assert kw.keys() == {"height", "prompt_embeds", "negative_prompt_embeds"}
    assert kw["prompt_embeds"].dtype == torch.bfloat16  # no encoders: the transformer's
    kw = {"prompt": "x"}
    apply(kw, e, SimpleNamespace(text_encoder=SimpleNamespace(dtype=torch.float16)), "cpu")
    assert kw["prompt_embeds"].dtype == torch.float16
