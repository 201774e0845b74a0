"""``nostall synthetic``: write a store of random-weight pipelines to try every command on."""

from __future__ import annotations

import os

import typer

from nostall.cli.app import app, check_choices, console, device_option, usage_errors

__all__ = ["synthetic"]

_SIZES = ("tiny", "full")


def _folder_bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(folder, followlinks=True)
        for f in files
    )


@app.command()
def synthetic(
    folder: str = typer.Argument(..., help="Where the store goes: one folder per pipeline."),
    size: str = typer.Option(
        "tiny",
        help="tiny (a few MB per pipeline, seconds on a CPU) or full (the real layouts at "
        "real size: FLUX.1-dev 34 GB, SDXL 6.9 GB).",
    ),
    pipeline: list[str] = typer.Option(  # noqa: B008
        None,
        "--pipeline",
        help="Pipelines to write (repeatable): flux, flux-b (FLUX with its own transformer), "
        "sdxl, sd3, wan; full size has flux, flux-b and sdxl. Default: all five when tiny, "
        "flux and sdxl when full.",
    ),
    device: str = device_option(
        "Where full-size weights are drawn (default: cuda when available)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Write into a folder that already holds files (a pipeline already written there "
        "at this size is kept: it has the same bytes).",
    ),
) -> None:
    """Write random-weight diffusers pipelines, laid out as save_pretrained writes them, to
    try the model cache, the server, quantization and decoding on without downloading
    anything. The weights are random: images are noise, timings are real."""
    from nostall.synthetic import PIPELINES, write_store

    check_choices([size], _SIZES, "--size")
    default = PIPELINES if size == "tiny" else ("flux", "sdxl")
    names = check_choices(pipeline or default, PIPELINES, "--pipeline")
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise typer.BadParameter(
            f"{folder!r} exists and is not a folder; a store is a folder of pipeline folders",
            param_hint="FOLDER",
        )
    if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
        raise typer.BadParameter(
            f"{folder!r} already holds files; pass --overwrite to write the pipelines into "
            "it, or choose a new folder",
            param_hint="FOLDER",
        )
    with usage_errors():
        paths = write_store(
            folder,
            names,
            size=size,
            device=device,
            progress=lambda line: console.print(line, highlight=False),
        )
    for name, path in paths.items():
        console.print(f"{name}: {path} ({_folder_bytes(path) / 1e6:.1f} MB)", highlight=False)
    first = next(iter(paths))
    console.print(
        f"Try: nostall switch --models {folder} {' '.join(paths)}\n"
        f"     nostall serve --models {folder}\n"
        f"     nostall quantize {paths[first]} {paths[first]}-fp8",
        highlight=False,
    )
