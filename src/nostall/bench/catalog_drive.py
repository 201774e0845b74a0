"""One pass of the catalog benchmark: a stream sent open-loop to a server, and its figures.

:func:`send` sends each :class:`~nostall.bench.workload.Arrival` at its time (from its own
thread, whatever the server has answered so far: an open-loop client, as production
traffic is), with its SLO as ``slo_ms`` where the server takes one. A 429 is retried after
its ``Retry-After`` without the SLO (best effort: the request is late, not lost), up to
:data:`RETRIES` times; a request with no 200 in the end is lost. :func:`figures` turns
the answers into what the report compares: SLO attainment (answered within its SLO,
counted from its first arrival), goodput, latency percentiles, the seconds the GPU waited
for weights (each answer's ``switch`` phase, summed) and the GPU's busy share.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from nostall.bench.workload import Arrival

__all__ = ["RETRIES", "figures", "send", "switch_tiers"]

RETRIES = 8  # 429s a request may get before it counts as lost
_TIERS = ("disk", "host")  # the slowest tier a switch read from names it


def _body(a: Arrival, k: int, res: int, steps: int, slo_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": a.model,
        "prompt": f"request {k}",
        "size": f"{res}x{res}",
        "steps": a.steps or steps,
        "seed": k,
    }
    if a.model.startswith("flux"):
        body["max_sequence_length"] = 64
    if slo_s is not None:
        body["slo_ms"] = max(1, int(slo_s * 1000))
    return body


def send(
    url: str,
    stream: Sequence[Arrival],
    *,
    res: int,
    steps: int,
    slo_s: dict[str, float],
    send_slo: bool,
    seed: int = 0,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Send ``stream`` to ``url``'s images endpoint open-loop; ``{"wall_s", "answers"}``,
    one answer per arrival in stream order (``model``, ``seed``, ``slo_s``, ``status``,
    ``latency_s`` from the first arrival, ``retries``, ``nostall`` (the answer's
    ``nostall`` object) and ``b64``). ``send_slo``: put ``slo_ms`` in the bodies; request
    ``k`` has seed ``seed + k``."""
    import httpx

    answers: list[dict[str, Any] | None] = [None] * len(stream)
    limits = httpx.Limits(max_connections=len(stream) + 4, max_keepalive_connections=32)
    with httpx.Client(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        def one(k: int, a: Arrival) -> None:
            delay = start + a.at_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sent = time.perf_counter()
            slo = slo_s.get(a.model)
            out: dict[str, Any] = {"model": a.model, "seed": seed + k, "slo_s": slo, "retries": 0}
            body = _body(a, seed + k, res, steps, slo if send_slo else None)
            while True:
                try:
                    r = client.post(f"{url}/v1/images/generations", json=body)
                except httpx.HTTPError as e:
                    out.update(status=None, error=f"{type(e).__name__}: {e}")
                    break
                if r.status_code == 429 and out["retries"] < RETRIES:
                    out["retries"] += 1
                    body.pop("slo_ms", None)  # late now: served best effort, not dropped
                    time.sleep(_retry_after(r.headers.get("retry-after")))
                    continue
                out["status"] = r.status_code
                if r.status_code == 200:
                    got = r.json()
                    out["nostall"] = got.get("nostall", {})
                    out["b64"] = got["data"][0]["b64_json"]
                else:
                    out["error"] = r.text[:300]
                break
            out["latency_s"] = time.perf_counter() - sent
            answers[k] = out

        threads = [
            threading.Thread(target=one, args=(k, a), daemon=True) for k, a in enumerate(stream)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    return {"wall_s": wall, "answers": answers}


def _retry_after(value: str | None) -> float:
    try:
        s = float(value) if value is not None else 1.0
    except ValueError:
        s = 1.0
    return min(max(s, 0.05), 30.0) if math.isfinite(s) else 1.0


def switch_tiers(answers: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Switches (answers whose weights were not all on the device) by the slowest tier
    they read from, ``disk`` or ``host``, from nostall's switch reports (each component's
    tier); a peer's answers name no components: a switch that took time read its CPU
    copies (``host``)."""
    out: Counter = Counter()
    for a in answers:
        info = a.get("nostall") or {}
        comps = (info.get("switch") or {}).get("components") or []
        tiers = {c.get("tier") for c in comps}
        if not comps and info.get("phases", {}).get("switch", 0.0) > 0:
            tiers = {"host"}
        tier = next((t for t in _TIERS if t in tiers), None)
        if tier is not None:
            out[tier] += 1
    return dict(out)


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """A pass's figures from :func:`send`'s result (answers left out)."""
    answers = result["answers"]
    wall = result["wall_s"]
    ok = [a for a in answers if a.get("status") == 200]
    lat = [a["latency_s"] for a in ok]
    met = [a for a in ok if a["slo_s"] is not None and a["latency_s"] <= a["slo_s"]]
    phases = [(a.get("nostall") or {}).get("phases", {}) for a in ok]
    stall = sum(p.get("switch", 0.0) for p in phases)
    # the time each answered request spent being computed (and encoded): neither
    # waiting in the queue nor for its weights
    busy = sum(
        max(0.0, p.get("total", 0.0) - p.get("queue", 0.0) - p.get("switch", 0.0)) for p in phases
    )
    n = len(answers)
    tiers = switch_tiers(ok)
    return {
        "requests": n,
        "answered_200": len(ok),
        "lost": n - len(ok),
        "statuses": dict(Counter(str(a.get("status")) for a in answers)),
        "retried": sum(1 for a in answers if a.get("retries")),
        "wall_s": wall,
        "slo_attainment": len(met) / n if n else None,
        "goodput_per_s": len(met) / wall if wall > 0 else None,
        "throughput_per_s": len(ok) / wall if wall > 0 else None,
        "latency_p50_s": float(np.percentile(lat, 50)) if lat else None,
        "latency_p99_s": float(np.percentile(lat, 99)) if lat else None,
        "weights_stall_s": stall,
        "switches": sum(tiers.values()),
        "switch_tiers": tiers,
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / wall if wall > 0 else None,
        "by_model": {
            m: {
                "requests": sum(1 for a in answers if a["model"] == m),
                "slo_s": next(a["slo_s"] for a in answers if a["model"] == m),
                "met": sum(1 for a in met if a["model"] == m),
            }
            for m in sorted({a["model"] for a in answers})
        },
    }
