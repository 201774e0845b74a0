"""``nostall switch``, ``nostall index`` and ``nostall bench switch``: thin layers over
``ModelCache``, ``Store`` and the switch benchmark (registered on the app by
:mod:`nostall.cli.main`)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table


def _gb(value: float | None, hint: str) -> int | None:
    if value is None:
        return None
    if value <= 0:
        raise typer.BadParameter(f"must be a positive number of GB, got {value}", param_hint=hint)
    return int(value * 1e9)


def index(
    models: str = typer.Argument(..., help="A folder of diffusers pipeline folders."),
    name: list[str] = typer.Option(  # noqa: B008
        None, "--name", help="Pipelines to hash (repeatable; default: all)."
    ),
    cache_dir: str = typer.Option(
        None, help="Digest index folder (default: $NOSTALL_CACHE_DIR or ~/.cache/nostall)."
    ),
    threads: int = typer.Option(8, help="Files hashed at once."),
) -> None:
    """Hash a store's weight files now, into the digest index, so that its components are
    identified by content (and shared) from their first switch on. Files the index knows
    are skipped; a switch would otherwise hash each file the first time it reads it."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nostall.cache import Store
    from nostall.cli.main import _option, console

    if threads < 1:
        raise typer.BadParameter(f"must be at least 1, got {threads}", param_hint="--threads")
    with _option():
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


def switch(
    names: list[str] = typer.Argument(  # noqa: B008
        ..., help="Pipelines to switch to, in order (folder names in --models)."
    ),
    models: str = typer.Option(..., "--models", help="A folder of diffusers pipeline folders."),
    device: str = typer.Option(None, help="cpu or cuda[:N] (default: cuda when available)."),
    gpu_gb: float = typer.Option(None, help="Device tier budget in GB (default: 80% of free)."),
    host_gb: float = typer.Option(None, help="Pinned host tier budget in GB (default: half RAM)."),
    dtype: str = typer.Option(None, help="Load floating weights as bf16, fp16 or fp32."),
    steps: int = typer.Option(0, help="Denoising steps to run after each switch (0: none)."),
    size: int = typer.Option(256, help="Image size for those steps."),
) -> None:
    """Switch among pipelines of a store and print, per switch, where each component came
    from and what each phase cost."""
    from nostall.cache import ModelCache
    from nostall.cli.main import _default_device, _dtype, _option, console
    from nostall.synthetic import denoise

    if steps < 0:
        raise typer.BadParameter(f"must be >= 0, got {steps}", param_hint="--steps")
    device = device or _default_device()
    with _option("--models"):
        cache = ModelCache(
            models,
            device=device,
            gpu_budget=_gb(gpu_gb, "--gpu-gb"),
            host_budget=_gb(host_gb, "--host-gb"),
            dtype=_dtype(dtype),
        )
    with cache:
        with console.status("preparing the tiers (device memory, pinning) and reading the store…"):
            cache.prepare(*names)  # unknown names fail here, before any switch
        for name in names:
            with cache.use(name) as pipe:
                report = cache.last_report
                run_s = (
                    denoise(pipe, name, steps=steps, res=size, dev=cache.device) if steps else None
                )
            console.print(report.table())
            if run_s is not None:
                console.print(f"  {steps} denoising steps at {size}x{size}: {run_s:.3f} s")
        _print_stats(cache.stats(), console)


def _print_stats(stats, console: Console) -> None:
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
    console.print(table)


def bench_switch(
    size: str = typer.Option(
        "full",
        help="full (FLUX.1-dev 34 GB + SDXL 6.9 GB layouts, and a second FLUX transformer), "
        "full-lean (no second FLUX: fits a 128 GiB host), full-flux (FLUX alone, and its FP8 "
        "copy for the memory-hit part) or tiny.",
    ),
    folder: str = typer.Option(
        "/tmp/nostall-bench/store", help="Where the random store is written."
    ),
    device: str = typer.Option(None, help="cuda[:N] or cpu (default: cuda when available)."),
    out: str = typer.Option(
        "bench-out/switch.json", help="JSON report path (recorded results live in docs/bench/)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing report at --out."
    ),
    part: list[str] = typer.Option(  # noqa: B008
        None,
        "--part",
        help="Parts to run (repeatable): nostall, new-process, cold, same-arch, prefetch, "
        "peers, identity, memory-hit, diffusers.",
    ),
) -> None:
    """Whole-pipeline switches: nostall's model cache against diffusers and the others.

    The cold part drops the OS page cache (announced before it happens)."""
    from nostall.bench.load import check_new_output, write_report
    from nostall.bench.switch import PARTS, run_switch_bench
    from nostall.cli.main import _default_device, _option, console

    parts = tuple(part) if part else PARTS
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise typer.BadParameter(
            f"unknown parts {bad}; choose from {list(PARTS)}", param_hint="--part"
        )
    if size not in ("full", "full-lean", "full-flux", "tiny"):
        raise typer.BadParameter(
            f"{size!r}; choose full, full-lean, full-flux or tiny", param_hint="--size"
        )
    with _option("--out"):
        check_new_output(out, overwrite=overwrite)
    report = run_switch_bench(
        folder=folder,
        size=size,
        device=device or _default_device(),
        parts=parts,
        log=lambda s: console.print(s, highlight=False),
        save=lambda r: write_report(r, out, overwrite=True),
    )
    figures = _figures(report)
    if figures.row_count:
        console.print(figures)
    table = Table(
        title=f"switch bench ({size}) on {report['hardware'].get('gpu', device)}",
        title_justify="left",
    )
    for col in ("target", "value", "threshold", "met"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for name, t in report.get("targets", {}).items():
        v = t["value"]
        mark = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "not run"}[t["met"]]
        table.add_row(
            name,
            f"{v:.4g}" if isinstance(v, float) else str(v),
            f"{t['op']} {t['threshold']}",
            mark,
        )
    console.print(table)
    console.print(f"report written to {out}")


def _figures(report: dict) -> Table:
    """The identity, memory-hit and peer figures of one run, side by side."""
    table = Table(title="FLUX switches, same run", title_justify="left")
    for col in ("what", "seconds", "GB moved", "GB/s"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for label in ("bf16", "fp8"):
        s = report.get("memory-hit", {}).get(label, {}).get("switch")
        if s:
            table.add_row(
                f"nostall, whole {label} FLUX from the host tier",
                f"{s['total_s']:.3f}",
                f"{s['moved_bytes'] / 1e9:.2f}",
                f"{s['gbps']:.1f}",
            )
    for r in report.get("diffusers", {}).get("diffusers_from_pretrained_to", []):
        table.add_row("diffusers from_pretrained + .to (bf16)", f"{r['switch_s']:.3f}", "", "")
    for kind in ("cold", "page_cache"):
        for r in report.get("identity", {}).get(kind, []):
            how = "hashing every byte" if r["hashing"] else "digests known"
            table.add_row(
                f"new process, {kind.replace('_', ' ')}, {how}", f"{r['total_s']:.3f}", "", ""
            )
    s = report.get("new-process", {}).get("switch")
    if s:
        table.add_row("new process, page cache (prepared)", f"{s['total_s']:.3f}", "", "")
    return table
