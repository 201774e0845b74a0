"""``nostall load``: load one checkpoint and print its read / H2D / build phases."""

from __future__ import annotations

import dataclasses
import json

import typer
from rich.table import Table

from nostall.cli.app import app, console, device_option, in_range, parse_dtype, usage_errors

__all__ = ["load"]

PHASE_COLUMNS = ("method", "scenario", "read s", "H2D s", "build s", "total s", "GB/s", "equal")


def _phase_table(title: str, rows: list[tuple[str, ...]]) -> Table:
    """One row per load: the phases of :class:`~nostall.LoadStats`, already formatted."""
    table = Table(title=title)
    for col in PHASE_COLUMNS:
        table.add_column(col, justify="left" if col in ("method", "scenario") else "right")
    for r in rows:
        table.add_row(*r)
    return table


@app.command()
def load(
    path: str = typer.Argument(
        ...,
        help="A .safetensors file, a shard index, or a component folder; local or "
        "s3://bucket/key (endpoint and credentials from the AWS variables).",
    ),
    device: str = device_option(),
    dtype: str = typer.Option(None, help="Cast floating tensors on the device: bf16, fp16, fp32."),
    model: bool = typer.Option(False, "--model", help="Also build the module (needs config.json)."),
    pool_gb: float = typer.Option(
        0.0,
        callback=in_range(0.0),
        help="Load through a pinned pool of this many GB; loads twice "
        "to show the memory-cache hit.",
    ),
    read_mode: str = typer.Option("auto", help="auto, buffered or direct (O_DIRECT)."),
    threads: int = typer.Option(
        None, callback=in_range(1), help="Reader threads (default: CPUs, at most 16)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the phase timings as JSON."),
    cache_dir: str = typer.Option(
        None, help="For s3:// paths: keep the weights here too (the disk tier)."
    ),
    connections: int = typer.Option(
        32, callback=in_range(1), help="For s3:// paths: parallel ranged GETs."
    ),
) -> None:
    """Load a checkpoint and print the read / H2D / build phases and GB/s."""
    from nostall.api import load_model_with_stats, local_source
    from nostall.memory.pool import PinnedPool
    from nostall.transfer.loader import Loader

    dt = parse_dtype(dtype)
    with usage_errors("--read-mode"):
        loader = Loader(threads=threads, read_mode=read_mode, connections=connections)
    with usage_errors("PATH"), console.status(f"reading the headers of {path}…"):
        path = local_source(path, cache_dir)
    rows, records = [], []
    with loader:
        pool = None
        if pool_gb > 0:
            with usage_errors("--pool-gb"):  # a budget beyond this machine's memory
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
