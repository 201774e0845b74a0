"""The ``nostall`` command: a thin layer over the public API."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.table import Table

from nostall.errors import ArgumentError, NostallError, SinkError

app = typer.Typer(
    help="Keep GPUs busy in diffusion inference: fast checkpoint loading, stall-free video output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks against the peers, written as JSON.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# Wide enough for the phase tables when piped to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 150)

# The floating dtypes a checkpoint can be cast to; the long names are accepted too.
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
_READ_MODES = ("auto", "buffered", "direct")
_BENCH_OUT = "bench-out"  # ignored by git; docs/bench/ holds the recorded results


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    key = name.lower()
    key = _DTYPES.get(key, key)
    if key not in _DTYPES.values():
        raise typer.BadParameter(
            f"{name!r} is not a cast target; use one of {', '.join(_DTYPES)} (floating "
            f"tensors are cast; integer tensors keep their dtype)",
            param_hint="--dtype",
        )
    return getattr(torch, key)


@contextlib.contextmanager
def _option(hint: str | None = None) -> Iterator[None]:
    """Report a library's refusal of an option value as a usage error (exit 2, one line)."""
    try:
        yield
    except (ArgumentError, SinkError) as e:
        raise typer.BadParameter(str(e), param_hint=hint) from e


def _print_version(value: bool) -> None:
    if value:
        from nostall import __version__

        print(f"nostall {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print nostall's version and exit.",
    ),
) -> None:
    pass


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _phase_table(title: str, rows: list[tuple]) -> Table:
    table = Table(title=title)
    for col in ("method", "scenario", "read s", "H2D s", "build s", "total s", "GB/s", "equal"):
        table.add_column(col, justify="left" if col in ("method", "scenario") else "right")
    for r in rows:
        table.add_row(*r)
    return table


@app.command()
def demo(
    device: str = typer.Option(None, help="cpu or cuda[:N] (default: cuda when available)."),
    size_mb: int = typer.Option(256, help="Size of the demo checkpoint in MB."),
    video: str = typer.Option(
        "nostall-demo.mp4", help="Where the demo video goes ('' to skip the video part)."
    ),
    switch: bool = typer.Option(
        True, "--switch/--no-switch", help="Switch among tiny pipelines through the model cache."
    ),
    serve: bool = typer.Option(
        True, "--serve/--no-serve", help="Serve tiny pipelines over HTTP on loopback."
    ),
) -> None:
    """Load a multi-dtype checkpoint with safetensors and nostall and compare; switch whole
    pipelines through the model cache; quantize to FP8; serve over HTTP; decode a video."""
    from nostall.demo import run_demo

    device = device or _default_device()
    console.print(
        f"[bold]nostall demo[/bold] on {device}: writing a {size_mb} MB multi-dtype checkpoint…"
    )
    rows, size = run_demo(device=device, nbytes=size_mb << 20)
    out = []
    for r in rows:
        s = r.stats
        out.append(
            (
                r.method,
                s.scenario if s else "-",
                f"{s.read_s:.3f}" if s else "-",
                f"{s.h2d_s:.3f}" if s else "-",
                "-",
                f"{r.seconds:.3f}",
                f"{r.gbps:.2f}",
                "yes" if r.equal else "[red]NO[/red]",
            )
        )
    console.print(_phase_table(f"{size / 1e6:.0f} MB checkpoint → {device}", out))
    if device == "cpu":
        console.print(
            "(on a CPU, safetensors maps the file lazily: its bytes are read on first use)"
        )
    if not all(r.equal for r in rows):
        console.print("[red]nostall's tensors differ from safetensors'[/red]")
        raise typer.Exit(1)
    console.print("All tensors equal to safetensors.load_file, bit for bit.")
    if switch:
        from nostall.demo import run_switch_demo

        console.print(
            "\n[bold]Model cache[/bold]: a store of tiny random FLUX, FLUX-b (same architecture, "
            "own transformer) and SDXL pipelines; the device tier holds one pipeline at a time."
        )
        reports, equal = run_switch_demo(device=device)
        for report in reports:
            console.print(report.table())
        if not equal:
            console.print("[red]an image differs from diffusers' from_pretrained[/red]")
            raise typer.Exit(1)
        console.print(
            "Every image equal to the same pipeline from diffusers' from_pretrained, bit for bit."
        )
        from nostall.demo import run_fp8_demo

        fp8 = run_fp8_demo(device=device)
        bf16_b, fp8_b = fp8["bytes"]
        console.print(
            f"FP8: nostall quantize converted {fp8['quantized']} linear weights of a tiny FLUX "
            f"transformer, {bf16_b / 1e6:.2f} → {fp8_b / 1e6:.2f} MB ({fp8_b / bf16_b:.2f}x; "
            f"the same rules on the full FLUX.1-dev layout: 0.50x); its linear layers: "
            f"{fp8['compute'][0]} "
            f"({fp8['compute'][1]}); output SQNR vs bf16 {fp8['sqnr_db']:.1f} dB"
        )
        if not fp8["sqnr_db"] > 20:
            console.print("[red]the FP8 transformer's output is far from bf16's[/red]")
            raise typer.Exit(1)
    if serve:
        _demo_serve(device)
    if video:
        from nostall.demo import run_video_demo

        what, result, modes = run_video_demo(device=device, path=video)
        s = result.stats
        console.print(
            f"Video: {what} → {result.path}: {result.frames} frames in {s.wall_s:.2f} s "
            f"({result.frames / s.wall_s:.1f} frames/s; the writer thread was busy {s.write_s:.2f} s "
            f"beside the decode)"
        )
        for mode, seconds, same in modes:
            console.print(f"  decoder mode {mode}: {seconds:.3f} s, frames {same}")
        if modes and not any(m == "exact" and same == "bit-identical" for m, _, same in modes):
            raise typer.Exit(1)  # exact mode must give vae.decode's bits


def _demo_serve(device: str) -> None:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        console.print(
            f"\nServing skipped: {', '.join(missing)} not installed (pip install nostall[serve])."
        )
        return
    from rich.table import Table

    from nostall.cache.report import human_bytes
    from nostall.demo import run_serve_demo

    console.print(
        "\n[bold]Serving[/bold]: nostall embed-server and nostall serve on loopback (real HTTP); "
        "the worker encodes prompts in the embedding service and switches the pipelines in "
        "without their text encoders, so its 2 MB device tier, which holds one whole pipeline, "
        "keeps both."
    )
    rows, ok = run_serve_demo(device=device)
    table = Table(title="POST /v1/images/generations", title_justify="left")
    for col in ("model", "HTTP", "switched in (tier)", "moved", "switch s", "text s", "denoise s",
                "image = diffusers"):  # fmt: skip
        table.add_column(col, justify="right" if col.endswith(" s") or col == "moved" else "left")
    for r in rows:
        if "phases" not in r:
            table.add_row(r["model"], str(r["status"]), r.get("error", "")[:60], "", "", "", "", "")
            continue
        ph = r["phases"]
        table.add_row(
            r["model"], str(r["status"]), r["switched"], human_bytes(r["moved_bytes"]),
            f"{ph.get('switch', 0):.3f}", f"{ph.get('text', 0):.3f}", f"{ph.get('denoise', 0):.3f}",
            "yes" if r["equal"] else "[red]NO[/red]",
        )  # fmt: skip
    console.print(table)
    if not ok:
        console.print("[red]a served image differs from diffusers', or an answer is wrong[/red]")
        raise typer.Exit(1)
    console.print("Every served image equal to the same diffusers pipeline's for its seed.")


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
    import signal

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from nostall.quant import quantize as run

    try:
        with Progress(
            TextColumn("quantizing"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as bar:
            task = bar.add_task("quantize", total=None)
            with _option():
                report = run(
                    src,
                    dst,
                    skip=tuple(skip or ()),
                    default_skip=default_skip,
                    overwrite=overwrite,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                )
    except SystemExit as e:
        # run() turns SIGTERM into SystemExit(128 + SIGTERM) once it has removed the
        # partial output (see nostall.quantize).
        if e.code == 128 + signal.SIGTERM:
            console.print(
                f"[red]terminated[/red] (SIGTERM): {dst} was not written; the partial "
                "output was removed",
                highlight=False,
            )
        raise
    kept = ", ".join(f"{n} {why}" for why, n in report.kept_reasons.most_common())
    console.print(
        f"{report.quantized} tensors → FP8, {report.kept} kept ({kept}); "
        f"{report.bytes_in / 1e9:.3f} GB → {report.bytes_out / 1e9:.3f} GB "
        f"({report.ratio:.3f}x) in {len(report.files)} file(s) under {report.destination}"
    )
    if check:
        _print_quantize_check(src, dst)


def _print_quantize_check(src: str, dst: str) -> None:
    import os
    import statistics

    from nostall.quant.check import check as run_check

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


@app.command()
def load(
    path: str = typer.Argument(
        ..., help="A .safetensors file, a shard index, or a component folder."
    ),
    device: str = typer.Option(None, help="cpu or cuda[:N] (default: cuda when available)."),
    dtype: str = typer.Option(None, help="Cast floating tensors on the device: bf16, fp16, fp32."),
    model: bool = typer.Option(False, "--model", help="Also build the module (needs config.json)."),
    pool_gb: float = typer.Option(
        0.0,
        min=0.0,
        help="Load through a pinned pool of this many GB; loads twice "
        "to show the memory-cache hit.",
    ),
    read_mode: str = typer.Option("auto", help="auto, buffered or direct (O_DIRECT)."),
    threads: int = typer.Option(None, min=1, help="Reader threads (default: CPUs, at most 16)."),
    as_json: bool = typer.Option(False, "--json", help="Print the phase timings as JSON."),
) -> None:
    """Load a checkpoint and print the read / H2D / build phases and GB/s."""
    import dataclasses

    from nostall.api import load_model_with_stats
    from nostall.memory.pool import PinnedPool
    from nostall.transfer.loader import Loader

    if read_mode not in _READ_MODES:
        raise typer.BadParameter(
            f"unknown read mode {read_mode!r}; use one of {', '.join(_READ_MODES)}",
            param_hint="--read-mode",
        )
    device = device or _default_device()
    dt = _dtype(dtype)
    rows, records = [], []
    with Loader(threads=threads, read_mode=read_mode) as loader:
        pool = None
        if pool_gb > 0:
            with _option("--pool-gb"):  # a budget beyond this machine's memory
                pool = PinnedPool(int(pool_gb * 1e9))
            with console.status("pinning the pool…"):
                pool.wait_pinned()
        try:
            for _attempt in range(2 if pool else 1):
                if model:
                    _, stats = load_model_with_stats(
                        path, device=device, dtype=dt, pool=pool, loader=loader
                    )
                else:
                    stats = loader.load(path, device=device, dtype=dt, pool=pool).stats
                records.append(dataclasses.asdict(stats))
                rows.append(
                    (
                        "nostall" + (" load_model" if model else ""),
                        stats.scenario,
                        f"{stats.read_s:.3f}",
                        f"{stats.h2d_s:.3f}",
                        f"{stats.build_s:.3f}" if model else "-",
                        f"{stats.total_s:.3f}",
                        f"{stats.gbps:.2f}",
                        "-",
                    )
                )
        finally:
            if pool is not None:
                pool.close()
    if as_json:
        print(json.dumps(records, indent=2))
        return
    last = records[-1]
    console.print(
        _phase_table(
            f"{last['source']} → {last['device']}: {last['nbytes'] / 1e9:.3f} GB, "
            f"{last['num_tensors']} tensors, read mode {last['read_mode']}",
            rows,
        )
    )


@bench_app.command("load")
def bench_load(
    preset: str = typer.Option(
        "flux", help="flux (23.8 GB FluxTransformer2DModel default config) or tiny."
    ),
    device: str = typer.Option(None, help="cuda[:N] or cpu (default: cuda when available)."),
    folder: str = typer.Option(
        "/tmp/nostall-bench/flux", help="Where the random checkpoint is written."
    ),
    out: str = typer.Option(
        f"{_BENCH_OUT}/load.json",
        help="JSON report path (the recorded results live in docs/bench/).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing report at --out."
    ),
    scenario: list[str] = typer.Option(None, help="Scenarios to run (default: all three)."),  # noqa: B008
    repeat: int = typer.Option(2, help="Runs per method in warm scenarios (best is reported)."),
    method: list[str] = typer.Option(None, help="Only these methods (by name)."),  # noqa: B008
) -> None:
    """FLUX-size checkpoint → GPU: nostall vs safetensors, diffusers, fastsafetensors, runai.

    The cold scenario drops the OS page cache (every file cached on the machine) before
    each method; each drop is announced before it happens and recorded in the JSON.
    """
    from nostall.bench.load import (
        SCENARIOS,
        check_new_output,
        run_load_bench,
        summarize,
        write_report,
    )

    with _option("--out"):
        check_new_output(out, overwrite=overwrite)
    device = device or _default_device()
    report = run_load_bench(
        preset=preset,
        device=device,
        folder=folder,
        scenarios=tuple(scenario) if scenario else SCENARIOS,
        repeat=repeat,
        methods=tuple(method) if method else None,
        log=lambda s: console.print(s, highlight=False),
    )
    with _option("--out"):
        write_report(report, out, overwrite=overwrite)
    table = Table(
        title=f"load bench ({preset}, {report['checkpoint']['bytes'] / 1e9:.2f} GB) on "
        f"{report['hardware'].get('gpu', device)}"
    )
    table.add_column("method")
    for s in SCENARIOS:
        table.add_column(s, justify="right")
    for row in summarize(report):
        table.add_row(*row)
    console.print(table)
    for t in report["targets"]:
        mark = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "?"}[t["met"]]
        console.print(f"{mark}  {t['target']}: {t['detail']}")
    console.print(f"report written to {out}")


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
    sync: bool = typer.Option(
        False, "--sync", help="The one-thread baseline instead of the async pipeline."
    ),
    device: str = typer.Option(None, help="cpu or cuda[:N] (default: cuda when available)."),
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
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from nostall.api import load_model
    from nostall.video import check_sink_path, decode_files, output_paths

    if denormalize is None:
        raise typer.BadParameter(
            "say whether the latents are normalised: --denormalize for latents a pipeline "
            "saved with output_type='latent', --no-denormalize for latents already "
            "de-normalised (what vae.decode takes); the wrong one gives wrong colours",
            param_hint="--denormalize/--no-denormalize",
        )
    from nostall.video.wan import MODES

    if mode not in MODES:
        raise typer.BadParameter(f"choose one of {', '.join(MODES)}", param_hint="--mode")
    split = [d.strip() for d in devices.split(",") if d.strip()] if devices else None
    if split is not None and mode != "exact":
        raise typer.BadParameter("needs --mode exact", param_hint="--devices")
    if split is not None:
        from nostall.video.wan import check_devices

        with _option("--devices"):
            check_devices(split, None)  # before the VAE is read
        device = device or split[0]
    # Everything about the outputs is checked before the VAE is loaded.
    with _option("-o/--out"):
        targets = output_paths(latents, out, suffix=suffix)
    with _option():
        for target in targets:
            check_sink_path(target, fps=fps, preset=preset, crf=crf)
    dt = _dtype(dtype)
    model = load_model(vae, device=device or _default_device(), dtype=dt)

    t0 = time.perf_counter()
    with Progress(
        TextColumn("decoding"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} frames"),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("decode", total=None)
        results = decode_files(
            latents,
            model,
            targets,
            denormalize=denormalize,
            sync=sync,
            fps=fps,
            preset=preset,
            crf=crf,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            mode=mode,
            devices=split,
        )
    wall = time.perf_counter() - t0
    for result in results:
        s = result.stats
        console.print(
            f"{result.frames} frames → {result.path} ({s.mode}; writer busy {s.write_s:.2f} s, "
            f"waited for the writer {s.backpressure_s:.2f} s, closing {result.close_s:.2f} s)"
        )
    frames = sum(r.frames for r in results)
    console.print(f"{frames} frames in {wall:.2f} s ({frames / wall:.1f} frames/s)")


@bench_app.command("decode")
def bench_decode(
    size: str = typer.Option("720p", help="720p (latents 16x41x90x160), 480p or tiny."),
    dtype: list[str] = typer.Option(None, help="bf16 and/or fp32 (default: both)."),  # noqa: B008
    latent_frames: int = typer.Option(41, help="Latent frames (41 → 161 video frames)."),
    repeat: int = typer.Option(10, help="Timed decodes per mode, after one warm-up."),
    device: str = typer.Option(None, help="cuda[:N] or cpu."),
    preset: str = typer.Option("veryfast", help="libx264 preset."),
    out: str = typer.Option(
        f"{_BENCH_OUT}/decode.json",
        help="JSON report path (the recorded results live in docs/bench/).",
    ),
    figure: str = typer.Option(
        f"{_BENCH_OUT}/decode-timeline-{{dtype}}.png", help="Timeline picture (CUDA runs)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing report or picture."
    ),
    work: str = typer.Option(None, help="Folder for the MP4s and traces (default: a temp dir)."),
    part: list[str] = typer.Option(  # noqa: B008
        None,
        "--part",
        help="Sections to run (repeatable): timed, memory (CUDA), back-to-back, modes. Default: all.",
    ),
    back_to_back: int = typer.Option(3, help="Videos in a row for the back-to-back section."),
    mode: list[str] = typer.Option(  # noqa: B008
        None,
        "--mode",
        help="Decoder modes for the modes section (repeatable): eager, exact, fast. Default: all.",
    ),
    devices: str = typer.Option(
        None, "--devices", help="Modes section: also exact split over these GPUs (cuda:0,cuda:1)."
    ),
) -> None:
    """Wan VAE decode: sync vs async vs decode-only, writing real MP4s; utilisation and
    memory; the decoder modes (eager, exact, fast; exact over several GPUs) against each
    other."""
    from nostall.bench.decode import DECODER_MODES, PARTS, run_decode_bench
    from nostall.bench.load import check_new_output, write_report

    dtypes = tuple(dtype) if dtype else ("bf16", "fp32")
    parts = tuple(part) if part else PARTS
    device = device or _default_device()
    modes = tuple(mode) if mode else DECODER_MODES
    bad = [m for m in modes if m not in DECODER_MODES]
    if bad:
        raise typer.BadParameter(f"{bad}; choose from {list(DECODER_MODES)}", param_hint="--mode")
    split = tuple(d.strip() for d in devices.split(",") if d.strip()) if devices else None
    if split:
        from nostall.transfer.loader import resolve_device
        from nostall.video.wan import check_devices

        with _option("--devices"):
            first = resolve_device(device) if device.startswith("cuda") else None
            check_devices(split, first)
            if "modes" not in parts:
                raise ArgumentError("--devices is measured in the modes part; add --part modes")
    with _option("--out"):
        check_new_output(out, overwrite=overwrite)
    if figure and "timed" in parts and device.startswith("cuda"):  # drawn from CUDA profiles
        with _option("--figure"):
            for name in dtypes:
                check_new_output(figure.replace("{dtype}", name), overwrite=overwrite)
    report = run_decode_bench(
        size=size,
        dtypes=dtypes,
        latent_frames=latent_frames,
        repeat=repeat,
        device=device,
        preset=preset,
        out_dir=work,
        figure=figure,
        parts=parts,
        back_to_back=back_to_back,
        modes=modes,
        devices=split,
        log=lambda s: console.print(s, highlight=False),
    )
    with _option("--out"):
        write_report(report, out, overwrite=overwrite)
    table = Table(
        title=f"decode bench: {report['config']['size']}, {report['config']['frames']} frames, "
        f"{report['hardware'].get('gpu', device)}"
    )
    cols = ("dtype", "mode", "min s", "mean s", "p99 s", "frames/s", "RTF@24", "close s", "util")
    for col in cols:
        table.add_column(col, justify="left" if col in ("dtype", "mode") else "right")
    for name, res in report["results"].items():
        for mode in ("decode-only", "sync", "async"):
            if mode not in res:
                continue
            r = res[mode]
            u = res.get("utilisation", {}).get(mode, {}).get("steady_two_chunks")
            table.add_row(
                name,
                mode,
                f"{r['min']:.3f}",
                f"{r['mean']:.3f}",
                f"{r['p99']:.3f}",
                f"{r['frames_per_s']:.1f}",
                f"{r['rtf']:.3f}",
                f"{r['close_mean_s']:.3f}" if "close_mean_s" in r else "",
                f"{u:.2%}" if u is not None else "",
            )
    if table.row_count:
        console.print(table)
    b2b = {n: r["back_to_back"] for n, r in report["results"].items() if "back_to_back" in r}
    if b2b:
        bt = Table(title="back to back: seconds per video")
        for col in ("dtype", "videos", "decode-only", "one at a time", "submit_decode"):
            bt.add_column(col, justify="left" if col == "dtype" else "right")
        for name, r in b2b.items():
            bt.add_row(
                name,
                str(r["videos"]),
                f"{r['decode_only_per_video_s']:.3f}",
                f"{r['one_at_a_time_per_video_s']:.3f} ({r['one_at_a_time_vs_decode_only']:.3f}x)",
                f"{r['submit_per_video_s']:.3f} ({r['submit_vs_decode_only']:.3f}x)",
            )
        console.print(bt)
    by_mode = {n: r["modes"] for n, r in report["results"].items() if "modes" in r}
    if by_mode:
        mt = Table(title="decoder modes: seconds per video (mean)")
        for col in ("dtype", "mode", "first call", "decode-only", "async MP4", "ratio", "peak GiB",
                    "frames vs eager", "PSNR vs fp32", "busy"):  # fmt: skip
            mt.add_column(col, justify="left" if col in ("dtype", "mode") else "right")
        for name, m in by_mode.items():
            rows = list(m.items())
            two = report["results"][name].get("devices")
            if two:
                rows.append((f"exact x{len(two['devices'])} GPUs", two))
            for label, r in rows:
                same = r.get("bit_identical")
                db = r.get("psnr_db_vs_fp32_eager", "")
                busy = (r.get("utilisation_async_mp4") or {}).get("steady_two_chunks")
                mt.add_row(
                    name,
                    label,
                    f"{r['first_call_s']:.3f}",
                    f"{r['decode_only']['mean']:.3f}",
                    f"{r['async_mp4']['mean']:.3f}",
                    f"{r['async_mp4']['mean'] / r['decode_only']['mean']:.4f}x",
                    f"{r['peak_gib']:.3f}" if "peak_gib" in r else "",
                    ""
                    if same is None
                    else ("bit-identical" if same else f"{r['mismatches']} differ"),
                    "same" if db is None else (f"{db:.2f} dB" if db != "" else ""),
                    f"{busy:.2%}" if busy is not None else "",
                )
        console.print(mt)
    _print_targets(report["targets"])
    for item in report.get("summary", []):
        console.print(f"·  {item['what']}: {item['value']}")
    console.print(f"report written to {out}")


@app.command()
def serve(
    models: str = typer.Option(..., "--models", help="Folder of diffusers pipeline folders."),
    device: str = typer.Option(None, help="cuda[:N] or cpu (default: cuda if present)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, help="Port."),
    max_queue: int = typer.Option(16, help="Requests allowed to wait; more get 429."),
    gpu_budget_gb: float = typer.Option(None, help="Device tier (default: 80% of free)."),
    host_budget_gb: float = typer.Option(None, help="Pinned host tier (default: half of RAM)."),
    dtype: str = typer.Option(None, help="bf16, fp16 or fp32 (default: as stored)."),
    prepare: bool = typer.Option(
        True, "--prepare/--no-prepare", help="Build every pipeline's modules at boot."
    ),
    embed_url: str = typer.Option(
        None, help="An embedding service (nostall embed-server) for FLUX, SDXL and SD3 prompts."
    ),
) -> None:
    """Serve image generation and video decoding over HTTP (OpenAI's images API shape),
    switching pipelines through the model cache. Status page at /, metrics at /metrics."""
    import torch
    import uvicorn

    from nostall.serve.app import create_app
    from nostall.serve.worker import Worker

    with _option():
        worker = Worker(
            models,
            device=device or _default_device(),
            gpu_budget=int(gpu_budget_gb * 1e9) if gpu_budget_gb else None,
            host_budget=int(host_budget_gb * 1e9) if host_budget_gb else None,
            dtype=getattr(torch, _DTYPES[dtype]) if dtype else None,
            max_queue=max_queue,
            prepare=prepare,
            embed_url=embed_url,
        )
    console.print(
        f"nostall worker: {len(worker.names())} pipelines on {worker.device}; "
        f"http://{host}:{port}/ (status), /v1/images/generations, /v1/videos/decode"
    )
    uvicorn.run(create_app(worker), host=host, port=port, log_level="info")


@app.command()
def fleet(
    models: str = typer.Option(..., "--models", help="Folder of diffusers pipeline folders."),
    replicas: int = typer.Option(..., "--replicas", help="Workers, one per GPU."),
    device: str = typer.Option("cuda", help="cuda (one GPU per worker) or cpu."),
    host: str = typer.Option("127.0.0.1", help="Address of Ray Serve's HTTP proxy."),
    port: int = typer.Option(8000, help="Port."),
    gpu_budget_gb: float = typer.Option(
        None, help="Each worker's device tier (default: 80% of its GPU's free memory)."
    ),
    host_budget_gb: float = typer.Option(
        None,
        help="Each worker's pinned host tier (default: half the memory, shared by the workers).",
    ),
    address: str = typer.Option(None, help="A running Ray cluster (default: start one here)."),
    embed: bool = typer.Option(
        False,
        "--embed/--no-embed",
        help="Also run the embedding service (at /embed, beside a worker on its GPU); the "
        "workers encode FLUX, SDXL and SD3 prompts there and leave their text encoders out.",
    ),
) -> None:
    """Run workers on Ray Serve, one per GPU, behind a router that sends each request to
    the worker that can serve its model soonest (GPU, then host memory, then disk)."""
    import ray
    from ray import serve as ray_serve

    from nostall.serve.fleet import build_embed, build_fleet

    opts = {}
    share = 1.0
    if embed:
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        opts["embed_url"] = f"http://{local}:{port}/embed"
        share = 0.9
    if gpu_budget_gb:
        opts["gpu_budget"] = int(gpu_budget_gb * 1e9)
    if host_budget_gb:
        opts["host_budget"] = int(host_budget_gb * 1e9)
    with _option():
        app_ = build_fleet(
            models, replicas=replicas, device=device, worker_options=opts, gpu_share=share
        )
        embed_app = build_embed(models, device=device, gpu_share=1 - share) if embed else None
    ray.init(address=address, include_dashboard=False)
    ray_serve.start(http_options={"host": host, "port": port})
    if embed_app is not None:
        ray_serve.run(embed_app, name="embed", route_prefix="/embed")
        console.print(f"nostall fleet: embedding service at http://{host}:{port}/embed")
    console.print(f"nostall fleet: {replicas} workers; http://{host}:{port}/v1/images/generations")
    ray_serve.run(app_, name="nostall", route_prefix="/", blocking=True)


@app.command("embed-server")
def embed_server(
    models: str = typer.Option(..., "--models", help="Folder of diffusers pipeline folders."),
    device: str = typer.Option(None, help="cuda[:N] or cpu (default: cuda if present)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8001, help="Port."),
    dtype: str = typer.Option(None, help="bf16, fp16 or fp32 (default: as stored)."),
    cache_gb: float = typer.Option(1.0, help="Byte budget of the embedding cache."),
    token_budget: int = typer.Option(8192, help="A batch closes at this many tokens..."),
    max_wait_ms: float = typer.Option(5.0, help="...or this long after its first text."),
) -> None:
    """Serve the store's text encoders (T5, UMT5, CLIP): unpooled and pooled embeddings as
    safetensors, dynamic batching, an exact-match cache."""
    import torch
    import uvicorn

    from nostall.serve.embed import EmbeddingService, create_embed_app

    with _option():
        service = EmbeddingService(
            models,
            device=device or _default_device(),
            dtype=getattr(torch, _DTYPES[dtype]) if dtype else None,
            cache_bytes=int(cache_gb * 1e9),
            token_budget=token_budget,
            max_wait_s=max_wait_ms / 1e3,
        )
    console.print(
        f"nostall embeddings: {len(service.names())} encoders on {service.device}; "
        f"POST http://{host}:{port}/v1/embeddings"
    )
    uvicorn.run(create_embed_app(service), host=host, port=port, log_level="info")


@bench_app.command("serve")
def bench_serve(
    models: str = typer.Option(None, help="Pipeline store (default: tiny FLUX/SDXL/SD3)."),
    device: str = typer.Option(None, help="cuda or cpu."),
    part: list[str] = typer.Option(  # noqa: B008
        None, "--part", help="worker, fleet, embed (repeatable). Default: all."
    ),
    clients: int = typer.Option(16, help="Concurrent clients of the worker and the fleet."),
    requests: int = typer.Option(96, help="Requests in the mixed stream."),
    size: int = typer.Option(256, help="Image side in pixels."),
    steps: int = typer.Option(4, help="Denoising steps per request."),
    replicas: int = typer.Option(2, help="Fleet workers (one GPU each)."),
    encoder: str = typer.Option(
        "flux/text_encoder_2",
        help="Encoder the embed part loads; t5xxl/text_encoder_2 writes a real-size T5-XXL.",
    ),
    texts_each: int = typer.Option(8, help="Texts per embedding client (32 clients)."),
    work: str = typer.Option(None, help="Folder for the written store."),
    out: str = typer.Option(f"{_BENCH_OUT}/serve.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
) -> None:
    """The worker, the Ray Serve fleet and the embedding service under concurrent load."""
    from nostall.bench.load import check_new_output, write_report
    from nostall.bench.serve import PARTS, run_serve_bench

    with _option("--out"):
        check_new_output(out, overwrite=overwrite)
    with _option():
        report = run_serve_bench(
            models=models,
            device=device or _default_device(),
            parts=tuple(part) if part else PARTS,
            clients=clients,
            requests=requests,
            size=size,
            steps=steps,
            replicas=replicas,
            encoder=encoder,
            texts_each=texts_each,
            work=work,
            log=lambda m: console.print(m, highlight=False),
        )
    with _option("--out"):
        write_report(report, out, overwrite=overwrite)
    _print_targets(report["targets"])
    console.print(f"report written to {out}")


@bench_app.command("fp8")
def bench_fp8(
    size: str = typer.Option("full", help="full (FLUX.1-dev layout, 34 GB) or tiny."),
    device: str = typer.Option(None, help="cuda[:N] or cpu."),
    repeat: int = typer.Option(5, help="Timed runs per figure (medians)."),
    part: list[str] = typer.Option(  # noqa: B008
        None, "--part", help="loads, forward, compile, cache, e2e (repeatable; default all)."
    ),
    compile_budget: float = typer.Option(
        None, help="Seconds the whole run may spend before the compile part skips a compile."
    ),
    store: str = typer.Option(
        None, help="FLUX store folder (written when absent, kept; its FP8 copy beside it)."
    ),
    out: str = typer.Option(
        f"{_BENCH_OUT}/fp8.json", help="JSON report path (recorded results: docs/bench/)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
) -> None:
    """FP8 against bf16 on FLUX, with torchao's FP8 as the peer: bytes, loads, one 1024x1024
    forward (eager and compiled), the model cache against load_model, and 28 steps end to
    end through the model cache."""
    from nostall.bench.fp8 import PARTS, run_fp8_bench
    from nostall.bench.load import check_new_output, write_report

    with _option("--out"):
        check_new_output(out, overwrite=overwrite)
    with _option():
        report = run_fp8_bench(
            size=size,
            device=device or _default_device(),
            store=store,
            repeat=repeat,
            parts=tuple(part or PARTS),
            compile_budget_s=compile_budget,
            log=lambda m: console.print(m, highlight=False),
        )
    with _option("--out"):
        write_report(report, out, overwrite=overwrite)
    console.print(fp8_table(report))
    console.print(f"FP8 linear layers: {report['config']['fp8_compute'][1]}")
    _print_targets(report["targets"])
    console.print(f"report written to {out}")


def fp8_table(report: dict) -> Table:
    """The FP8 report's figures: bf16 against FP8 (and the torchao peer where it ran)."""
    res = report["results"]
    table = Table(title=f"FP8 vs bf16: {report['config']['model']}")
    for col in ("figure", "bf16", "fp8", "fp8 / bf16", "torchao (peer)"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    table.add_row(
        "transformer weights (GB)",
        f"{res['bytes']['bf16'] / 1e9:.3f}",
        f"{res['bytes']['fp8'] / 1e9:.3f}",
        f"{res['bytes']['ratio']:.3f}",
        "",
    )
    loads = res.get("loads", {})
    for key, label in (
        ("page_cache_load_s", "page-cache load (s)"),
        ("memory_hit_s", "memory hit, load_model (s)"),
        ("switch_hit_s", "memory-hit switch (s)"),
    ):
        r = loads.get(key)
        if r:
            table.add_row(label, f"{r['bf16']:.3f}", f"{r['fp8']:.3f}", f"{r['ratio']:.3f}", "")
    fwd = res.get("forward", {})
    if "bf16_eager_s" in fwd:
        ao = fwd.get("torchao", {})
        table.add_row(
            "forward, eager (ms)",
            f"{fwd['bf16_eager_s'] * 1e3:.1f}",
            f"{fwd['fp8_eager_s'] * 1e3:.1f}",
            f"{fwd['fp8_vs_bf16_eager']:.3f}",
            f"{ao['eager_s'] * 1e3:.1f}" if "eager_s" in ao else ao.get("error", "")[:40],
        )
        table.add_row(
            "output SQNR vs bf16 (dB)",
            "",
            f"{fwd['sqnr_db']:.2f}",
            "",
            f"{ao['sqnr_db']:.2f}" if "sqnr_db" in ao else "",
        )
    comp = res.get("compile", {})
    if "bf16_compiled_s" in comp:
        fp8 = comp.get("fp8_compiled_s")
        table.add_row(
            "forward, compiled (ms)",
            f"{comp['bf16_compiled_s'] * 1e3:.1f}",
            f"{fp8 * 1e3:.1f}" if fp8 else comp.get("fp8_skipped", "—"),
            f"{fp8 / comp['bf16_compiled_s']:.3f}" if fp8 else "",
            "",
        )
    e2e = res.get("e2e", {})
    if "fp8_speedup" in e2e:
        table.add_row(
            f"end to end, {e2e['steps']} steps at {e2e['resolution']}² (s)",
            f"{e2e['bf16']['total_s']:.3f}",
            f"{e2e['fp8']['total_s']:.3f}",
            f"{1 / e2e['fp8_speedup']:.3f}",
            "",
        )
    if "equal" in res.get("cache", {}):
        table.add_row(
            "model cache = load_model (FP8)", "", str(bool(res["cache"]["equal"])), "", ""
        )
    return table


def _print_targets(targets: dict) -> None:
    table = Table(title="targets")
    for col in ("target", "value", "threshold", "met"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for name, t in targets.items():
        v = t["value"]
        mark = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "not run"}[t["met"]]
        value = "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        table.add_row(name, value, f"{t['op']} {t['threshold']}", mark)
    console.print(table)


# Commands that live in their own modules (one job per module), registered here.
from nostall.cli.switch import bench_switch, index, switch  # noqa: E402

app.command()(switch)
app.command()(index)
bench_app.command("switch")(bench_switch)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except NostallError as e:
        console.print(f"[red]error:[/red] {type(e).__name__}: {e}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
