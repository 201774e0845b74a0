# ruff: noqa: B023, F821, F841  (a one-off diagnostic: loop variables are rebound on purpose)
"""Where does the async decode lose time against decode-only? GPU machine only.

Prints, for the Wan 2.1 VAE at 720p (41 latent frames): timings of decode-only, async
(null sink and MP4 with several encoder thread counts, with the sink's close timed
apart), sync MP4; then from profiler traces of decode-only and async MP4 the kernel
utilisation, the GPU gaps by size, what fills them (memcpy/memset) and whether the GPU
was starved by the launching thread (kernel launched after the gap began).
Writes $OUT/diag-decode.json.
"""

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nostall.bench.decode import SIZES, _vae
from nostall.video import AsyncFramePipeline, NullSink, SyncFramePipeline, decode_chunks, drain
from nostall.video.sinks import Mp4Sink

OUT = os.environ.get("OUT", "bench-out")
dev = torch.device("cuda")
report: dict = {}


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, r


def gaps(path):
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    kernels, others, launch = [], [], {}
    for e in ev:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        a = float(e["ts"])
        b = a + float(e.get("dur", 0))
        corr = e.get("args", {}).get("correlation")
        if cat == "kernel":
            kernels.append((a, b, corr))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            others.append((a, b, e["name"], e.get("args", {}).get("stream")))
        elif cat == "cuda_runtime" and corr is not None:
            launch[corr] = a
    kernels.sort()
    lo, hi = kernels[0][0], max(b for _, b, _ in kernels)
    busy, cur_b, gl = 0.0, None, []
    for a, b, corr in kernels:
        if cur_b is not None and a > cur_b:
            gl.append((cur_b, a, corr))
        cur_b = b if cur_b is None else max(cur_b, b)
    idle = sum(b - a for a, b, _ in gl)
    buckets = {
        "<5us": [0, 0.0],
        "5-20us": [0, 0.0],
        "20-100us": [0, 0.0],
        "0.1-1ms": [0, 0.0],
        ">1ms": [0, 0.0],
    }
    starved = [0, 0.0]
    filled = 0.0
    for a, b, corr in gl:
        d = b - a
        k = (
            "<5us"
            if d < 5
            else "5-20us"
            if d < 20
            else "20-100us"
            if d < 100
            else "0.1-1ms"
            if d < 1000
            else ">1ms"
        )
        buckets[k][0] += 1
        buckets[k][1] += d
        t = launch.get(corr)
        if t is not None and t > a:  # the next kernel was launched only after the GPU went idle
            starved[0] += 1
            starved[1] += d
    # overlap of the gaps with the union of memcpy/memset intervals (two-pointer sweep)
    ou = []
    for oa, ob, _, _ in sorted(others):
        if ou and oa <= ou[-1][1]:
            ou[-1][1] = max(ou[-1][1], ob)
        else:
            ou.append([oa, ob])
    j = 0
    for a, b, _ in gl:
        while j < len(ou) and ou[j][1] <= a:
            j += 1
        k = j
        while k < len(ou) and ou[k][0] < b:
            filled += max(0.0, min(ou[k][1], b) - max(ou[k][0], a))
            k += 1
    big = sorted(gl, key=lambda g: g[0] - g[1])[:12]
    return {
        "span_ms": (hi - lo) / 1e3,
        "kernels": len(kernels),
        "kernel_util": 1 - idle / (hi - lo),
        "idle_ms": idle / 1e3,
        "gaps": {k: [v[0], round(v[1] / 1e3, 3)] for k, v in buckets.items()},
        "starved_gaps": [starved[0], round(starved[1] / 1e3, 3)],
        "idle_filled_by_memcpy_memset_ms": round(filled / 1e3, 3),
        "biggest_gaps": [
            {
                "at_ms": round((a - lo) / 1e3, 2),
                "us": round(b - a, 1),
                "launch_after_gap_start_us": None
                if launch.get(c) is None
                else round(launch[c] - a, 1),
            }
            for a, b, c in big
        ],
        "memcpy_memset": {},
    } | {"memcpy_kinds": _kinds(others)}


def _kinds(others):
    out: dict = {}
    for a, b, name, stream in others:
        k = f"{name.split(' (')[0]} s{stream}"
        n, t = out.get(k, (0, 0.0))
        out[k] = (n + 1, round(t + (b - a) / 1e3, 3))
    return out


def mp4_run(pipe, z, vae, threads, path):
    sink = Mp4Sink(path, fps=16, threads=threads)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stats = pipe.run(decode_chunks(vae, z), sink)
    t1 = time.perf_counter()
    sink.close()
    t2 = time.perf_counter()
    last_write_end = stats.chunk_log[-1][2]
    return {
        "total": t2 - t0,
        "run": t1 - t0,
        "close": t2 - t1,
        "producer": stats.producer_s,
        "backpressure": stats.backpressure_s,
        "write": stats.write_s,
        "copy_wait": stats.copy_wait_s,
        "last_write_end": last_write_end,
    }


for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    h, w = SIZES["720p"]
    vae = _vae("720p", dev, dtype)
    z = torch.randn(1, 16, 41, h, w, device=dev, generator=torch.Generator(dev).manual_seed(1)).to(
        dtype
    )
    r = report[name] = {}
    mp4 = os.path.join(OUT, f"diag-{name}.mp4")
    with AsyncFramePipeline(device=dev) as ap, SyncFramePipeline(device=dev) as sp:
        r["warm_decode_only"] = timed(lambda: drain(decode_chunks(vae, z), device=dev))[0]
        print(name, "warm", r["warm_decode_only"], flush=True)
        t, st = timed(lambda: drain(decode_chunks(vae, z), device=dev))
        r["decode_only"] = {"total": t, "producer": None}
        t, st = timed(lambda: ap.run(decode_chunks(vae, z), NullSink()))
        r["async_null"] = {"total": t, "producer": st.producer_s, "backpressure": st.backpressure_s}
        r["pinned"] = [b.tensor.is_pinned() for b in ap._buffers.host if b is not None]
        print(name, json.dumps(r), flush=True)
        if name == "fp32":
            r["async_mp4_t0"] = mp4_run(ap, z, vae, 0, mp4)
            print(name, json.dumps(r), flush=True)
            continue
        for th in (0, 8, 4):
            r[f"async_mp4_t{th}"] = mp4_run(ap, z, vae, th, mp4)
        r["sync_mp4_t0"] = mp4_run(sp, z, vae, 0, mp4)
        print(name, json.dumps(r, indent=1), flush=True)
        for label, fn in (
            ("decode_only", lambda: drain(decode_chunks(vae, z), device=dev)),
            ("async_mp4", lambda: mp4_run(ap, z, vae, 0, mp4)),
            ("async_null", lambda: ap.run(decode_chunks(vae, z), NullSink())),
        ):
            path = os.path.join(OUT, f"diag-trace-{label}.json")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(path)
            r[f"trace_{label}"] = gaps(path)
            os.remove(path)
            print(label, json.dumps(r[f"trace_{label}"], indent=1), flush=True)
    del vae, z
    torch.cuda.empty_cache()
    with open(os.path.join(OUT, "diag-decode.json"), "w") as f:
        json.dump(report, f, indent=1)
print("done", file=sys.stderr)
