"""The serve bench's soak: minutes of mixed traffic, bad requests and clients that leave,
against one worker; what got lost and what memory grew.

``clients`` threads send until the time is up. Each request is, at random:

* 85% good: one of the models, a seed of its own, the stream's size and steps. A 429,
  or a 503 with ``Retry-After`` (no room, out of device memory twice), is retried after
  the time it asks (the documented behaviour); anything but a 200 carrying its own
  model and seed at the end is **lost**;
* 10% bad, each kind a fault a client makes (:data:`BAD`): they must be answered 4xx,
  never 5xx (which would say the worker failed) or 2xx (which would say it was not
  checked);
* 5% a client that leaves: a good request whose client closes the connection after
  0.05–1.5 s, queued or running.

Memory is sampled (``sample``: name → bytes) after ``settle`` (the same requests, one at
a time, before and after, so the same pipelines were used last) once the warm-up is over
and again at the end; ``growth`` is each figure's relative change.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["BAD", "run_soak"]

BAD = (
    "steps_zero",
    "odd_size",
    "unknown_model",
    "malformed_json",
    "long_sequence",
    "string_steps",
)
_GOOD, _BAD = 0.85, 0.10  # the rest leave early
_GRACE_S = 120.0  # how long after the end a good request may still be retried


def _bad(kind: str, models: list[str], res: int, steps: int) -> dict[str, Any]:
    """``{"json": body}`` or ``{"content": bytes}`` for a request of fault ``kind``."""
    model = "flux" if "flux" in models else models[0]
    body: dict[str, Any] = {
        "model": model,
        "prompt": f"bad {kind}",
        "size": f"{res}x{res}",
        "steps": steps,
        "seed": 1,
    }
    if kind == "steps_zero":
        body["steps"] = 0
    elif kind == "odd_size":
        body["size"] = f"{res + 3}x{res}"
    elif kind == "unknown_model":
        body["model"] = "no-such-model"
    elif kind == "malformed_json":
        return {"content": b'{"model": "' + model.encode() + b'", "prompt": '}
    elif kind == "long_sequence":  # beyond T5's 512 (FLUX's check_inputs refuses it)
        body["max_sequence_length"] = 100_000
    elif kind == "string_steps":  # a number as a string: strict types refuse it
        body["steps"] = str(steps)
    return {"json": body}


def run_soak(
    url: str,
    *,
    models: list[str],
    duration_s: float,
    clients: int,
    res: int,
    steps: int,
    settle: Callable[[], None],
    sample: Callable[[], dict[str, int]],
    log: Callable[[str], None] = print,
    seed: int = 0,
) -> dict[str, Any]:
    """Soak the worker at ``url`` for ``duration_s``; the report (see the module)."""
    import httpx

    endpoint = f"{url}/v1/images/generations"
    settle()
    warm = sample()
    lock = threading.Lock()
    seeds = itertools.count(10_000_000)
    good = Counter()
    lost_statuses: Counter = Counter()
    bad: dict[str, Counter] = {k: Counter() for k in BAD}
    leaving = Counter()
    retried = Counter()
    unexpected: Counter = Counter()
    t0 = time.monotonic()
    end = t0 + duration_s

    def good_one(c, rng) -> None:
        with lock:
            s = next(seeds)
        model = rng.choice(models)
        body = {
            "model": model,
            "prompt": f"soak {s}",
            "size": f"{res}x{res}",
            "steps": steps,
            "seed": s,
        }
        if model == "flux":
            body["max_sequence_length"] = 64
        status = None
        try:
            while True:
                r = c.post(endpoint, json=body)
                status = r.status_code
                wait = r.headers.get("retry-after")
                if status not in (429, 503) or wait is None or time.monotonic() > end + _GRACE_S:
                    break
                with lock:
                    retried[str(status)] += 1
                try:
                    seconds = float(wait)
                except ValueError:  # an HTTP date: not what a worker sends; a second
                    seconds = 1.0
                time.sleep(min(seconds, 30.0))  # as asked: the documented behaviour
        except httpx.HTTPError as e:
            status = type(e).__name__
        ok = False
        if status == 200:  # its own image: the model and seed it asked for
            try:
                info = r.json().get("nostall", {})
            except ValueError:  # not the JSON answer asked for: lost
                info = {}
            ok = info.get("model") == model and info.get("seed") == s
        with lock:
            good["sent"] += 1
            good["ok" if ok else "lost"] += 1
            if not ok:
                lost_statuses[str(status)] += 1

    def bad_one(c, rng) -> None:
        kind = rng.choice(BAD)
        try:
            status = str(c.post(endpoint, **_bad(kind, models, res, steps)).status_code)
        except httpx.HTTPError as e:
            status = type(e).__name__
        with lock:
            bad[kind][status] += 1

    def leave_one(rng) -> None:
        with lock:
            s = next(seeds)
        body = {
            "model": rng.choice(models),
            "prompt": f"leaves {s}",
            "size": f"{res}x{res}",
            "steps": steps,
            "seed": s,
        }
        after = rng.uniform(0.05, 1.5)
        # its own connection, closed when the client gives up: the server sees it leave
        with httpx.Client(timeout=httpx.Timeout(30.0, read=after)) as c:
            try:
                c.post(endpoint, json=body)
                outcome = "answered_first"
            except httpx.TimeoutException:
                outcome = "left"
            except httpx.HTTPError:
                outcome = "failed"
        with lock:
            leaving["sent"] += 1
            leaving[outcome] += 1

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=600) as c:
            while time.monotonic() < end:
                x = rng.random()
                try:
                    if x < _GOOD:
                        good_one(c, rng)
                    elif x < _GOOD + _BAD:
                        bad_one(c, rng)
                    else:
                        leave_one(rng)
                except Exception as e:  # an answer this loop did not expect: counted
                    with lock:
                        unexpected[f"{type(e).__name__}: {e}"[:200]] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    settle()
    final = sample()
    growth = {k: (final[k] - warm[k]) / warm[k] for k in warm if warm[k] and k in final}
    statuses = [s for c in bad.values() for s in c.elements()]
    out = {
        "duration_s": wall,
        "clients": clients,
        "good": {
            "sent": good["sent"],
            "ok": good["ok"],
            "lost": good["lost"],
            "lost_statuses": dict(lost_statuses),
        },
        "good_per_s": good["ok"] / wall,
        "bad": {k: dict(c) for k, c in bad.items()},
        "bad_sent": len(statuses),
        "bad_answered_4xx": sum(1 for s in statuses if s.startswith("4")),
        "bad_answered_5xx": sum(1 for s in statuses if s.startswith("5")),
        "bad_answered_2xx": sum(1 for s in statuses if s.startswith("2")),
        "leaving": dict(leaving),
        "retried": dict(retried),
        "unexpected": dict(unexpected),
        "memory": {"after_warm_up": warm, "end": final, "growth": growth},
        "memory_growth": max(
            (growth[k] for k in ("gpu_allocated", "host_pinned") if k in growth), default=None
        ),
    }
    log(
        f"soak {wall:.0f} s: {good['ok']}/{good['sent']} good answered, {good['lost']} lost "
        f"{dict(lost_statuses)}; bad {out['bad_answered_4xx']} 4xx / "
        f"{out['bad_answered_5xx']} 5xx / {out['bad_answered_2xx']} 2xx; "
        f"{leaving['left']} clients left; memory growth {growth}"
    )
    return out
