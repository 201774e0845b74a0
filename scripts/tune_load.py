"""Sweep nostall's loader knobs on one checkpoint (page cache warm); prints GB/s per setting.

Used on the GPU machine to pick defaults: python scripts/tune_load.py FOLDER [RUNS]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from nostall import Loader, PinnedPool

folder = sys.argv[1]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
weights = os.path.join(folder, "diffusion_pytorch_model.safetensors")
size = os.path.getsize(weights)
os.system(f"cat {weights} > /dev/null")
rows = []
MiB = 1 << 20


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, r


def report(path, cfg, results):
    secs = [s for s, _ in results]
    row = {
        "path": path,
        **cfg,
        "min_s": round(min(secs), 3),
        "median_s": round(statistics.median(secs), 3),
        "GBps_best": round(size / min(secs) / 1e9, 1),
        "read_s": round(results[0][1].read_s, 3),
        "h2d_s": round(results[0][1].h2d_s, 3),
    }
    rows.append(row)
    print(row, flush=True)


ring_cfgs = [
    (16, 32, 8, 20),
    (16, 64, 8, 20),
    (16, 16, 8, 20),
    (16, 32, 16, 20),
    (12, 32, 8, 16),
    (16, 32, 4, 20),
]
for threads, slot, block, slots in ring_cfgs:
    with Loader(
        threads=threads, block_bytes=block * MiB, ring_slot_bytes=slot * MiB, ring_slots=slots
    ) as ld:
        ld.prepare("cuda")
        res = []
        for _ in range(runs):
            s, r = timed(lambda: ld.load(folder, device="cuda"))
            res.append((s, r.stats))
            del r
            torch.cuda.empty_cache()
        report(
            "ring", {"threads": threads, "slot_MiB": slot, "block_MiB": block, "slots": slots}, res
        )

with PinnedPool(int(size * 1.15)) as pool:
    pool.wait_pinned()
    for threads, chunk, block in [
        (16, 64, 8),
        (16, 64, 16),
        (16, 128, 8),
        (16, 128, 16),
        (16, 32, 8),
        (12, 64, 8),
        (14, 64, 8),
        (16, 256, 32),
    ]:
        with Loader(threads=threads, chunk_bytes=chunk * MiB, block_bytes=block * MiB) as ld:
            ld.prepare("cuda")
            res = []
            for _ in range(runs):
                pool.evict()
                s, r = timed(lambda: ld.load(folder, device="cuda", pool=pool))
                res.append((s, r.stats))
                del r
                torch.cuda.empty_cache()
            report("pool-read", {"threads": threads, "chunk_MiB": chunk, "block_MiB": block}, res)
    with Loader() as ld:
        res = []
        for _ in range(runs):
            s, r = timed(lambda: ld.load(folder, device="cuda", pool=pool))
            res.append((s, r.stats))
            del r
        report("pool-hit", {}, res)
out = os.environ.get("OUT", ".")
with open(os.path.join(out, "tune.json"), "w") as f:
    json.dump(rows, f, indent=1)
