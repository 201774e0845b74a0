"""What a request may ask of a pipeline, checked before it is queued.

A pipeline's configs say what it can run: the VAE's scale factor and the transformer's
patch size fix the multiple image sides must be of, SD3's ``pos_embed_max_size`` the
largest side, diffusers' ``check_inputs`` and the T5 tokenizer the longest
``max_sequence_length``, the pipeline's ``__call__`` which optional fields it takes at
all. :func:`image_rules` reads them from a store entry (no weights are touched) and
:func:`check_image` holds a request body to them; :func:`video_rules` and
:func:`check_video` do the same for latents sent to be decoded. A request that breaks a
rule raises :class:`~nostall.ArgumentError` whose ``field`` names the request field and
``allowed`` what that field may be — the worker's HTTP app answers it as a 422.

Bodies come typed (:mod:`nostall.serve.bodies`: pydantic checked their fields and JSON
types); here only what their values may be.

>>> from nostall.serve.bodies import ImageBody
>>> limits = Limits()
>>> rules = ImageRules("sd3", "StableDiffusion3Pipeline", multiple=16, min_side=16,
...                    max_side=2048, max_steps=150, max_sequence_length=512)
>>> body = ImageBody(model="sd3", prompt="a cat", size="512x512", steps=4, seed=1)
>>> check_image(body, rules, limits)["width"]
512
>>> check_image(ImageBody(model="sd3", prompt="a cat", size="520x512"), rules, limits)
Traceback (most recent call last):
nostall.errors.ArgumentError: size='520x512': width 520 must be a multiple of 16 in [16, 2048] for sd3 (StableDiffusion3Pipeline)
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from nostall.errors import ArgumentError
from nostall.serve.bodies import ControlRef, ImageBody, LoraRef

__all__ = [
    "ImageRules",
    "Limits",
    "RuleBook",
    "VideoRules",
    "check_controlnet",
    "check_image",
    "check_loras",
    "check_video",
    "check_video_target",
    "component_config",
    "image_rules",
    "video_rules",
]

# FluxPipeline's and StableDiffusion3Pipeline's check_inputs refuse more than this.
_DIFFUSERS_MAX_SEQUENCE = 512
# A tokenizer's model_max_length this large means "no limit" (transformers' sentinel 1e30).
_NO_LIMIT = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What any request may ask for, whatever its pipeline allows (beyond these: HTTP
    422 naming the field). The video caps bound one decode's work: output frames and
    pixels per frame (a Wan latent frame makes 4 frames, a latent pixel 8×8 pixels)."""

    min_side: int = 16
    max_side: int = 2048
    max_steps: int = 150
    max_prompt_chars: int = 4000
    max_loras: int = 8
    max_control_bytes: int = 16 << 20  # a ControlNet image, base64-decoded
    max_guidance: float = 50.0
    max_latent_bytes: int = 128 << 20
    max_video_frames: int = 161
    max_video_pixels: int = 1280 * 720
    max_fps: float = 240.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ArgumentError(f"Limits.{f.name}={v!r}: must be a positive number")
        if self.min_side > self.max_side:
            raise ArgumentError(f"Limits: min_side {self.min_side} > max_side {self.max_side}")


@dataclass(frozen=True)
class ImageRules:
    """What one pipeline accepts in an image request, from its configs.

    ``kind``: ``"image"``, or ``"video"`` for a pipeline whose call makes frames (it
    cannot serve the images endpoint). ``multiple``: image sides must be multiples of
    it, within ``min_side..max_side`` (``why_max`` says which limit set the top).
    ``max_sequence_length``: the longest text sequence, ``None`` if the pipeline takes
    no such argument. ``negative_prompt`` / ``guidance``: whether it takes them.
    """

    model: str
    pipeline: str
    multiple: int
    min_side: int
    max_side: int
    max_steps: int
    max_sequence_length: int | None = None
    negative_prompt: bool = True
    guidance: bool = True
    kind: str = "image"
    why_max: str = ""

    def describe(self) -> str:
        return f"{self.model} ({self.pipeline})"


@dataclass(frozen=True)
class VideoRules:
    """What the decode endpoint accepts for one pipeline: its VAE class (a Wan VAE or
    nothing can be decoded), the latent channels and its spatial and temporal scales."""

    model: str
    vae: str | None
    z_dim: int = 16
    spatial: int = 8
    temporal: int = 4

    @property
    def wan(self) -> bool:
        return self.vae == "AutoencoderKLWan"


def component_config(component: Any) -> dict[str, Any]:
    """A store component's config.json (weights components keep it canonicalised)."""
    if component is None:
        return {}
    if getattr(component, "config_key", b""):
        return json.loads(component.config_key)
    path = os.path.join(component.folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _tokenizer_max(component: Any) -> int | None:
    if component is None:
        return None
    try:
        with open(os.path.join(component.folder, "tokenizer_config.json")) as f:
            n = json.load(f).get("model_max_length")
    except (OSError, ValueError):
        return None
    return int(n) if isinstance(n, (int, float)) and 0 < n < _NO_LIMIT else None


def _call_params(class_name: str) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of diffusers' ``class_name.__call__``; ``None`` when diffusers has
    no such class (then nothing optional is refused here; the pipeline says)."""
    import diffusers

    try:
        call = getattr(diffusers, class_name).__call__
        return inspect.signature(call).parameters
    except (AttributeError, ImportError, TypeError, ValueError):
        return None


def _vae_scale(vae: dict[str, Any]) -> int:
    # as diffusers' pipelines compute it: one halving per VAE block after the first
    blocks = vae.get("block_out_channels")
    if isinstance(blocks, list) and blocks:
        return 2 ** (len(blocks) - 1)
    return int(vae.get("scale_factor_spatial") or 8)


def image_rules(entry: Any, limits: Limits) -> ImageRules:
    """The :class:`ImageRules` of the pipeline in store entry ``entry`` (a
    :class:`~nostall.store.catalog.PipelineEntry`): its class, VAE, denoiser and
    tokenizer configs, read without loading a weight."""
    cls = entry.class_name
    comps = entry.components
    params = _call_params(cls)
    vae = component_config(comps.get("vae"))
    scale = _vae_scale(vae)
    denoiser = component_config(comps.get("transformer")) or component_config(comps.get("unet"))
    patch = denoiser.get("patch_size")
    max_side, why = limits.max_side, "the worker's largest side"
    if cls.startswith("Flux"):
        # FLUX packs 2×2 latent patches: the latent sides must be even
        multiple = scale * 2
    elif isinstance(patch, int) and patch > 0 and "transformer" in comps:
        multiple = scale * patch
        pos = denoiser.get("pos_embed_max_size")
        if isinstance(pos, int) and pos > 0 and pos * patch * scale < max_side:
            # SD3's PatchEmbed crops a pos_embed_max_size² table of positions
            max_side = pos * patch * scale
            why = f"pos_embed_max_size {pos} × patch {patch} × VAE scale {scale}"
    else:
        multiple = scale
    # diffusers' UNet pipelines (and this worker, always) want multiples of 8
    multiple = math.lcm(multiple, 8)
    lo = -(-max(limits.min_side, multiple) // multiple) * multiple
    hi = max_side // multiple * multiple
    max_seq = None
    if params is None or "max_sequence_length" in params:
        # max_sequence_length is the T5 tokenizer's length (CLIP's stay at theirs)
        toks = [c for r, c in comps.items() if r.startswith("tokenizer") and c is not None]
        t5 = [c for c in toks if "T5" in c.class_name] or toks
        known = [n for n in map(_tokenizer_max, t5) if n]
        max_seq = min([_DIFFUSERS_MAX_SEQUENCE, *known])
    return ImageRules(
        model=entry.name,
        pipeline=cls,
        multiple=multiple,
        min_side=lo,
        max_side=hi,
        max_steps=limits.max_steps,
        max_sequence_length=max_seq,
        negative_prompt=params is None or "negative_prompt" in params,
        guidance=params is None or "guidance_scale" in params,
        kind="video" if params is not None and "num_frames" in params else "image",
        why_max=why,
    )


def _int(name: str, v: int | None, default: Any, lo: int, hi: int) -> Any:
    if v is None:
        return default
    if not lo <= v <= hi:
        raise ArgumentError(
            f"{name}={v}: must be in [{lo}, {hi}]", field=name, allowed={"min": lo, "max": hi}
        )
    return v


def _text(name: str, v: str | None, limit: int, *, required: bool) -> str | None:
    if v is None:
        return None
    if (required and not v.strip()) or len(v) > limit:
        what = "1" if required else "0"
        raise ArgumentError(
            f"{name} of {len(v)} characters: give {what} to {limit}",
            field=name,
            allowed={"min_chars": 1 if required else 0, "max_chars": limit},
        )
    return v


def _size(size: Any, rules: ImageRules) -> tuple[int, int]:
    allowed = {"multiple_of": rules.multiple, "min": rules.min_side, "max": rules.max_side}
    if size is None:
        side = min(max(1024, rules.min_side), rules.max_side)
        return side, side
    try:
        w, h = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise ArgumentError(
            f"size={size!r}: give WIDTHxHEIGHT, e.g. '1024x1024'", field="size", allowed=allowed
        ) from None
    for name, v in (("width", w), ("height", h)):
        if not rules.min_side <= v <= rules.max_side or v % rules.multiple:
            why = f"; at most {rules.max_side}: {rules.why_max}" if v > rules.max_side else ""
            raise ArgumentError(
                f"size={size!r}: {name} {v} must be a multiple of {rules.multiple} in "
                f"[{rules.min_side}, {rules.max_side}] for {rules.describe()}{why}",
                field="size",
                allowed=allowed,
            )
    return w, h


def _unknown(field: str, kind: str, name: Any, available: list[str]) -> ArgumentError:
    """The 422 for an adapter name the server lacks: the names that look like it."""
    close = difflib.get_close_matches(str(name), available)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ArgumentError(
        f"{field}: no {kind} {name!r} on this server{hint}",
        field=field,
        allowed={"names": close or available[:50]},
    )


_LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def check_loras(
    loras: list[LoraRef] | None, available: list[str], limits: Limits
) -> tuple[tuple[str, float], ...]:
    """The request's ``loras`` as ``((name, scale), ...)``: names of the store's LoRAs
    only (no paths: a client names, the server resolves), each once, scales finite
    within ±10, at most ``limits.max_loras``; else :class:`~nostall.ArgumentError` naming
    ``loras`` and what it allows.

    >>> check_loras([LoraRef(name="ghibli", scale=0.8)], ["ghibli"], Limits())
    (('ghibli', 0.8),)
    """
    from nostall.adapters import lora_weights

    if loras is None:
        return ()
    if len(loras) > limits.max_loras:
        raise ArgumentError(
            f"loras: a list of at most {limits.max_loras} {{name, scale}} objects",
            field="loras",
            allowed={"max": limits.max_loras, "names": available[:50]},
        )
    for ref in loras:
        if not _LORA_NAME.fullmatch(ref.name) or ref.name not in available:
            raise _unknown("loras", "LoRA", ref.name, available)
    return tuple(lora_weights([(ref.name, ref.scale) for ref in loras]))


MAX_CONTROL_SCALE = 5.0


def check_controlnet(
    control: ControlRef | None, available: list[str], size: tuple[int, int], limits: Limits
) -> tuple[str, Any, float] | None:
    """The request's ``controlnet`` (a name, a base64 PNG/JPEG/WebP image, a scale) as
    ``(name, PIL image, scale)``: a name of the store's ControlNets, an image of the
    request's own ``size`` (``(width, height)``), a finite scale in [0, 5]; else
    :class:`~nostall.ArgumentError` naming ``controlnet`` (or ``controlnet.image``)."""
    import base64
    import binascii
    import io

    if control is None:
        return None
    name, scale, data = control.name, control.scale, control.image
    if name not in available:
        raise _unknown("controlnet", "ControlNet", name, available)
    if not 0.0 <= scale <= MAX_CONTROL_SCALE:  # (NaN fails this too)
        raise ArgumentError(
            f"controlnet.scale={scale!r}: a number in [0, {MAX_CONTROL_SCALE:g}]",
            field="controlnet.scale",
            allowed={"min": 0.0, "max": MAX_CONTROL_SCALE},
        )
    if len(data) > limits.max_control_bytes * 4 // 3 + 4:
        raise ArgumentError(
            f"controlnet.image: a base64 PNG or JPEG of at most "
            f"{limits.max_control_bytes >> 20} MB",
            field="controlnet.image",
        )
    from PIL import Image, UnidentifiedImageError

    allowed = f"{size[0]}x{size[1]}"
    try:
        # Image.open reads the header only: the declared size is checked before a pixel
        # is decoded, so a small file declaring a huge image costs nothing
        img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        if img.format not in ("PNG", "JPEG", "WEBP"):
            raise ArgumentError(
                f"controlnet.image: a {img.format} image; send PNG, JPEG or WebP",
                field="controlnet.image",
            )
        if img.size != size:
            raise ArgumentError(
                f"controlnet.image declares {img.size[0]}x{img.size[1]} pixels; it must be "
                f"the image's size, {allowed}",
                field="controlnet.image",
                allowed=allowed,
            )
        img.load()
    except Image.DecompressionBombError as e:  # (declared beyond PIL's own pixel cap)
        raise ArgumentError(
            f"controlnet.image declares too many pixels ({e}); it must be {allowed}",
            field="controlnet.image",
            allowed=allowed,
        ) from None
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as e:
        if isinstance(e, ArgumentError):
            raise
        raise ArgumentError(
            f"controlnet.image is not a base64 image ({type(e).__name__}: {e})",
            field="controlnet.image",
        ) from None
    return name, img.convert("RGB"), float(scale)


def check_image(body: ImageBody, rules: ImageRules, limits: Limits) -> dict[str, Any]:
    """The image request ``body`` (typed: :class:`~nostall.serve.bodies.ImageBody`) held to
    ``rules`` and ``limits``: the fields an image job needs (``prompt, width, height,
    steps, seed, guidance, negative_prompt, max_sequence_length``; a random seed if none
    was given), or :class:`~nostall.ArgumentError` naming the first field at fault and
    what it allows."""
    if body.n != 1:
        raise ArgumentError("n: only 1", field="n", allowed=[1])
    if rules.kind != "image":
        raise ArgumentError(
            f"model {rules.model!r} is a {rules.kind} pipeline ({rules.pipeline}); the images "
            "endpoint serves image pipelines",
            field="model",
        )
    prompt = _text("prompt", body.prompt, limits.max_prompt_chars, required=True)
    w, h = _size(body.size, rules)
    steps = _int("steps", body.steps, 28, 1, rules.max_steps)
    seed = _int("seed", body.seed, None, 0, 2**63 - 1)
    if seed is None:
        seed = random.randrange(2**31)
    guidance = body.guidance
    if guidance is not None:
        if not rules.guidance:
            raise ArgumentError(
                f"{rules.describe()} takes no guidance", field="guidance", allowed=None
            )
        if not 0.0 <= guidance <= limits.max_guidance:  # NaN fails this too
            raise ArgumentError(
                f"guidance={guidance}: must be in [0, {limits.max_guidance}]",
                field="guidance",
                allowed={"min": 0.0, "max": limits.max_guidance},
            )
        guidance = float(guidance)
    negative = _text(
        "negative_prompt", body.negative_prompt, limits.max_prompt_chars, required=False
    )
    if negative is not None and not rules.negative_prompt:
        raise ArgumentError(
            f"{rules.describe()} takes no negative_prompt", field="negative_prompt", allowed=None
        )
    max_seq = body.max_sequence_length
    if max_seq is not None:
        if rules.max_sequence_length is None:
            raise ArgumentError(
                f"{rules.describe()} takes no max_sequence_length",
                field="max_sequence_length",
                allowed=None,
            )
        max_seq = _int("max_sequence_length", max_seq, None, 1, rules.max_sequence_length)
    return {
        "prompt": prompt,
        "width": w,
        "height": h,
        "steps": steps,
        "seed": seed,
        "guidance": guidance,
        "negative_prompt": negative,
        "max_sequence_length": max_seq,
    }


def video_rules(entry: Any) -> VideoRules:
    """The :class:`VideoRules` of the pipeline in store entry ``entry``."""
    vae = entry.components.get("vae")
    if vae is None:
        return VideoRules(entry.name, None)
    cfg = component_config(vae)
    return VideoRules(
        entry.name,
        vae.class_name,
        z_dim=int(cfg.get("z_dim") or 16),
        spatial=int(cfg.get("scale_factor_spatial") or 8),
        temporal=int(cfg.get("scale_factor_temporal") or 4),
    )


def check_video_target(rules: VideoRules, limits: Limits, *, fps: Any, mode: Any) -> None:
    """The parts of a decode request known before its latents arrive: the model has a
    Wan VAE, ``mode`` is one of the decoder's, ``fps`` is in range."""
    from nostall.video.wan import MODES as modes

    if not rules.wan:
        raise ArgumentError(
            f"model {rules.model!r} has {'no VAE' if rules.vae is None else 'a ' + rules.vae}, "
            "not a Wan VAE (AutoencoderKLWan): it cannot decode video latents",
            field="model",
        )
    if mode not in modes:
        raise ArgumentError(
            f"mode={mode!r}: choose one of {', '.join(modes)}", field="mode", allowed=list(modes)
        )
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= limits.max_fps:
        raise ArgumentError(
            f"fps={fps!r}: must be a number in (0, {limits.max_fps}]",
            field="fps",
            allowed={"min_exclusive": 0, "max": limits.max_fps},
        )


def check_video(latents: Any, rules: VideoRules, limits: Limits, *, fps: Any, mode: Any) -> None:
    """Latents sent to be decoded, held to the pipeline's VAE and ``limits``:
    :class:`~nostall.ArgumentError` naming the field (``model``, ``latents``, ``fps``,
    ``mode``) and what it allows. The shape: ``(1, z_dim, T, h, w)``, floating point,
    finite; the video it makes within ``max_video_frames`` frames of at most
    ``max_video_pixels`` pixels."""
    import torch

    check_video_target(rules, limits, fps=fps, mode=mode)
    want = f"(1, {rules.z_dim}, T, h, w)"
    shape_rule = {"shape": want, "dtype": "floating point", "values": "finite"}
    if not isinstance(latents, torch.Tensor) or latents.dim() != 5:
        got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise ArgumentError(
            f"latents: shape {got}; give {want}", field="latents", allowed=shape_rule
        )
    b, c, t, h, w = latents.shape
    if b != 1 or c != rules.z_dim or 0 in (t, h, w):
        if b != 1:
            why = f"a batch of {b}: decode one video per request"
        elif c != rules.z_dim:
            why = f"{c} channels; {rules.model}'s VAE takes {rules.z_dim}"
        else:
            why = "an empty dimension"
        raise ArgumentError(
            f"latents: shape {tuple(latents.shape)} ({why}); give {want}",
            field="latents",
            allowed=shape_rule,
        )
    if not latents.is_floating_point():
        raise ArgumentError(
            f"latents: dtype {latents.dtype}; give floating-point latents",
            field="latents",
            allowed=shape_rule,
        )
    frames = 1 + rules.temporal * (t - 1)
    pixels = h * rules.spatial * w * rules.spatial
    if frames > limits.max_video_frames or pixels > limits.max_video_pixels:
        raise ArgumentError(
            f"latents: shape {tuple(latents.shape)} makes {frames} frames of "
            f"{w * rules.spatial}x{h * rules.spatial}; this worker decodes at most "
            f"{limits.max_video_frames} frames of at most {limits.max_video_pixels} pixels",
            field="latents",
            allowed={"max_frames": limits.max_video_frames, "max_pixels": limits.max_video_pixels},
        )
    bad = latents.numel() - int(torch.isfinite(latents).sum())
    if bad:
        raise ArgumentError(
            f"latents: {bad} of {latents.numel()} values are NaN or infinite; they would "
            "decode to a black or garbage video",
            field="latents",
            allowed=shape_rule,
        )


class RuleBook:
    """The :class:`ImageRules` and :class:`VideoRules` of a store's pipelines, read
    again only when a pipeline's files change (the store says when)."""

    def __init__(self, store: Any, limits: Limits):
        self.store = store
        self.limits = limits
        self._image: dict[str, tuple[Any, ImageRules]] = {}
        self._video: dict[str, tuple[Any, VideoRules]] = {}

    def image(self, name: str) -> ImageRules:
        """``name``'s image rules; :class:`~nostall.UnknownModel` if the store has no
        such pipeline."""
        entry = self.store.entry(name)
        held = self._image.get(name)
        if held is None or held[0] is not entry:  # the store rescanned: files changed
            held = self._image[name] = (entry, image_rules(entry, self.limits))
        return held[1]

    def video(self, name: str) -> VideoRules:
        """``name``'s decode rules; :class:`~nostall.UnknownModel` as :meth:`image`."""
        entry = self.store.entry(name)
        held = self._video.get(name)
        if held is None or held[0] is not entry:
            held = self._video[name] = (entry, video_rules(entry))
        return held[1]

    def serving(self, kind: str, names: list[str]) -> list[str]:
        """Those of ``names`` that serve ``kind`` (``"image"`` or ``"video"``)."""
        out = []
        for n in names:
            try:
                ok = self.image(n).kind == "image" if kind == "image" else self.video(n).wan
            except Exception:  # a folder that cannot be read serves nothing
                continue
            if ok:
                out.append(n)
        return out
