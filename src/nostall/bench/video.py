"""``nostall bench video``: text-to-video served end to end against diffusers' own code.

Two parts, each against the peer a user would run on that hardware:

* ``wan21`` — Wan 2.1 T2V-14B (bf16, 832×480): nostall's worker over HTTP (the jobs
  API: ``POST /v1/videos``, polled, the MP4 fetched) against the same pipeline call in
  the process (the worker's own cache, the exact chunked decode, MP4) and against
  diffusers as its docs write it (``WanPipeline.from_pretrained`` with the VAE in
  float32, ``.to("cuda")``, the call, ``export_to_video``). All three in one process,
  interleaved pass by pass (A/B/C/A/B/C), medians; the served frames (written as
  ``.npy``) against diffusers' for the same seed.
* ``a14b`` — Wan 2.2 T2V-A14B under a device budget (44 GB: a 48 GB card): nostall's
  worker, one expert at a time (the second switched in at the boundary step), against
  diffusers with ``enable_model_cpu_offload()``. Their host copies do not fit one
  process beside each other (69 GB each), so each system runs in a process of its
  own, alternating; the boundary's visible cost is read from CUDA events at each step's
  end (the boundary step's time less the median of the others).

The full store is real-size random weights (:mod:`nostall.synthetic.full`): ``wan-14b``
on the disk; for ``a14b``, ``wan22-a14b`` with its low-noise expert in ``/dev/shm`` (the
disk holds 64 GB; ``elsewhere``), and ``wan-14b``'s transformer removed first where the
disk cannot hold both. ``tiny`` runs the same code on the tiny layouts in seconds.
"""

from __future__ import annotations

import json
import multiprocessing
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
from nostall.bench.timing import sync

__all__ = ["PARTS", "SIZES", "run_video_bench", "tables"]

PARTS = ("wan21", "a14b")
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "wan21": "wan-14b",
        "a14b": "wan22-a14b",
        "width": 832,
        "height": 480,
        # (frames, steps): 20 steps do not fit a device call's 10 minutes for three
        # systems interleaved; every system runs the same steps
        "rows": ((33, 8), (33, 4), (81, 4)),
        "a14b_rows": ((33, 8),),
        "budget": 44 * 10**9,
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
        "a14b_rows": ((5, 6),),
        "budget": None,  # the tiny store's: room for one expert beside the rest
        "wan21_budget": None,
        "host_budget": 256 << 20,
        "elsewhere": None,
        "work": None,
    },
}
PROMPT = "a red fox running through fresh snow at dawn, cinematic"


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
) -> dict[str, Any]:
    """Run the parts; return the report (``save`` gets it after each row). ``figures``:
    the folder for the served job's timeline PNG (default: ``work``)."""
    from nostall.transfer.loader import resolve_device

    cfg = SIZES[size]
    dev = resolve_device(device)
    device = str(dev)
    report: dict[str, Any] = header("video", dev)
    report.update(size=size, passes=passes, parts={}, width=cfg["width"], height=cfg["height"])
    own = work is None and cfg["work"] is None
    work = work or cfg["work"] or tempfile.mkdtemp(prefix="nostall-bench-video-")
    os.makedirs(work, exist_ok=True)
    try:
        # a store per part: a process's store lists the folders it found when opened
        if "wan21" in parts:
            store = os.path.join(work, "store-wan21")
            _write(store, (cfg["wan21"],), size, device, log)

            def partial(part: dict) -> None:  # each row as it ends: a cut run keeps them
                report["parts"]["wan21"] = part
                report["targets"] = evaluate_targets(report)
                if save is not None:
                    save(report)

            partial(_wan21(store, cfg, dev, passes, work, log, partial, figures or work))
        if "a14b" in parts:
            store = os.path.join(work, "store-a14b")
            _make_room_for_a14b(work, store, cfg, size, log)
            _write(store, (cfg["a14b"],), size, device, log, elsewhere=cfg["elsewhere"])

            def partial_a14b(part: dict) -> None:
                report["parts"]["a14b"] = part
                report["targets"] = evaluate_targets(report)
                if save is not None:
                    save(report)

            partial_a14b(_a14b(store, cfg, dev, passes, work, size, log, save=partial_a14b))
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


# ---- the systems ------------------------------------------------------------------


def _served(url: str, body: dict, timeout: float = 900.0) -> dict[str, Any]:
    """One video over HTTP: created, polled until done, its MP4 fetched."""
    import httpx

    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/videos", json=body, timeout=60)
    r.raise_for_status()
    vid = r.json()["id"]
    deadline = t + timeout
    while True:
        job = httpx.get(f"{url}/v1/videos/{vid}", timeout=60).json()
        if job["status"] in ("completed", "failed", "cancelled"):
            break
        if time.perf_counter() > deadline:
            raise TimeoutError(f"video {vid} still {job['status']} after {timeout} s")
        time.sleep(0.02)
    if job["status"] != "completed":
        raise RuntimeError(f"video {vid} {job['status']}: {job.get('error')}")
    content = httpx.get(f"{url}/v1/videos/{vid}/content", timeout=120)
    content.raise_for_status()
    wall = time.perf_counter() - t
    httpx.delete(f"{url}/v1/videos/{vid}", timeout=60)
    return {"wall_s": wall, "mp4_bytes": len(content.content)}


def _body(model: str, cfg: dict, frames: int, steps: int, seed: int = 7) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "size": f"{cfg['width']}x{cfg['height']}",
        "frames": frames,
        "steps": steps,
        "seed": seed,
        "fps": 16,
        "mode": "exact",
    }


def _call_kwargs(cfg: dict, frames: int, steps: int, dev: torch.device, seed: int = 7) -> dict:
    """diffusers' call for the same job the worker runs (its own defaults otherwise)."""
    return {
        "prompt": PROMPT,
        "height": cfg["height"],
        "width": cfg["width"],
        "num_frames": frames,
        "num_inference_steps": steps,
        "generator": torch.Generator(device=dev.type).manual_seed(seed),
    }


def _alone(cache, model, cfg, frames, steps, dev, path, frames_out) -> float:
    """The worker's pipeline call, exact decode and MP4 in this process: no HTTP, no job;
    ``frames_out`` is one :class:`~nostall.video.AsyncFramePipeline` kept across videos,
    as the worker keeps its own."""
    from nostall.video import denormalize, submit_decode

    t = time.perf_counter()
    with cache.use(model) as pipe, torch.inference_mode():
        pipe.set_progress_bar_config(disable=True)
        latents = pipe(**_call_kwargs(cfg, frames, steps, dev), output_type="latent").frames
        vae = pipe.vae
        z = denormalize(vae, latents.to(next(vae.parameters()).dtype))
        submit_decode(vae, z, path, pipeline=frames_out, fps=16, mode="exact").result()
    return time.perf_counter() - t


def _diffusers_pipe(folder: str, dev: torch.device, *, offload: bool = False):
    from diffusers import AutoencoderKLWan, WanPipeline

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=dtype)
    if offload:
        pipe.enable_model_cpu_offload(device=dev)
    else:
        pipe.to(dev)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers(pipe, cfg, frames, steps, dev, path) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    out = pipe(**_call_kwargs(cfg, frames, steps, dev), output_type="np").frames[0]
    WRITERS["used"] = _export(list(out), path)
    return time.perf_counter() - t, out


WRITERS: dict[str, str] = {}  # which of diffusers' writers the peer's MP4s went through


def _export(frames: list, path: str) -> str:
    """diffusers' ``export_to_video``; where imageio has no ffmpeg (the GPU machine has
    imageio without imageio-ffmpeg, whose wheel is 68 MB), diffusers' own OpenCV writer,
    which it uses when imageio is absent."""
    from diffusers.utils import export_to_video, export_utils

    try:
        export_to_video(frames, path, fps=16)
        return "export_to_video (imageio-ffmpeg)"
    except AttributeError as e:
        if "ffmpeg" not in str(e):
            raise
    export_utils._legacy_export_to_video(frames, path, fps=16)
    return "export_to_video's OpenCV writer (imageio has no ffmpeg here)"


def _peak(dev: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _worker(store: str, dev: torch.device, work: str, **kw):
    from nostall.serve.worker import Worker

    return Worker(store, device=str(dev), video_dir=os.path.join(work, "videos"), **kw)


# ---- wan21 ---------------------------------------------------------------------------


def _wan21(store, cfg, dev, passes, work, log, save=None, figures=None) -> dict[str, Any]:
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer

    model = cfg["wan21"]
    folder = os.path.join(store, model)
    t = time.perf_counter()
    worker = _worker(store, dev, work, gpu_budget=cfg["wan21_budget"])
    part: dict[str, Any] = {"model": model, "rows": [], "complete": False}
    from nostall.video import AsyncFramePipeline

    frames_out = AsyncFramePipeline(device=dev)  # the in-process system's, kept
    with frames_out, BackgroundServer(create_app(worker)) as server:
        worker.cache.prepare(model)
        part["worker_start_s"] = time.perf_counter() - t
        t = time.perf_counter()
        pipe = _diffusers_pipe(folder, dev)
        part["diffusers_load_s"] = time.perf_counter() - t
        # warm-ups, one step each (the worker's first switch moves the weights in)
        frames0 = cfg["rows"][0][0]
        t = time.perf_counter()
        _served(server.url, _body(model, cfg, frames0, 1))
        part["nostall_first_video_s"] = time.perf_counter() - t
        _diffusers(pipe, cfg, frames0, 1, dev, os.path.join(work, "warm.mp4"))
        for n, (frames, steps) in enumerate(cfg["rows"]):
            row: dict[str, Any] = {
                "frames": frames,
                "steps": steps,
                "nostall": [],
                "alone": [],
                "diffusers": [],
            }
            for k in range(passes):
                served = _served(server.url, _body(model, cfg, frames, steps))
                row["nostall"].append(served["wall_s"])
                path = os.path.join(work, f"alone-{frames}-{steps}-{k}.mp4")
                alone = _alone(worker.cache, model, cfg, frames, steps, dev, path, frames_out)
                row["alone"].append(alone)
                path = os.path.join(work, f"diffusers-{frames}-{steps}-{k}.mp4")
                wall, ref = _diffusers(pipe, cfg, frames, steps, dev, path)
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
            body = _body(model, cfg, frames, steps)
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
        wall = _served(url, body)["wall_s"]
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


# ---- a14b ----------------------------------------------------------------------------


def _budget(store: str, cfg: dict) -> int:
    if cfg["budget"] is not None:
        return cfg["budget"]
    from nostall.serve.budget import device_bytes
    from nostall.store.catalog import Store

    entry = Store(store).entry(cfg["a14b"])
    sizes = {c.role: device_bytes(c, None) for c in entry.distinct_weights()}
    rest = sum(n for r, n in sizes.items() if not r.startswith("transformer"))
    return rest + sizes["transformer"] + sizes["transformer"] // 8  # one expert, not two


def _a14b(store, cfg, dev, passes, work, size, log, save=None) -> dict[str, Any]:
    budget = _budget(store, cfg)
    part: dict[str, Any] = {
        "model": cfg["a14b"],
        "gpu_budget": budget,
        "rows": [],
        "isolated": size == "full",
    }
    for frames, steps in cfg["a14b_rows"]:
        row: dict[str, Any] = {
            "frames": frames,
            "steps": steps,
            "nostall": [],
            "diffusers": [],
            "boundary_visible_s": [],
            "peak_bytes": {},
        }
        for k in range(passes):
            for who in ("nostall", "diffusers"):
                args = (who, store, cfg, str(dev), budget, frames, steps, work)
                out = _isolated(args) if size == "full" else _a14b_system(*args)
                row[who].append(out["wall_s"])
                row["peak_bytes"][who] = out["peak_bytes"]
                row.setdefault(f"{who}_load_s", []).append(out["load_s"])
                if "boundary_visible_s" in out:
                    row["boundary_visible_s"].append(out["boundary_visible_s"])
                    row.setdefault("boundary_switch", out["boundary_switch"])
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


def _medians(row: dict[str, Any]) -> dict[str, Any]:
    for who in ("nostall", "diffusers"):
        if row[who]:
            row[f"{who}_median_s"] = statistics.median(row[who])
    if row["boundary_visible_s"]:
        row["boundary_visible_median_s"] = statistics.median(row["boundary_visible_s"])
    return row


def _isolated(args: tuple) -> dict[str, Any]:
    """:func:`_a14b_system` in a process of its own (spawned: CUDA is not forked)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        p = ctx.Process(target=_child, args=(args, path))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"the {args[0]} process ended with exit code {p.exitcode}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _child(args: tuple, path: str) -> None:
    out = _a14b_system(*args)
    with open(path, "w") as f:
        json.dump(out, f)


def _a14b_system(who, store, cfg, device, budget, frames, steps, work) -> dict[str, Any]:
    """One A14B video by ``who`` (after its load; nostall's first video, which moves the
    weights from disk, is a warm-up), its peak device bytes, and for nostall the boundary's
    visible seconds from step-end events."""
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer

    dev = torch.device(device)
    model = cfg["a14b"]
    out: dict[str, Any] = {}
    t = time.perf_counter()
    if who == "diffusers":
        pipe = _diffusers_pipe(os.path.join(store, model), dev, offload=True)
        out["load_s"] = time.perf_counter() - t
        _reset_peak(dev)
        out["wall_s"], _ = _diffusers(pipe, cfg, frames, steps, dev, os.path.join(work, "o.mp4"))
        out["peak_bytes"] = _peak(dev)
        out["writer"] = WRITERS.get("used")
        return out
    worker = _worker(store, dev, work, gpu_budget=budget, host_budget=cfg["host_budget"])
    try:
        with BackgroundServer(create_app(worker)) as server:
            worker.cache.prepare(model)
            _served(server.url, _body(model, cfg, frames, 2))  # disk → host tier → device
            out["load_s"] = time.perf_counter() - t
            _reset_peak(dev)
            out["wall_s"] = _served(server.url, _body(model, cfg, frames, steps))["wall_s"]
            out["peak_bytes"] = _peak(dev)
            out.update(_boundary(worker.cache, model, cfg, frames, steps, dev))
    finally:
        worker.shutdown()
    return out


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
            **_call_kwargs(cfg, frames, steps, dev),
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
    rep = reports[0] if reports else None
    return {
        "boundary_visible_s": visible,
        "boundary_step": b,
        "step_s": steps_s,
        "boundary_switch": None
        if rep is None
        else {"moved_bytes": rep.moved_bytes, "total_s": rep.total_s, "evicted": list(rep.evicted)},
    }


# ---- targets and tables --------------------------------------------------------------


def evaluate_targets(report: dict[str, Any]) -> Targets:
    t = Targets()
    wan = report.get("parts", {}).get("wan21")
    a14b = report.get("parts", {}).get("a14b")
    main = wan["rows"][0] if wan and wan["rows"] else None
    t.add(
        "t2v_served_vs_pipeline_alone",
        main and main["nostall_median_s"] / main["alone_median_s"],
        "<=",
        1.03,
    )
    t.add(
        "t2v_e2e_vs_diffusers",
        main and main["diffusers_median_s"] / main["nostall_median_s"],
        ">=",
        1.0,
    )
    t.add("fp8_t2v_e2e_vs_diffusers_bf16", None, ">=", 1.15)
    row = a14b["rows"][0] if a14b and a14b["rows"] else None
    ratio = None
    if row and "diffusers_median_s" in row and "nostall_median_s" in row:
        ratio = row["diffusers_median_s"] / row["nostall_median_s"]
    t.add("a14b_44gb_e2e_vs_diffusers_offload", ratio, ">=", 2.0)
    t.add("a14b_boundary_visible_s", row and row.get("boundary_visible_median_s"), "<=", 0.6)
    t.add("fp8_a14b_boundary_visible_s", None, "<=", 0.02)
    busy = wan.get("profiled", {}).get("busy_share") if wan else None
    t.add("video_job_kernel_busy_share", busy, ">=", 0.99)
    equal = wan.get("frames_equal") if wan else None
    t.add("video_frames_equal_pipeline", None if equal is None else int(equal), ">=", 1)
    return t


def tables(report: dict[str, Any]) -> list:
    from rich.table import Table

    from nostall.bench.targets import table

    out = []
    for name, part in report.get("parts", {}).items():
        systems = ("nostall", "alone", "diffusers") if name == "wan21" else ("nostall", "diffusers")
        tab = Table(
            title=f"{name}: {part['model']} (medians of {report['passes']} passes, s)",
            title_justify="left",
        )
        for col in ("frames", "steps", *systems, "diffusers ÷ nostall"):
            tab.add_column(col, justify="right")
        for row in part["rows"]:
            med = [row[f"{w}_median_s"] for w in systems]
            ratio = row["diffusers_median_s"] / row["nostall_median_s"]
            tab.add_row(
                str(row["frames"]), str(row["steps"]), *(f"{m:.2f}" for m in med), f"{ratio:.2f}×"
            )
        out.append(tab)
    out.append(table(report.get("targets", {})))
    return out
