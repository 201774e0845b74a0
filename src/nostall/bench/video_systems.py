"""The systems ``nostall bench video`` runs, one video each: the worker over HTTP (the
jobs API), the same call in the process, diffusers' documented code."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

__all__ = [
    "PROMPT",
    "WRITERS",
    "alone_video",
    "call_kwargs",
    "device_peak",
    "diffusers_pipe",
    "diffusers_video",
    "export_video",
    "job_body",
    "make_worker",
    "reset_device_peak",
    "serve_video",
]

PROMPT = "a red fox running through fresh snow at dawn, cinematic"


def serve_video(url: str, body: dict, timeout: float = 900.0) -> dict[str, Any]:
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


def job_body(model: str, cfg: dict, frames: int, steps: int, seed: int = 7) -> dict:
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


def call_kwargs(cfg: dict, frames: int, steps: int, dev: torch.device, seed: int = 7) -> dict:
    """diffusers' call for the same job the worker runs (its own defaults otherwise)."""
    return {
        "prompt": PROMPT,
        "height": cfg["height"],
        "width": cfg["width"],
        "num_frames": frames,
        "num_inference_steps": steps,
        "generator": torch.Generator(device=dev.type).manual_seed(seed),
    }


def alone_video(cache, model, cfg, frames, steps, dev, path, frames_out) -> float:
    """The worker's pipeline call, exact decode and MP4 in this process: no HTTP, no job;
    ``frames_out`` is one :class:`~nostall.video.AsyncFramePipeline` kept across videos,
    as the worker keeps its own."""
    from nostall.video import denormalize, submit_decode

    t = time.perf_counter()
    with cache.use(model) as pipe, torch.inference_mode():
        pipe.set_progress_bar_config(disable=True)
        latents = pipe(**call_kwargs(cfg, frames, steps, dev), output_type="latent").frames
        vae = pipe.vae
        z = denormalize(vae, latents.to(next(vae.parameters()).dtype))
        submit_decode(vae, z, path, pipeline=frames_out, fps=16, mode="exact").result()
    return time.perf_counter() - t


def diffusers_pipe(folder: str, dev: torch.device, *, offload: bool = False):
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


def diffusers_video(pipe, cfg, frames, steps, dev, path) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    out = pipe(**call_kwargs(cfg, frames, steps, dev), output_type="np").frames[0]
    WRITERS["used"] = export_video(list(out), path)
    return time.perf_counter() - t, out


WRITERS: dict[str, str] = {}  # which of diffusers' writers the peer's MP4s went through


def export_video(frames: list, path: str) -> str:
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


def device_peak(dev: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def reset_device_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def make_worker(store: str, dev: torch.device, work: str, **kw):
    from nostall.serve.worker import Worker

    return Worker(store, device=str(dev), video_dir=os.path.join(work, "videos"), **kw)
