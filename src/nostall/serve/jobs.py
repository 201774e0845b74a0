"""What a worker queues and runs: a job, checked against its pipeline before it is queued
(:meth:`Worker.image_job <nostall.serve.worker.Worker.image_job>`,
:meth:`~nostall.serve.worker.Worker.video_job`), plain data the queue, the scheduler
(:mod:`nostall.serve.lineup`) and the runner (:mod:`nostall.serve.runner`) share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["GenerateJob", "ImageJob", "VideoJob", "activation_key"]


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
    slo_s: float | None = None  # done within this many seconds of arriving, or refused


@dataclass
class VideoJob:
    model: str
    latents: torch.Tensor
    fps: float = 16.0
    mode: str = "eager"
    denormalize: bool = False


@dataclass
class GenerateJob:
    """A video to generate (``POST /v1/videos``): its row in the worker's
    :class:`~nostall.serve.video_store.VideoStore` is ``id``; ``cancel`` set ends it at
    its next denoising step."""

    id: str
    model: str
    prompt: str
    width: int
    height: int
    frames: int
    fps: int
    steps: int
    seed: int
    mode: str = "exact"
    negative_prompt: str | None = None
    guidance: float | None = None
    guidance_2: float | None = None
    max_sequence_length: int | None = None
    image: Any = None  # the first frame of an image-to-video pipeline (PIL)
    path: str = ""  # where the video is written (its suffix picks the format)
    cancel: threading.Event = field(default_factory=threading.Event)
    # called from the worker thread with (denoising steps done, frames written)
    progress: Callable[[int, int], None] | None = None

    @classmethod
    def of(cls, id: str, model: str, path: str, checked: dict[str, Any], **kw: Any) -> GenerateJob:
        """The job of ``checked``, the fields
        :func:`~nostall.serve.video_requests.check_generate` returned."""
        names = {f.name for f in fields(cls)}
        return cls(
            id=id, model=model, path=path, **{k: v for k, v in checked.items() if k in names}, **kw
        )


def activation_key(job: ImageJob | VideoJob | GenerateJob) -> tuple[str, str]:
    """``(pipeline, shape)``: what a job's activation peak depends on, for the budget."""
    if isinstance(job, GenerateJob):
        return job.model, f"generate {job.frames}x{job.height}x{job.width} {job.mode}"
    if isinstance(job, VideoJob):
        b, _, t, h, w = job.latents.shape  # (B, C, T, h, w)
        return job.model, f"video {t}x{h}x{w} b{b} {job.mode}"
    return job.model, f"{job.width}x{job.height} b1"
