"""``nostall bench decode``: Wan 2.1 VAE, 720p, sync vs async vs decode-only, real MP4s.

For each precision: one warm-up of every mode, then ``repeat`` rounds that run
decode-only (no output), the synchronous baseline and the asynchronous pipeline
back to back (interleaved, so drift hits all three alike), each writing a real
MP4 through PyAV/libx264; then each output mode once with the raw ``.npy`` sink;
then one profiled decode per output mode for the kernel utilisation and the
timeline picture; then peak GPU memory at ``latent_frames`` and twice as many.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from nostall.bench.load import _commit, _hardware
from nostall.bench.timeline import load_trace, plot_timelines
from nostall.video import (
    AsyncFramePipeline,
    NullSink,
    SyncFramePipeline,
    decode_chunks,
    decode_to_file,
    drain,
    frame_count,
)

__all__ = ["run_decode_bench"]

SIZES = {"720p": (90, 160), "480p": (60, 104), "tiny": (8, 12)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
RTF_FPS = 24  # the seed's real-time factor: seconds of decode per second of 24 fps video


def _vae(size: str, device: torch.device, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    kwargs = (
        {} if size != "tiny" else {"base_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}
    )
    with torch.device(device):
        vae = AutoencoderKLWan(**kwargs)
    return vae.to(dtype).eval()


def _summary(times: list[float], frames: int) -> dict:
    arr = np.asarray(times)
    mean = float(arr.mean())
    return {
        "runs": [round(t, 4) for t in times],
        "min": float(arr.min()),
        "mean": mean,
        "p99": float(np.percentile(arr, 99)),
        "stdev": float(arr.std()),
        "frames_per_s": frames / mean,
        "rtf": mean / (frames / RTF_FPS),
    }


def run_decode_bench(
    *,
    size: str = "720p",
    dtypes: tuple[str, ...] = ("bf16", "fp32"),
    latent_frames: int = 41,
    repeat: int = 10,
    device: str = "cuda",
    preset: str = "veryfast",
    crf: int = 23,
    out_dir: str | None = None,
    figure: str | None = None,
    profile: bool = True,
    memory: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the benchmark; return the JSON-able report."""
    dev = torch.device(device)
    h, w = SIZES[size]
    frames = frame_count(latent_frames)
    out_dir = out_dir or tempfile.mkdtemp(prefix="nostall-decode-")
    os.makedirs(out_dir, exist_ok=True)
    report: dict = {
        "benchmark": "decode",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "hardware": _hardware(dev),
        "config": {
            "vae": "diffusers AutoencoderKLWan() defaults, random weights"
            if size != "tiny"
            else "tiny",
            "latents": [1, 16, latent_frames, h, w],
            "frames": frames,
            "size": f"{w * 8}x{h * 8}",
            "mp4": {"codec": "libx264", "preset": preset, "crf": crf, "pix_fmt": "yuv420p"},
            "repeat": repeat,
            "rtf_fps": RTF_FPS,
        },
        "results": {},
    }
    for name in dtypes:
        report["results"][name] = _bench_dtype(
            name,
            dev,
            size,
            latent_frames,
            repeat,
            preset,
            crf,
            out_dir,
            figure,
            profile,
            memory,
            log,
        )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["targets"] = evaluate_targets(report)
    return report


def _bench_dtype(
    name, dev, size, latent_frames, repeat, preset, crf, out_dir, figure, profile, memory, log
):
    dtype = DTYPES[name]
    h, w = SIZES[size]
    frames = frame_count(latent_frames)
    vae = _vae(size, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    z = torch.randn(1, 16, latent_frames, h, w, device=dev, generator=g).to(dtype)
    sync_dev = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    res: dict = {}
    mp4 = os.path.join(out_dir, f"{name}.mp4")

    def decode_only() -> float:
        sync_dev()
        t = time.perf_counter()
        drain(decode_chunks(vae, z), device=dev)
        return time.perf_counter() - t

    def to_file(pipe, path) -> float:
        sync_dev()
        t = time.perf_counter()
        decode_to_file(vae, z, path, preset=preset, crf=crf, pipeline=pipe)
        sync_dev()
        return time.perf_counter() - t

    with SyncFramePipeline(device=dev) as sp, AsyncFramePipeline(device=dev) as ap:
        modes = {
            "decode-only": decode_only,
            "sync": lambda: to_file(sp, mp4),
            "async": lambda: to_file(ap, mp4),
        }
        for m, fn in modes.items():
            log(f"{name} warm-up {m}: {fn():.2f} s")
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(repeat):
            for m, fn in modes.items():
                times[m].append(fn())
            log(
                f"{name} round {i + 1}/{repeat}: "
                + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in modes)
            )
        for m in modes:
            res[m] = _summary(times[m], frames)
        res["mp4_bytes"] = os.path.getsize(mp4)
        npy = os.path.join(out_dir, f"{name}.npy")
        res["raw_npy"] = {"sync": to_file(sp, npy), "async": to_file(ap, npy)}
        os.remove(npy)
        log(
            f"{name} raw .npy sink: sync {res['raw_npy']['sync']:.2f} s, async {res['raw_npy']['async']:.2f} s"
        )
        if profile and dev.type == "cuda":
            res["utilisation"], traces = _profile(vae, z, sp, ap, out_dir, name, preset, crf)
            log(f"{name} kernel utilisation: {res['utilisation']}")
            if figure:
                fig = figure.replace("{dtype}", name)
                title = f"Wan 2.1 VAE {w * 8}x{h * 8}, {name}, MP4 (libx264 {preset})"
                plot_timelines(traces, fig, title=title)
                res["figure"] = fig
    if memory and dev.type == "cuda":
        res["peak_memory_gib"] = _peak_memory(vae, dev, dtype, h, w, latent_frames)
        log(f"{name} peak GPU memory: {res['peak_memory_gib']}")
    return res


def _profile(vae, z, sp, ap, out_dir, name, preset, crf):
    from torch.profiler import ProfilerActivity, profile

    util, traces = {}, {}
    for label, pipe in (("sync", sp), ("async", ap)):
        path = os.path.join(out_dir, f"trace-{name}-{label}.json")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode_to_file(
                vae,
                z,
                os.path.join(out_dir, f"{name}-prof.mp4"),
                preset=preset,
                crf=crf,
                pipeline=pipe,
            )
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        tr = load_trace(path)
        window = tr.steady_window()
        whole = tr.whole()
        util[label] = {
            "steady_two_chunks": tr.utilisation(*window) if window else None,
            "whole_decode": tr.utilisation(*whole),
            "chunks_seen": len(tr.chunks),
        }
        traces[label] = tr
    return util, traces


def _peak_memory(vae, dev, dtype, h, w, latent_frames) -> dict:
    out = {}
    for t in (latent_frames, 2 * latent_frames - 1):
        z = torch.randn(1, 16, t, h, w, device=dev).to(dtype)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        with AsyncFramePipeline(device=dev) as ap:
            ap.run(decode_chunks(vae, z), NullSink())
        torch.cuda.synchronize(dev)
        out[str(t)] = round((torch.cuda.max_memory_allocated(dev) - base) / 2**30, 3)
        del z
    return out


def evaluate_targets(report: dict) -> list[dict]:
    out = []
    for name, res in report["results"].items():
        if "async" not in res:
            continue
        u = res.get("utilisation", {}).get("async", {})
        if u.get("steady_two_chunks") is not None:
            out.append(
                {
                    "target": f"{name}: async kernel utilisation >= 99.5% steady, >= 99% whole decode (MP4)",
                    "measured": [round(u["steady_two_chunks"], 4), round(u["whole_decode"], 4)],
                    "met": u["steady_two_chunks"] >= 0.995 and u["whole_decode"] >= 0.99,
                }
            )
        ratio = res["async"]["mean"] / res["decode-only"]["mean"]
        out.append(
            {
                "target": f"{name}: async end-to-end <= 1.02x decode-only",
                "measured": round(ratio, 4),
                "met": ratio <= 1.02,
            }
        )
        mem = res.get("peak_memory_gib")
        if mem and len(mem) == 2:
            a, b = mem.values()
            out.append(
                {
                    "target": f"{name}: peak GPU memory at 2x latent frames within 5% of 1x",
                    "measured": round(b / a, 4),
                    "met": b <= 1.05 * a,
                }
            )
        s, a = res["sync"], res["async"]
        out.append(
            {
                "target": f"{name}: sync -> async (min/mean/p99 s, RTF)",
                "measured": {
                    "sync": [
                        round(s["min"], 3),
                        round(s["mean"], 3),
                        round(s["p99"], 3),
                        round(s["rtf"], 3),
                    ],
                    "async": [
                        round(a["min"], 3),
                        round(a["mean"], 3),
                        round(a["p99"], 3),
                        round(a["rtf"], 3),
                    ],
                    "gain": round(1 - a["mean"] / s["mean"], 4),
                },
                "met": None,
            }
        )
    return out
