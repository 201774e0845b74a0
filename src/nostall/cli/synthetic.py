"""``nostall synthetic``: write a store of random-weight pipelines to try every command on."""

from __future__ import annotations

import os

import typer

from nostall.cli.app import app, check_choices, console, device_option, usage_errors

__all__ = ["synthetic"]

_SIZES = ("tiny", "full")
_LAYOUTS = ("diffusers", "comfy")


def _elsewhere(values: list[str] | None, size: str) -> dict[str, str]:
    """``--elsewhere ROLE=DIR`` values as role → folder (the library checks the roles)."""
    out: dict[str, str] = {}
    for value in values or ():
        role, sep, where = value.partition("=")
        if not (sep and role and where):
            raise typer.BadParameter(
                f"{value!r} is not ROLE=DIR; e.g. --elsewhere transformer_2=/dev/shm/wan22",
                param_hint="--elsewhere",
            )
        if role in out:
            raise typer.BadParameter(
                f"{role!r} is given twice ({out[role]!r}, {where!r}); give each role once",
                param_hint="--elsewhere",
            )
        out[role] = where
    if out and size != "full":
        raise typer.BadParameter(
            "only full-size weights go elsewhere; add --size full or leave --elsewhere out",
            param_hint="--elsewhere",
        )
    return out


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
        "real size: FLUX.1-dev 34 GB, SDXL 6.9 GB, SD3-medium 15.5 GB, Wan 2.1 T2V-1.3B 14.7 "
        "GB, T2V-14B 40.4 GB, Wan 2.2 T2V-A14B 69.0 GB; components shared with a pipeline "
        "written beside are links to its files).",
    ),
    pipeline: list[str] = typer.Option(  # noqa: B008
        None,
        "--pipeline",
        help="Pipelines to write (repeatable): flux, flux-b (FLUX with its own transformer), "
        "sdxl, sd3, wan when tiny; flux, flux-b, sdxl, sdxl-b, sdxl-c (SDXL fine-tunes: their "
        "own UNet), sd3, wan-1.3b, wan-14b and wan22-a14b "
        "(Wan 2.2's two 14B experts) when full. Default: all five when tiny, flux and sdxl "
        "when full.",
    ),
    elsewhere: list[str] = typer.Option(  # noqa: B008
        None,
        "--elsewhere",
        help="ROLE=DIR (repeatable, full size): write that component's weight files under "
        "DIR/PIPELINE/ROLE and link them into the pipeline folder, to spread a store over "
        "two disks (e.g. transformer_2=/dev/shm/wan22 for wan22-a14b on a 64 GB disk).",
    ),
    device: str = device_option(
        "Where full-size weights are drawn (default: cuda when available)."
    ),
    layout: str = typer.Option(
        "diffusers",
        "--layout",
        help="diffusers (save_pretrained's folders) or comfy: also write each Wan pipeline "
        "as <name>-comfy, its transformers as the community's single files (ComfyUI's scaled "
        "FP8, the original Wan key names, beside diffusers' config.json), the rest linked.",
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
    check_choices([layout], _LAYOUTS, "--layout")
    away = _elsewhere(elsewhere, size)
    if size == "tiny":
        names = check_choices(pipeline or PIPELINES, PIPELINES, "--pipeline")
    else:
        from nostall.synthetic.full import FULL_PIPELINES, write_full_store

        names = check_choices(pipeline or ("flux", "sdxl"), FULL_PIPELINES, "--pipeline")
    wan = [n for n in names if n.startswith("wan")]
    if layout == "comfy" and not wan:
        raise typer.BadParameter(
            "--layout comfy writes Wan pipelines' transformers as ComfyUI files; add a Wan "
            "--pipeline (wan when tiny; wan-1.3b, wan-14b or wan22-a14b when full)",
            param_hint="--layout",
        )
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

    def progress(line: str) -> None:
        console.print(line, highlight=False)

    with usage_errors():
        if size == "tiny":
            paths = write_store(folder, names, device=device, progress=progress)
        else:
            paths = write_full_store(
                folder, names, device=device, progress=progress, elsewhere=away
            )
    if layout == "comfy":
        from nostall.synthetic.comfy import comfy_pipeline

        with usage_errors():
            for name in wan:
                progress(f"{name}-comfy: the transformers as ComfyUI scaled-FP8 files")
                paths[f"{name}-comfy"] = comfy_pipeline(paths[name], paths[name] + "-comfy")
    for name, path in paths.items():
        console.print(f"{name}: {path} ({_folder_bytes(path) / 1e6:.1f} MB)", highlight=False)
    first = next(iter(paths))
    console.print(
        f"Try: nostall switch --models {folder} {' '.join(paths)}\n"
        f"     nostall serve --models {folder}\n"
        f"     nostall quantize {paths[first]} {paths[first]}-fp8",
        highlight=False,
    )
