"""Reference images for the serve bench's stream: one per (model, seed), kept on disk,
and each answer held to its own.

The diffusers peer (:mod:`nostall.bench.serve_peer`) makes them, one request at a time;
a worker's answer is right when its image is much nearer its own reference than any
other's. The comparison runs on block means (at most 64×64 per image, the mean absolute
difference in levels of 255): a batch or an embedding computed elsewhere moves a few
pixels by a level or two, another seed or another model moves the whole image (random
pipelines' images differ by ~50 levels, see :mod:`nostall.synthetic.full`). References
that do not differ from each other cannot tell a mix-up: :func:`check` says so rather
than pass it.
"""

from __future__ import annotations

import base64
import io
import json
import os
from typing import Any

import numpy as np

__all__ = ["check", "decode", "load", "save"]

_SIDE = 64  # block means per side at most
_DISTINCT = 2.0  # references closer than this (levels) cannot tell images apart
_RIGHT = 0.5  # an answer is right within this share of the distance to the nearest other


def decode(b64: str) -> np.ndarray:
    """uint8 (H, W, 3) from a base64 PNG."""
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB"))


def _blocks(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    k = max(1, max(h, w) // _SIDE)
    h, w = h // k * k, w // k * k
    x = img[:h, :w].astype(np.float32)
    return x.reshape(h // k, k, w // k, k, -1).mean(axis=(1, 3))


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).mean())


def save(folder: str, images: dict[tuple[str, int], str], meta: dict[str, Any]) -> None:
    """Write ``images`` (``(model, seed) → base64 PNG``) and ``meta`` (what they were made
    with) under ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for (model, seed), b64 in images.items():
        with open(os.path.join(folder, f"{model}-{seed}.png"), "wb") as f:
            f.write(base64.b64decode(b64))
    tmp = os.path.join(folder, "meta.json.partial")
    with open(tmp, "w") as f:
        json.dump({**meta, "count": len(images)}, f, indent=2)
    os.replace(tmp, os.path.join(folder, "meta.json"))


def load(folder: str, meta: dict[str, Any]) -> dict[tuple[str, int], np.ndarray] | None:
    """The references under ``folder`` if they were made with ``meta``; None otherwise."""
    from PIL import Image

    try:
        with open(os.path.join(folder, "meta.json")) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    if {k: got.get(k) for k in meta} != meta:
        return None
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".png"):
            model, _, seed = name[:-4].rpartition("-")
            with Image.open(os.path.join(folder, name)) as im:
                out[(model, int(seed))] = np.asarray(im.convert("RGB"))
    return out


def check(
    answers: list[dict[str, Any]], refs: dict[tuple[str, int], np.ndarray] | None
) -> dict[str, Any]:
    """Hold each answer (``{"model", "seed", "b64"}``) to its reference: ``checked``
    (False when there are none, or they are too alike to tell apart), ``wrong`` (the
    answers nearer another reference, or with none of their own), ``own_max`` (the
    largest distance of a right answer to its reference) and ``references_min`` (the
    least distance between two references)."""
    if not refs:
        return {"checked": False, "why": "no references for this stream", "wrong": []}
    keys = sorted(refs)
    blocks = {k: _blocks(refs[k]) for k in keys}
    nearest = min(
        (_distance(blocks[a], blocks[b]) for i, a in enumerate(keys) for b in keys[i + 1 :]),
        default=float("inf"),
    )
    if nearest < _DISTINCT:
        return {
            "checked": False,
            "why": f"references differ by {nearest:.2f} levels only",
            "references_min": nearest,
            "wrong": [],
        }
    wrong, own_max = [], 0.0
    for a in answers:
        key = (a["model"], a["seed"])
        if key not in blocks:
            wrong.append({**_key(a), "why": "no reference for it"})
            continue
        img = _blocks(decode(a["b64"]))
        own = _distance(img, blocks[key])
        other = min((_distance(img, blocks[k]) for k in keys if k != key), default=float("inf"))
        if own <= _RIGHT * other:
            own_max = max(own_max, own)
        else:
            far = None if other == float("inf") else other
            wrong.append(
                {**_key(a), "own": None if own == float("inf") else own, "nearest_other": far}
            )
    return {
        "checked": True,
        "wrong": wrong,
        "own_max": own_max,
        "references_min": None if nearest == float("inf") else nearest,
    }


def _key(a: dict[str, Any]) -> dict[str, Any]:
    return {"model": a["model"], "seed": a["seed"]}
