"""``nostall bench serve``: the worker, the fleet and the embedding service under load,
through real HTTP on loopback.

* **worker**: ``clients`` threads send a mixed stream of three pipelines (FLUX, SDXL,
  SD3 layouts) to ``nostall serve``'s app; a 429 is honoured (the client waits and sends
  again). Checked: every request answered once, with its own model and seed; after the
  first pass over the three pipelines, the share of requests whose switch found every
  component in memory (GPU or pinned host tier). Reported: p50/p99 latency, throughput,
  bytes moved per request; then the same stream through a worker that encodes its
  prompts in an embedding service and switches pipelines in without their text encoders
  (``with_embedding_service``).
* **fleet** (Ray Serve, ``replicas`` workers, one GPU each on a GPU machine): the same
  stream through the router; the share of warm requests routed to a worker already
  holding their pipeline on the device, and throughput against a fleet of one.
* **embed**: 32 clients, one text per request, against the embedding service batching
  one text at a time (token budget = one text) and dynamically (8192 tokens, 5 ms);
  then the end-to-end latency of a cache hit.

With ``size="full"`` (``--size full``) the store is real-size random FLUX.1-dev, SDXL
and SD3-medium (47 GB, written once under ``work``; :func:`nostall.synthetic.full.footprint`
and the disk's room are checked first) and the default parts are issue #18's
(:mod:`nostall.bench.serve_full`): the stream through a plain diffusers worker
(``peer``) and through the worker, alone and with the embedding service in-process and
in a separate process, every image held to the peer's; a soak; the prefetch slowdown.
They run on tiny pipelines too (CI). Each part's result is saved as it ends (``save``),
and a part that fails is reported and the others still run; ``previous`` (an earlier
report of the same configuration) keeps its parts' results, so one long benchmark can
run as several shorter commands.

The report's ``targets`` are issue #11's (tiny: the harness) and issue #18's (full).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nostall.bench.record import header
from nostall.bench.serve_full import FULL_PARTS
from nostall.bench.targets import Targets

__all__ = ["PARTS", "SIZES", "evaluate_targets", "run_serve_bench"]

PIPELINES = ("flux", "sdxl", "sd3")
# Per size: the default parts, then the stream's requests, side in pixels and steps.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"parts": ("worker", "fleet", "embed"), "requests": 96, "res": 128, "steps": 4},
    "full": {"parts": FULL_PARTS, "requests": 64, "res": 512, "steps": 8},
}
PARTS = ("worker", "fleet", "embed", *FULL_PARTS)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q * 100))


def _stream(n: int) -> list[tuple[str, int]]:
    """(pipeline, seed) in a fixed mixed order: runs of 1-3 of one pipeline."""
    import random

    rng = random.Random(0)
    out: list[tuple[str, int]] = [(p, i) for i, p in enumerate(PIPELINES)]  # warm-up pass
    while len(out) < n:
        p = rng.choice(PIPELINES)
        out += [(p, len(out) + k) for k in range(rng.randint(1, 3))]
    return out[:n]


def _drive(url: str, stream, clients: int, size: int, steps: int) -> dict[str, Any]:
    """Send ``stream`` from ``clients`` threads; collect what came back."""
    import httpx

    lock = threading.Lock()
    todo = list(enumerate(stream))
    answers: dict[int, dict[str, Any]] = {}
    rejected = 0

    def client():
        nonlocal rejected
        with httpx.Client(timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    k, (model, seed) = todo.pop(0)
                body = {
                    "model": model,
                    "prompt": f"request {k}",
                    "size": f"{size}x{size}",
                    "steps": steps,
                    "seed": seed,
                }
                if model == "flux":
                    body["max_sequence_length"] = 64
                t = time.perf_counter()
                while True:
                    sent = time.perf_counter()
                    r = c.post(f"{url}/v1/images/generations", json=body)
                    if r.status_code != 429:
                        break
                    with lock:
                        rejected += 1
                    # the worker's estimate of when its queue has room: retrying sooner
                    # only adds 429s
                    time.sleep(float(r.headers.get("retry-after", "1")))
                latency = time.perf_counter() - t
                out = r.json() if r.status_code == 200 else {"error": r.text}
                with lock:
                    answers[k] = {
                        "status": r.status_code,
                        "latency": latency,
                        "model": model,
                        "seed": seed,
                        "body": out,
                        "sent": sent,
                        "done": t + latency,
                        "worker": r.headers.get("x-nostall-worker"),
                        "routed_tier": r.headers.get("x-nostall-routed-tier"),
                    }

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [a for a in answers.values() if a["status"] == 200]
    mixed = sum(
        1
        for a in ok
        if a["body"]["nostall"]["model"] != a["model"] or a["body"]["nostall"]["seed"] != a["seed"]
    )
    lat = [a["latency"] for a in ok]
    return {
        "requests": len(stream),
        "answered_200": len(ok),
        "lost_or_failed": len(stream) - len(ok),
        "mixed_up": mixed,
        "rejected_429_retried": rejected,
        "wall_s": wall,
        "throughput_per_s": len(ok) / wall,
        "latency_p50_s": _pct(lat, 0.5) if lat else None,
        "latency_p99_s": _pct(lat, 0.99) if lat else None,
        "answers": answers,
    }


def _worker_part(models, device, clients, n, size, steps, budgets, log) -> dict[str, Any]:
    """The stream through one worker; then the same stream through a worker that encodes
    its prompts in an embedding service on the same device (``with_embedding_service``:
    the bytes its switches move without the text encoders, its latency)."""
    from nostall.serve.embed import EmbeddingService, create_embed_app
    from nostall.serve.local import BackgroundServer

    res = _worker_run(models, device, clients, n, size, steps, budgets, None)
    log(
        f"worker: {res['answered_200']}/{res['requests']} answered, {res['mixed_up']} mixed up, "
        f"{res['rejected_429_retried']} 429s retried, {res['throughput_per_s']:.2f} req/s, "
        f"p50 {res['latency_p50_s']:.3f} s, p99 {res['latency_p99_s']:.3f} s, warm switches "
        f"from memory {res['warm_switches_from_memory_share']:.2%}, "
        f"{res['moved_bytes_per_request'] / 1e6:.1f} MB moved per request"
    )
    service = EmbeddingService(models, device=device)
    with BackgroundServer(create_embed_app(service)) as embed:
        e = _worker_run(models, device, clients, n, size, steps, budgets, embed.url)
    e["texts_encoded"] = service.stats()["texts_encoded"]
    res["with_embedding_service"] = e
    log(
        f"worker + embedding service: {e['answered_200']}/{e['requests']} answered, "
        f"{e['mixed_up']} mixed up, {e['throughput_per_s']:.2f} req/s, p50 "
        f"{e['latency_p50_s']:.3f} s, {e['moved_bytes_per_request'] / 1e6:.1f} MB moved per "
        f"request (text encoders left out)"
    )
    return res


def _worker_run(models, device, clients, n, size, steps, budgets, embed_url) -> dict[str, Any]:
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    worker = Worker(models, device=device, max_queue=clients // 2, embed_url=embed_url, **budgets)
    with BackgroundServer(create_app(worker)) as srv:
        res = _drive(srv.url, _stream(n), clients, size, steps)
    # every switch and prefetch (which of the two moves a component depends on timing)
    reports = list(worker.cache.reports)
    res["moved_bytes_total"] = sum(r.moved_bytes for r in reports)
    res["moved_bytes_complete"] = len(reports) < worker.cache.reports.maxlen
    # Warm: served after the first served request of its pipeline (the order the worker ran
    # them, not the stream's: 429 retries reorder concurrent clients).
    answers = res.pop("answers")
    served = sorted(
        (a for a in answers.values() if a["status"] == 200),
        key=lambda a: a["body"]["nostall"]["order"],
    )
    seen: set[str] = set()
    warm = []
    for a in served:
        if a["model"] in seen:
            warm.append(a)
        seen.add(a["model"])
    memory, other = [], []
    for a in warm:
        tiers = {c["tier"] for c in a["body"]["nostall"]["switch"]["components"]}
        (memory if tiers <= {"gpu", "device", "host"} else other).append(a)
    res["warm_requests"] = len(warm)
    res["warm_switches_from_memory_share"] = len(memory) / len(warm) if warm else None
    res["warm_switches_not_from_memory"] = [
        {
            "order": a["body"]["nostall"]["order"],
            "model": a["model"],
            "tiers": sorted({c["tier"] for c in a["body"]["nostall"]["switch"]["components"]}),
        }
        for a in other
    ]
    res["moved_bytes_per_request"] = res["moved_bytes_total"] / max(1, len(served))
    return res


def _fleet_part(models, device, clients, n, size, steps, replicas, budgets, log) -> dict:
    import ray
    from ray import serve

    from nostall.serve.fleet import build_fleet
    from nostall.serve.local import free_port

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    try:
        for count in sorted({1, replicas}):
            app = build_fleet(
                str(models),
                replicas=count,
                device=device,
                worker_options={**budgets, "max_queue": clients},
            )
            serve.run(app, name=f"fleet{count}", route_prefix="/")
            res = _drive(url, _stream(n), clients, size, steps)
            serve.delete(f"fleet{count}")
            answers = res.pop("answers")
            # Warm: sent after a first answer for its model came back (then some worker
            # holds it); concurrent clients make the stream's order no guide.
            first: dict[str, float] = {}
            for a in answers.values():
                if a["status"] == 200:
                    first[a["model"]] = min(first.get(a["model"], a["done"]), a["done"])
            warm = [a for a in answers.values() if a["sent"] > first.get(a["model"], float("inf"))]
            holding = [a for a in warm if a["routed_tier"] in ("gpu", "device")]
            res["warm_on_holding_worker_share"] = len(holding) / len(warm) if warm else None
            res["per_worker"] = {
                w: sum(1 for a in answers.values() if a["worker"] == w)
                for w in sorted({a["worker"] for a in answers.values()})
            }
            out[f"replicas_{count}"] = res
            log(
                f"fleet x{count}: {res['throughput_per_s']:.2f} req/s, warm on holding worker "
                f"{res['warm_on_holding_worker_share']:.2%}, per worker {res['per_worker']}"
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    one, many = out.get("replicas_1"), out.get(f"replicas_{replicas}")
    if one and many and replicas > 1:
        out["throughput_vs_one"] = many["throughput_per_s"] / one["throughput_per_s"]
    return out


def write_t5_store(folder: str, device: str, progress=None) -> str:
    """A store holding one "pipeline", ``t5xxl``, with a real-size T5-XXL encoder (random
    weights, bf16, 9.5 GB) and the offline T5 tokenizer: what the embedding part encodes
    with on the GPU machine (the tiny stores' T5 is too small to show batching)."""
    import json

    import torch

    from nostall.synthetic.full import t5_xxl, write_weights
    from nostall.synthetic.tokenizers import t5_tokenizer

    root = os.path.join(folder, "t5xxl")
    sub = os.path.join(root, "text_encoder_2")
    if os.path.exists(os.path.join(root, "model_index.json")):
        return folder
    os.makedirs(sub, exist_ok=True)
    with torch.device("meta"):
        module = t5_xxl()
    module.config.torch_dtype = torch.bfloat16
    module.config.architectures = ["T5EncoderModel"]
    module.config.save_pretrained(sub)
    gen = device if torch.device(device).type == "cuda" else "cpu"
    write_weights(module, sub, "model", torch.bfloat16, torch.device(gen), 7, progress, "t5xxl")
    t5_tokenizer(512).save_pretrained(os.path.join(root, "tokenizer_2"))
    index = {
        "_class_name": "FluxPipeline",
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
    }
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump(index, f)
    return folder


def _embed_part(models, device, encoder, clients, texts_each, log) -> dict[str, Any]:
    import httpx

    from nostall.serve.client import EmbeddingClient
    from nostall.serve.embed import EmbeddingService, create_embed_app
    from nostall.serve.local import BackgroundServer

    max_length = 512 if encoder.endswith("text_encoder_2") else 77
    out: dict[str, Any] = {"encoder": encoder, "clients": clients, "max_length": max_length}
    for label, budget in (("one_at_a_time", max_length), ("batched", 8192)):
        service = EmbeddingService(models, device=device, token_budget=budget, max_wait_s=0.005)
        with BackgroundServer(create_embed_app(service)) as srv:
            with EmbeddingClient(srv.url, timeout=600) as c:
                c.encode(encoder, ["warm-up"], max_length)  # loads the encoder

            def client(i, url=srv.url, label=label):
                with EmbeddingClient(url, timeout=600) as c:
                    for j in range(texts_each):
                        c.encode(encoder, [f"{label} client {i} text {j}"], max_length)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t
            stats = service.stats()
            out[label] = {
                "texts": clients * texts_each,
                "wall_s": wall,
                "texts_per_s": clients * texts_each / wall,
                "batches": stats["batches"] - 1,
            }
            if label == "batched":
                body = {"encoder": encoder, "texts": ["a cached prompt"], "max_length": max_length}
                with httpx.Client() as h:
                    h.post(f"{srv.url}/v1/embeddings", json=body)
                    hits = []
                    for _ in range(50):
                        t1 = time.perf_counter()
                        r = h.post(f"{srv.url}/v1/embeddings", json=body)
                        hits.append(time.perf_counter() - t1)
                        if r.headers.get("x-nostall-cache-hits") != "1":
                            raise RuntimeError(f"a repeated request missed the cache: {r.headers}")
                out["cache_hit_ms_p50"] = _pct(hits, 0.5) * 1e3
        log(
            f"embed {label}: {out[label]['texts_per_s']:.1f} texts/s in {out[label]['batches']} batches"
        )
    out["batching_speedup"] = out["batched"]["texts_per_s"] / out["one_at_a_time"]["texts_per_s"]
    log(
        f"embed: batching {out['batching_speedup']:.2f}x, cache hit {out['cache_hit_ms_p50']:.2f} ms"
    )
    return out


def run_serve_bench(
    *,
    models: str | None = None,
    device: str = "cuda",
    size: str = "tiny",
    parts: tuple[str, ...] | None = None,
    clients: int = 16,
    requests: int | None = None,
    res: int | None = None,
    steps: int | None = None,
    replicas: int = 2,
    encoder: str = "flux/text_encoder_2",
    embed_clients: int = 32,
    texts_each: int = 8,
    soak_s: float = 120.0,
    peer_mode: str = "auto",
    batch: int = 8,
    work: str | None = None,
    log: Callable[[str], None] = print,
    save: Callable[[dict], None] | None = None,
    previous: dict | None = None,
) -> dict:
    """Run the parts (default: the size's, :data:`SIZES`); ``models`` defaults to a store
    of random FLUX, SDXL and SD3 pipelines of ``size`` written into ``work`` (full:
    ``/tmp/nostall-bench/serve`` unless given, kept for the next run)."""
    import gc

    import torch

    from nostall.bench import serve_full
    from nostall.errors import ArgumentError

    if size not in SIZES:
        raise ArgumentError(f"size={size!r}; choose one of {', '.join(SIZES)}")
    cfg = SIZES[size]
    parts = tuple(parts or cfg["parts"])
    bad = sorted(set(parts) - set(PARTS))
    if bad or not parts:
        raise ArgumentError(f"parts must be some of {PARTS}, got {tuple(parts)!r}")
    requests = requests or cfg["requests"]
    res_px = res or cfg["res"]
    steps = steps or cfg["steps"]
    work = work or ("/tmp/nostall-bench/serve" if size == "full" else None)
    work = work or tempfile.mkdtemp(prefix="nostall-serve-")
    os.makedirs(work, exist_ok=True)
    config = {
        "size": size,
        "models": models,
        "clients": clients,
        "requests": requests,
        "res": res_px,
        "steps": steps,
    }
    earlier = {k: (previous or {}).get("config", {}).get(k) for k in config}
    if previous is not None and earlier != config:
        raise ArgumentError(
            f"the earlier report ran {earlier} and this run {config}; its results cannot "
            "be added to another run's (run the same --size, --models, --clients, "
            "--requests, --resolution and --steps)"
        )
    dev = torch.device(device)
    report: dict = {
        **header("serve", dev),
        "config": {
            **config,
            "device": device,
            "parts": list(parts),
            "replicas": replicas,
            "encoder": encoder,
            "embed_clients": embed_clients,
            "texts_each": texts_each,
            "soak_s": soak_s,
            "peer_mode": peer_mode,
            "batch": batch,
            "work": work,
        },
        "results": dict((previous or {}).get("results", {})),
    }
    if previous is not None:
        report["config"]["parts"] = sorted({*previous["config"].get("parts", []), *parts})
        report["store"] = previous.get("store")
    if models is None:
        from nostall.synthetic import write_store

        models = os.path.join(work, "store")
        if size == "full":
            report["store"] = serve_full.write_full_store(models, device, log)
        else:
            write_store(models, PIPELINES)
    run = serve_full.Run(
        str(models),
        device,
        clients,
        requests,
        res_px,
        steps,
        work,
        _stream(requests),
        _drive,
        log,
        batch,
    )
    budgets: dict[str, Any] = {}
    steps_of = {
        "worker": lambda: _worker_part(
            models, device, clients, requests, res_px, steps, budgets, log
        ),
        "fleet": lambda: _fleet_part(
            models, device, clients, requests, res_px, steps, replicas, budgets, log
        ),
        "embed": lambda: _embed_run(models, device, encoder, embed_clients, texts_each, work, log),
        "peer": lambda: serve_full.peer_part(run, peer_mode),
        "stream": lambda: serve_full.stream_part(run),
        "stream-batched": lambda: serve_full.stream_part(run, batch=batch),
        "stream-embed": lambda: serve_full.stream_part(run, "in-process"),
        "stream-embed-process": lambda: serve_full.stream_part(run, "process"),
        "soak": lambda: serve_full.soak_part(run, soak_s),
        "prefetch": lambda: serve_full.prefetch_part(run, size),
    }
    # in PARTS' order: the peer before the stream parts, which hold images to its
    for part in sorted(parts, key=PARTS.index):
        log(f"== {part}")
        t = time.perf_counter()
        try:
            report["results"][part] = steps_of[part]()
        except Exception as e:  # reported; the other parts still run
            report["results"][part] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {part} failed: {type(e).__name__}: {e}")
        report["results"][part]["part_s"] = time.perf_counter() - t
        report["targets"] = evaluate_targets(report)
        if save is not None:
            save(report)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["targets"] = evaluate_targets(report)
    return report


def _embed_run(models, device, encoder, embed_clients, texts_each, work, log) -> dict:
    embed_models = models
    if encoder == "t5xxl/text_encoder_2":  # the real-size encoder, written on demand
        embed_models = write_t5_store(os.path.join(work, "t5store"), device, progress=log)
    return _embed_part(embed_models, device, encoder, embed_clients, texts_each, log)


def evaluate_targets(report: dict) -> dict[str, dict]:
    res = report["results"]
    t = Targets()

    w = res.get("worker", {})
    t.add(
        "worker_lost_or_mixed_up", None if not w else w["lost_or_failed"] + w["mixed_up"], "<=", 0
    )
    t.add(
        "worker_warm_switches_from_memory_share",
        w.get("warm_switches_from_memory_share"),
        ">=",
        1.0,
    )
    f = res.get("fleet", {})
    many = f.get(f"replicas_{report['config'].get('replicas')}", {})
    t.add("fleet_warm_on_holding_worker_share", many.get("warm_on_holding_worker_share"), ">=", 0.9)
    t.add("fleet_throughput_vs_one", f.get("throughput_vs_one"), ">=", 1.8)
    e = res.get("embed", {})
    t.add("embed_batching_speedup", e.get("batching_speedup"), ">=", 4.0)
    t.add("embed_cache_hit_ms", e.get("cache_hit_ms_p50"), "<=", 2.0)
    # issue #18: the mixed stream at real size (the names say full; tiny runs fill them too).
    # Throughput, busy share and tail: the batched stream where it ran (batching is the
    # issue's scheduling item), else the default one; stream_targets_from says which.
    peer = res.get("peer", {})
    # a part that failed outright says so in its own "error" (its requests never ran)
    plain = [res[p] for p in ("stream", "stream-batched") if "requests" in res.get(p, {})]
    counts = [x.get("lost_or_mixed_up") for x in plain]
    t.add(
        "full_worker_lost_or_mixed_up",
        sum(counts) if counts and None not in counts else None,
        "<=",
        0,
    )
    embeds = [res[p] for p in ("stream-embed", "stream-embed-process") if p in res]
    embeds = [x for x in embeds if "requests" in x]
    counts = [x.get("lost_or_mixed_up") for x in embeds]
    t.add(
        "full_worker_with_embed_lost_or_mixed_up",
        sum(counts) if counts and None not in counts else None,
        "<=",
        0,
    )
    s = res.get(stream_targets_from(res) or "stream", {})
    ours, theirs = s.get("throughput_per_s"), peer.get("throughput_per_s")
    t.add(
        "full_throughput_vs_diffusers_worker", ours / theirs if ours and theirs else None, ">=", 4.0
    )
    t.add("full_gpu_busy_share", s.get("gpu_busy_share"), ">=", 0.85)
    t.add("full_p99_over_p50", s.get("p99_over_p50"), "<=", 3.0)
    t.add("full_prefetch_inference_slowdown", res.get("prefetch", {}).get("slowdown"), "<=", 0.05)
    soak = res.get("soak", {})
    t.add("soak_good_requests_lost", soak.get("good", {}).get("lost"), "<=", 0)
    t.add("soak_memory_growth", soak.get("memory_growth"), "<=", 0.01)
    return t


def stream_targets_from(results: dict) -> str | None:
    """The stream part the throughput, busy-share and tail targets are read from: the
    batched one where it ran without failing, else the default one (``None``: neither)."""
    for part in ("stream-batched", "stream"):
        if "requests" in results.get(part, {}):
            return part
    return None


def tables(report: dict) -> list:
    """What ``nostall bench serve`` prints after a run: the mixed stream through each
    server (where it ran), then the targets."""
    from rich.table import Table

    from nostall.bench import targets

    res = report["results"]
    batch = report["config"].get("batch", "")
    rows = [
        (label, r)
        for label, part in (
            ("diffusers worker (peer)", "peer"),
            ("worker", "stream"),
            (f"worker, batches up to {batch}", "stream-batched"),
            ("worker + embedding service in-process", "stream-embed"),
            ("worker + embedding service process", "stream-embed-process"),
        )
        if "requests" in (r := res.get(part, {}))
    ]
    stream = Table(title="the mixed stream, same run", title_justify="left")
    for col in ("server", "answered", "wrong images", "req/s", "p50 s", "p99 s", "GPU busy"):
        stream.add_column(col, justify="left" if col == "server" else "right")
    for label, r in rows:
        wrong = r.get("wrong_images", "") if r.get("images", {}).get("checked") else "-"
        busy = r.get("gpu_busy_share")
        stream.add_row(
            label,
            f"{r['answered_200']}/{r['requests']}",
            str(wrong),
            f"{r['throughput_per_s']:.3f}",
            f"{r['latency_p50_s'] or 0:.2f}",
            f"{r['latency_p99_s'] or 0:.2f}",
            "" if busy is None else f"{busy:.1%}",
        )
    models = Table(
        title="where the worker's time went (medians per pipeline call)", title_justify="left"
    )
    for col in ("stream", "pipeline", "requests", "calls", "text s", "denoise s", "decode s"):
        models.add_column(col, justify="left" if col in ("stream", "pipeline") else "right")
    for label, r in rows:
        for name, m in r.get("by_model", {}).items():
            med = m["median_s"]
            models.add_row(
                label,
                name,
                str(m["requests"]),
                str(m["calls"]),
                *(f"{med.get(k, 0.0):.3f}" for k in ("text", "denoise", "decode")),
            )
    rows_by_model = [models] if models.row_count else []
    return [stream] * bool(rows) + rows_by_model + [targets.table(report["targets"])]
