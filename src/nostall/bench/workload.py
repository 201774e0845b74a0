"""Request streams for the serving benchmark: replayed production traces, or drawn.

A stream is a list of :class:`Arrival` records (seconds from the stream's start, the
catalog pipeline asked for, its LoRAs and ControlNets, steps and images), read from a
trace file or drawn by :func:`draw`.

Trace files (:func:`read_trace`), told apart by their contents:

* **Katz** (``diffusion_model_request_trace.json``, ModelScope
  ``mental2008/T2I-Model-Serving-Request-Trace``): a JSON list of objects with
  ``timestamp``, ``ip``, ``scene_id``, ``base_model_id``, ``controlnets`` and ``loras``
  (lists of anonymised ids, or null);
* **GenTD26** (``lora_request_trace.csv``, Alibaba ``cluster-trace-v2026-GenAI``): CSV
  with ``gmt_create`` (``2024-11-15 16:57:50``), ``checkpoint_model_version_id``,
  ``num_inference_steps``, ``num_images_per_prompt``, ``num_lora``, ``predict_type``,
  ``predict_status`` and more;
* **nostall's own** CSV: ``at_s,model`` and optionally ``steps``, ``images``, ``loras``
  (``;``-separated).

Models: the production traces name anonymised checkpoints (``M0001``), so by default
(``mapping="rank"``) the trace's models ranked by request count are laid onto the
catalog's pipelines in the order given (the most requested onto the first), the rest
folded round-robin: the trace's popularity and its bursts, on the catalog that exists.
``mapping="names"`` takes the model column as catalog names and refuses a row naming
another. A malformed row is an :class:`~nostall.ArgumentError` naming the file, the
row and the field.

:func:`draw`: Zipf(``alpha``) popularity over the catalog, Poisson arrivals at ``rate``
requests per second, and optionally one burst (``burst_x`` times the rate for
``burst_s`` seconds, starting at ``burst_at_s``): production traces show bursts up to
90x the normal rate.

>>> s = draw(["flux", "sdxl", "sd3"], n=6, rate=2.0, seed=0)
>>> [a.model for a in s], round(s[-1].at_s, 2)
(['sdxl', 'flux', 'flux', 'flux', 'sdxl', 'flux'], 3.84)
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from nostall.errors import ArgumentError

__all__ = ["Arrival", "draw", "read_trace", "scale_to_rate"]

_GENTD = ("gmt_create", "checkpoint_model_version_id")
_OURS = ("at_s", "model")


@dataclass(frozen=True)
class Arrival:
    """One request of a stream.

    ``at_s``: seconds from the stream's start; ``model``: the catalog pipeline;
    ``source``: the trace's own model id (``None`` for drawn streams); ``row``: its row
    in the trace (1-based; the header of a CSV is row 1), ``None`` when drawn.
    """

    at_s: float
    model: str
    loras: tuple[str, ...] = ()
    controlnets: tuple[str, ...] = ()
    steps: int | None = None
    images: int = 1
    source: str | None = None
    row: int | None = None


def draw(
    models: Sequence[str],
    n: int,
    *,
    rate: float,
    alpha: float = 1.0,
    seed: int = 0,
    burst_at_s: float | None = None,
    burst_s: float = 5.0,
    burst_x: float = 10.0,
) -> list[Arrival]:
    """``n`` arrivals: each model drawn Zipf(``alpha``) over ``models`` (the first the most
    popular), Poisson at ``rate`` per second, ``burst_x`` times that during the burst."""
    models = _check_models(models)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ArgumentError(f"n={n!r} must be a number of requests >= 0", field="n")
    for name, value in (("rate", rate), ("burst_x", burst_x), ("burst_s", burst_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ArgumentError(f"{name}={value!r} must be a finite number > 0", field=name)
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise ArgumentError(f"alpha={alpha!r} must be a finite number >= 0 (0: uniform)")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** alpha for k in range(len(models))]
    out, t = [], 0.0
    for _ in range(n):
        in_burst = burst_at_s is not None and burst_at_s <= t < burst_at_s + burst_s
        t += rng.expovariate(rate * (burst_x if in_burst else 1.0))
        out.append(Arrival(t, rng.choices(models, weights)[0]))
    return out


def scale_to_rate(stream: Sequence[Arrival], rate: float) -> list[Arrival]:
    """``stream`` with its times scaled so that its mean rate is ``rate`` per second
    (its bursts keep their shape); the first arrival at 0."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ArgumentError(f"rate={rate!r} must be a finite number > 0", field="rate")
    if len(stream) < 2:
        return [_at(a, 0.0) for a in stream]
    t0, span = stream[0].at_s, stream[-1].at_s - stream[0].at_s
    if span <= 0:
        return [_at(a, 0.0) for a in stream]
    k = (len(stream) - 1) / rate / span
    return [_at(a, (a.at_s - t0) * k) for a in stream]


def read_trace(
    path: str | os.PathLike,
    models: Sequence[str],
    *,
    mapping: str = "rank",
    limit: int | None = None,
) -> list[Arrival]:
    """The arrivals of a Katz, GenTD26 or nostall trace file (see the module), in time
    order, the first at 0; failed requests (GenTD26 ``predict_status`` other than
    ``SUCCEED``) left out; at most ``limit`` of them."""
    models = _check_models(models)
    if mapping not in ("rank", "names"):
        raise ArgumentError(
            f"mapping={mapping!r} is not one of rank, names",
            field="mapping",
            allowed=["rank", "names"],
        )
    path = os.fspath(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ArgumentError(f"{path}: cannot read the trace: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ArgumentError(f"{path}: the trace is not UTF-8 text ({e.reason})") from e
    rows = _katz(text, path) if text.lstrip()[:1] in ("[", "{") else _csv(text, path)
    rows.sort(key=lambda r: (r.at_s, r.row or 0))
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise ArgumentError(f"{path}: the trace holds no request")
    names = _map(rows, models, mapping, path)
    t0 = rows[0].at_s
    return [
        Arrival(
            r.at_s - t0, names[r.source], r.loras, r.controlnets, r.steps, r.images, r.source, r.row
        )
        for r in rows
    ]


# ---- the formats -----------------------------------------------------------------------


def _katz(text: str, path: str) -> list[Arrival]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArgumentError(f"{path}: not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(doc, list):
        raise ArgumentError(
            f"{path}: a Katz trace is a JSON list of requests; this one is a {type(doc).__name__}"
        )
    out = []
    for i, req in enumerate(doc, 1):
        where = f"{path}: request {i}"
        if not isinstance(req, dict):
            raise ArgumentError(f"{where} is a {type(req).__name__}, not an object")
        model = req.get("base_model_id")
        if model is None:
            continue  # the trace's own analysis skips these too
        if not isinstance(model, (str, int)):
            raise ArgumentError(
                f"{where}: base_model_id {model!r} is not an id", field="base_model_id"
            )
        out.append(
            Arrival(
                _seconds(req.get("timestamp"), where, "timestamp"),
                "",
                _ids(req.get("loras"), where, "loras"),
                _ids(req.get("controlnets"), where, "controlnets"),
                source=str(model),
                row=i,
            )
        )
    return out


def _csv(text: str, path: str) -> list[Arrival]:
    reader = csv.DictReader(text.splitlines())
    fields = reader.fieldnames or []
    if all(f in fields for f in _GENTD):
        time_col, model_col = _GENTD
    elif all(f in fields for f in _OURS):
        time_col, model_col = _OURS
    else:
        raise ArgumentError(
            f"{path}: a trace CSV needs the columns {' and '.join(_GENTD)} (GenTD26) or "
            f"{' and '.join(_OURS)} (nostall's); its header is {fields}"
        )
    out = []
    for i, row in enumerate(reader, 2):
        where = f"{path}: row {i}"
        if None in row:
            raise ArgumentError(f"{where} has more fields than the header")
        status = row.get("predict_status")
        if status not in (None, "", "SUCCEED"):
            continue
        model = (row.get(model_col) or "").strip()
        if not model:
            raise ArgumentError(f"{where}: {model_col} is empty", field=model_col)
        loras: tuple[str, ...] = ()
        if row.get("loras"):
            loras = tuple(x for x in row["loras"].split(";") if x)
        elif row.get("num_lora"):
            loras = tuple(f"lora{k}" for k in range(_count(row["num_lora"], where, "num_lora")))
        steps_col = "steps" if "steps" in row else "num_inference_steps"
        images_col = "images" if "images" in row else "num_images_per_prompt"
        out.append(
            Arrival(
                _seconds(row[time_col], where, time_col),
                "",
                loras,
                steps=_count(row.get(steps_col), where, steps_col, low=1),
                images=_count(row.get(images_col), where, images_col, low=1) or 1,
                source=model,
                row=i,
            )
        )
    return out


def _map(rows: list[Arrival], models: list[str], mapping: str, path: str) -> dict[str, str]:
    if mapping == "names":
        known = set(models)
        for r in rows:
            if r.source not in known:
                raise ArgumentError(
                    f"{path}: row {r.row} asks for model {r.source!r}, which is not in the "
                    f"catalog ({', '.join(models)}); pass mapping='rank' to lay the trace's "
                    "models onto the catalog by popularity",
                    field="model",
                    allowed=models,
                )
        return {m: m for m in known}
    ranked = [
        m
        for m, _ in sorted(Counter(r.source for r in rows).items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    return {source: models[k % len(models)] for k, source in enumerate(ranked)}


# ---- fields ----------------------------------------------------------------------------


def _seconds(value: object, where: str, field: str) -> float:
    """A timestamp as seconds: a number (seconds, or milliseconds when it is that
    large), or a date ``2024-11-15 16:57:50`` / ISO 8601 (UTC unless it says)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value) / (1000.0 if value > 1e11 else 1.0)
    if isinstance(value, str) and value.strip():
        s = value.strip()
        try:
            return _seconds(float(s), where, field)
        except ValueError:
            pass
        try:
            t = datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    raise ArgumentError(
        f"{where}: {field} {value!r} is not a time (seconds, milliseconds, or a date such as "
        "2024-11-15 16:57:50)",
        field=field,
    )


def _count(value: object, where: str, field: str, *, low: int = 0) -> int | None:
    """A count field (``30.0`` in GenTD26's CSV is 30); ``None`` when empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x == int(x) and x >= low):
        raise ArgumentError(
            f"{where}: {field} {value!r} is not a whole number >= {low}", field=field
        )
    return int(x)


def _ids(value: object, where: str, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, (str, int)) for x in value):
        raise ArgumentError(f"{where}: {field} {value!r} is not a list of ids", field=field)
    return tuple(str(x) for x in value)


def _check_models(models: Sequence[str]) -> list[str]:
    out = list(models) if not isinstance(models, str) else [models]
    if not out or not all(isinstance(m, str) and m for m in out):
        raise ArgumentError(f"models={models!r} must name at least one catalog pipeline")
    return out


def _at(a: Arrival, t: float) -> Arrival:
    return Arrival(t, a.model, a.loras, a.controlnets, a.steps, a.images, a.source, a.row)
