"""The GPU check's smoke figures and report (``scripts/gpu-check`` runs this on the GPU machine).

CI has no GPU, so ``scripts/gpu-check`` runs every ``cuda`` test, the demo on ``cuda``
and this short benchmark on the GPU machine, and this module folds the results into
one JSON record (``$OUT/gpu-check.json``): date, commit, GPU, tests passed /
failed / skipped (with the names of the ``cuda`` tests that ran), and smoke figures:

* **load**: a ~4 GB random bf16 checkpoint, ``safetensors.load_file(device=...)``
  beside nostall from the page cache (staging ring, into the pool) and from the pool
  (memory-cache hit), every result compared bit for bit with safetensors';
* **two GPUs** (when there are two): a pool registered from GPU 0's context feeding
  GPU 1, and both GPUs at once from one pinned block;
* **decode**: a short Wan 2.1 VAE decode at 480p, decode-only and the async MP4
  pipeline, the frames compared with ``vae.decode``.

Usage (on the GPU machine)::

    python -m nostall.bench.gpucheck smoke --out $OUT/smoke.json
    python -m nostall.bench.gpucheck report --junit $OUT/cuda.xml --smoke $OUT/smoke.json \\
        --demo-rc 0 --out $OUT/gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any

import torch

from nostall.bench.record import header, write_report
from nostall.bench.timing import sync_all, timed

__all__ = ["junit_summary", "run_smoke"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _write_checkpoint(path: str, nbytes: int) -> int:
    from safetensors.torch import save_file

    g = torch.Generator(device="cuda").manual_seed(0)
    n = max(1, nbytes // (2 * 64 << 20))
    tensors = {
        f"blocks.{i}.weight": torch.randn(4096, 8192, generator=g, device="cuda")
        .to(torch.bfloat16)
        .cpu()
        for i in range(n)
    }
    tensors["norm.weight"] = torch.ones(4096)
    save_file(tensors, path)
    return os.path.getsize(path)


def smoke_load(folder: str, *, nbytes: int = 4 << 30, repeat: int = 3) -> dict:
    """Page-cache and pool-hit loads of one checkpoint, against safetensors, bit-compared."""
    from safetensors.torch import load_file

    from nostall.memory.pool import PinnedPool
    from nostall.transfer.loader import Loader

    path = os.path.join(folder, "smoke.safetensors")
    size = _write_checkpoint(path, nbytes)
    dev = torch.device("cuda", 0)
    out: dict[str, Any] = {"bytes": size}
    ref_s, ref = timed(None, load_file, path, device=str(dev))
    out["safetensors_page_cache_s"] = ref_s
    with Loader() as loader, PinnedPool(int(size * 1.2), device=dev) as pool:
        loader.prepare(dev)
        pool.wait_pinned()
        best: dict[str, float] = {}
        equal = True
        for _ in range(repeat):
            pool.evict()
            for name, kwargs in (
                ("nostall_ring_page_cache", {}),
                ("nostall_pool_read_page_cache", {"pool": pool}),
                ("nostall_pool_hit", {"pool": pool}),
            ):
                torch.cuda.empty_cache()
                s, result = timed(None, loader.load, path, device=dev, **kwargs)
                equal &= _same(result.tensors, ref)
                best[name] = min(best.get(name, float("inf")), s)
                del result
        for name, s in best.items():
            out[f"{name}_s"] = s
            out[f"{name}_gbps"] = size / s / 1e9
        out["equal_to_safetensors"] = equal
        if torch.cuda.device_count() >= 2:
            out["two_gpus"] = _two_gpus(loader, pool, path, size, ref)
    return out


def _two_gpus(loader, pool, path: str, size: int, ref: dict) -> dict:
    """Pool registered from GPU 0's context: a hit to GPU 1, then both GPUs at once."""
    from nostall.transfer.loader import Loader

    gpu1 = torch.device("cuda", 1)
    loader.load(path, device=gpu1, pool=pool)  # warm the copy stream of GPU 1
    torch.cuda.empty_cache()
    s1, r1 = timed(None, loader.load, path, device=gpu1, pool=pool)
    equal = _same({k: v.to("cuda:0") for k, v in r1.tensors.items()}, ref)
    del r1
    with Loader() as other:
        other.load(path, device=gpu1, pool=pool)  # warm
        times: dict[int, float] = {}
        barrier = threading.Barrier(2)

        def run(ld, d):
            barrier.wait()
            t = time.perf_counter()
            ld.load(path, device=torch.device("cuda", d), pool=pool)
            torch.cuda.synchronize(d)
            times[d] = time.perf_counter() - t

        sync_all()
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=run, args=(ld, d)) for ld, d in ((loader, 0), (other, 1))
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        both = time.perf_counter() - t0
    return {
        "hit_to_gpu1_s": s1,
        "hit_to_gpu1_gbps": size / s1 / 1e9,
        "both_gpus_s": both,
        "both_gpus_total_gbps": 2 * size / both / 1e9,
        "per_gpu_s": times,
        "equal": equal,
    }


def smoke_decode(folder: str, *, latent_frames: int = 9) -> dict:
    """A short Wan 2.1 VAE decode at 480p: decode-only, async MP4, frames vs ``vae.decode``."""
    from diffusers import AutoencoderKLWan

    from nostall.video import AsyncFramePipeline, decode_chunks, decode_to_file, drain

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    with torch.device(dev):
        vae = AutoencoderKLWan().to(torch.bfloat16).eval()
    g = torch.Generator(device=dev).manual_seed(1)
    z = torch.randn(1, 16, latent_frames, 60, 104, generator=g, device=dev).to(torch.bfloat16)
    out: dict[str, Any] = {"latents": list(z.shape)}
    with torch.inference_mode():
        ref = vae.decode(z).sample
        got = torch.cat([c for c in decode_chunks(vae, z)], dim=2)
        out["chunks_equal_vae_decode"] = bool(torch.equal(ref, got))
        out["frames"] = int(ref.shape[2])
        del ref, got
        drain(decode_chunks(vae, z), device=dev)  # warm-up
        s, _ = timed(None, lambda: drain(decode_chunks(vae, z), device=dev))
        out["decode_only_s"] = s
        mp4 = os.path.join(folder, "smoke.mp4")
        with AsyncFramePipeline(device=dev) as pipe:
            decode_to_file(vae, z, mp4, pipeline=pipe)  # warm-up
            s, result = timed(None, decode_to_file, vae, z, mp4, pipeline=pipe)
        out["async_mp4_s"] = s
        out["async_vs_decode_only"] = s / out["decode_only_s"]
        out["mp4_frames"] = result.frames
    return out


def run_smoke(folder: str | None = None) -> dict:
    """Every smoke figure, each section recorded even when another fails."""
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for name, fn in (("load", smoke_load), ("decode", smoke_decode)):
            try:
                report[name] = fn(tmp)
            except Exception as e:  # a failed section is a finding, reported beside the others
                report[name] = {"error": f"{type(e).__name__}: {e}"}
            torch.cuda.empty_cache()
    return report


def junit_summary(path: str) -> dict:
    """Counts and names of the tests in a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    passed, failed, skipped = [], [], []
    for c in cases:
        name = f"{c.get('classname', '')}::{c.get('name', '')}"
        if c.find("skipped") is not None:
            skipped.append(name)
        elif c.find("failure") is not None or c.find("error") is not None:
            failed.append(name)
        else:
            passed.append(name)
    return {
        "passed": len(passed),
        "failed": len(failed),
        "skipped": len(skipped),
        "passed_tests": passed,
        "failed_tests": failed,
        "skipped_tests": skipped,
    }


def _gpu() -> dict:
    n = torch.cuda.device_count()
    return {
        "name": torch.cuda.get_device_name(0) if n else None,
        "count": n,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }


def build_report(junit: str, smoke: str | None, demo_rc: int | None) -> dict:
    report = {
        **header("gpu-check", machine=_gpu()),
        "cuda_tests": junit_summary(junit),
        "demo_rc": demo_rc,
    }
    if smoke and os.path.exists(smoke):
        with open(smoke) as f:
            report["smoke"] = json.load(f)
    ok = report["cuda_tests"]["failed"] == 0 and report["cuda_tests"]["passed"] > 0
    report["ok"] = bool(ok and demo_rc == 0 and "error" not in json.dumps(report.get("smoke", {})))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nostall.bench.gpucheck")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("smoke")
    s.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("--junit", required=True)
    r.add_argument("--smoke")
    r.add_argument("--demo-rc", type=int)
    r.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "smoke":
        report = run_smoke()
    else:
        report = build_report(args.junit, args.smoke, args.demo_rc)
    write_report(report, args.out)
    print(json.dumps(report, indent=2)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
