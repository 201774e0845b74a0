"""``nostall decode``: Wan latents files to video files, through the async frame pipeline."""

from __future__ import annotations

import os
import time

import typer

from nostall.cli.app import (
    app,
    check_choices,
    console,
    default_device,
    parse_dtype,
    usage_errors,
)

__all__ = ["decode"]


@app.command()
def decode(
    latents: list[str] = typer.Argument(  # noqa: B008
        ...,
        help="Latents (1, C, T, h, w): .safetensors, .pt or .npy; several are decoded back to back.",
    ),
    vae: str = typer.Option(
        ..., "--vae", help="AutoencoderKLWan component folder (config.json + weights)."
    ),
    out: str = typer.Option(
        ...,
        "-o",
        "--out",
        help="Output: .mp4, .npy, .y4m, or a folder for PNGs; with several latents, an "
        "existing folder that receives one file per input.",
    ),
    denormalize: bool | None = typer.Option(
        None,
        "--denormalize/--no-denormalize",
        show_default=False,
        help="Required. --denormalize for latents a pipeline saved with output_type='latent' "
        "(normalised: z*std+mean is applied); --no-denormalize for latents as vae.decode "
        "takes them.",
    ),
    suffix: str = typer.Option(
        ".mp4", "--suffix", help="With several latents: the output kind (.mp4, .npy, .y4m)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace output files that already exist."
    ),
    sync: bool = typer.Option(
        False, "--sync", help="The one-thread baseline instead of the async pipeline."
    ),
    device: str = typer.Option(
        None, help="cpu or cuda[:N] (default: the first of --devices, else cuda when available)."
    ),
    dtype: str = typer.Option(
        None, help="VAE and latents dtype: bf16, fp16, fp32 (default: the weights')."
    ),
    fps: float = typer.Option(16, help="Frame rate of the video."),
    preset: str = typer.Option("veryfast", help="libx264 preset for .mp4."),
    crf: int = typer.Option(23, help="libx264 quality for .mp4 (0 = lossless, up to 51)."),
    mode: str = typer.Option(
        "eager",
        "--mode",
        help="Decoder forward: eager (vae.decoder as is), exact (bit-identical frames, "
        "fused norm+SiLU, no cat/pad copies) or fast (channels last, CUDA graphs; close "
        "to eager, not bit-identical; CUDA only, else exact).",
    ),
    devices: str = typer.Option(
        None,
        "--devices",
        help="With --mode exact: GPUs to split the decoder over, the VAE's first "
        "(cuda:0,cuda:1); frames stay bit-identical.",
    ),
) -> None:
    """Decode Wan latents to video files, chunk by chunk, with a progress bar.

    Several latents files are decoded back to back through one pipeline: each file is
    finished (the MP4 encoder flushed) on the writer thread while the next decodes.
    Every latents file is read and checked (one video, the VAE's channels, dtype, values)
    before the VAE is loaded, and the bar starts once everything is checked.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from nostall.api import load_model
    from nostall.transfer.loader import resolve_device
    from nostall.video import check_sink_path, decode_files, output_paths
    from nostall.video.files import read_latents_files, vae_latent_channels
    from nostall.video.wan import MODES, check_devices

    if denormalize is None:
        raise typer.BadParameter(
            "say whether the latents are normalised: --denormalize for latents a pipeline "
            "saved with output_type='latent', --no-denormalize for latents already "
            "de-normalised (what vae.decode takes); the wrong one gives wrong colours",
            param_hint="--denormalize/--no-denormalize",
        )
    check_choices([mode], MODES, "--mode")
    split = [d.strip() for d in devices.split(",") if d.strip()] if devices else None
    if split is not None and mode != "exact":
        raise typer.BadParameter("needs --mode exact", param_hint="--devices")
    if split is not None:
        with usage_errors("--devices"):
            check_devices(split, None)  # before the VAE is read
    device = device or (split[0] if split else default_device())
    with usage_errors("--device"):
        resolve_device(device)
    dt = parse_dtype(dtype)
    # Everything about the outputs is checked before the VAE is loaded.
    with usage_errors("-o/--out"):
        targets = output_paths(latents, out, suffix=suffix)
    with usage_errors():
        for target in targets:
            check_sink_path(target, fps=fps, preset=preset, crf=crf)
    for target in targets:
        if os.path.lexists(target) and not os.path.isdir(target) and not overwrite:
            raise typer.BadParameter(
                f"{target!r} already exists; pass --overwrite to replace it, or choose "
                "another output",
                param_hint="-o/--out",
            )
    # The latents too (a LatentsError naming the file: one line, exit 2, from main()), so a
    # bad file costs no VAE load; a remote VAE's channels are checked once it is loaded.
    remote = vae.startswith("s3://")
    read_latents_files(latents, z_dim=None if remote else vae_latent_channels(vae))
    model = load_model(vae, device=device, dtype=dt)

    t0 = time.perf_counter()
    bar = Progress(
        TextColumn("decoding"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} frames"),
        TimeRemainingColumn(),
        console=console,
    )
    task = bar.add_task("decode", total=None)

    def progress(done: int, total: int) -> None:
        # decode_files calls this first once every input is checked against the VAE:
        # a refusal before then prints no bar.
        if not bar.live.is_started:
            bar.start()
        bar.update(task, completed=done, total=total)

    try:
        results = decode_files(
            latents,
            model,
            targets,
            denormalize=denormalize,
            sync=sync,
            fps=fps,
            preset=preset,
            crf=crf,
            progress=progress,
            mode=mode,
            devices=split,
        )
    finally:
        if bar.live.is_started:
            bar.stop()
    wall = time.perf_counter() - t0
    for result in results:
        s = result.stats
        console.print(
            f"{result.frames} frames → {result.path} ({s.mode}; writer busy {s.write_s:.2f} s, "
            f"waited for the writer {s.backpressure_s:.2f} s, closing {result.close_s:.2f} s)"
        )
    frames = sum(r.frames for r in results)
    console.print(f"{frames} frames in {wall:.2f} s ({frames / wall:.1f} frames/s)")
