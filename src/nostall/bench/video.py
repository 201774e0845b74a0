"""``nostall bench video``: text-to-video served end to end against diffusers' own code.

Two parts, each against the peer a user would run on that hardware:

* ``wan21`` — Wan 2.1 T2V-14B (bf16, 832×480): nostall's worker over HTTP (the jobs
  API: ``POST /v1/videos``, polled, the MP4 fetched) against the same pipeline call in
  the process (the worker's own cache, the exact chunked decode, MP4) and against
  diffusers as its docs write it (``WanPipeline.from_pretrained`` with the VAE in
  float32, ``.to("cuda")``, the call, ``export_to_video``). All three in one process,
  interleaved pass by pass (A/B/C/A/B/C), medians; the served frames (written as
  ``.npy``) against diffusers' for the same seed.
* ``fp8`` — the same Wan 2.1 14B converted to FP8 (:func:`nostall.quantize`: the
  transformer and UMT5; the VAE as it is), served by the worker over HTTP, against
  diffusers in bf16 as above, interleaved.
* ``a14b`` — Wan 2.2 T2V-A14B on a 48 GB card: the worker's device budget is made from
  47.5 GB (a 48 GB card less its CUDA context), less the activation reserve its own
  measured peaks call for (a calibration run first where none is remembered), as
  ``nostall serve`` makes it on such a card. nostall bf16 (one expert at a time, the
  text encoder gone before the first, the second switched in at the boundary step) and
  nostall FP8 (both experts resident) against diffusers bf16 with
  ``enable_model_cpu_offload()``. Their host copies do not fit one process beside each
  other (69 GB each), so each system runs in a process of its own, alternating; the
  boundary's visible cost is read from CUDA events at each step's end (the boundary
  step's time less the median of the others).

The full store is real-size random weights (:mod:`nostall.synthetic.full`): ``wan-14b``
on the disk; for ``a14b``, ``wan22-a14b`` with its low-noise expert in ``/dev/shm`` (the
disk holds 64 GB; ``elsewhere``), and ``wan-14b``'s transformer removed first where the
disk cannot hold both. ``tiny`` runs the same code on the tiny layouts in seconds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nostall.bench.record import header
from nostall.bench.targets import Targets
from nostall.bench.video_a14b import SYSTEMS, run_a14b
from nostall.bench.video_systems import (
    PROMPT,
    WRITERS,
    alone_video,
    diffusers_pipe,
    diffusers_video,
    job_body,
    make_worker,
    serve_video,
)

__all__ = ["PARTS", "SIZES", "SYSTEMS", "run_video_bench", "tables"]

PARTS = ("wan21", "fp8", "a14b")
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "wan21": "wan-14b",
        "a14b": "wan22-a14b",
        "width": 832,
        "height": 480,
        # (frames, steps): 20 steps do not fit a device call's 10 minutes for three
        # systems interleaved; every system runs the same steps
        "rows": ((33, 8), (33, 4), (81, 4)),
        "fp8_rows": ((33, 8), (81, 4)),
        "a14b_rows": ((33, 8),),
        "budget": None,
        "card": 47_500_000_000,  # a 48 GB card (L40S: 46,068 MiB) less its CUDA context
        "fp8_budget": 46 * 10**9,  # as wan21_budget: the bf16 14B is in the same store
        "wan21_budget": 46 * 10**9,  # the worker's tier: diffusers' copy must fit beside it
        "host_budget": 72 * 10**9,
        "elsewhere": "/dev/shm/nostall-bench-video",
        "work": "/tmp/nostall-bench/video",
    },
    "tiny": {
        "wan21": "wan",
        "a14b": "wan22",
        "width": 16,
        "height": 16,
        "rows": ((5, 2), (9, 2)),
        "fp8_rows": ((5, 2),),
        "a14b_rows": ((5, 6),),
        "budget": None,  # the tiny store's: room for one expert beside the rest
        "card": None,
        "fp8_budget": None,
        "wan21_budget": None,
        "host_budget": 256 << 20,
        "elsewhere": None,
        "work": None,
    },
}


def run_video_bench(
    *,
    size: str = "full",
    device: str | None = None,
    parts: tuple[str, ...] = PARTS,
    passes: int = 2,
    work: str | None = None,
    log: Callable[[str], None] = print,
    save: Callable[[dict], None] | None = None,
    figures: str | None = None,
    systems: tuple[str, ...] = SYSTEMS,
) -> dict[str, Any]:
    """Run the parts; return the report (``save`` gets it after each row). ``figures``:
    the folder for the served job's timeline PNG (default: ``work``); ``systems``: the
    a14b part's (a device call may not hold all three)."""
    from nostall.transfer.loader import resolve_device

    cfg = SIZES[size]
    dev = resolve_device(device)
    device = str(dev)
    report: dict[str, Any] = header("video", dev)
    report.update(size=size, passes=passes, parts={}, width=cfg["width"], height=cfg["height"])
    if cfg["card"] is not None:
        report["card_total_bytes"] = cfg["card"]
    own = work is None and cfg["work"] is None
    work = work or cfg["work"] or tempfile.mkdtemp(prefix="nostall-bench-video-")
    os.makedirs(work, exist_ok=True)
    try:
        # a store per part: a process's store lists the folders it found when opened
        store = os.path.join(work, "store-wan21")
        if "wan21" in parts or "fp8" in parts:
            _write(store, (cfg["wan21"],), size, device, log)
        if "fp8" in parts:  # before a worker opens the store (its folders are listed then)
            model = cfg["wan21"]
            _fp8_copy(os.path.join(store, model), os.path.join(store, f"{model}-fp8"), log)
        if "wan21" in parts:

            def partial(part: dict) -> None:  # each row as it ends: a cut run keeps them
                report["parts"]["wan21"] = part
                report["targets"] = evaluate_targets(report)
                if save is not None:
                    save(report)

            partial(_wan21(store, cfg, dev, passes, work, log, partial, figures or work))
        if "fp8" in parts:

            def partial_fp8(part: dict) -> None:
                report["parts"]["fp8"] = part
                report["targets"] = evaluate_targets(report)
                if save is not None:
                    save(report)

            partial_fp8(_fp8(store, cfg, dev, passes, work, log, partial_fp8))
        if "a14b" in parts:
            store = os.path.join(work, "store-a14b")
            _make_room_for_a14b(work, store, cfg, size, log)
            _write(store, (cfg["a14b"],), size, device, log, elsewhere=cfg["elsewhere"])
            if "nostall_fp8" in systems:
                away = {"transformer_2": cfg["elsewhere"]} if cfg["elsewhere"] else None
                src = os.path.join(store, cfg["a14b"])
                _fp8_copy(src, f"{src}-fp8", log, away=away)

            def partial_a14b(part: dict) -> None:
                report["parts"]["a14b"] = part
                report["targets"] = evaluate_targets(report)
                if save is not None:
                    save(report)

            part = run_a14b(store, cfg, dev, passes, work, size, log, systems, save=partial_a14b)
            partial_a14b(part)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    report["peer_video_writer"] = WRITERS.get("used")
    report["targets"] = evaluate_targets(report)
    return report


# ---- stores ------------------------------------------------------------------------


def _write(store, names, size, device, log, elsewhere: str | None = None) -> None:
    from nostall.synthetic import write_store

    t = time.perf_counter()
    if size == "full":
        from nostall.synthetic.full import write_full_store

        away = {"transformer_2": elsewhere} if elsewhere else None
        write_full_store(store, names, device=device, progress=log, elsewhere=away)
    else:
        write_store(store, names, progress=log)
    log(f"store {', '.join(names)} ready in {time.perf_counter() - t:.1f} s")


def _make_room_for_a14b(work: str, store: str, cfg: dict, size: str, log) -> None:
    """The full ``wan21`` store leaves the disk when ``wan22-a14b`` needs its room."""
    if size != "full" or os.path.exists(os.path.join(store, cfg["a14b"], "model_index.json")):
        return
    from nostall.errors import ArgumentError
    from nostall.synthetic.full import check_room

    try:
        check_room(store, (cfg["a14b"],), elsewhere={"transformer_2": cfg["elsewhere"]})
    except ArgumentError:
        log(f"disk: removing the {cfg['wan21']} store to write {cfg['a14b']}")
        shutil.rmtree(os.path.join(work, "store-wan21"), ignore_errors=True)


def _fp8_copy(src: str, dst: str, log, away: dict[str, str] | None = None) -> None:
    """``src``'s pipeline in FP8 at ``dst`` (:func:`nostall.quantize`; kept for the next
    run). ``away``: roles converted into another folder (``/dev/shm``: the disk does
    not take the A14B's bf16 and FP8 stores beside each other) and linked in."""
    from nostall.quant import quantize

    if os.path.exists(os.path.join(dst, "model_index.json")):
        return
    t = time.perf_counter()
    away = dict(away or {})
    view = f"{dst}.source"  # src without the roles written elsewhere
    for stale in (view, f"{dst}.staged", f"{dst}.staged.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(view)
    for name in os.listdir(src):
        if name not in away:
            os.symlink(os.path.realpath(os.path.join(src, name)), os.path.join(view, name))
    elsewhere = []
    try:
        for role, folder in away.items():
            out = os.path.join(folder, os.path.basename(dst), role)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(f"{out}.partial", ignore_errors=True)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            quantize(os.path.join(src, role), out)
            elsewhere.append((out, role))
        quantize(view, f"{dst}.staged")
        for out, role in elsewhere:
            os.symlink(out, os.path.join(f"{dst}.staged", role))
        os.replace(f"{dst}.staged", dst)
    finally:
        shutil.rmtree(view, ignore_errors=True)
        shutil.rmtree(f"{dst}.staged", ignore_errors=True)
    log(f"FP8 {os.path.basename(dst)} written in {time.perf_counter() - t:.1f} s")


# ---- wan21 ---------------------------------------------------------------------------


def _wan21(store, cfg, dev, passes, work, log, save=None, figures=None) -> dict[str, Any]:
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer

    model = cfg["wan21"]
    folder = os.path.join(store, model)
    t = time.perf_counter()
    worker = make_worker(store, dev, work, gpu_budget=cfg["wan21_budget"])
    part: dict[str, Any] = {"model": model, "rows": [], "complete": False}
    from nostall.video import AsyncFramePipeline

    frames_out = AsyncFramePipeline(device=dev)  # the in-process system's, kept
    with frames_out, BackgroundServer(create_app(worker)) as server:
        worker.cache.prepare(model)
        part["worker_start_s"] = time.perf_counter() - t
        t = time.perf_counter()
        pipe = diffusers_pipe(folder, dev)
        part["diffusers_load_s"] = time.perf_counter() - t
        # warm-ups, one step each (the worker's first switch moves the weights in)
        frames0 = cfg["rows"][0][0]
        t = time.perf_counter()
        serve_video(server.url, job_body(model, cfg, frames0, 1))
        part["nostall_first_video_s"] = time.perf_counter() - t
        diffusers_video(pipe, cfg, frames0, 1, dev, os.path.join(work, "warm.mp4"))
        for n, (frames, steps) in enumerate(cfg["rows"]):
            row: dict[str, Any] = {
                "frames": frames,
                "steps": steps,
                "nostall": [],
                "alone": [],
                "diffusers": [],
            }
            for k in range(passes):
                served = serve_video(server.url, job_body(model, cfg, frames, steps))
                row["nostall"].append(served["wall_s"])
                path = os.path.join(work, f"alone-{frames}-{steps}-{k}.mp4")
                alone = alone_video(worker.cache, model, cfg, frames, steps, dev, path, frames_out)
                row["alone"].append(alone)
                path = os.path.join(work, f"diffusers-{frames}-{steps}-{k}.mp4")
                wall, ref = diffusers_video(pipe, cfg, frames, steps, dev, path)
                row["diffusers"].append(wall)
                log(
                    f"wan21 {frames}f {steps} steps pass {k + 1}: nostall "
                    f"{row['nostall'][-1]:.2f} s, alone {row['alone'][-1]:.2f} s, "
                    f"diffusers {wall:.2f} s"
                )
            for who in ("nostall", "alone", "diffusers"):
                row[f"{who}_median_s"] = statistics.median(row[who])
            part["rows"].append(row)
            if n == 0:  # the served frames, before encoding, against diffusers' last ones
                part.update(_frames_check(worker, model, cfg, frames, steps, work, ref))
            if save is not None:
                save(part)
        if dev.type == "cuda":  # one served job under the profiler: the GPU's busy share
            frames, steps = cfg["rows"][1] if len(cfg["rows"]) > 1 else cfg["rows"][0]
            body = job_body(model, cfg, frames, steps)
            part["profiled"] = _busy(server.url, body, work, figures or work)
            if save is not None:
                save(part)
        del pipe
    worker.shutdown()
    part["complete"] = True
    return part


def _busy(url: str, body: dict, work: str, figures: str) -> dict[str, Any]:
    """One served job under ``torch.profiler``: kernels (and device copies, memsets)
    over the span from its first kernel to its last; the timeline as a PNG."""
    from torch.profiler import ProfilerActivity, profile

    from nostall.bench.timeline import load_trace, plot_timelines

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = serve_video(url, body)["wall_s"]
    path = os.path.join(work, "served-job.trace.json")
    prof.export_chrome_trace(path)
    tr = load_trace(path)
    a, b = tr.whole()
    os.makedirs(figures, exist_ok=True)
    png = os.path.join(figures, "video-job-timeline.png")
    try:
        plot_timelines({"served job": tr}, png, title="one served text-to-video job")
    except Exception as e:  # the figure is a picture of the figure: the number stands
        png = f"not drawn: {type(e).__name__}: {e}"
    return {
        "frames": body["frames"],
        "steps": body["steps"],
        "wall_s": wall,
        "kernel_span_s": (b - a) / 1e6,
        "kernel_share": tr.utilisation(a, b),
        "busy_share": tr.busy(a, b),
        "kernels": len(tr.kernels),
        # Where the rest of the span went: the longest idle stretches, with what the host
        # was doing meanwhile (the profiler's own launch overhead is in them too).
        "idle_ms": (b - a) / 1e3 * (1 - tr.busy(a, b)),
        "longest_gaps": tr.gaps(a, b),
        "timeline_png": png,
    }


def _frames_check(worker, model, cfg, frames, steps, work, ref) -> dict[str, Any]:
    """The worker's frames for the job (written as ``.npy``) against diffusers' (``ref``,
    floats in [0, 1], rounded to 8 bits as ``export_to_video`` and PIL do)."""
    from nostall.serve.jobs import GenerateJob

    npy = os.path.join(work, "served.npy")
    job = GenerateJob(
        id="frames",
        model=model,
        prompt=PROMPT,
        width=cfg["width"],
        height=cfg["height"],
        frames=frames,
        fps=16,
        steps=steps,
        seed=7,
        path=npy,
    )
    fut, _ = worker.submit(job)
    fut.result(900).info["written"].result(900)
    served = np.load(npy)
    ref8 = (ref * 255).round().astype(np.uint8)
    diff = np.abs(served.astype(np.int16) - ref8.astype(np.int16))
    return {
        "frames_equal": bool(served.shape == ref8.shape and not diff.any()),
        "frames_max_abs_diff": int(diff.max()),
        "frames_mean_abs_diff": float(diff.mean()),
    }


# ---- fp8 -----------------------------------------------------------------------------


def _fp8(store, cfg, dev, passes, work, log, save=None) -> dict[str, Any]:
    """The FP8 copy served over HTTP against diffusers in bf16, interleaved."""
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer

    model = f"{cfg['wan21']}-fp8"
    part: dict[str, Any] = {"model": model, "peer_model": cfg["wan21"], "rows": []}
    part["complete"] = False
    worker = make_worker(store, dev, work, gpu_budget=cfg["fp8_budget"])
    with BackgroundServer(create_app(worker)) as server:
        worker.cache.prepare(model)
        part["fp8_layers"] = _fp8_layers(worker.cache, model)
        pipe = diffusers_pipe(os.path.join(store, cfg["wan21"]), dev)
        frames0 = cfg["fp8_rows"][0][0]
        serve_video(server.url, job_body(model, cfg, frames0, 1))  # warm-ups, one step each
        diffusers_video(pipe, cfg, frames0, 1, dev, os.path.join(work, "warm.mp4"))
        for frames, steps in cfg["fp8_rows"]:
            row: dict[str, Any] = {"frames": frames, "steps": steps}
            row.update(nostall_fp8=[], diffusers=[])
            for k in range(passes):
                row["nostall_fp8"].append(
                    serve_video(server.url, job_body(model, cfg, frames, steps))["wall_s"]
                )
                path = os.path.join(work, f"diffusers-{frames}-{steps}-{k}.mp4")
                row["diffusers"].append(diffusers_video(pipe, cfg, frames, steps, dev, path)[0])
                log(
                    f"fp8 {frames}f {steps} steps pass {k + 1}: nostall FP8 "
                    f"{row['nostall_fp8'][-1]:.2f} s, diffusers bf16 {row['diffusers'][-1]:.2f} s"
                )
            for who in ("nostall_fp8", "diffusers"):
                row[f"{who}_median_s"] = statistics.median(row[who])
            part["rows"].append(row)
            if save is not None:
                save(part)
        del pipe
    worker.shutdown()
    part["complete"] = True
    return part


def _fp8_layers(cache, model: str) -> dict[str, Any]:
    """How many of the served transformer's linear layers hold FP8 weights, and on
    which path they compute (tensor cores, or the weight upcast per call)."""
    with cache.use(model) as pipe:
        module = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
        fp8 = [
            m
            for m in module.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn
        ]
        return {
            "fp8": len(fp8),
            "linear": sum(isinstance(m, torch.nn.Linear) for m in module.modules()),
            "tensor_cores": sum(bool(getattr(m, "_fp8_tensor_cores", False)) for m in fp8),
        }


# ---- targets and tables --------------------------------------------------------------


def evaluate_targets(report: dict[str, Any]) -> Targets:
    t = Targets()
    parts = report.get("parts", {})
    wan, fp8, a14b = (parts.get(k) for k in ("wan21", "fp8", "a14b"))
    main = wan["rows"][0] if wan and wan["rows"] else None
    t.add(
        "t2v_served_vs_pipeline_alone",
        main and main["nostall_median_s"] / main["alone_median_s"],
        "<=",
        1.03,
    )
    t.add("t2v_e2e_vs_diffusers", _ratio(main, "diffusers", "nostall"), ">=", 1.0)
    first = fp8["rows"][0] if fp8 and fp8["rows"] else None
    t.add("fp8_t2v_e2e_vs_diffusers_bf16", _ratio(first, "diffusers", "nostall_fp8"), ">=", 1.15)
    row = a14b["rows"][0] if a14b and a14b["rows"] else None
    t.add("a14b_44gb_e2e_vs_diffusers_offload", _ratio(row, "diffusers", "nostall"), ">=", 2.0)
    t.add("a14b_boundary_visible_s", row and row.get("boundary_visible_median_s"), "<=", 0.6)
    fp8_visible = row and row.get("fp8_boundary_visible_median_s")
    t.add("fp8_a14b_boundary_visible_s", fp8_visible, "<=", 0.02)
    busy = wan.get("profiled", {}).get("busy_share") if wan else None
    t.add("video_job_kernel_busy_share", busy, ">=", 0.99)
    equal = wan.get("frames_equal") if wan else None
    t.add("video_frames_equal_pipeline", None if equal is None else int(equal), ">=", 1)
    return t


def _ratio(row: dict[str, Any] | None, a: str, b: str) -> float | None:
    """``a``'s median over ``b``'s in ``row``, where both ran."""
    if not row or f"{a}_median_s" not in row or f"{b}_median_s" not in row:
        return None
    return row[f"{a}_median_s"] / row[f"{b}_median_s"]


_COLUMNS = {
    "wan21": ("nostall", "alone", "diffusers"),
    "fp8": ("nostall_fp8", "diffusers"),
    "a14b": SYSTEMS,
}


def tables(report: dict[str, Any]) -> list:
    from rich.table import Table

    from nostall.bench.targets import table

    out = []
    for name, part in report.get("parts", {}).items():
        systems = [w for w in _COLUMNS[name] if any(w in r for r in part["rows"])]
        tab = Table(
            title=f"{name}: {part['model']} (medians of {report['passes']} passes, s)",
            title_justify="left",
        )
        ours = [w for w in systems if w != "diffusers" and w != "alone"]
        for col in ("frames", "steps", *systems, *(f"diffusers ÷ {w}" for w in ours)):
            tab.add_column(col, justify="right")
        for row in part["rows"]:
            med = [row.get(f"{w}_median_s") for w in systems]
            ratios = [_ratio(row, "diffusers", w) for w in ours]
            tab.add_row(
                str(row["frames"]),
                str(row["steps"]),
                *("—" if m is None else f"{m:.2f}" for m in med),
                *("—" if r is None else f"{r:.2f}×" for r in ratios),
            )
        out.append(tab)
    out.append(table(report.get("targets", {})))
    return out
