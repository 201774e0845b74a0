"""``nostall demo``: every part of nostall on tiny random inputs, checked against the
references (the parts and their printing live in :mod:`nostall.demo`)."""

from __future__ import annotations

import typer

from nostall.cli.app import app, check_output, console, device_option, in_range, usage_errors

__all__ = ["demo"]


@app.command()
def demo(
    device: str = device_option(),
    size_mb: int = typer.Option(
        256, callback=in_range(1), help="Size of the demo checkpoint in MB."
    ),
    video: str = typer.Option(
        "nostall-demo.mp4", help="Where the demo video goes ('' to skip the video part)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the video at --video if it exists."
    ),
    switch: bool = typer.Option(
        True, "--switch/--no-switch", help="Switch among tiny pipelines through the model cache."
    ),
    serve: bool = typer.Option(
        True, "--serve/--no-serve", help="Serve tiny pipelines over HTTP on loopback."
    ),
) -> None:
    """Load a multi-dtype checkpoint with safetensors and nostall and compare; switch whole
    pipelines through the model cache; quantize to FP8; serve over HTTP; decode a video.

    `nostall synthetic DIR` writes a store of tiny pipelines to try the other commands on."""
    from nostall.demo import show
    from nostall.video import check_sink_path

    if video:
        check_output(video, hint="--video", overwrite=overwrite)
        with usage_errors("--video"):
            check_sink_path(video)
    ok = show(
        console,
        device=device,
        nbytes=size_mb << 20,
        video=video or None,
        switch=switch,
        serve=serve,
    )
    if not ok:
        raise typer.Exit(1)
