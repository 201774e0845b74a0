"""One mapping from a failure to its HTTP answer, for the worker app and the fleet."""

from __future__ import annotations

import json

import pytest

from nostall.serve.answers import error_answer, read_body


def test_failures_are_answered_with_their_status_and_retry_hints():
    import torch

    from nostall.errors import (
        ArgumentError,
        BudgetExceeded,
        DeviceBusy,
        LatentsError,
        QueueFull,
        ShuttingDown,
        UnknownModel,
    )

    def status(e):
        return error_answer(e)[0]

    unknown = UnknownModel("no model 'x'", name="x", available=["flux"], close=[])
    assert error_answer(unknown, models=["flux"])[:2] == (
        404,
        {"type": "unknown_model", "message": "no model 'x'", "models": ["flux"]},
    )
    code, error, _ = error_answer(ValueError("height above pos_embed_max_size"), model="sd3")
    assert code == 422 and error["message"] == "sd3: height above pos_embed_max_size"
    full = error_answer(QueueFull("full", retry_after=2.4))
    assert full[0] == 429 and full[2] == {"Retry-After": "3"} and full[1]["retry_after_s"] == 2.4
    assert status(ShuttingDown("bye")) == 503
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert status(oom) == 503 and "Retry-After" in error_answer(oom)[2]
    busy = DeviceBusy("twice", retry_after=7)
    assert status(busy) == 503 and error_answer(busy)[2] == {"Retry-After": "7"}
    no_room = BudgetExceeded("tier", tier="gpu", requested=2, budget=1, in_use=0)
    assert status(no_room) == 503 and error_answer(no_room)[1]["type"] == "no_room"
    assert error_answer(LatentsError("NaN"))[:2] == (
        422,
        {"type": "invalid_value", "message": "NaN", "field": "latents"},
    )
    assert status(RuntimeError("a bug")) == 500
    field = ArgumentError("steps=0: give 1 to 150")
    field.field, field.allowed = "steps", range(1, 151)  # (set as newer errors carry them)
    code, error, _ = error_answer(field)
    assert code == 422 and error["field"] == "steps" and error["allowed"] == "range(1, 151)"


@pytest.mark.parametrize(
    "raw, status, kind",
    [
        (b"{oops", 400, "malformed_json"),
        (b'{"model": "\xff\xfe"}', 400, "malformed_json"),  # not UTF-8 (was a 500 on the fleet)
        (b"[" * 100_000 + b"]" * 100_000, 400, "malformed_json"),
        (b'{"model": "flux"}', 422, "invalid_value"),  # no prompt
    ],
)
def test_a_body_that_is_not_the_schema_is_a_400_or_422_naming_it(raw, status, kind):
    from nostall.serve.app import ImageBody

    out = read_body(raw, ImageBody)
    assert out.status_code == status
    error = json.loads(out.body)["error"]
    assert error["type"] == kind
    if status == 422:
        assert error["field"] == "prompt"
