"""Are the served frames diffusers' frames at real size? Wan 2.1 T2V-1.3B (14.7 GB, random
weights, bf16 with the VAE in float32): one job through the worker written as .npy against
diffusers' WanPipeline for the same seed, 832x480. A GPU diagnostic for the
video_frames_equal_pipeline target of ``nostall bench video`` (its 14B row is the record).

    python scripts/diag_video_frames.py OUT.json [--frames 33 --steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from nostall.bench import video as v
from nostall.bench import video_systems as systems
from nostall.serve.app import create_app
from nostall.serve.local import BackgroundServer
from nostall.synthetic.full import write_full_store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "nostall-frames"))
    a = ap.parse_args()
    store = os.path.join(a.work, "store")
    write_full_store(store, ("wan-1.3b",), device="cuda", progress=print)
    cfg = {**v.SIZES["full"], "wan21": "wan-1.3b"}
    dev = torch.device("cuda")
    worker = systems.make_worker(store, dev, a.work, gpu_budget=20 * 10**9)
    with BackgroundServer(create_app(worker)):
        pipe = systems.diffusers_pipe(os.path.join(store, "wan-1.3b"), dev)
        _, ref = systems.diffusers_video(pipe, cfg, a.frames, a.steps, dev, os.path.join(a.work, "r.mp4"))
        out = v._frames_check(worker, "wan-1.3b", cfg, a.frames, a.steps, a.work, ref)
    worker.shutdown()
    out.update(frames=a.frames, steps=a.steps, model="wan-1.3b")
    print(out)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
