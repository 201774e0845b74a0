"""``nostall bench ...``: the benchmarks against the peers, written as JSON reports.

The only command module that imports :mod:`nostall.bench`. Each benchmark module renders
its own report (``tables(report)``: rich tables and lines); this one checks the options,
runs the benchmark and prints them.
"""

from __future__ import annotations

import typer

from nostall.cli.app import (
    BENCH_OUT,
    bench_app,
    check_choices,
    check_output,
    console,
    device_option,
    in_range,
    usage_errors,
)

__all__ = [
    "bench_adapters",
    "bench_catalog",
    "bench_decode",
    "bench_fp8",
    "bench_load",
    "bench_remote",
    "bench_serve",
    "bench_stream",
    "bench_switch",
    "bench_video",
]

_DEVICE = "cuda[:N] or cpu (default: cuda when available)."
_SWITCH_SIZES = ("full", "full-lean", "full-flux", "tiny")


def _log(line: str) -> None:
    console.print(line, highlight=False)


def _finish(report: dict, tables: list, out: str, *, overwrite: bool) -> None:
    """Write the report (never over another unless ``--overwrite``), then show its tables."""
    from nostall.bench.record import write_report

    with usage_errors("--out"):
        write_report(report, out, overwrite=overwrite)
    _show(tables)
    console.print(f"report written to {out}")


def _show(renderables: list) -> None:
    for r in renderables:
        console.print(r)


def _drop_caches_option() -> bool:
    return typer.Option(
        False,
        "--drop-caches",
        help="Allow the cold measurements, which drop the OS page cache (sync; echo 3 > "
        "/proc/sys/vm/drop_caches: every file cached on the machine, root only). Without "
        "it they are skipped.",
    )


@bench_app.command("load")
def bench_load(
    preset: str = typer.Option(
        "flux", help="flux (23.8 GB FluxTransformer2DModel default config) or tiny."
    ),
    device: str = device_option(_DEVICE),
    folder: str = typer.Option(
        "/tmp/nostall-bench/flux", help="Where the random checkpoint is written."
    ),
    out: str = typer.Option(
        f"{BENCH_OUT}/load.json",
        help="JSON report path.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing report at --out."
    ),
    scenario: list[str] = typer.Option(  # noqa: B008
        None, help="Scenarios to run: cold, page-cache, memory-cache (default: all three)."
    ),
    repeat: int = typer.Option(
        2, callback=in_range(1), help="Runs per method in warm scenarios (best is reported)."
    ),
    method: list[str] = typer.Option(None, help="Only these methods (by name)."),  # noqa: B008
    drop_caches: bool = _drop_caches_option(),
) -> None:
    """FLUX-size checkpoint → GPU: nostall vs safetensors, diffusers, fastsafetensors, runai.

    The cold scenario drops the OS page cache (every file cached on the machine) before
    each method, with --drop-caches only; each drop is announced before it happens and
    recorded in the JSON.
    """
    from nostall.bench import load as bench
    from nostall.synthetic import PRESETS

    check_choices([preset], PRESETS, "--preset")
    scenarios = check_choices(scenario or bench.SCENARIOS, bench.SCENARIOS, "--scenario")
    check_output(out, hint="--out", overwrite=overwrite)
    report = bench.run_load_bench(
        preset=preset,
        device=device,
        folder=folder,
        scenarios=scenarios,
        repeat=repeat,
        methods=tuple(method) if method else None,
        log=_log,
        drop_caches=drop_caches,
    )
    _finish(report, bench.tables(report), out, overwrite=overwrite)


@bench_app.command("decode")
def bench_decode(
    size: str = typer.Option("720p", help="720p (latents 16x41x90x160), 480p or tiny."),
    dtype: list[str] = typer.Option(None, help="bf16 and/or fp32 (default: both)."),  # noqa: B008
    latent_frames: int = typer.Option(
        41, callback=in_range(1), help="Latent frames (41 → 161 video frames)."
    ),
    repeat: int = typer.Option(
        10, callback=in_range(1), help="Timed decodes per mode, after one warm-up."
    ),
    device: str = device_option(_DEVICE),
    preset: str = typer.Option("veryfast", help="libx264 preset."),
    out: str = typer.Option(
        f"{BENCH_OUT}/decode.json",
        help="JSON report path.",
    ),
    figure: str = typer.Option(
        f"{BENCH_OUT}/decode-timeline-{{dtype}}.png", help="Timeline picture (CUDA runs)."
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
    back_to_back: int = typer.Option(
        3, callback=in_range(0), help="Videos in a row for the back-to-back section."
    ),
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
    import os
    import tempfile

    from nostall.bench import decode as bench
    from nostall.errors import SinkError
    from nostall.transfer.loader import resolve_device
    from nostall.video import check_sink_path
    from nostall.video.wan import check_devices

    check_choices([size], bench.SIZES, "--size")
    dtypes = check_choices(dtype or ("bf16", "fp32"), bench.DTYPES, "--dtype")
    parts = check_choices(part or bench.PARTS, bench.PARTS, "--part")
    modes = check_choices(mode or bench.DECODER_MODES, bench.DECODER_MODES, "--mode")
    try:  # the sinks know the x264 presets; a nominal output path asks them
        check_sink_path(os.path.join(tempfile.gettempdir(), "bench.mp4"), preset=preset)
    except SinkError as e:
        raise typer.BadParameter(str(e).removeprefix(f"{e.path}: "), param_hint="--preset") from e
    if set(parts) == {"memory"} and not device.startswith("cuda"):  # else it is left out
        raise typer.BadParameter(
            f"the memory part measures peak GPU memory, which needs a CUDA device (--device "
            f"cuda), not {device!r}",
            param_hint="--part",
        )
    split = tuple(d.strip() for d in devices.split(",") if d.strip()) if devices else None
    if split:
        with usage_errors("--devices"):
            first = resolve_device(device) if device.startswith("cuda") else None
            check_devices(split, first)
        if "modes" not in parts:
            raise typer.BadParameter(
                "is measured in the modes part; add --part modes", param_hint="--devices"
            )
    check_output(out, hint="--out", overwrite=overwrite)
    if figure and "timed" in parts and device.startswith("cuda"):  # drawn from CUDA profiles
        for name in dtypes:
            check_output(figure.replace("{dtype}", name), hint="--figure", overwrite=overwrite)
    report = bench.run_decode_bench(
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
        log=_log,
    )
    _finish(report, bench.tables(report), out, overwrite=overwrite)


@bench_app.command("serve")
def bench_serve(
    size: str = typer.Option(
        "tiny",
        help="tiny (random tiny FLUX/SDXL/SD3, seconds on a CPU; parts worker, fleet, embed) "
        "or full (real-size FLUX.1-dev, SDXL and SD3-medium, 47 GB written under --work; "
        "parts peer, stream, stream-batched, stream-embed, stream-embed-process, soak, "
        "prefetch).",
    ),
    models: str = typer.Option(None, help="Pipeline store (default: written, see --size)."),
    device: str = device_option(_DEVICE),
    part: list[str] = typer.Option(  # noqa: B008
        None,
        "--part",
        help="Parts to run (repeatable): worker, fleet, embed, peer, stream, stream-batched, "
        "stream-embed, stream-embed-process, soak, prefetch. Default: the size's.",
    ),
    clients: int = typer.Option(
        16, callback=in_range(1), help="Concurrent clients of the worker and the fleet."
    ),
    requests: int = typer.Option(
        None, callback=in_range(1), help="Requests in the mixed stream (tiny 96, full 64)."
    ),
    resolution: int = typer.Option(
        None, callback=in_range(16), help="Image side in pixels (tiny 128, full 512)."
    ),
    steps: int = typer.Option(
        None, callback=in_range(1), help="Denoising steps per request (tiny 4, full 8)."
    ),
    replicas: int = typer.Option(2, callback=in_range(1), help="Fleet workers (one GPU each)."),
    encoder: str = typer.Option(
        "flux/text_encoder_2",
        help="Encoder the embed part loads; t5xxl/text_encoder_2 writes a real-size T5-XXL.",
    ),
    embed_clients: int = typer.Option(
        32, callback=in_range(1), help="Concurrent clients of the embedding service."
    ),
    texts_each: int = typer.Option(8, callback=in_range(1), help="Texts per embedding client."),
    soak_s: float = typer.Option(
        120.0, "--soak-s", callback=in_range(1.0), help="Seconds the soak part runs."
    ),
    peer_mode: str = typer.Option(
        "auto",
        help="How the diffusers peer switches: to (pipelines in CPU memory, .to()), "
        "from_pretrained (per switch) or auto (the faster of one round of each).",
    ),
    batch: int = typer.Option(
        8,
        callback=in_range(1),
        help="The stream-batched part's batch cap (the worker's --batch); the other parts "
        "run the worker's default, one request per pipeline call.",
    ),
    work: str = typer.Option(
        None,
        help="Folder for the written store and the peer's reference images (default: a "
        "temporary one; full: /tmp/nostall-bench/serve, kept for the next run).",
    ),
    out: str = typer.Option(f"{BENCH_OUT}/serve.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
    append: bool = typer.Option(
        False,
        "--append",
        help="Add this run's parts to the report at --out (same size, store, clients, "
        "requests, resolution and steps), so a long benchmark can run as several commands.",
    ),
) -> None:
    """The worker, the Ray Serve fleet and the embedding service under concurrent load;
    at full size, the mixed stream against a plain diffusers worker, with the embedding
    service in-process and as a separate process, a soak and the prefetch slowdown."""

    from nostall.bench import serve as bench
    from nostall.bench.record import write_report
    from nostall.bench.serve_peer import MODES

    check_choices([size], tuple(bench.SIZES), "--size")
    parts = check_choices(part or bench.SIZES[size]["parts"], bench.PARTS, "--part")
    check_choices([peer_mode], ("auto", *MODES), "--peer-mode")
    previous = _previous(out) if append else None
    check_output(out, hint="--out", overwrite=overwrite or append)
    with usage_errors():
        report = bench.run_serve_bench(
            models=models,
            device=device,
            size=size,
            parts=parts,
            clients=clients,
            requests=requests,
            res=resolution,
            steps=steps,
            replicas=replicas,
            encoder=encoder,
            embed_clients=embed_clients,
            texts_each=texts_each,
            soak_s=soak_s,
            peer_mode=peer_mode,
            batch=batch,
            work=work,
            log=_log,
            save=lambda r: write_report(r, out, overwrite=True),
            previous=previous,
        )
    write_report(report, out, overwrite=True)
    _show(bench.tables(report))
    console.print(f"report written to {out}")


@bench_app.command("catalog")
def bench_catalog(
    size: str = typer.Option(
        "tiny",
        help="tiny (the catalog's five layouts, tiny, seconds on a CPU) or full (FLUX.1-dev, "
        "SDXL and two fine-tunes, SD3-medium: 56.8 GB written under --work).",
    ),
    models: str = typer.Option(None, help="A store holding the catalog (default: written)."),
    device: str = device_option(_DEVICE),
    budget_gb: list[float] = typer.Option(  # noqa: B008
        None,
        "--budget-gb",
        help="Device budgets for weights, every system alike (repeatable; default 44 and 80; "
        "at tiny size scaled by the tiny catalog's bytes over the full one's).",
    ),
    system: list[str] = typer.Option(  # noqa: B008
        None, "--system", help="nostall, lru-pinned, lru-pageable (repeatable; default all)."
    ),
    alpha: float = typer.Option(1.0, callback=in_range(0.0), help="Zipf popularity exponent."),
    load: float = typer.Option(
        0.7, callback=in_range(0.01, 2.0), help="Arrival rate as a share of nostall's capacity."
    ),
    requests: int = typer.Option(
        None, callback=in_range(1), help="Requests per stream (tiny 24, full 48)."
    ),
    rounds: int = typer.Option(2, callback=in_range(1), help="Interleaved rounds (medians)."),
    burst_x: float = typer.Option(
        4.0, callback=in_range(1.0), help="The burst's rate over the stream's."
    ),
    slo_scale: float = typer.Option(
        3.0, callback=in_range(1.0), help="Each request's SLO: its model's warm latency times this."
    ),
    max_queue: int = typer.Option(16, callback=in_range(1), help="nostall's --max-queue."),
    host_budget_gb: float = typer.Option(
        None,
        callback=in_range(0.001),
        help="CPU memory each system keeps copies in (default: all of the catalog); smaller "
        "than the catalog, some switches read the store.",
    ),
    trace: str = typer.Option(
        None, help="Replay a trace file (Katz JSON, GenTD26 CSV, or at_s,model CSV) instead."
    ),
    elsewhere: list[str] = typer.Option(  # noqa: B008
        None, "--elsewhere", help="ROLE=DIR (full size): that role's weight files under DIR."
    ),
    preempt: bool = typer.Option(
        True, "--preempt/--no-preempt", help="Run the preemption part after the first budget."
    ),
    work: str = typer.Option(
        None, help="Folder for the written store (default: temporary; full: kept in /tmp)."
    ),
    out: str = typer.Option(f"{BENCH_OUT}/catalog.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
) -> None:
    """A catalog larger than the device budget served to deadlines: nostall against plain
    diffusers keeping what fits on the device (LRU; CPU copies pinned, and pageable),
    interleaved rounds of one open-loop Zipf stream with a burst (issue #31)."""
    from nostall.bench import catalog as bench
    from nostall.bench.record import write_report

    check_choices([size], ("tiny", "full"), "--size")
    systems = check_choices(system or bench.SYSTEMS, bench.SYSTEMS, "--system")
    away = {}
    for item in elsewhere or ():
        role, sep, folder = item.partition("=")
        if not sep or not role or not folder:
            raise typer.BadParameter(f"{item!r}: give ROLE=DIR", param_hint="--elsewhere")
        away[role] = folder
    check_output(out, hint="--out", overwrite=overwrite)
    with usage_errors():
        report = bench.run_catalog_bench(
            models=models,
            size=size,
            device=device,
            budgets_gb=tuple(budget_gb or (44.0, 80.0)),
            systems=tuple(systems),
            alpha=alpha,
            load=load,
            requests=requests,
            rounds=rounds,
            burst_x=burst_x,
            slo_scale=slo_scale,
            max_queue=max_queue,
            host_budget_gb=host_budget_gb,
            trace=trace,
            work=work,
            elsewhere=away,
            preempt=preempt,
            log=_log,
            save=lambda r: write_report(r, out, overwrite=True),
        )
    write_report(report, out, overwrite=True)
    _show(bench.tables(report))
    console.print(f"report written to {out}")


@bench_app.command("stream")
def bench_stream(
    size: str = typer.Option(
        "full",
        help="full (FLUX.1-dev bf16 1024² 28 steps; Wan 2.1 T2V-14B bf16 832x480 33 frames 20 "
        "steps) or tiny (seconds on a CPU).",
    ),
    device: str = device_option(_DEVICE),
    models: str = typer.Option(
        None, help="A store holding the parts' pipelines (default: written)."
    ),
    part: list[str] = typer.Option(  # noqa: B008
        None, "--part", help="flux, wan (repeatable; default: both)."
    ),
    budget_gb: list[float] = typer.Option(  # noqa: B008
        None, "--budget-gb", help="Device budgets in GB (repeatable; default: 24 and 16)."
    ),
    system: list[str] = typer.Option(  # noqa: B008
        None,
        "--system",
        help="resident, nostall, group-offload, sequential (repeatable; default: all).",
    ),
    rounds: int = typer.Option(2, callback=in_range(1), help="Interleaved rounds."),
    work: str = typer.Option(None, help="Where stores are written (default: a temp folder)."),
    out: str = typer.Option(f"{BENCH_OUT}/stream.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, help="Replace an existing report at --out."),
) -> None:
    """A pipeline larger than the device budget, resident in part (its blocks streamed
    from the pinned host tier), against diffusers' group and sequential offload and the
    fully resident pipeline, interleaved (issue #32)."""
    from nostall.bench import stream as bench
    from nostall.bench.record import write_report

    check_choices([size], ("tiny", "full"), "--size")
    parts = check_choices(part or bench.PARTS, tuple(bench.PARTS), "--part")
    systems = check_choices(system or bench.SYSTEMS, bench.SYSTEMS, "--system")
    for gb in budget_gb or ():
        if not gb > 0:
            raise typer.BadParameter(
                f"must be a positive number of GB, got {gb}", param_hint="--budget-gb"
            )
    check_output(out, hint="--out", overwrite=overwrite)
    with usage_errors():
        report = bench.run_stream_bench(
            size=size,
            device=device,
            models=models,
            parts=tuple(parts),
            budgets_gb=tuple(budget_gb or (24.0, 16.0)),
            systems=tuple(systems),
            rounds=rounds,
            work=work,
            log=_log,
            save=lambda r: write_report(r, out, overwrite=True),
        )
    write_report(report, out, overwrite=True)
    _show(bench.tables(report))
    console.print(f"report written to {out}")


@bench_app.command("fp8")
def bench_fp8(
    size: str = typer.Option("full", help="full (FLUX.1-dev layout, 34 GB) or tiny."),
    device: str = device_option(_DEVICE),
    repeat: int = typer.Option(5, callback=in_range(1), help="Timed runs per figure (medians)."),
    part: list[str] = typer.Option(  # noqa: B008
        None, "--part", help="loads, forward, compile, cache, e2e (repeatable; default all)."
    ),
    compile_budget: float = typer.Option(
        None,
        callback=in_range(0.0),
        help="Seconds the whole run may spend before the compile part skips a compile.",
    ),
    store: str = typer.Option(
        None, help="FLUX store folder (written when absent, kept; its FP8 copy beside it)."
    ),
    out: str = typer.Option(f"{BENCH_OUT}/fp8.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
) -> None:
    """FP8 against bf16 on FLUX, with torchao's FP8 as the peer: bytes, loads, one 1024x1024
    forward (eager and compiled), the model cache against load_model, and 28 steps end to
    end through the model cache."""
    from nostall.bench import fp8 as bench

    check_choices([size], bench.SIZES, "--size")
    parts = check_choices(part or bench.PARTS, bench.PARTS, "--part")
    check_output(out, hint="--out", overwrite=overwrite)
    with usage_errors():
        report = bench.run_fp8_bench(
            size=size,
            device=device,
            store=store,
            repeat=repeat,
            parts=parts,
            compile_budget_s=compile_budget,
            log=_log,
        )
    _finish(report, bench.tables(report), out, overwrite=overwrite)


@bench_app.command("switch")
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
    device: str = device_option(_DEVICE),
    out: str = typer.Option(f"{BENCH_OUT}/switch.json", help="JSON report path."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing report at --out."
    ),
    part: list[str] = typer.Option(  # noqa: B008
        None,
        "--part",
        help="Parts to run (repeatable): nostall, new-process, cold, same-arch, prefetch, "
        "peers, identity, memory-hit, diffusers.",
    ),
    drop_caches: bool = _drop_caches_option(),
) -> None:
    """Whole-pipeline switches: nostall's model cache against diffusers and the others.

    The cold part, and the identity part's cold runs, drop the OS page cache (announced
    before it happens), with --drop-caches only."""
    from nostall.bench import switch as bench
    from nostall.bench.record import write_report

    parts = check_choices(part or bench.PARTS, bench.PARTS, "--part")
    check_choices([size], _SWITCH_SIZES, "--size")
    check_output(out, hint="--out", overwrite=overwrite)
    report = bench.run_switch_bench(
        folder=folder,
        size=size,
        device=device,
        parts=parts,
        log=_log,
        save=lambda r: write_report(r, out, overwrite=True),
        drop_caches=drop_caches,
    )
    _show(bench.tables(report))
    console.print(f"report written to {out}")


def _previous(out: str) -> dict | None:
    """The report at ``out`` for ``--append`` (``None`` if there is none yet)."""
    import json
    import os

    if not os.path.isfile(out):
        return None
    try:
        with open(out) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        msg = f"cannot read {out!r} to add to it: {e}"
        raise typer.BadParameter(msg, param_hint="--out") from None


@bench_app.command("adapters")
def bench_adapters(
    size: str = typer.Option(
        "full",
        help="full (FLUX.1-dev layout, 34 GB; LoRA ranks 16, 64, 128 on its 418 block linears) "
        "or tiny (the tiny FLUX, ranks 2, 4, 8: seconds on a CPU).",
    ),
    device: str = device_option(_DEVICE),
    part: list[str] = typer.Option(  # noqa: B008
        None,
        "--part",
        help="peer (diffusers + PEFT), nostall, controlnet (repeatable; default all).",
    ),
    repeat: int = typer.Option(5, callback=in_range(1), help="Timed runs per figure (medians)."),
    work: str = typer.Option(
        None,
        help="Folder for the store and its LoRAs (default: full /tmp/nostall-bench/adapters, "
        "kept for the next run; tiny a temporary one).",
    ),
    out: str = typer.Option(f"{BENCH_OUT}/adapters.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
    append: bool = typer.Option(
        False,
        "--append",
        help="Keep the other parts of the report at --out (same size, device and repeat), "
        "so the benchmark can run as several commands.",
    ),
) -> None:
    """LoRAs on a cached FLUX: nostall's fused switches against diffusers + PEFT (loads,
    hotswap, fuse), the forward with a LoRA against the base, recompiles under
    torch.compile and the base restored bit for bit."""
    from nostall.bench import adapters as bench
    from nostall.bench.record import write_report

    check_choices([size], tuple(bench.SIZES), "--size")
    parts = check_choices(part or bench.PARTS, bench.PARTS, "--part")
    previous = _previous(out) if append else None
    check_output(out, hint="--out", overwrite=overwrite or append)
    with usage_errors():
        report = bench.run_adapters_bench(
            size=size,
            device=device,
            parts=parts,
            repeat=repeat,
            work=work,
            log=_log,
            save=lambda r: write_report(r, out, overwrite=True),
            previous=previous,
        )
    write_report(report, out, overwrite=True)
    _show(bench.tables(report))
    console.print(f"report written to {out}")


@bench_app.command("remote")
def bench_remote(
    size: str = typer.Option(
        "full",
        help="full (the FLUX.1-dev transformer, 23.8 GB), small (~0.3 GB) or tiny (for tests).",
    ),
    device: str = device_option(_DEVICE),
    part: list[str] = typer.Option(  # noqa: B008
        None, "--part", help="remote (S3 against the peers), shared (two processes; repeatable)."
    ),
    connections: int = typer.Option(
        64, callback=in_range(1), help="nostall's parallel ranged GETs."
    ),
    bwlimit: str = typer.Option(
        "50M",
        help="The throttled link: each connection's bandwidth (rclone units, 50M = 50 MiB/s).",
    ),
    single_cap_s: float = typer.Option(
        10.0, callback=in_range(0.1), help="Seconds the one-stream peer runs (a steady rate)."
    ),
    work: str = typer.Option(
        None, help="Folder for the bucket (kept, and reused by the next run; default temporary)."
    ),
    out: str = typer.Option(f"{BENCH_OUT}/remote.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
) -> None:
    """A FLUX transformer from a real S3 server (rclone, loopback, with and without a
    per-connection limit) to the device: nostall against one GET stream and boto3's
    download_file; then the shared host tier, a second process's switch."""
    from nostall.bench import remote as bench

    check_choices([size], bench.SIZES, "--size")
    parts = check_choices(part or bench.PARTS, bench.PARTS, "--part")
    check_output(out, hint="--out", overwrite=overwrite)
    with usage_errors():
        report = bench.run_remote_bench(
            size=size,
            device=device,
            parts=parts,
            connections=connections,
            bwlimit=bwlimit,
            single_cap_s=single_cap_s,
            work=work,
            log=_log,
        )
    _finish(report, bench.tables(report), out, overwrite=overwrite)


@bench_app.command("video")
def bench_video(
    size: str = typer.Option(
        "full",
        help="full (Wan 2.1 T2V-14B, 40 GB, and Wan 2.2 T2V-A14B, 69 GB, at 832x480) or "
        "tiny (the tiny Wan layouts: seconds on a CPU).",
    ),
    device: str = device_option(_DEVICE),
    part: list[str] = typer.Option(  # noqa: B008
        None,
        "--part",
        help="wan21 (the worker against the pipeline alone and diffusers), fp8 (the worker "
        "serving the FP8 copy against diffusers bf16), a14b (a 48 GB card: one expert at a "
        "time in bf16, both in FP8, against diffusers' model CPU offload); repeatable, "
        "default all.",
    ),
    system: list[str] = typer.Option(  # noqa: B008
        None,
        "--system",
        help="The a14b part's systems: nostall, nostall_fp8, diffusers; repeatable, default "
        "all (one device call may not hold all three).",
    ),
    passes: int = typer.Option(2, callback=in_range(1), help="Interleaved passes (medians)."),
    work: str = typer.Option(
        None,
        help="Folder for the store and the videos (default: full /tmp/nostall-bench/video, "
        "kept for the next run; tiny a temporary one).",
    ),
    out: str = typer.Option(f"{BENCH_OUT}/video.json", help="JSON report path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report."),
) -> None:
    """Text-to-video served end to end (HTTP, the jobs API, MP4) against the same call
    in-process and diffusers' own code; Wan 2.2 A14B's experts switched under a 48 GB
    card's budget against diffusers' model CPU offload."""
    import os

    from nostall.bench import video as bench
    from nostall.bench.record import write_report

    check_choices([size], tuple(bench.SIZES), "--size")
    parts = check_choices(part or bench.PARTS, bench.PARTS, "--part")
    systems = check_choices(system or bench.SYSTEMS, bench.SYSTEMS, "--system")
    check_output(out, hint="--out", overwrite=overwrite)
    with usage_errors():
        report = bench.run_video_bench(
            size=size,
            device=device,
            parts=tuple(parts),
            passes=passes,
            work=work,
            log=_log,
            save=lambda r: write_report(r, out, overwrite=True),
            figures=os.path.dirname(os.path.abspath(out)),
            systems=tuple(systems),
        )
    _finish(report, bench.tables(report), out, overwrite=True)
