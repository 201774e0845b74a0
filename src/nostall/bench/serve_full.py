"""The mixed-stream parts of ``nostall bench serve`` (issue #18): real-size FLUX.1-dev,
SDXL and SD3-medium with ``--size full`` on one H200, tiny ones on a CPU for CI.

* ``peer``: the stream through a plain diffusers worker with the worker's HTTP shape
  (:mod:`nostall.bench.serve_peer`; pipelines in CPU memory moved with ``.to()``, or
  ``from_pretrained`` per switch, whichever a probe finds faster). Its images are the
  stream's references, kept under ``<work>/references`` for a later run's parts.
* ``stream``: the same stream through ``nostall serve``'s worker and app: every answer
  checked for its model, its seed and its image against the reference
  (:mod:`nostall.bench.references`: a wrong image counts as mixed up); throughput,
  p50/p99 latency, and the GPU's busy share: the worker's CUDA-event-timed denoise and
  decode of each job, summed, over the stream's wall time.
* ``stream-batched``: the same with the worker batching like requests
  (``Policy(batch=run.batch)``; every other part runs the default, one request per call).
* ``stream-embed``: the same with the embedding service in this process (one device
  budget for both where this nostall has one); ``stream-embed-process``: with the
  service as a separate ``nostall embed-server`` process on the same device, its
  encoders loaded before the worker sizes its budget.
* ``soak``: :mod:`nostall.bench.soak` against the worker alone.
* ``prefetch``: ``nostall bench switch --part prefetch`` on this store (``full-lean``:
  FLUX denoising while SDXL is prefetched; ``tiny`` in a folder of its own).

Every worker runs with its default budgets: the benchmark measures what a user gets.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from nostall.bench import references

__all__ = [
    "FULL_PARTS",
    "PIPELINES",
    "Run",
    "peer_part",
    "prefetch_part",
    "soak_part",
    "stream_part",
    "write_full_store",
]

FULL_PARTS = (
    "peer",
    "stream",
    "stream-batched",
    "stream-embed",
    "stream-embed-process",
    "soak",
    "prefetch",
)
PIPELINES = ("flux", "sdxl", "sd3")
_WARM_SEED = 1_000_000  # warm-up and settling requests: seeds the stream never uses


@dataclass(frozen=True)
class Run:
    """What the parts share. ``drive(url, stream, clients, res, steps)`` sends ``stream``
    (``[(model, seed)]``, prompt ``"request {k}"``) from ``clients`` threads and returns
    its figures with every answer under ``"answers"``."""

    store: str
    device: str
    clients: int
    requests: int
    res: int
    steps: int
    work: str
    stream: list[tuple[str, int]]
    drive: Callable[..., dict[str, Any]]
    log: Callable[[str], None]
    batch: int = 8  # the stream-batched part's batch cap

    @property
    def refs(self) -> str:
        return os.path.join(self.work, "references", f"{self.res}px-{self.steps}steps")

    @property
    def refs_meta(self) -> dict[str, Any]:
        return {
            "store": os.path.abspath(self.store),
            "res": self.res,
            "steps": self.steps,
            "stream": [list(x) for x in self.stream],
        }

    def body(self, model: str, seed: int, prompt: str) -> dict[str, Any]:
        body = {
            "model": model,
            "prompt": prompt,
            "size": f"{self.res}x{self.res}",
            "steps": self.steps,
            "seed": seed,
        }
        if model == "flux":
            body["max_sequence_length"] = 64
        return body


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    except OSError:
        return {}


def _written(folder: str, names: tuple[str, ...]) -> list[str]:
    """The pipelines of ``names`` already written at real size under ``folder``."""
    out = []
    for name in names:
        try:
            with open(os.path.join(folder, name, "nostall-store.json")) as f:
                if json.load(f) == {"size": "full", "name": name}:
                    out.append(name)
        except (OSError, ValueError):
            pass
    return out


def write_full_store(folder: str, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The real-size FLUX.1-dev, SDXL and SD3-medium pipelines under ``folder`` (written,
    or kept from an earlier run), after checking the disk takes them; what they take on
    disk and in memory beside what the host has."""
    from nostall.memory.host import memory_limit
    from nostall.synthetic import write_store
    from nostall.synthetic.full import check_room, footprint

    need = check_room(folder, PIPELINES, tuple(_written(folder, PIPELINES)))
    fp = footprint(PIPELINES)
    log(
        f"store {folder}: {fp['disk_bytes'] / 1e9:.1f} GB on disk ({need / 1e9:.1f} GB to "
        f"write), {fp['distinct_bytes'] / 1e9:.1f} GB distinct in a cache's tiers, "
        f"{fp['separate_bytes'] / 1e9:.1f} GB as separate diffusers pipelines"
    )
    t = time.perf_counter()
    write_store(folder, PIPELINES, size="full", device=device, progress=log)
    ram = memory_limit()[0]
    return {
        **fp,
        "written_bytes": need,
        "write_s": time.perf_counter() - t,
        "ram_bytes": ram,
        "fits": {
            "disk": True,  # check_room refused it otherwise
            "host_tier_in_half_the_ram": None if not ram else fp["distinct_bytes"] <= ram / 2,
            "peer_pipelines_in_ram": None if not ram else fp["separate_bytes"] <= 0.8 * ram,
        },
    }


def _warm_up(url: str, run: Run, names: list[str], seed: int = _WARM_SEED) -> list[dict]:
    """One request per pipeline, one at a time (each its first switch and first run)."""
    import httpx

    out = []
    with httpx.Client(timeout=1800) as c:
        for i, name in enumerate(names):
            t = time.perf_counter()
            r = c.post(
                f"{url}/v1/images/generations", json=run.body(name, seed + i, f"warm-up {name}")
            )
            out.append(
                {"model": name, "status": r.status_code, "latency_s": time.perf_counter() - t}
            )
            if r.status_code != 200:
                out[-1]["error"] = r.text[:500]
                run.log(f"  warm-up {name}: {r.status_code} {r.text[:200]}")
    return out


def _answers(answers: dict[int, dict]) -> list[dict[str, Any]]:
    return [
        {"model": a["model"], "seed": a["seed"], "b64": a["body"]["data"][0]["b64_json"]}
        for a in answers.values()
        if a["status"] == 200
    ]


def peer_part(run: Run, mode: str = "auto") -> dict[str, Any]:
    """The stream through the diffusers peer; its images saved as the references."""
    from nostall.bench.serve_peer import PeerWorker, create_peer_app, pipeline_bytes, probe
    from nostall.errors import ArgumentError
    from nostall.memory.host import memory_limit
    from nostall.serve.local import BackgroundServer

    folders = {n: os.path.join(run.store, n) for n in PIPELINES}
    need = sum(pipeline_bytes(f) for f in folders.values())
    limit = memory_limit()[0]
    out: dict[str, Any] = {
        "cpu_bytes_to_hold_all": need,
        "memory_limit": limit,
        "ram_available": _meminfo().get("MemAvailable"),
    }
    if mode != "from_pretrained" and limit and need > 0.85 * limit:
        why = (
            f"the pipelines take {need / 1e9:.1f} GB in CPU memory and this process "
            f"may use {limit / 1e9:.1f} GB"
        )
        if mode == "to":
            raise ArgumentError(f"peer mode 'to': {why}; use --peer-mode from_pretrained")
        mode, out["mode_why"] = "from_pretrained", why
    if mode == "auto":
        out["probe"], peer = probe(folders, PIPELINES, run.device)
        mode = out["probe"]["faster"]
        run.log(
            f"  peer switches (flux→sdxl→sd3→flux): from_pretrained "
            f"{out['probe']['from_pretrained']['sum_s']:.2f} s, .to() "
            f"{out['probe']['to']['sum_s']:.2f} s; the stream uses {mode}"
        )
        if mode != "to":
            peer.close()
            peer = PeerWorker(folders, device=run.device, mode=mode)
    else:
        peer = PeerWorker(folders, device=run.device, mode=mode)
        peer.load()
    out["mode"] = mode
    try:
        with BackgroundServer(create_peer_app(peer)) as srv:
            out["warm_up"] = _warm_up(srv.url, run, list(PIPELINES))
            res = run.drive(srv.url, run.stream, run.clients, run.res, run.steps)
    finally:
        peer.close()
    answers = res.pop("answers")
    ok = _answers(answers)
    references.save(run.refs, {(a["model"], a["seed"]): a["b64"] for a in ok}, run.refs_meta)
    phases = [a["body"]["nostall"]["phases"] for a in answers.values() if a["status"] == 200]
    out.update(res)
    out["switches"] = sum(1 for p in phases if p["switch"] > 0)
    out["switch_s_total"] = sum(p["switch"] for p in phases)
    out["run_s_total"] = sum(p["run"] for p in phases)
    out["references"] = {"folder": run.refs, "count": len(ok)}
    run.log(
        f"peer ({mode}): {res['answered_200']}/{res['requests']} answered, "
        f"{res['throughput_per_s']:.3f} req/s, {out['switches']} switches "
        f"{out['switch_s_total']:.1f} s, p50 {res['latency_p50_s'] or 0:.2f} s"
    )
    return out


def _one_budget(device: str) -> dict[str, Any]:
    """One device budget for a worker and an embedding service in one process, where this
    nostall has it (issue #18, item 1); before it each sized its own."""
    try:
        from nostall.serve.budget import DeviceBudget
    except ImportError:
        return {}
    return {"budget": DeviceBudget(device)}


def _embed_process(run: Run, stack: contextlib.ExitStack) -> str:
    """``nostall embed-server`` on this store and device, in a process of its own; its
    URL once it answers. Stopped (SIGTERM) when ``stack`` closes."""
    import httpx

    from nostall.errors import ServeError
    from nostall.serve.local import free_port

    port = free_port()
    path = os.path.join(run.work, f"embed-server-{port}.log")
    logf = stack.enter_context(open(path, "w"))  # noqa: SIM115 (closed with the stack)
    cmd = [
        sys.executable,
        "-m",
        "nostall.cli",
        "embed-server",
        "--models",
        run.store,
        "--device",
        run.device,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(path) as f:
                tail = f.read()[-2000:]
            raise ServeError(f"the embedding service process did not start ({cmd}): {tail}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a process that is starting, within the deadline


def _warm_encoders(url: str) -> dict[str, Any]:
    """Every encoder of the service loaded (one text each), so its device memory is taken
    before a worker sizes its own."""
    import httpx

    with httpx.Client(timeout=900) as c:
        names = sorted(c.get(f"{url}/stats").json()["encoders"])
        statuses = {
            n: c.post(f"{url}/v1/embeddings", json={"encoder": n, "texts": ["warm-up"]}).status_code
            for n in names
        }
    return statuses


def _busy_s(ok: list[dict]) -> float:
    """Seconds of denoising and decoding, each job once (requests run in one batch report
    the same job's phases)."""
    jobs = set()
    for a in ok:
        p = a["body"]["nostall"]["phases"]
        jobs.add((a["model"], p.get("denoise", 0.0), p.get("decode", 0.0)))
    return float(sum(denoise + decode for _, denoise, decode in jobs))


def _by_model(ok: list[dict]) -> dict[str, dict[str, Any]]:
    """Per pipeline: its jobs' median phases (each job once), and how many requests ran
    in batches of each size: where a stream's time went."""
    jobs: dict[str, dict[tuple, dict]] = {}
    for a in ok:
        p = a["body"]["nostall"]["phases"]
        key = (p.get("denoise", 0.0), p.get("decode", 0.0), p.get("switch", 0.0))
        jobs.setdefault(a["model"], {}).setdefault(key, {"phases": p, "requests": 0})
        jobs[a["model"]][key]["requests"] += 1
    out: dict[str, dict[str, Any]] = {}
    for model, runs in sorted(jobs.items()):
        phases = [r["phases"] for r in runs.values()]
        names = sorted({k for p in phases for k in p if k not in ("queue", "total")})
        out[model] = {
            "requests": sum(r["requests"] for r in runs.values()),
            "calls": len(runs),
            "requests_per_call": dict(Counter(str(r["requests"]) for r in runs.values())),
            "median_s": {k: float(np.median([p.get(k, 0.0) for p in phases])) for k in names},
        }
    return out


def stream_part(run: Run, embed: str | None = None, *, batch: int = 1) -> dict[str, Any]:
    """The stream through the worker: alone (``embed`` None), with the embedding service
    ``"in-process"`` or in a separate ``"process"``; ``batch``: the worker's batch cap."""
    import httpx

    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.schedule import Policy
    from nostall.serve.worker import Worker

    refs = references.load(run.refs, run.refs_meta)
    budget = _one_budget(run.device) if embed == "in-process" else {}
    out: dict[str, Any] = {"embedding_service": embed, "batch": batch}
    with contextlib.ExitStack() as stack:
        url = None
        if embed == "in-process":
            from nostall.serve.embed import EmbeddingService, create_embed_app

            service = EmbeddingService(run.store, device=run.device, **budget)
            url = stack.enter_context(BackgroundServer(create_embed_app(service))).url
        elif embed == "process":
            url = _embed_process(run, stack)
        if url:
            out["encoders_warmed"] = _warm_encoders(url)
        worker = Worker(
            run.store,
            device=run.device,
            max_queue=run.clients,
            embed_url=url,
            schedule=Policy(batch=batch),
            **budget,
        )
        with BackgroundServer(create_app(worker)) as srv:
            names = [n for n in PIPELINES if n in worker.names()]
            out["warm_up"] = _warm_up(srv.url, run, names)
            res = run.drive(srv.url, run.stream, run.clients, run.res, run.steps)
            status = worker.status()
        if url:
            stats = httpx.get(f"{url}/stats", timeout=60).json()
            out["texts_encoded"] = stats.get("texts_encoded")
    answers = res.pop("answers")
    served = [a for a in answers.values() if a["status"] == 200]
    images = references.check(_answers(answers), refs)
    lat = [a["latency"] for a in served]
    out.update(res)
    out["statuses"] = dict(Counter(str(a["status"]) for a in answers.values()))
    out["images"] = images
    out["wrong_images"] = len(images["wrong"])
    out["lost_or_mixed_up"] = (
        res["lost_or_failed"] + res["mixed_up"] + len(images["wrong"])
        if images["checked"]
        else None
    )
    out["gpu_busy_s"] = _busy_s(served)
    out["gpu_busy_share"] = out["gpu_busy_s"] / res["wall_s"]
    out["p99_over_p50"] = float(np.percentile(lat, 99) / np.percentile(lat, 50)) if lat else None
    out["by_model"] = _by_model(served)
    out["worker"] = {k: status.get(k) for k in ("device", "gpu", "host", "budget", "unavailable")}
    run.log(
        f"worker{f' + embedding service ({embed})' if embed else ''}"
        f"{f', batches up to {batch}' if batch > 1 else ''}: "
        f"{res['answered_200']}/{res['requests']} answered, {res['mixed_up']} mixed up, "
        f"{out['wrong_images']} wrong images"
        f"{'' if images['checked'] else ' (images not checked: ' + images['why'] + ')'}, "
        f"{res['throughput_per_s']:.3f} req/s, p99/p50 {out['p99_over_p50'] or 0:.2f}, "
        f"GPU busy {out['gpu_busy_share']:.1%}"
    )
    return out


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _memory(worker: Any) -> dict[str, int]:
    """What the soak watches: device memory allocated (a CPU worker: its device tier) and
    pinned host memory (the cache's host tier and torch's pinned blocks); RSS beside."""
    import torch

    gc.collect()
    stats = worker.cache.stats()
    out = {"host_pinned": stats.host_bytes, "rss": _rss()}
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
        out["gpu_allocated"] = torch.cuda.memory_allocated(worker.device)
        host = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.7
        if host is not None:
            out["host_pinned"] += int(host().get("allocated_bytes.current", 0))
    else:
        out["gpu_allocated"] = stats.gpu_bytes
    return out


def soak_part(run: Run, duration_s: float) -> dict[str, Any]:
    """:func:`nostall.bench.soak.run_soak` against the worker alone."""
    from nostall.bench.soak import run_soak
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    worker = Worker(run.store, device=run.device, max_queue=run.clients)
    with BackgroundServer(create_app(worker)) as srv:
        names = [n for n in PIPELINES if n in worker.names()]
        out = {"warm_up": _warm_up(srv.url, run, names)}
        out.update(
            run_soak(
                srv.url,
                models=names,
                duration_s=duration_s,
                clients=run.clients,
                res=run.res,
                steps=run.steps,
                settle=lambda: _warm_up(srv.url, run, names, seed=_WARM_SEED + 100),
                sample=lambda: _memory(worker),
                log=run.log,
            )
        )
    return out


def prefetch_part(run: Run, size: str) -> dict[str, Any]:
    """``nostall bench switch --part prefetch``: on this store at full size
    (``full-lean``), on tiny pipelines of its own folder otherwise."""
    from nostall.bench.switch import run_switch_bench

    if size == "full":
        folder, switch_size = run.store, "full-lean"
        # the switch bench writes what its store lacks: only ever into a store of ours
        if _written(folder, ("flux", "sdxl")) != ["flux", "sdxl"]:
            from nostall.errors import ArgumentError

            raise ArgumentError(
                f"{folder} is not a store this benchmark wrote (no real-size flux and sdxl "
                "stamps), and the prefetch part would write them into it; run `nostall bench "
                "switch --size full-lean --part prefetch` on a folder of its own instead"
            )
    else:
        folder, switch_size = os.path.join(run.work, "switch-tiny"), "tiny"
    rep = run_switch_bench(
        folder=folder, size=switch_size, device=run.device, parts=("prefetch",), log=run.log
    )
    return {"switch_size": switch_size, "folder": folder, **rep.get("prefetch", {})}
