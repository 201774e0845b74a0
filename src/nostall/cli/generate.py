"""``nostall generate-video``: a prompt (and an image) to an MP4 from the shell, through the
same worker, model cache and asynchronous frame pipeline as ``POST /v1/videos``."""

from __future__ import annotations

import os
import tempfile
import time

import typer

from nostall.cli.app import app, console, default_device, gigabytes, usage_errors

__all__ = ["generate_video"]


@app.command("generate-video")
def generate_video(
    models: str = typer.Option(..., "--models", help="Folder of diffusers pipeline folders."),
    model: str = typer.Option(..., "--model", help="The Wan pipeline of the store to run."),
    prompt: str = typer.Option(..., "--prompt", help="What the video shows."),
    out: str = typer.Option(..., "-o", "--out", help="The video: .mp4, .npy or .y4m."),
    image: str = typer.Option(
        None, "--image", help="The first frame, for an image-to-video pipeline (PNG/JPEG/WebP)."
    ),
    size: str = typer.Option(None, help="WIDTHxHEIGHT (default: the pipeline's, 832x480)."),
    seconds: float = typer.Option(None, help="Length (default 4 s; or --frames)."),
    frames: int = typer.Option(None, help="Frames, 4k+1 (instead of --seconds)."),
    fps: int = typer.Option(None, help="Frame rate (default: the pipeline's, 16)."),
    steps: int = typer.Option(None, help="Denoising steps (default 50)."),
    seed: int = typer.Option(None, help="Seed (default: random, printed)."),
    guidance: float = typer.Option(None, help="Guidance scale (default: the pipeline's)."),
    negative_prompt: str = typer.Option(None, help="What the video should not show."),
    mode: str = typer.Option("exact", help="Decoder mode: exact, fast or eager."),
    device: str = typer.Option(None, help="cpu or cuda[:N] (default: cuda when available)."),
    gpu_budget_gb: float = typer.Option(None, help="Device tier (default: what is free)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
) -> None:
    """Generate one video with a progress bar over the denoising steps and the frames
    written. Every option is checked before a weight is read; the file appears under its
    name only once complete."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nostall.serve.bodies import VideoBody
    from nostall.serve.jobs import GenerateJob
    from nostall.serve.requests import Limits
    from nostall.serve.video_requests import check_generate, generate_rules
    from nostall.serve.worker import Worker
    from nostall.store.catalog import Store
    from nostall.video import check_sink_path

    if os.path.lexists(out) and not overwrite:
        raise typer.BadParameter(
            f"{out!r} already exists; pass --overwrite to replace it", param_hint="-o/--out"
        )
    with usage_errors("-o/--out"):
        check_sink_path(out, fps=fps or 16)
    picture = None
    if image is not None:
        try:
            with open(image, "rb") as f:
                picture = f.read()
        except OSError as e:
            raise typer.BadParameter(f"cannot read {image!r}: {e}", param_hint="--image") from None
    fields = {"model": model, "prompt": prompt, "size": size, "frames": frames, "fps": fps,
              "steps": steps, "seed": seed, "guidance": guidance,
              "negative_prompt": negative_prompt, "mode": mode}  # fmt: skip
    if seconds is not None:
        fields["seconds"] = seconds
    with usage_errors():
        body = VideoBody(**{k: v for k, v in fields.items() if v is not None})
        rules = generate_rules(Store(models).entry(model))
        if rules is None:
            raise typer.BadParameter(f"{model!r} is not a video pipeline", param_hint="--model")
        job_fields = check_generate(body, rules, Limits(), picture)
    device = device or default_device()
    jobs = tempfile.TemporaryDirectory(prefix="nostall-generate-")  # (the worker's job index)
    with usage_errors():
        worker = Worker(
            models,
            device=device,
            gpu_budget=gigabytes(gpu_budget_gb, "--gpu-budget-gb"),
            prepare=False,
            video_dir=jobs.name,
        )
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    )
    denoise = bar.add_task("denoising", total=job_fields["steps"])
    write = bar.add_task("frames", total=job_fields["frames"])

    def progress(done_steps: int, done_frames: int) -> None:
        bar.update(denoise, completed=done_steps)
        bar.update(write, completed=done_frames)

    job = GenerateJob.of("cli", model, out, job_fields, progress=progress)
    t0 = time.perf_counter()
    worker.start()
    try:
        with bar:
            future, _ = worker.submit(job)
            result = future.result()
            written = result.info["written"].result()
    finally:
        worker.shutdown()
        jobs.cleanup()
    wall = time.perf_counter() - t0
    ph = result.phases
    console.print(
        f"{written.frames} frames → {written.path} (seed {job.seed}; switch {ph['switch']:.2f} s, "
        f"denoise {ph.get('denoise', 0):.2f} s; {wall:.2f} s in all)"
    )
