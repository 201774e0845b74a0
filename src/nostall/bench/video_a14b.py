"""The ``a14b`` part of ``nostall bench video``: Wan 2.2 T2V-A14B on a 48 GB card, each
system in a process of its own (two 69 GB host copies do not fit one process's RAM
beside each other), alternating; the boundary's visible seconds from step-end events."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from nostall.bench.timing import sync
from nostall.bench.video_systems import (
    WRITERS,
    call_kwargs,
    device_peak,
    diffusers_pipe,
    diffusers_video,
    job_body,
    make_worker,
    reset_device_peak,
    serve_video,
)

__all__ = ["SYSTEMS", "run_a14b"]

SYSTEMS = ("nostall", "nostall_fp8", "diffusers")


def _budget(store: str, cfg: dict) -> int:
    if cfg["budget"] is not None:
        return cfg["budget"]
    from nostall.serve.budget import device_bytes
    from nostall.store.catalog import Store

    entry = Store(store).entry(cfg["a14b"])
    sizes = {c.role: device_bytes(c, None) for c in entry.distinct_weights()}
    rest = sum(n for r, n in sizes.items() if not r.startswith(("transformer", "text_encoder")))
    # one expert and half the text encoder: it leaves before the first expert comes in
    return rest + sizes["transformer"] + sizes["text_encoder"] // 2


def run_a14b(store, cfg, dev, passes, work, size, log, systems, save=None) -> dict[str, Any]:
    budget = _budget(store, cfg) if cfg["card"] is None else None  # (a card's: measured)
    part: dict[str, Any] = {
        "model": cfg["a14b"],
        "systems": list(systems),
        "gpu_budget": budget,
        "card_total_bytes": cfg["card"],
        "rows": [],
        "isolated": size == "full",
    }
    for frames, steps in cfg["a14b_rows"]:
        row: dict[str, Any] = {"frames": frames, "steps": steps, "peak_bytes": {}, "tier": {}}
        for who in systems:
            row[who] = []
            if who != "diffusers":
                row[_visible(who)] = []
        if cfg["card"] is not None:  # each nostall system's activations, measured first
            for who in systems:
                if who != "diffusers":
                    got = _isolated((who, store, cfg, str(dev), frames, work), "calibrate")
                    row.setdefault("calibrated_s", {})[who] = got["calibrated_s"]
        for k in range(passes):
            for who in systems:
                args = (who, store, cfg, str(dev), budget, frames, steps, work)
                out = _isolated(args) if size == "full" else _a14b_system(*args)
                row[who].append(out["wall_s"])
                row["peak_bytes"][who] = out["peak_bytes"]
                row.setdefault(f"{who}_load_s", []).append(out["load_s"])
                if "tier" in out:
                    row["tier"][who] = out["tier"]
                if "boundary_visible_s" in out:
                    row[_visible(who)].append(out["boundary_visible_s"])
                    switch = "boundary_switch" if who == "nostall" else "fp8_boundary_switch"
                    row.setdefault(switch, out["boundary_switch"])
                log(
                    f"a14b {frames}f {steps} steps pass {k + 1}: {who} {out['wall_s']:.2f} s "
                    f"(load {out['load_s']:.1f} s)"
                )
                _medians(row)
                if save is not None:  # each system's video as it ends: a cut run keeps it
                    save({**part, "rows": [*part["rows"], row], "complete": False})
        part["rows"].append(_medians(row))
    part["complete"] = True
    return part


def _visible(who: str) -> str:
    """The row's key for ``who``'s boundary seconds (bf16's kept its first name)."""
    return "boundary_visible_s" if who == "nostall" else "fp8_boundary_visible_s"


def _medians(row: dict[str, Any]) -> dict[str, Any]:
    for who in SYSTEMS:
        if row.get(who):
            row[f"{who}_median_s"] = statistics.median(row[who])
    for key in ("boundary_visible_s", "fp8_boundary_visible_s"):
        if row.get(key):
            row[f"{key[:-2]}_median_s"] = statistics.median(row[key])
    return row


def _isolated(args: tuple, fn: str = "system") -> dict[str, Any]:
    """:func:`_a14b_system` (or :func:`_calibrate`) in a process of its own (spawned:
    CUDA is not forked)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        p = ctx.Process(target=_child, args=(args, path, fn))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"the {args[0]} process ended with exit code {p.exitcode}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _child(args: tuple, path: str, fn: str = "system") -> None:
    out = (_a14b_system if fn == "system" else _calibrate)(*args)
    with open(path, "w") as f:
        json.dump(out, f)


def _a14b_system(who, store, cfg, device, budget, frames, steps, work) -> dict[str, Any]:
    """One A14B video by ``who`` (after its load; nostall's first video, which moves the
    weights from disk, is a warm-up), its peak device bytes, and for nostall the boundary's
    visible seconds from step-end events."""
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer

    dev = torch.device(device)
    model = cfg["a14b"] + ("-fp8" if who == "nostall_fp8" else "")
    out: dict[str, Any] = {}
    t = time.perf_counter()
    if who == "diffusers":
        pipe = diffusers_pipe(os.path.join(store, model), dev, offload=True)
        out["load_s"] = time.perf_counter() - t
        reset_device_peak(dev)
        out["wall_s"], _ = diffusers_video(
            pipe, cfg, frames, steps, dev, os.path.join(work, "o.mp4")
        )
        out["peak_bytes"] = device_peak(dev)
        out["writer"] = WRITERS.get("used")
        return out
    peaks = os.path.join(work, "activation-peaks")  # remembered across the passes
    card = _card(cfg, dev, model, peaks)
    kw = {"budget": card} if card is not None else {"gpu_budget": budget}
    worker = make_worker(store, dev, work, host_budget=cfg["host_budget"], **kw)
    try:
        with BackgroundServer(create_app(worker)) as server:
            worker.cache.prepare(model)
            serve_video(server.url, job_body(model, cfg, frames, 2))  # disk → host → device
            out["load_s"] = time.perf_counter() - t
            reset_device_peak(dev)
            out["wall_s"] = serve_video(server.url, job_body(model, cfg, frames, steps))["wall_s"]
            out["peak_bytes"] = device_peak(dev)
            stats = worker.cache.stats()
            out["tier"] = {"gpu_budget": stats.gpu_budget, "reserve": worker.budget.reserve}
            out.update(_boundary(worker.cache, model, cfg, frames, steps, dev))
    finally:
        worker.shutdown()
    return out


def _calibrate(who, store, cfg, device, frames, work) -> dict[str, Any]:
    """A 48 GB card's first start: one short video whose activation peak the worker
    remembers, so the measured processes reserve it (as ``nostall serve`` does at its
    next start); nothing where the peak is remembered already. A process of its own:
    the measured one then holds one worker, one tier."""
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer

    dev = torch.device(device)
    model = cfg["a14b"] + ("-fp8" if who == "nostall_fp8" else "")
    card = _card(cfg, dev, model, os.path.join(work, "activation-peaks"))
    if card is None or card.status()["peaks"].get(model):
        return {"calibrated_s": 0.0}
    t = time.perf_counter()
    worker = make_worker(store, dev, work, host_budget=cfg["host_budget"], budget=card)
    try:
        with BackgroundServer(create_app(worker)) as server:
            worker.cache.prepare(model)
            serve_video(server.url, job_body(model, cfg, frames, 2))
    finally:
        worker.shutdown()
    return {"calibrated_s": time.perf_counter() - t, "reserve_short": _reserve_short(card, model)}


def _card(cfg: dict, dev: torch.device, model: str, peaks: str):
    """The device budget of a 48 GB card's serving process (``None``: the tiny run's
    explicit tier instead): its total, less the reserve its remembered peaks ask."""
    if cfg["card"] is None:
        return None
    from nostall.serve.budget import DeviceBudget

    return DeviceBudget(dev, total=cfg["card"], pipelines=[model], cache_dir=peaks)


def _reserve_short(card, model: str) -> bool:
    """Whether ``model``'s measured activation peak (with the margin a new process
    reserves) is above what ``card`` reserved when it was made."""
    from nostall.serve.budget import RESERVE_MARGIN

    peaks = card.status()["peaks"].get(model, {})
    return bool(peaks) and int(max(peaks.values()) * RESERVE_MARGIN) > card.reserve


def _boundary(cache, model, cfg, frames, steps, dev) -> dict[str, Any]:
    """The boundary step's time less the median of the other steps (the first step,
    which includes the text encoding, left out), from marks at each step's end."""
    cuda = dev.type == "cuda"
    marks: list[Any] = []

    def mark() -> Any:
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def step_end(pipe, i, t, tensors):
        marks.append(mark())
        return {}

    with cache.use(model) as pipe, torch.inference_mode():
        pipe.set_progress_bar_config(disable=True)
        pipe(
            **call_kwargs(cfg, frames, steps, dev),
            output_type="latent",
            callback_on_step_end=step_end,
        )
        sync(dev)
        ts = [float(t) for t in pipe.scheduler.timesteps.cpu()]
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        reports = list(pipe.nostall_experts.reports)
    b = next(i for i, t in enumerate(ts) if t < boundary)
    steps_s = [
        (marks[i - 1].elapsed_time(marks[i]) / 1e3) if cuda else marks[i] - marks[i - 1]
        for i in range(1, len(marks))
    ]  # steps_s[i - 1]: step i
    others = [s for i, s in enumerate(steps_s, start=1) if i != b]
    visible = steps_s[b - 1] - statistics.median(others) if others else None
    rep = next((r for r in reports if "transformer_2" in {c.role for c in r.components}), None)
    return {
        "boundary_visible_s": visible,
        "boundary_step": b,
        "step_s": steps_s,
        "boundary_switch": None
        if rep is None
        else {"moved_bytes": rep.moved_bytes, "total_s": rep.total_s, "evicted": list(rep.evicted)},
    }
