"""What a worker queues and runs: a job, checked against its pipeline before it is queued
(:meth:`Worker.image_job <nostall.serve.worker.Worker.image_job>`,
:meth:`~nostall.serve.worker.Worker.video_job`), plain data the queue, the scheduler
(:mod:`nostall.serve.lineup`) and the runner (:mod:`nostall.serve.runner`) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ImageJob", "VideoJob", "activation_key"]


@dataclass
class ImageJob:
    model: str
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    guidance: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    loras: tuple[tuple[str, float], ...] = ()  # fused for this job (name, weight)
    controlnet: tuple[str, Any, float] | None = None  # (name, control image, scale)


@dataclass
class VideoJob:
    model: str
    latents: torch.Tensor
    fps: float = 16.0
    mode: str = "eager"
    denormalize: bool = False


def activation_key(job: ImageJob | VideoJob) -> tuple[str, str]:
    """``(pipeline, shape)``: what a job's activation peak depends on, for the budget."""
    if isinstance(job, VideoJob):
        b, _, t, h, w = job.latents.shape  # (B, C, T, h, w)
        return job.model, f"video {t}x{h}x{w} b{b} {job.mode}"
    return job.model, f"{job.width}x{job.height} b1"
