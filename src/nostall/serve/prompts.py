"""Prompt embeddings from the embedding service, put together as each pipeline's own
``encode_prompt`` would: FLUX, SDXL and SD3.

The service returns one encoder's output per request (:mod:`nostall.serve.embed`); what a
pipeline takes is built from several:

- **FLUX**: ``prompt_embeds`` = T5's ``last_hidden_state`` (``max_sequence_length``, 512
  by default); ``pooled_prompt_embeds`` = CLIP-L's ``pooler_output``.
- **SDXL**: ``prompt_embeds`` = CLIP-L's and CLIP-G's ``hidden_states[-2]`` side by side;
  ``pooled_prompt_embeds`` = CLIP-G's ``text_embeds``. A negative prompt is encoded the
  same way; without one, zeros if the pipeline's ``force_zeros_for_empty_prompt`` says
  so (the pipeline makes them), else ``""`` encoded, as the pipeline would.
- **SD3**: CLIP-L's and CLIP-G's ``hidden_states[-2]`` side by side, padded (or cut) to
  T5's width, above T5's ``last_hidden_state`` (256 tokens by default); pooled = the two
  ``text_embeds`` side by side. The negative prompt (``""`` by default) likewise.

A pipeline of another class, or one missing an encoder, is encoded locally (``None``).
Everything a pipeline's call needs from its encoders is here, so the worker switches the
pipeline in without them (``ModelCache.use(..., without=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["REMOTE_PIPELINES", "remote_prompt_embeds"]

# pipeline class -> the text encoders (component roles) its recipe needs
REMOTE_PIPELINES: dict[str, tuple[str, ...]] = {
    "FluxPipeline": ("text_encoder", "text_encoder_2"),
    "StableDiffusionXLPipeline": ("text_encoder", "text_encoder_2"),
    "StableDiffusion3Pipeline": ("text_encoder", "text_encoder_2", "text_encoder_3"),
}

Encode = Callable[[str, str, "int | None", "int | None"], dict[str, torch.Tensor]]


def remote_prompt_embeds(
    encode: Encode,
    model: str,
    class_name: str,
    roles: set[str],
    prompt: str,
    negative_prompt: str | None = None,
    max_sequence_length: int | None = None,
    *,
    zeros_for_empty_negative: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The ``prompt_embeds``-style arguments for pipeline ``model`` of ``class_name``, or
    ``None`` when its prompts must be encoded locally.

    ``encode(encoder, text, max_length, hidden_layer)`` asks the service for one text
    (``max_length``/``hidden_layer`` ``None``: the tokenizer's own length, the last hidden
    state) and returns its tensors with a batch dimension of one.
    ``zeros_for_empty_negative``: SDXL's ``force_zeros_for_empty_prompt`` (then, with no
    negative prompt, the pipeline makes zeros itself; otherwise it encodes ``""``, here
    in the service, since its encoders may be left out)."""
    needed = REMOTE_PIPELINES.get(class_name)
    if needed is None or not set(needed) <= roles:
        return None
    te = [f"{model}/{role}" for role in needed]

    if class_name == "FluxPipeline":
        t5 = encode(te[1], prompt, max_sequence_length or 512, None)["last_hidden_state"]
        pooled = encode(te[0], prompt, None, None)["pooled"]
        # a negative prompt matters to FLUX only with true CFG, which the worker does not
        # expose; the pipeline ignores it otherwise
        return {"prompt_embeds": t5, "pooled_prompt_embeds": pooled}

    if class_name == "StableDiffusionXLPipeline":

        def sdxl(text: str) -> tuple[torch.Tensor, torch.Tensor]:
            a = encode(te[0], text, None, -2)
            b = encode(te[1], text, None, -2)
            return torch.cat([a["hidden_state"], b["hidden_state"]], dim=-1), b["pooled"]

        embeds, pooled = sdxl(prompt)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if negative_prompt is None and not zeros_for_empty_negative:
            negative_prompt = ""
        if negative_prompt is not None:
            n_embeds, n_pooled = sdxl(negative_prompt)
            out |= {"negative_prompt_embeds": n_embeds, "negative_pooled_prompt_embeds": n_pooled}
        return out

    def sd3(text: str) -> tuple[torch.Tensor, torch.Tensor]:
        a = encode(te[0], text, None, -2)
        b = encode(te[1], text, None, -2)
        t5 = encode(te[2], text, max_sequence_length or 256, None)["last_hidden_state"]
        clip = torch.cat([a["hidden_state"], b["hidden_state"]], dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([a["pooled"], b["pooled"]], dim=-1)

    embeds, pooled = sd3(prompt)
    n_embeds, n_pooled = sd3(negative_prompt or "")
    return {
        "prompt_embeds": embeds,
        "pooled_prompt_embeds": pooled,
        "negative_prompt_embeds": n_embeds,
        "negative_pooled_prompt_embeds": n_pooled,
    }


def apply(kwargs: dict[str, Any], embeds: dict[str, torch.Tensor], pipe: Any, device) -> None:
    """Swap ``prompt``/``negative_prompt`` in a pipeline call for ``embeds``, on the
    pipeline's device in its text encoders' dtype (the dtype a local encode gives), or,
    with the encoders left out, its denoiser's (as the pipelines fall back to)."""
    dtype = next(
        (
            m.dtype
            for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "unet")
            if (m := getattr(pipe, name, None)) is not None
        ),
        None,
    )
    kwargs.pop("prompt", None)
    if "negative_prompt_embeds" in embeds:
        kwargs.pop("negative_prompt", None)
    for k, v in embeds.items():
        kwargs[k] = v.to(device=device, dtype=dtype or v.dtype)
