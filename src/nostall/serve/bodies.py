"""The shapes of the services' JSON bodies, as pydantic models: types and fields checked
once, where a body is parsed.

What a value may be for a given pipeline (sides a multiple of its patch, at most its
steps, a LoRA the server has) is :mod:`nostall.serve.requests`'s, which takes these
models typed; here only the shape: which fields, of which JSON types. Types are strict
(``"28"``, ``28.0`` and ``true`` are not a number of steps) and unknown fields are
refused (a typo should not silently fall back to a default).

:func:`parse` validates a parsed body (a dict, from Python or a router) and raises
:class:`~nostall.ArgumentError` naming the first field at fault; the HTTP apps answer the
same problem as a 422 (:func:`~nostall.serve.answers.read_body`), with the same words
(:func:`first_problem`).

>>> parse(ImageBody, {"model": "flux", "prompt": "a cat", "steps": "28"})
Traceback (most recent call last):
nostall.errors.ArgumentError: steps: Input should be a valid integer (got '28')
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError, field_validator

from nostall.errors import ArgumentError

__all__ = [
    "EMBED_SHAPE",
    "ControlRef",
    "EmbedBody",
    "ImageBody",
    "LoraRef",
    "VideoBody",
    "first_problem",
    "parse",
]

M = TypeVar("M", bound=BaseModel)


class LoraRef(BaseModel):
    """One LoRA of an images request: a name of the server's ``<store>/loras`` and its
    weight (an extension of OpenAI's images body)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    scale: float = 1.0


class ControlRef(BaseModel):
    """The ControlNet of an images request: a name of the server's
    ``<store>/controlnets``, the control image (base64 PNG/JPEG/WebP of the request's
    size) and its conditioning scale."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    image: str
    scale: float = 1.0


class ImageBody(BaseModel):
    """The images/generations body. OpenAI's ``n`` (1 only), ``user``, ``quality`` and
    ``style`` are accepted and ignored."""

    # strict: "28", 28.0 and true are not a number of steps (a client bug to show)
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    prompt: str
    size: str | None = None
    steps: int | None = None
    seed: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    loras: list[LoraRef] | None = None
    controlnet: ControlRef | None = None
    slo_ms: float | None = None  # answer within this, or be refused at once (429)
    response_format: Literal["b64_json", "png"] = "b64_json"
    n: int = 1
    user: str | None = None
    quality: str | None = None
    style: str | None = None


class ImageRef(BaseModel):
    """OpenAI's ``input_reference`` as JSON: ``{"image_url": "data:image/png;base64,..."}``
    (a data URL; this server fetches no URL)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    image_url: str


class VideoBody(BaseModel):
    """The ``POST /v1/videos`` body (OpenAI's Videos API: ``model``, ``prompt``,
    ``size``, ``seconds``, ``input_reference``), with the diffusion settings a Wan
    pipeline takes. ``seconds`` is a string as OpenAI sends it (``"2"``) or a number;
    ``frames`` (4k+1) may be given instead; ``input_reference`` is the image of an
    image-to-video pipeline, as a data URL or ``{"image_url": ...}`` (a multipart body
    sends it as a file)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    prompt: str
    negative_prompt: str | None = None
    size: str | None = None
    seconds: StrictStr | StrictInt | float | None = None
    frames: int | None = None
    fps: int | None = None
    steps: int | None = None
    seed: int | None = None
    guidance: float | None = None
    guidance_2: float | None = None
    max_sequence_length: int | None = None
    mode: Literal["eager", "exact", "fast"] = "exact"
    input_reference: str | ImageRef | None = None
    user: str | None = None


class EmbedBody(BaseModel):
    """``POST /v1/embeddings``: strict types, so ``"77"``, ``77.9`` and ``true`` are not
    lengths; one text may be given bare (``"texts": "a cat"``)."""

    model_config = ConfigDict(extra="forbid")

    encoder: StrictStr
    texts: list[StrictStr]
    max_length: StrictInt | None = None
    hidden_layer: StrictInt | None = None

    @field_validator("texts", mode="before")
    @classmethod
    def _one_text(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


#: What the embedding service's 422s add: the body's shape, for a client that got it wrong.
EMBED_SHAPE = (
    "the body is {encoder: string, texts: [string], max_length: integer?, hidden_layer: integer?}"
)


def first_problem(e: ValidationError) -> tuple[str, str]:
    """``(field, message)`` for the first problem pydantic found: the field's dotted
    path (``"body"`` for the body as a whole) and what is wrong with it, the value given
    included (cut at 200 characters)."""
    first = e.errors()[0]
    loc = [str(x) for x in first["loc"] if x not in ("body", "query")]
    where = ".".join(loc) or "body"
    got = f" (got {first['input']!r:.200})" if "input" in first and loc else ""
    return where, f"{where}: {first['msg']}{got}"


def parse(schema: type[M], data: Any) -> M:
    """``data`` (a parsed body) as ``schema``; :class:`~nostall.ArgumentError` naming the
    first field at fault otherwise."""
    if isinstance(data, schema):
        return data
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        where, message = first_problem(e)
        raise ArgumentError(message, field=where) from None
