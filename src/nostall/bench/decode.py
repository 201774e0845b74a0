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

import copy
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from nostall.bench.record import header
from nostall.bench.targets import Targets
from nostall.bench.timeline import load_trace, plot_timelines
from nostall.bench.timing import sync, sync_all
from nostall.errors import ArgumentError
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

__all__ = ["evaluate_targets", "merge_reports", "run_decode_bench", "summarise"]

SIZES = {"720p": (90, 160), "480p": (60, 104), "tiny": (4, 6)}  # tiny: 48x32 px, CI on a CPU
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
RTF_FPS = 24  # the seed's real-time factor: seconds of decode per second of 24 fps video


def _vae(size: str, device: torch.device, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    kwargs = (
        {} if size != "tiny" else {"base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}
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


PARTS = ("timed", "memory", "back-to-back", "modes")
DECODER_MODES = ("eager", "exact", "fast")


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
    modes: tuple[str, ...] = DECODER_MODES,
    devices: tuple[str, ...] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the benchmark; return the JSON-able report.

    ``parts`` picks the sections: ``timed`` (rounds, raw sink, profiles, timeline),
    ``memory`` (peak GPU memory at 1x and 2x the length; CUDA only) and
    ``back-to-back`` (``back_to_back`` videos in a row: decode-only against
    :func:`~nostall.video.submit_decode`, whose encoder flush overlaps the next decode)
    and ``modes`` (issue #9: each decoder mode of ``modes``, eager always included as
    the reference: first call, decode-only and async MP4 rounds, peak memory, every
    frame compared with eager's; with ``devices``, exact split over those GPUs too).
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ArgumentError(f"parts must be some of {PARTS}, got {tuple(parts)!r}")
    bad = sorted(set(modes) - set(DECODER_MODES))
    if bad:
        raise ArgumentError(f"decoder modes must be some of {DECODER_MODES}, got {tuple(modes)!r}")
    modes = ("eager", *(m for m in modes if m != "eager"))
    dev = torch.device(device)
    if set(parts) == {"memory"} and dev.type != "cuda":
        raise ArgumentError(f"peak GPU memory needs a CUDA device, got device={device!r}")
    h, w = SIZES[size]
    frames = frame_count(latent_frames)
    out_dir = out_dir or tempfile.mkdtemp(prefix="nostall-decode-")
    os.makedirs(out_dir, exist_ok=True)
    report: dict = {
        **header("decode", dev),
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
            "decoder_modes": list(modes) if "modes" in parts else [],
            "devices": list(devices) if devices and "modes" in parts else None,
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
        if "modes" in parts:
            res["modes"] = _decoder_modes(
                name, vae, z, dev, repeat, preset, crf, out_dir, modes, log
            )
            if devices:
                res["devices"] = _devices(
                    name, vae, z, repeat, preset, crf, out_dir, devices, res["modes"], log
                )
        if "memory" in parts and dev.type == "cuda":
            res["peak_memory_gib"] = _peak_memory(vae, dev, dtype, h, w, latent_frames)
            log(f"{name} peak GPU memory: {res['peak_memory_gib']}")
        report["results"][name] = res
        del vae, z
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["targets"] = evaluate_targets(report)
    report["summary"] = summarise(report)
    return report


def _timed(name, vae, z, dev, repeat, preset, crf, out_dir, figure, profile, log):
    h, w = z.shape[-2:]
    frames = frame_count(int(z.shape[2]))

    res: dict = {}
    mp4 = os.path.join(out_dir, f"{name}.mp4")

    def decode_only() -> float:
        sync(dev)
        t = time.perf_counter()
        drain(decode_chunks(vae, z), device=dev)
        return time.perf_counter() - t

    closes: dict[str, list[float]] = {"sync": [], "async": []}

    def to_file(pipe, path, mode=None) -> float:
        sync(dev)
        t = time.perf_counter()
        result = decode_to_file(vae, z, path, preset=preset, crf=crf, pipeline=pipe)
        sync(dev)
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


def _frames(vae, z, **kw) -> torch.Tensor:
    return torch.cat(list(decode_chunks(vae, z, **kw)), dim=2)


def _compare(out: dict, got: torch.Tensor, ref: torch.Tensor) -> None:
    got = got.to(ref.device)
    out["bit_identical"] = bool(torch.equal(got, ref))
    out["mismatches"] = int((got != ref).sum())
    out["max_abs_diff"] = float((got.float() - ref.float()).abs().max())


def _psnr(got: torch.Tensor, ref: torch.Tensor) -> float | None:
    """PSNR in dB of frames in [-1, 1] (peak-to-peak 2) against ``ref``; ``None`` if equal."""
    mse = float(((got.to(ref.device).float() - ref.float()) ** 2).mean())
    return None if mse == 0.0 else round(10.0 * float(np.log10(4.0 / mse)), 3)


def _reference_fp32(vae, z) -> torch.Tensor:
    """Eager fp32 frames of the same latents and the same weights (for PSNR)."""
    vae32 = copy.deepcopy(vae).float()
    try:
        return _frames(vae32, z.float())
    finally:
        del vae32


def _decoder_modes(name, vae, z, dev, repeat, preset, crf, out_dir, modes, log) -> dict:
    """Each decoder mode: first call, then ``repeat`` interleaved rounds of decode-only
    and async MP4, peak memory of a decode-only run, its frames against eager's and
    their PSNR against an fp32 eager decode, and (CUDA) the kernel-busy share of a
    profiled async MP4 run."""
    frames = frame_count(int(z.shape[2]))
    out: dict = {m: {} for m in modes}
    with torch.inference_mode():
        ref = _frames(vae, z)  # eager: vae.decoder as vae.decode calls it
        ref32 = ref if z.dtype == torch.float32 else _reference_fp32(vae, z)
    with AsyncFramePipeline(device=dev) as ap:
        for mode in modes:
            r = out[mode]
            sync(dev)
            t = time.perf_counter()
            drain(decode_chunks(vae, z, mode=mode), device=dev)
            r["first_call_s"] = time.perf_counter() - t  # compile/capture land here
            mp4 = os.path.join(out_dir, f"{name}-{mode}.mp4")
            decode_to_file(vae, z, mp4, preset=preset, crf=crf, pipeline=ap, mode=mode)
        times = {m: {"decode_only": [], "async_mp4": []} for m in modes}
        closes: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(repeat):
            for mode in modes:
                sync(dev)
                t = time.perf_counter()
                drain(decode_chunks(vae, z, mode=mode), device=dev)
                times[mode]["decode_only"].append(time.perf_counter() - t)
                mp4 = os.path.join(out_dir, f"{name}-{mode}.mp4")
                sync(dev)
                t = time.perf_counter()
                done = decode_to_file(vae, z, mp4, preset=preset, crf=crf, pipeline=ap, mode=mode)
                sync(dev)
                times[mode]["async_mp4"].append(time.perf_counter() - t)
                closes[mode].append(done.close_s)
            log(
                f"{name} modes round {i + 1}/{repeat}: "
                + ", ".join(
                    f"{m} {times[m]['decode_only'][-1]:.2f}/{times[m]['async_mp4'][-1]:.2f} s"
                    for m in modes
                )
            )
    for mode in modes:
        r = out[mode]
        r["decode_only"] = _summary(times[mode]["decode_only"], frames)
        r["async_mp4"] = _summary(times[mode]["async_mp4"], frames)
        r["async_vs_decode_only"] = round(r["async_mp4"]["mean"] / r["decode_only"]["mean"], 4)
        # the encoder's flush after the last frame (x264's delayed frames, the trailer):
        # a fixed cost, so a larger share of a faster decode
        r["async_close_mean_s"] = round(float(np.mean(closes[mode])), 4)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            drain(decode_chunks(vae, z, mode=mode), device=dev)
            r["peak_gib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
        with torch.inference_mode():
            got = ref if mode == "eager" else _frames(vae, z, mode=mode)
            if mode != "eager":
                _compare(r, got, ref)
            if got is not ref32:
                r["psnr_db_vs_fp32_eager"] = _psnr(got, ref32)
            del got
        if dev.type == "cuda":
            r["utilisation_async_mp4"] = _mode_utilisation(
                vae, z, dev, out_dir, name, mode, preset, crf
            )
        log(
            f"{name} {mode}: decode-only {r['decode_only']['mean']:.3f} s, async MP4 "
            f"{r['async_mp4']['mean']:.3f} s ({r['async_vs_decode_only']:.4f}x)"
            + (f", bit-identical {r['bit_identical']}" if "bit_identical" in r else "")
            + (f", PSNR {r['psnr_db_vs_fp32_eager']} dB" if "psnr_db_vs_fp32_eager" in r else "")
            + (
                f", steady kernel-busy {r['utilisation_async_mp4']['steady_two_chunks']}"
                if "utilisation_async_mp4" in r
                else ""
            )
        )
    del ref, ref32
    return out


def _mode_utilisation(vae, z, dev, out_dir, name, mode, preset, crf) -> dict:
    """One profiled async MP4 decode in ``mode``: kernel-busy share of two steady chunks
    and of the whole decode."""
    from torch.profiler import ProfilerActivity, profile

    mp4 = os.path.join(out_dir, f"{name}-{mode}-prof.mp4")
    path = os.path.join(out_dir, f"trace-{name}-{mode}.json")
    with AsyncFramePipeline(device=dev) as ap:
        decode_to_file(vae, z, mp4, preset=preset, crf=crf, pipeline=ap, mode=mode)  # warm
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode_to_file(vae, z, mp4, preset=preset, crf=crf, pipeline=ap, mode=mode)
            torch.cuda.synchronize(dev)
    prof.export_chrome_trace(path)
    tr = load_trace(path)
    os.remove(path)
    window = tr.steady_window()
    return {
        "steady_two_chunks": round(tr.utilisation(*window), 5) if window else None,
        "whole_decode": round(tr.utilisation(*tr.whole()), 5),
        "kernels": len(tr.kernels),
    }


def _devices(name, vae, z, repeat, preset, crf, out_dir, devices, modes, log) -> dict:
    """``exact`` split over ``devices`` against ``exact`` on the first one."""
    frames = frame_count(int(z.shape[2]))
    last = torch.device(devices[-1])
    out: dict = {"devices": list(devices)}
    mp4 = os.path.join(out_dir, f"{name}-devices.mp4")
    dec, asy = [], []
    with AsyncFramePipeline(device=last) as ap:
        t = time.perf_counter()
        drain(decode_chunks(vae, z, mode="exact", devices=devices), device=last)
        sync_all(devices)
        out["first_call_s"] = time.perf_counter() - t
        for _ in range(repeat):
            sync_all(devices)
            t = time.perf_counter()
            drain(decode_chunks(vae, z, mode="exact", devices=devices), device=last)
            sync_all(devices)
            dec.append(time.perf_counter() - t)
            t = time.perf_counter()
            decode_to_file(
                vae, z, mp4, preset=preset, crf=crf, pipeline=ap, mode="exact", devices=devices
            )
            sync_all(devices)
            asy.append(time.perf_counter() - t)
    out["decode_only"] = _summary(dec, frames)
    out["async_mp4"] = _summary(asy, frames)
    one = modes.get("exact", {}).get("decode_only", {}).get("mean")
    out["speedup"] = round(one / out["decode_only"]["mean"], 4) if one else None
    with torch.inference_mode():
        ref = _frames(vae, z, mode="exact")
        _compare(out, _frames(vae, z, mode="exact", devices=devices), ref)
    log(f"{name} exact over {devices}: {out['decode_only']['mean']:.3f} s ({out['speedup']}x)")
    return out


def _back_to_back(name, vae, z, dev, n, preset, crf, out_dir, log) -> dict:
    """``n`` videos in a row: decode-only, one ``decode_to_file`` at a time, and
    ``submit_decode`` (each file finished on the writer thread while the next decodes)."""

    paths = [os.path.join(out_dir, f"{name}-b2b-{i}.mp4") for i in range(n)]
    out: dict = {"videos": n}
    with AsyncFramePipeline(device=dev) as ap:
        # warm-up (first MP4 of the process, allocator, cuDNN choices)
        drain(decode_chunks(vae, z), device=dev)
        decode_to_file(vae, z, paths[0], preset=preset, crf=crf, pipeline=ap)
        sync(dev)
        t = time.perf_counter()
        for _ in range(n):
            drain(decode_chunks(vae, z), device=dev)
        out["decode_only_s"] = time.perf_counter() - t
        sync(dev)
        t = time.perf_counter()
        for p in paths:
            decode_to_file(vae, z, p, preset=preset, crf=crf, pipeline=ap)
        sync(dev)
        out["one_at_a_time_s"] = time.perf_counter() - t
        t = time.perf_counter()
        futures = [submit_decode(vae, z, p, preset=preset, crf=crf, pipeline=ap) for p in paths]
        results = [f.result() for f in futures]
        sync(dev)
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


def evaluate_targets(report: dict) -> dict[str, dict]:
    """The issues' targets, each ``{"value", "threshold", "op", "met"}`` (``None``: not
    measured in this report). Supplementary figures are in :func:`summarise`."""
    t = Targets()

    results = report["results"]
    for name, res in results.items():
        mem = res.get("peak_memory_gib")
        if mem and len(mem) == 2:
            a, b = mem.values()
            t.add(f"{name}_peak_memory_2x_vs_1x_latent_frames", round(b / a, 4), "<=", 1.05)
        if "async" in res:
            u = res.get("utilisation", {}).get("async", {})
            if u.get("steady_two_chunks") is not None:
                t.add(f"{name}_async_kernel_util_steady", u["steady_two_chunks"], ">=", 0.995)
                t.add(f"{name}_async_kernel_util_whole", u["whole_decode"], ">=", 0.99)
            ratio = res["async"]["mean"] / res["decode-only"]["mean"]
            t.add(f"{name}_async_vs_decode_only", round(ratio, 4), "<=", 1.02)
    # Issue #9: the decoder modes (the "modes" part).
    modes = {name: res.get("modes", {}) for name, res in results.items()}
    if any(modes.values()):
        bf16, fp32 = modes.get("bf16", {}), modes.get("fp32", {})

        def decode_s(m: dict, mode: str):
            return m.get(mode, {}).get("decode_only", {}).get("mean")

        def speedup(m: dict, mode: str):
            a, b = decode_s(m, "eager"), decode_s(m, mode)
            return round(a / b, 4) if a and b else None

        t.add("exact_bf16_decode_s", decode_s(bf16, "exact"), "<=", 5.5)
        t.add("exact_bf16_speedup_vs_eager", speedup(bf16, "exact"), ">=", 1.5)
        t.add("exact_fp32_speedup_vs_eager", speedup(fp32, "exact"), ">=", 1.4)
        for name, m in modes.items():
            exact = m.get("exact", {})
            if "bit_identical" in exact:
                t.add(
                    f"exact_{name}_bit_identical_to_vae_decode",
                    int(exact["bit_identical"]),
                    ">=",
                    1,
                )
            eager_peak = m.get("eager", {}).get("peak_gib")
            if exact.get("peak_gib") is not None and eager_peak:
                t.add(
                    f"exact_{name}_peak_memory_vs_eager",
                    round(exact["peak_gib"] / eager_peak, 4),
                    "<=",
                    1.0,
                )
            for mode, r in m.items():
                if r.get("async_vs_decode_only") is not None:
                    t.add(
                        f"{mode}_{name}_async_vs_decode_only", r["async_vs_decode_only"], "<=", 1.02
                    )
        t.add("fast_bf16_decode_s", decode_s(bf16, "fast"), "<=", 4.0)
        t.add("fast_bf16_speedup_vs_eager", speedup(bf16, "fast"), ">=", 2.0)
        eager_db = bf16.get("eager", {}).get("psnr_db_vs_fp32_eager")
        fast_db = bf16.get("fast", {}).get("psnr_db_vs_fp32_eager")
        gap = round(eager_db - fast_db, 3) if eager_db is not None and fast_db is not None else None
        t.add("fast_bf16_psnr_gap_to_bf16_eager_db", gap, "<=", 0.5)
        for name, m in modes.items():
            for mode, r in m.items():
                u = (r.get("utilisation_async_mp4") or {}).get("steady_two_chunks")
                if u is not None:
                    t.add(f"{mode}_{name}_async_kernel_util_steady", u, ">=", 0.995)
            fast = m.get("fast", {})
            eager_peak = m.get("eager", {}).get("peak_gib")
            if fast.get("peak_gib") is not None and eager_peak:
                t.add(
                    f"fast_{name}_peak_memory_vs_eager",
                    round(fast["peak_gib"] / eager_peak, 4),
                    "<=",
                    1.0,
                )
        two = results.get("bf16", {}).get("devices", {})
        t.add("exact_bf16_two_gpus_speedup_vs_one", two.get("speedup"), ">=", 1.8)
    return t


def summarise(report: dict) -> list[dict]:
    """Figures reported beside the targets (no threshold of their own)."""
    out = []
    for name, res in report["results"].items():
        b2b = res.get("back_to_back")
        if b2b:
            out.append(
                {
                    "what": f"{name}: {b2b['videos']} videos back to back, submit_decode vs "
                    f"decode-only (the encoder flush overlaps the next decode)",
                    "value": round(b2b["submit_vs_decode_only"], 4),
                }
            )
        if "sync" in res and "async" in res:
            s, a = res["sync"], res["async"]
            out.append(
                {
                    "what": f"{name}: sync -> async mean seconds, RTF",
                    "value": {
                        "sync": [round(s["mean"], 3), round(s["rtf"], 3)],
                        "async": [round(a["mean"], 3), round(a["rtf"], 3)],
                        "gain": round(1 - a["mean"] / s["mean"], 4),
                    },
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
        raise ArgumentError("merge_reports needs at least one report")
    base = reports[0]
    keys = ("latents", "frames", "size", "mp4")
    merged = {k: v for k, v in base.items() if k not in ("results", "targets")}
    merged["results"] = {}
    merged["runs"] = []
    for r in reports:
        if any(r["config"].get(k) != base["config"].get(k) for k in keys):
            raise ArgumentError(
                f"cannot merge decode reports of different configurations: "
                f"{ {k: r['config'].get(k) for k in keys} } vs "
                f"{ {k: base['config'].get(k) for k in keys} }"
            )
        merged["runs"].append(
            {
                "date": r["date"],
                "commit": r["commit"],
                "dirty": r.get("dirty"),
                "dtypes": sorted(r["results"]),
                "parts": _parts_in(r),
            }
        )
        for name, res in r["results"].items():
            merged["results"].setdefault(name, {}).update(res)
    # One run from a changed tree makes the merged record one; unknown stays unknown.
    dirty = [run["dirty"] for run in merged["runs"]]
    merged["dirty"] = True if True in dirty else (False if all(d is False for d in dirty) else None)
    merged["targets"] = evaluate_targets(merged)
    merged["summary"] = summarise(merged)
    return merged


def _parts_in(report: dict) -> list[str]:
    """The sections a report holds results for (older reports did not list them)."""
    found = set()
    for res in report["results"].values():
        found |= {p for p, key in _PART_KEYS.items() if key in res}
    return [p for p in PARTS if p in found]


_PART_KEYS = {
    "timed": "async",
    "memory": "peak_memory_gib",
    "back-to-back": "back_to_back",
    "modes": "modes",
}


def tables(report: dict) -> list:
    """What ``nostall bench decode`` prints after a run: sync, async and decode-only per
    dtype, back to back, the decoder modes, the targets and the summary lines."""
    from rich.table import Table

    from nostall.bench import targets

    cfg, out = report["config"], []
    on = report["hardware"].get("gpu", "CPU")
    table = Table(title=f"decode bench: {cfg['size']}, {cfg['frames']} frames, {on}")
    cols = ("dtype", "mode", "min s", "mean s", "p99 s", "frames/s", "RTF@24", "close s", "util")
    for col in cols:
        table.add_column(col, justify="left" if col in ("dtype", "mode") else "right")
    for name, res in report["results"].items():
        for mode in ("decode-only", "sync", "async"):
            if mode not in res:
                continue
            r = res[mode]
            u = res.get("utilisation", {}).get(mode, {}).get("steady_two_chunks")
            table.add_row(
                name,
                mode,
                f"{r['min']:.3f}",
                f"{r['mean']:.3f}",
                f"{r['p99']:.3f}",
                f"{r['frames_per_s']:.1f}",
                f"{r['rtf']:.3f}",
                f"{r['close_mean_s']:.3f}" if "close_mean_s" in r else "",
                f"{u:.2%}" if u is not None else "",
            )
    if table.row_count:
        out.append(table)
    b2b = {n: r["back_to_back"] for n, r in report["results"].items() if "back_to_back" in r}
    if b2b:
        bt = Table(title="back to back: seconds per video")
        for col in ("dtype", "videos", "decode-only", "one at a time", "submit_decode"):
            bt.add_column(col, justify="left" if col == "dtype" else "right")
        for name, r in b2b.items():
            bt.add_row(
                name,
                str(r["videos"]),
                f"{r['decode_only_per_video_s']:.3f}",
                f"{r['one_at_a_time_per_video_s']:.3f} ({r['one_at_a_time_vs_decode_only']:.3f}x)",
                f"{r['submit_per_video_s']:.3f} ({r['submit_vs_decode_only']:.3f}x)",
            )
        out.append(bt)
    by_mode = {n: r["modes"] for n, r in report["results"].items() if "modes" in r}
    if by_mode:
        mt = Table(title="decoder modes: seconds per video (mean)")
        for col in (
            "dtype",
            "mode",
            "first call",
            "decode-only",
            "async MP4",
            "ratio",
            "peak GiB",
            "frames vs eager",
            "PSNR vs fp32",
            "busy",
        ):
            mt.add_column(col, justify="left" if col in ("dtype", "mode") else "right")
        for name, m in by_mode.items():
            rows = list(m.items())
            two = report["results"][name].get("devices")
            if two:
                rows.append((f"exact x{len(two['devices'])} GPUs", two))
            for label, r in rows:
                same = r.get("bit_identical")
                db = r.get("psnr_db_vs_fp32_eager", "")
                busy = (r.get("utilisation_async_mp4") or {}).get("steady_two_chunks")
                mt.add_row(
                    name,
                    label,
                    f"{r['first_call_s']:.3f}",
                    f"{r['decode_only']['mean']:.3f}",
                    f"{r['async_mp4']['mean']:.3f}",
                    f"{r['async_mp4']['mean'] / r['decode_only']['mean']:.4f}x",
                    f"{r['peak_gib']:.3f}" if "peak_gib" in r else "",
                    ""
                    if same is None
                    else ("bit-identical" if same else f"{r['mismatches']} differ"),
                    "same" if db is None else (f"{db:.2f} dB" if db != "" else ""),
                    f"{busy:.2%}" if busy is not None else "",
                )
        out.append(mt)
    out.append(targets.table(report["targets"]))
    out += [f"·  {item['what']}: {item['value']}" for item in report.get("summary", [])]
    return out
