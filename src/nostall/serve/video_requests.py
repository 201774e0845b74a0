"""What a video generation request may ask of a Wan pipeline, checked before it is queued.

A Wan pipeline's configs fix what it can make: the VAE's spatial scale × the
transformer's patch the multiple a side must be of (16 for Wan 2.1 and the A14B
experts, 32 for TI2V-5B's 48-channel VAE), the VAE's temporal scale the frame counts
(``4k + 1``), the pipeline class whether it needs an image (``WanImageToVideoPipeline``)
or takes none (``WanPipeline``), ``boundary_ratio`` whether a second expert
(``transformer_2``) runs the low-noise steps and takes its own ``guidance_2``.
:func:`generate_rules` reads them from a store entry without touching a weight and
:func:`check_generate` holds a :class:`~nostall.serve.bodies.VideoBody` to them and to
the worker's :class:`~nostall.serve.requests.Limits`: the fields a
:class:`~nostall.serve.jobs.GenerateJob` needs, or :class:`~nostall.ArgumentError`
naming the field and what it allows (HTTP 422).

>>> rules = GenerateRules("wan", "WanPipeline", multiple=16, temporal=4)
>>> body = VideoBody(model="wan", prompt="a cat", size="832x480", seconds="2", fps=16)
>>> f = check_generate(body, rules, Limits())
>>> f["width"], f["height"], f["frames"]
(832, 480, 33)
>>> check_generate(VideoBody(model="wan", prompt="a cat", frames=32), rules, Limits())
Traceback (most recent call last):
nostall.errors.ArgumentError: frames=32: give 4k+1 frames (wan's VAE makes 4 frames per latent frame, and one first frame), from 1 to 161
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass
from typing import Any

from nostall.errors import ArgumentError
from nostall.serve.bodies import ImageRef, VideoBody
from nostall.serve.requests import Limits, component_config

__all__ = ["GENERATE_PIPELINES", "GenerateRules", "check_generate", "generate_rules", "read_image"]

#: The diffusers pipelines that generate video, and whether they need an image.
GENERATE_PIPELINES = {"WanPipeline": False, "WanImageToVideoPipeline": True}
#: What an input image may declare (pixels), before a byte of it is decoded.
MAX_INPUT_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class GenerateRules:
    """What one video pipeline accepts. ``image``: it needs an ``input_reference``;
    ``experts``: 2 for Wan 2.2 A14B (``transformer_2`` after ``boundary_ratio``);
    ``size``, ``fps``: its defaults (Wan's 832x480 at 16 fps; TI2V-5B's 1280x704 at 24)."""

    model: str
    pipeline: str
    multiple: int
    temporal: int
    image: bool = False
    experts: int = 1
    boundary_ratio: float | None = None
    size: tuple[int, int] = (832, 480)
    fps: int = 16
    max_sequence_length: int = 512
    # Wan 2.1 I2V: its attention takes the last 512 context tokens as the text, the rest
    # as the image's (a shorter text would feed it no image tokens, silently)
    fixed_sequence: bool = False

    def describe(self) -> str:
        return f"{self.model} ({self.pipeline})"


def generate_rules(entry: Any) -> GenerateRules | None:
    """The :class:`GenerateRules` of store entry ``entry``, or ``None`` for a pipeline
    that does not generate video."""
    cls = entry.class_name
    if cls not in GENERATE_PIPELINES:
        return None
    comps = entry.components
    vae = component_config(comps.get("vae"))
    transformer = component_config(comps.get("transformer"))
    spatial = int(vae.get("scale_factor_spatial") or 8)
    temporal = int(vae.get("scale_factor_temporal") or 4)
    patch = transformer.get("patch_size") or (1, 2, 2)
    multiple = spatial * int(patch[-1])
    ratio = entry.config.get("boundary_ratio")
    experts = 2 if comps.get("transformer_2") is not None else 1
    wide = int(vae.get("z_dim") or 16) == 48  # Wan 2.2's VAE: TI2V-5B, 1280x704 at 24 fps
    return GenerateRules(
        model=entry.name,
        pipeline=cls,
        multiple=multiple,
        temporal=temporal,
        image=GENERATE_PIPELINES[cls],
        experts=experts,
        boundary_ratio=float(ratio) if isinstance(ratio, (int, float)) else None,
        size=(1280, 704) if wide else (832, 480),
        fps=24 if wide else 16,
        fixed_sequence=comps.get("image_encoder") is not None,
    )


def _whole(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ArgumentError(
            f"{name}={v!r}: must be an integer in [{lo}, {hi}]",
            field=name,
            allowed={"min": lo, "max": hi},
        )
    return v


def _size(size: str | None, rules: GenerateRules, limits: Limits) -> tuple[int, int]:
    m = rules.multiple
    allowed = {"multiple_of": m, "min": m, "max_pixels": limits.max_video_pixels}
    if size is None:
        return rules.size
    try:
        w, h = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise ArgumentError(
            f"size={size!r}: give WIDTHxHEIGHT, e.g. {rules.size[0]}x{rules.size[1]}",
            field="size",
            allowed=allowed,
        ) from None
    if w < m or h < m or w % m or h % m or w * h > limits.max_video_pixels:
        raise ArgumentError(
            f"size={size!r}: sides must be multiples of {m} (the VAE's scale × the "
            f"transformer's patch for {rules.describe()}), at most "
            f"{limits.max_video_pixels} pixels a frame",
            field="size",
            allowed=allowed,
        )
    return w, h


def _frames(body: VideoBody, fps: int, rules: GenerateRules, limits: Limits) -> int:
    k = rules.temporal
    top = (limits.max_video_frames - 1) // k * k + 1
    if body.frames is not None and body.seconds is not None:
        raise ArgumentError("give frames or seconds, not both", field="frames")
    if body.frames is not None:
        n = body.frames
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n > top or (n - 1) % k:
            raise ArgumentError(
                f"frames={n!r}: give {k}k+1 frames ({rules.model}'s VAE makes {k} frames per "
                f"latent frame, and one first frame), from 1 to {top}",
                field="frames",
                allowed={"form": f"{k}k+1", "min": 1, "max": top},
            )
        return n
    seconds: Any = 4 if body.seconds is None else body.seconds  # OpenAI's default, "4"
    try:
        s = float(seconds)
    except ValueError:
        s = math.nan
    longest = (top - 1) / fps
    if not 0 < s <= longest:  # (NaN fails this too)
        raise ArgumentError(
            f"seconds={seconds!r}: a number in (0, {longest:g}] at {fps} fps",
            field="seconds",
            allowed={"min_exclusive": 0, "max": longest},
        )
    return min(top, k * max(1, round(s * fps / k)) + 1)


def check_generate(
    body: VideoBody, rules: GenerateRules, limits: Limits, image: bytes | None = None
) -> dict[str, Any]:
    """``body`` held to ``rules`` and ``limits``: the fields of a generate job
    (``prompt, negative_prompt, width, height, frames, fps, steps, seed, guidance,
    guidance_2, max_sequence_length, mode, image``; a random seed if none was given).
    ``image``: the input image's bytes when a multipart body sent it as a file (else
    ``body.input_reference`` is read)."""
    if not body.prompt.strip() or len(body.prompt) > limits.max_prompt_chars:
        raise ArgumentError(
            f"prompt of {len(body.prompt)} characters: give 1 to {limits.max_prompt_chars}",
            field="prompt",
        )
    neg = body.negative_prompt
    if neg is not None and len(neg) > limits.max_prompt_chars:
        raise ArgumentError(
            f"negative_prompt of {len(neg)} characters: at most {limits.max_prompt_chars}",
            field="negative_prompt",
        )
    w, h = _size(body.size, rules, limits)
    fps = rules.fps if body.fps is None else _whole("fps", body.fps, 1, int(limits.max_fps))
    frames = _frames(body, fps, rules, limits)
    steps = 50 if body.steps is None else _whole("steps", body.steps, 1, limits.max_steps)
    seed = random.randrange(2**31) if body.seed is None else _whole("seed", body.seed, 0, 2**63 - 1)
    guidance = {}
    for name in ("guidance", "guidance_2"):
        g = getattr(body, name)
        if g is None:
            continue
        if name == "guidance_2" and rules.experts < 2:
            raise ArgumentError(
                f"{rules.describe()} has one transformer: guidance_2 is for Wan 2.2's "
                "low-noise expert",
                field=name,
            )
        if not 0.0 <= g <= limits.max_guidance:
            raise ArgumentError(
                f"{name}={g}: must be in [0, {limits.max_guidance}]",
                field=name,
                allowed={"min": 0.0, "max": limits.max_guidance},
            )
        guidance[name] = float(g)
    seq = body.max_sequence_length
    if seq is not None:
        seq = _whole("max_sequence_length", seq, 1, rules.max_sequence_length)
        if rules.fixed_sequence and seq != rules.max_sequence_length:
            raise ArgumentError(
                f"max_sequence_length={seq}: {rules.describe()} reads the image's tokens "
                f"after {rules.max_sequence_length} text tokens; leave it out (or give "
                f"{rules.max_sequence_length})",
                field="max_sequence_length",
                allowed=[rules.max_sequence_length],
            )
    given = image is not None or body.input_reference is not None
    if rules.image and not given:
        raise ArgumentError(
            f"{rules.describe()} makes a video from an image: send input_reference",
            field="input_reference",
        )
    if given and not rules.image:
        raise ArgumentError(
            f"{rules.describe()} makes a video from text alone: send no input_reference "
            "(an image-to-video pipeline takes one)",
            field="input_reference",
        )
    picture = None
    if given:
        picture = read_image(image if image is not None else _data_url(body.input_reference))
    return {
        "prompt": body.prompt,
        "negative_prompt": neg,
        "width": w,
        "height": h,
        "frames": frames,
        "fps": fps,
        "steps": steps,
        "seed": seed,
        "guidance": guidance.get("guidance"),
        "guidance_2": guidance.get("guidance_2"),
        "max_sequence_length": seq,
        "mode": body.mode,
        "image": picture,
    }


def _data_url(ref: str | ImageRef | None) -> bytes:
    import base64
    import binascii

    url = ref.image_url if isinstance(ref, ImageRef) else (ref or "")
    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ArgumentError(
            "input_reference: give a data URL (data:image/png;base64,...) or send the image "
            "as a multipart file; this server fetches no URL",
            field="input_reference",
        )
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ArgumentError(
            f"input_reference: the data URL is not base64 ({e})", field="input_reference"
        ) from None


def read_image(data: bytes, field: str = "input_reference") -> Any:
    """``data`` (PNG, JPEG or WebP) as an RGB PIL image; its declared size is checked
    against :data:`MAX_INPUT_PIXELS` before a pixel is decoded (a small file declaring a
    huge image costs nothing). :class:`~nostall.ArgumentError` naming ``field``."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.format not in ("PNG", "JPEG", "WEBP"):
            raise ArgumentError(
                f"{field}: a {img.format} image; send PNG, JPEG or WebP", field=field
            )
        w, h = img.size
        if w * h > MAX_INPUT_PIXELS:
            raise ArgumentError(
                f"{field} declares {w}x{h} pixels; at most {MAX_INPUT_PIXELS} (it is resized "
                "to the video's size anyway)",
                field=field,
            )
        img.load()
    except Image.DecompressionBombError as e:
        raise ArgumentError(f"{field} declares too many pixels ({e})", field=field) from None
    except (ValueError, UnidentifiedImageError, OSError) as e:
        if isinstance(e, ArgumentError):
            raise
        raise ArgumentError(
            f"{field} is not an image ({type(e).__name__}: {e})", field=field
        ) from None
    return img.convert("RGB")
