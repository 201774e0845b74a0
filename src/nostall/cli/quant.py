"""``nostall quantize``: a streaming FP8 copy of a checkpoint, and its SQNR check."""

from __future__ import annotations

import os
import statistics

import typer
from rich.table import Table

from nostall.cli.app import app, console, usage_errors
from nostall.errors import NostallError

__all__ = ["quantize"]


@app.command()
def quantize(
    src: str = typer.Argument(
        ..., help="A .safetensors file, a shard index, a component or a pipeline folder."
    ),
    dst: str = typer.Argument(..., help="Where the FP8 copy goes (same layout and names)."),
    skip: list[str] = typer.Option(  # noqa: B008
        None, "--skip", help="Regex of more tensor names to keep in their dtype (repeatable)."
    ),
    default_skip: bool = typer.Option(
        True,
        "--default-skip/--no-default-skip",
        help="Keep embeddings and first/last projections in their dtype.",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Then compare FP8 with the original: SQNR per layer (random inputs) and at a "
        "text encoder's output.",
    ),
) -> None:
    """Convert a checkpoint to FP8 (e4m3 linear weights, a float32 scale per output row),
    streaming: memory stays at the largest tensor. The output appears only when complete;
    an error, Ctrl-C or SIGTERM (exit status 143) removes what was written."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from nostall.quant import quantize as run

    # (SIGTERM: nostall.cli.main unwinds the command as Ctrl-C does; the partial output
    # is removed on the way and the process exits 143)
    with Progress(
        TextColumn("quantizing"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("quantize", total=None)
        with usage_errors():
            report = run(
                src,
                dst,
                skip=tuple(skip or ()),
                default_skip=default_skip,
                overwrite=overwrite,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    kept = ", ".join(f"{n} {why}" for why, n in report.kept_reasons.most_common())
    console.print(
        f"{report.quantized} tensors → FP8, {report.kept} kept ({kept}); "
        f"{report.bytes_in / 1e9:.3f} GB → {report.bytes_out / 1e9:.3f} GB "
        f"({report.ratio:.3f}x) in {len(report.files)} file(s) under {report.destination}"
    )
    if check:
        _print_check(src, dst)


def _print_check(src: str, dst: str) -> None:
    """Per converted component: the median and worst layer SQNR, the output's, and the
    ten worst layers."""
    from nostall.verify import check as run_check

    pairs = [(src, dst, os.path.basename(os.path.normpath(src)))]
    if os.path.isfile(os.path.join(src, "model_index.json")):
        pairs = [
            (os.path.join(src, n), os.path.join(dst, n), n)
            for n in sorted(os.listdir(dst))
            if os.path.isfile(os.path.join(dst, n, "config.json"))
        ]
    summary = Table(title="FP8 against the original: SQNR (dB)")
    for col in ("component", "layers", "median", "worst layer", "worst", "output", "how"):
        summary.add_column(
            col, justify="right" if col in ("layers", "median", "worst", "output") else "left"
        )
    for a, b, label in pairs:
        try:
            r = run_check(a, b)
        except NostallError:
            continue  # a component that was copied, not converted
        if not r.layers:
            continue
        name, worst = r.worst
        summary.add_row(
            label,
            str(len(r.layers)),
            f"{statistics.median(db for _, db in r.layers):.1f}",
            name,
            f"{worst:.1f}",
            "—" if r.output_db is None else f"{r.output_db:.1f}",
            r.output_note,
        )
        worst_rows = sorted(r.layers, key=lambda x: x[1])[:10]
        detail = Table(title=f"{label}: the {len(worst_rows)} lowest of {len(r.layers)} layers")
        detail.add_column("layer")
        detail.add_column("SQNR dB", justify="right")
        for layer, db in worst_rows:
            detail.add_row(layer, f"{db:.2f}")
        console.print(detail)
    console.print(summary)
