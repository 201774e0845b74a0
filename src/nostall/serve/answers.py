"""What a failed request is answered: one mapping for the worker app, the fleet and the
embedding service.

Every error is JSON ``{"error": {"type", "message", ...}}``
(:func:`~nostall.serve.http.error_response`). :func:`error_answer` maps an exception to
``(status, error, headers)``, the same whether the worker's own app answers it or a fleet
router relays it from a worker; :func:`read_body` turns the bytes of a JSON request body
into its pydantic model or the 400/422 answer, naming the first problem;
:func:`timing_headers` says where a served request's time went.

>>> error_answer(ValueError("height 4096 above 3072"))[:2]
(422, {'type': 'rejected_by_pipeline', 'message': 'height 4096 above 3072'})
"""

from __future__ import annotations

import json
import math
from typing import Any

from nostall.errors import (
    ArgumentError,
    BudgetExceeded,
    Cancelled,
    DeviceBusy,
    LatentsError,
    NostallError,
    QueueFull,
    ShuttingDown,
    UnknownModel,
)
from nostall.serve.http import error_response

__all__ = ["answer", "error_answer", "read_body", "schema_error", "timing_headers"]


def _allowed(value: Any) -> Any:
    """``value`` if JSON can carry it, else its text."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def error_answer(
    e: BaseException,
    *,
    model: str | None = None,
    models: list[str] | None = None,
    unknown: str = "model",
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(status, error, headers)`` for a request that failed with ``e``: 404 unknown
    model (listing ``models``; with ``unknown="encoder"``, the embedding service's
    ``unknown_encoder``, naming the encoder asked for, those there are and the close
    ones), 422 a value the request or the pipeline refused (with ``field`` and
    ``allowed`` where the error names them), 429 queue full, 503 shutting down, no room
    or out of device memory (with ``Retry-After``), 500 anything else. ``model``: the
    request's, named in a pipeline's refusal."""
    from nostall.serve.budget import is_out_of_memory

    def retry(default: float) -> dict[str, str]:
        wait = getattr(e, "retry_after", None) or default
        return {"Retry-After": str(max(1, math.ceil(wait)))}

    def err(kind: str, message: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"type": kind, "message": str(e) if message is None else message, **extra}

    if isinstance(e, UnknownModel):
        if unknown == "encoder":
            fields = {"encoder": e.name, "encoders": e.available, "close": e.close}
            return 404, err("unknown_encoder", **fields), {}
        return 404, err("unknown_model", **({"models": models} if models is not None else {})), {}
    if isinstance(e, QueueFull):
        wait = e.retry_after if e.retry_after is not None else 1.0  # the queue's estimate
        return 429, err("queue_full", retry_after_s=round(wait, 3)), retry(1)
    if isinstance(e, ArgumentError):
        if getattr(e, "field", None) is None:
            return 422, err("invalid_value"), {}
        return 422, err("invalid_value", field=e.field, allowed=_allowed(e.allowed)), {}
    if isinstance(e, LatentsError):  # the decoder's own checks, as it ran
        return 422, err("invalid_value", field="latents"), {}
    if isinstance(e, (ShuttingDown, Cancelled)):
        return 503, err("shutting_down"), {}
    if isinstance(e, BudgetExceeded):
        return 503, err("no_room"), retry(5)
    if isinstance(e, DeviceBusy):  # out of device memory twice: the worker carries on
        return 503, err("device_busy"), retry(5)
    if is_out_of_memory(e):  # torch's (or a library's), where a service lets it through
        return 503, err("out_of_memory", f"{type(e).__name__}: {e}"), retry(5)
    if isinstance(e, ValueError):  # the pipeline refused what it was given (check_inputs)
        return 422, err("rejected_by_pipeline", f"{model}: {e}" if model else None), {}
    if isinstance(e, NostallError):
        return 500, err(type(e).__name__), {}
    return 500, err(type(e).__name__, f"{type(e).__name__}: {e}"), {}


def answer(e: BaseException, **kw: Any):
    """:func:`error_answer` as a JSON response."""
    status, error, headers = error_answer(e, **kw)
    kind, message = error.pop("type"), error.pop("message")
    return error_response(status, kind, message, headers=headers or None, **error)


def schema_error(e: Any, *, hint: str = ""):
    """A 422 for a body or query that does not fit its schema (the first problem named,
    and the value given: :func:`~nostall.serve.bodies.first_problem`); ``hint`` follows
    the message (the embedding service says the body's shape)."""
    from nostall.serve.bodies import first_problem

    where, message = first_problem(e)
    return error_response(
        422, "invalid_value", f"{message}; {hint}" if hint else message, field=where
    )


def read_body(raw: bytes, schema: type, *, hint: str = "") -> Any:
    """The JSON body ``raw`` as the pydantic model ``schema``; or the answer to give
    instead: 400 for bytes that are not UTF-8 JSON (or nest too deep), 422 for JSON that
    does not fit the schema (``hint``: as :func:`schema_error`'s)."""
    from pydantic import ValidationError

    try:
        return schema.model_validate(json.loads(raw))
    except ValidationError as e:
        return schema_error(e, hint=hint)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep
        why = "nested too deep" if isinstance(e, RecursionError) else str(e)
        return error_response(400, "malformed_json", f"body is not JSON: {why:.300}")


def timing_headers(phases: dict[str, float], switch: dict[str, Any]) -> dict[str, str]:
    """A served request's phase times as ``Server-Timing`` (milliseconds, what browsers'
    developer tools show) and ``X-Nostall-<Phase>-S`` headers, and the tiers its switch
    took components from (``X-Nostall-Switch-Tiers``)."""
    headers = {"Server-Timing": ", ".join(f"{k};dur={v * 1e3:.1f}" for k, v in phases.items())}
    for k, v in phases.items():
        headers[f"X-Nostall-{k.capitalize()}-S"] = f"{v:.4f}"
    tiers = sorted({c["tier"] for c in switch.get("components", [])})
    if tiers:
        headers["X-Nostall-Switch-Tiers"] = ",".join(tiers)
    return headers
