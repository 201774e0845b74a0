"""``nostall switch`` and ``nostall index``: thin layers over ``ModelCache`` and ``Store``."""

from __future__ import annotations

import time

import typer
from rich.table import Table

from nostall.cli.app import (
    app,
    console,
    device_option,
    gigabytes,
    in_range,
    parse_dtype,
    usage_errors,
)

__all__ = ["index", "switch"]


@app.command()
def index(
    models: str = typer.Argument(
        ..., help="A folder of diffusers pipeline folders, or s3://bucket/prefix."
    ),
    name: list[str] = typer.Option(  # noqa: B008
        None, "--name", help="Pipelines to hash (repeatable; default: all)."
    ),
    cache_dir: str = typer.Option(
        None, help="Digest index folder (default: $NOSTALL_CACHE_DIR or ~/.cache/nostall)."
    ),
    threads: int = typer.Option(8, callback=in_range(1), help="Files hashed at once."),
) -> None:
    """Hash a store's weight files now, into the digest index, so that its components are
    identified by content (and shared) from their first switch on. Files the index knows
    are skipped; a switch would otherwise hash each file the first time it reads it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nostall.cache import Store

    with usage_errors():
        store = Store(models, cache_dir=cache_dir)
        names = list(name) if name else store.names()
        for n in names:
            store.entry(n)  # unknown names fail here, before any hashing
        t0, total = time.perf_counter(), 0
        with Progress(
            TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console
        ) as bar:
            task = bar.add_task("hashing", total=len(names))
            for n in names:
                bar.update(task, description=f"hashing {n}")
                total += store.index_files(n, threads=threads)
                bar.advance(task)
        seconds = time.perf_counter() - t0
        shared: dict[str, list[str]] = {}
        for n in names:
            for c in store.entry(n).weights:
                shared.setdefault(c.digest, []).append(f"{n}/{c.role}")
    console.print(
        f"hashed {total / 1e9:.2f} GB in {seconds:.1f} s"
        + (f" ({total / seconds / 1e9:.2f} GB/s)" if total and seconds > 0 else "")
        + f"; index: {store.index.path or 'memory only'}"
    )
    for roles in shared.values():
        if len(roles) > 1:
            console.print(f"one copy: {', '.join(roles)}", highlight=False)


@app.command()
def switch(
    names: list[str] = typer.Argument(  # noqa: B008
        ..., help="Pipelines to switch to, in order (folder names in --models)."
    ),
    models: str = typer.Option(
        ..., "--models", help="A folder of diffusers pipeline folders, or s3://bucket/prefix."
    ),
    device: str = device_option(),
    gpu_gb: float = typer.Option(None, help="Device tier budget in GB (default: 80% of free)."),
    host_gb: float = typer.Option(None, help="Pinned host tier budget in GB (default: half RAM)."),
    dtype: str = typer.Option(None, help="Load floating weights as bf16, fp16 or fp32."),
    steps: int = typer.Option(
        0, callback=in_range(0), help="Denoising steps to run after each switch (0: none)."
    ),
    size: int = typer.Option(256, callback=in_range(16), help="Image size for those steps."),
    lora: list[str] = typer.Option(  # noqa: B008
        None,
        "--lora",
        help="NAME:SCALE (repeatable): fuse this LoRA into every pipeline switched to; NAME "
        "is a file of <models>/loras/ without .safetensors, or a path.",
    ),
    explain: bool = typer.Option(
        False,
        "--explain",
        help="After each switch, print the plan of each component resident in part: which "
        "blocks stream, the ring, the bytes per call.",
    ),
) -> None:
    """Switch among pipelines of a store and print, per switch, where each component came
    from and what each phase cost (and the LoRAs fused, and how long that took)."""
    from nostall.adapters import lora_weights
    from nostall.cache import ModelCache
    from nostall.synthetic import denoise

    gpu_budget, host_budget = gigabytes(gpu_gb, "--gpu-gb"), gigabytes(host_gb, "--host-gb")
    dt = parse_dtype(dtype)
    with usage_errors("--lora"):
        loras = lora_weights([_lora_option(x) for x in lora or ()])
    with usage_errors("--models"):
        cache = ModelCache(
            models, device=device, gpu_budget=gpu_budget, host_budget=host_budget, dtype=dt
        )
    with cache:
        with console.status("preparing the tiers (device memory, pinning) and reading the store…"):
            cache.prepare(*names)  # unknown names fail here, before any switch
        for name in names:
            t = time.perf_counter()
            with cache.use(name, loras=loras) as pipe:
                entered_s = time.perf_counter() - t
                report = cache.last_report
                run_s = (
                    denoise(pipe, name, steps=steps, res=size, dev=cache.device) if steps else None
                )
            console.print(report.table())
            if loras:
                fused = ", ".join(f"{n} {w:g}" for n, w in loras)
                console.print(
                    f"  LoRAs fused: {fused} ({max(0.0, entered_s - report.total_s):.3f} s "
                    "after the switch)",
                    highlight=False,
                )
            if run_s is not None:
                console.print(f"  {steps} denoising steps at {size}x{size}: {run_s:.3f} s")
            if explain:
                _explain(cache, name)
        console.print(_tiers_table(cache.stats()))


def _explain(cache, name: str) -> None:
    """The partial-residency plans of ``name``'s components (``--explain``)."""
    from nostall.cache.partial import explain
    from nostall.cache.report import human_bytes

    plans = explain(cache, name)
    if not plans:
        console.print(f"  {name}: every component resident whole")
    for p in plans:
        blocks = p["blocks"]
        shown = ", ".join(blocks[:4]) + (f", … ({len(blocks)} in all)" if len(blocks) > 4 else "")
        console.print(
            f"  {name}/{p['role']} resident in part: {p['streamed_blocks']} blocks stream "
            f"({shown}) through {p['depth']} buffer(s) of {human_bytes(p['slot_bytes'])}; "
            f"{human_bytes(p['resident_bytes'])} stay; {human_bytes(p['streamed_bytes'])} "
            f"cross the link per call; copied so far {human_bytes(p['copied_bytes'])}, "
            f"{p['misses']} block(s) not there in time",
            highlight=False,
        )
        predicted, measured = p.get("predicted_call_s"), p.get("measured_period_s")
        if predicted is not None or measured is not None:
            said = [f"predicted {predicted:.4f} s" if predicted is not None else None]
            said.append(f"measured {measured:.4f} s" if measured is not None else None)
            console.print(f"    a call of it: {', '.join(x for x in said if x)}", highlight=False)


def _lora_option(value: str) -> tuple[str, float]:
    """``NAME:SCALE`` (``NAME`` alone: scale 1) as ``(name, scale)``."""
    name, sep, scale = value.rpartition(":")
    if not sep:
        return value, 1.0
    try:
        return name, float(scale)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r}: give NAME:SCALE, the scale a number (e.g. ghibli:0.8)",
            param_hint="--lora",
        ) from None


def _tiers_table(stats) -> Table:
    """What each tier of a :class:`~nostall.CacheStats` holds against its budget."""
    table = Table(title="tiers after the switches", title_justify="left")
    for col in ("tier", "GB", "budget GB"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    table.add_row(
        "gpu" if stats.device.startswith("cuda") else "device",
        f"{stats.gpu_bytes / 1e9:.3f}",
        f"{stats.gpu_budget / 1e9:.3f}",
    )
    table.add_row(
        "host (pinned)", f"{stats.host_bytes / 1e9:.3f}", f"{stats.host_budget / 1e9:.3f}"
    )
    return table
