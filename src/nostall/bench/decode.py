"""``nostall bench decode``: Wan 2.1 VAE, 720p, sync vs async vs decode-only, real MP4s.

For each precision: one warm-up of every mode, then ``repeat`` rounds that run
decode-only (no output), the synchronous baseline and the asynchronous pipeline
back to back (interleaved, so drift hits all three alike), each writing a real
MP4 through PyAV/libx264; then each output mode once with the raw ``.npy`` sink;
then one profiled decode per mode (decode-only included, as the reference) for
the kernel utilisation and the timeline picture; then peak GPU memory at
``latent_frames`` and ``2 * latent_frames - 1`` (twice the video length).

A precision can be benchmarked in one process and another in the next (a GPU
machine call has a time limit); :func:`merge_reports` joins the JSON reports and
re-evaluates the targets.
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
    submit_decode,
)

__all__ = ["evaluate_targets", "merge_reports", "run_decode_bench"]

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


PARTS = ("timed", "memory", "back-to-back")


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
    parts: tuple[str, ...] = PARTS,
    back_to_back: int = 3,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the benchmark; return the JSON-able report.

    ``parts`` picks the sections: ``timed`` (rounds, raw sink, profiles, timeline),
    ``memory`` (peak GPU memory at 1x and 2x the length; CUDA only) and
    ``back-to-back`` (``back_to_back`` videos in a row: decode-only against
    :func:`~nostall.video.submit_decode`, whose encoder flush overlaps the next decode).
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"parts must be some of {PARTS}, got {tuple(parts)!r}")
    dev = torch.device(device)
    if set(parts) == {"memory"} and dev.type != "cuda":
        raise ValueError(f"peak GPU memory needs a CUDA device, got device={device!r}")
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
            "parts": list(parts),
        },
        "results": {},
    }
    for name in dtypes:
        dtype = DTYPES[name]
        vae = _vae(size, dev, dtype)
        g = torch.Generator(device=dev).manual_seed(1)
        z = torch.randn(1, 16, latent_frames, h, w, device=dev, generator=g).to(dtype)
        res: dict = {}
        if "timed" in parts:
            res.update(
                _timed(name, vae, z, dev, repeat, preset, crf, out_dir, figure, profile, log)
            )
        if "back-to-back" in parts and back_to_back > 0:
            res["back_to_back"] = _back_to_back(
                name, vae, z, dev, back_to_back, preset, crf, out_dir, log
            )
        if "memory" in parts and dev.type == "cuda":
            res["peak_memory_gib"] = _peak_memory(vae, dev, dtype, h, w, latent_frames)
            log(f"{name} peak GPU memory: {res['peak_memory_gib']}")
        report["results"][name] = res
        del vae, z
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["targets"] = evaluate_targets(report)
    return report


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(name, vae, z, dev, repeat, preset, crf, out_dir, figure, profile, log):
    h, w = z.shape[-2:]
    frames = frame_count(int(z.shape[2]))

    res: dict = {}
    mp4 = os.path.join(out_dir, f"{name}.mp4")

    def decode_only() -> float:
        _sync(dev)
        t = time.perf_counter()
        drain(decode_chunks(vae, z), device=dev)
        return time.perf_counter() - t

    closes: dict[str, list[float]] = {"sync": [], "async": []}

    def to_file(pipe, path, mode=None) -> float:
        _sync(dev)
        t = time.perf_counter()
        result = decode_to_file(vae, z, path, preset=preset, crf=crf, pipeline=pipe)
        _sync(dev)
        elapsed = time.perf_counter() - t
        if mode is not None:
            closes[mode].append(result.close_s)
        return elapsed

    with SyncFramePipeline(device=dev) as sp, AsyncFramePipeline(device=dev) as ap:
        modes = {
            "decode-only": decode_only,
            "sync": lambda: to_file(sp, mp4, "sync"),
            "async": lambda: to_file(ap, mp4, "async"),
        }
        for m, fn in modes.items():
            log(f"{name} warm-up {m}: {fn():.2f} s")
        for v in closes.values():
            v.clear()
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
        for m, v in closes.items():
            # Closing the MP4 after the last frame: x264's delayed (look-ahead) frames,
            # the trailer, the rename. Nothing is left on the GPU to overlap it with.
            res[m]["close_mean_s"] = float(np.mean(v))
        res["mp4_bytes"] = os.path.getsize(mp4)
        npy = os.path.join(out_dir, f"{name}.npy")
        res["raw_npy"] = {"sync": to_file(sp, npy), "async": to_file(ap, npy)}
        os.remove(npy)
        log(
            f"{name} raw .npy sink: sync {res['raw_npy']['sync']:.2f} s, async {res['raw_npy']['async']:.2f} s"
        )
        if profile and dev.type == "cuda":
            res["utilisation"], traces = _profile(vae, z, dev, sp, ap, out_dir, name, preset, crf)
            log(f"{name} kernel utilisation: {res['utilisation']}")
            if figure:
                fig = figure.replace("{dtype}", name)
                title = f"Wan 2.1 VAE {w * 8}x{h * 8}, {name}, MP4 (libx264 {preset})"
                plot_timelines(traces, fig, title=title)
                res["figure"] = fig
    return res


def _back_to_back(name, vae, z, dev, n, preset, crf, out_dir, log) -> dict:
    """``n`` videos in a row: decode-only, one ``decode_to_file`` at a time, and
    ``submit_decode`` (each file finished on the writer thread while the next decodes)."""

    paths = [os.path.join(out_dir, f"{name}-b2b-{i}.mp4") for i in range(n)]
    out: dict = {"videos": n}
    with AsyncFramePipeline(device=dev) as ap:
        # warm-up (first MP4 of the process, allocator, cuDNN choices)
        drain(decode_chunks(vae, z), device=dev)
        decode_to_file(vae, z, paths[0], preset=preset, crf=crf, pipeline=ap)
        _sync(dev)
        t = time.perf_counter()
        for _ in range(n):
            drain(decode_chunks(vae, z), device=dev)
        out["decode_only_s"] = time.perf_counter() - t
        _sync(dev)
        t = time.perf_counter()
        for p in paths:
            decode_to_file(vae, z, p, preset=preset, crf=crf, pipeline=ap)
        _sync(dev)
        out["one_at_a_time_s"] = time.perf_counter() - t
        t = time.perf_counter()
        futures = [submit_decode(vae, z, p, preset=preset, crf=crf, pipeline=ap) for p in paths]
        results = [f.result() for f in futures]
        _sync(dev)
        out["submit_s"] = time.perf_counter() - t
    out["close_s"] = [round(r.close_s, 4) for r in results]
    for k in ("decode_only_s", "one_at_a_time_s", "submit_s"):
        out[k.replace("_s", "_per_video_s")] = out[k] / n
    out["submit_vs_decode_only"] = out["submit_s"] / out["decode_only_s"]
    out["one_at_a_time_vs_decode_only"] = out["one_at_a_time_s"] / out["decode_only_s"]
    log(f"{name} back to back x{n}: {out}")
    return out


def _profile(vae, z, dev, sp, ap, out_dir, name, preset, crf):
    from torch.profiler import ProfilerActivity, profile

    util, traces = {}, {}
    mp4 = os.path.join(out_dir, f"{name}-prof.mp4")
    runs = {
        "decode-only": lambda: drain(decode_chunks(vae, z), device=dev),
        "sync": lambda: decode_to_file(vae, z, mp4, preset=preset, crf=crf, pipeline=sp).stats,
        "async": lambda: decode_to_file(vae, z, mp4, preset=preset, crf=crf, pipeline=ap).stats,
    }
    for label, fn in runs.items():
        path = os.path.join(out_dir, f"trace-{name}-{label}.json")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            stats = fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        tr = load_trace(path)
        os.remove(path)  # ~100 MB each; the figures below are what we keep
        if label == "async":
            tr.add_writes_from_log(stats.chunk_log)  # writer-thread ranges are not traced
        window = tr.steady_window()
        whole = tr.whole()
        util[label] = {
            "steady_two_chunks": tr.utilisation(*window) if window else None,
            "whole_decode": tr.utilisation(*whole),
            "busy_steady_two_chunks": tr.busy(*window) if window else None,
            "busy_whole_decode": tr.busy(*whole),
            "chunks_seen": len(tr.chunks),
            "kernels": len(tr.kernels),
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
        b2b = res.get("back_to_back")
        if b2b:
            out.append(
                {
                    "target": f"{name}: {b2b['videos']} videos back to back, submit_decode vs "
                    f"decode-only (supplementary: the encoder flush overlaps the next decode)",
                    "measured": round(b2b["submit_vs_decode_only"], 4),
                    "met": None,
                }
            )
        if "async" not in res:
            continue
        u = res.get("utilisation", {}).get("async", {})
        if u.get("steady_two_chunks") is not None:
            ref = res["utilisation"].get("decode-only", {})
            target = {
                "target": f"{name}: async kernel utilisation >= 99.5% steady, >= 99% whole decode (MP4)",
                "measured": [round(u["steady_two_chunks"], 4), round(u["whole_decode"], 4)],
                "met": u["steady_two_chunks"] >= 0.995 and u["whole_decode"] >= 0.99,
            }
            if ref.get("steady_two_chunks") is not None:
                # The decoder alone, no output: what the pipeline cannot exceed.
                target["decode_only"] = [
                    round(ref["steady_two_chunks"], 4),
                    round(ref["whole_decode"], 4),
                ]
            out.append(target)
        ratio = res["async"]["mean"] / res["decode-only"]["mean"]
        out.append(
            {
                "target": f"{name}: async end-to-end <= 1.02x decode-only",
                "measured": round(ratio, 4),
                "met": ratio <= 1.02,
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


def merge_reports(reports: list[dict]) -> dict:
    """Join reports of the same configuration run in separate processes.

    Results of one precision found in several reports are merged key by key (a
    memory-only report adds ``peak_memory_gib``); each report keeps its own date,
    commit and sections under ``runs``. Targets are evaluated again on the merged results.
    """
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    base = reports[0]
    keys = ("latents", "frames", "size", "mp4")
    merged = {k: v for k, v in base.items() if k not in ("results", "targets")}
    merged["results"] = {}
    merged["runs"] = []
    for r in reports:
        if any(r["config"].get(k) != base["config"].get(k) for k in keys):
            raise ValueError(
                f"cannot merge decode reports of different configurations: "
                f"{ {k: r['config'].get(k) for k in keys} } vs "
                f"{ {k: base['config'].get(k) for k in keys} }"
            )
        merged["runs"].append(
            {
                "date": r["date"],
                "commit": r["commit"],
                "dtypes": sorted(r["results"]),
                "parts": _parts_in(r),
            }
        )
        for name, res in r["results"].items():
            merged["results"].setdefault(name, {}).update(res)
    merged["targets"] = evaluate_targets(merged)
    return merged


def _parts_in(report: dict) -> list[str]:
    """The sections a report holds results for (older reports did not list them)."""
    found = set()
    for res in report["results"].values():
        found |= {p for p, key in _PART_KEYS.items() if key in res}
    return [p for p in PARTS if p in found]


_PART_KEYS = {"timed": "async", "memory": "peak_memory_gib", "back-to-back": "back_to_back"}
