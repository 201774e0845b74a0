"""``nostall serve``, ``nostall fleet`` and ``nostall embed-server``: the HTTP services."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import typer

from nostall.cli.app import (
    app,
    check_choices,
    console,
    device_option,
    gigabytes,
    in_range,
    parse_dtype,
    usage_errors,
)

__all__ = ["embed_server", "fleet", "serve"]


def _port(default: int, help: str = "Port.") -> int:
    return typer.Option(default, callback=in_range(1, 65535), help=help)


def _grace(help: str) -> float:
    return typer.Option(30.0, callback=in_range(1.0, 3600.0), help=help)


def _token() -> str | None:
    return typer.Option(
        None,
        "--api-token",
        envvar="NOSTALL_API_TOKEN",
        show_envvar=True,
        help="Requests must carry 'Authorization: Bearer <token>' (the probes excepted); an "
        "empty one is refused.",
    )


def _time_limit() -> float:
    return typer.Option(
        600.0, callback=in_range(0.001), help="Seconds a request may wait for its answer (504)."
    )


def _variant() -> str | None:
    return typer.Option(
        None,
        help="Weights variant read in every component folder (fp16: "
        "diffusion_pytorch_model.fp16.safetensors; default: the plain files).",
    )


def _watermark() -> float:
    return typer.Option(
        0.95,
        help="When a switch must evict from the device tier, it evicts idle components "
        "until the tier is at most this full after it (room for the next switch or a "
        "prefetch); a fraction in (0, 1].",
    )


def _wait() -> float:
    return typer.Option(
        300.0,
        "--wait-s",
        help="Seconds a switch waits for device room held by requests running elsewhere "
        "before it fails (503 no_room).",
    )


def _cache_dir() -> str | None:
    return typer.Option(
        None,
        help="Folder of the digest index (and, for an s3:// store, the disk tier of the "
        "files read from the bucket); default: $NOSTALL_CACHE_DIR, else ~/.cache/nostall.",
    )


def _lora_budget() -> float | None:
    return typer.Option(
        None,
        "--lora-budget-gb",
        help="Pinned host memory for LoRAs read (copied to the GPU at link speed when "
        "fused), taken from the host tier (default: what <store>/loras holds, at most a "
        "quarter of the host tier).",
    )


def _cache_options(
    *,
    device: str,
    gpu_budget_gb: float | None,
    host_budget_gb: float | None,
    host_tier: str,
    dtype: str | None = None,
    variant: str | None,
    watermark: float,
    wait_s: float,
    cache_dir: str | None,
    lora_budget_gb: float | None,
    activation_reserve: int | None = None,
) -> dict[str, Any]:
    """The model cache's fields (:class:`~nostall.cache.config.CacheConfig`) from the
    flags: budgets in GB as bytes, the dtype parsed; the config checks the rest."""
    lora = None
    if lora_budget_gb is not None:
        lora = 0 if lora_budget_gb == 0 else gigabytes(lora_budget_gb, "--lora-budget-gb")
    return {
        "device": device,
        "gpu_budget": gigabytes(gpu_budget_gb, "--gpu-budget-gb"),
        "host_budget": gigabytes(host_budget_gb, "--host-budget-gb"),
        "host_tier": host_tier,
        "dtype": parse_dtype(dtype),
        "variant": variant,
        "watermark": watermark,
        "wait_s": wait_s,
        "cache_dir": cache_dir,
        "lora_budget": lora,
        "activation_reserve": activation_reserve,
    }


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """A config's refusal as the usage error of the flag behind its field."""
    from nostall.errors import ArgumentError

    try:
        yield
    except ArgumentError as e:
        flag = None if e.field is None else "--" + e.field.replace("_", "-")
        flag = _FLAGS.get(e.field, flag)
        raise typer.BadParameter(str(e), param_hint=flag) from e


# Config fields whose flag is not "--" + the field's name.
_FLAGS = {
    "gpu_budget": "--gpu-budget-gb",
    "host_budget": "--host-budget-gb",
    "lora_budget": "--lora-budget-gb",
    "reserve": "--activation-reserve-gb",
    "external": "--embed-budget-gb",
    "lora_room": "--lora-room-gb",
    "video_max_bytes": "--video-max-gb",
    "delay_s": "--max-delay-s",
    "overtake": "--max-overtaken",
}


@app.command()
def serve(
    models: str = typer.Option(
        ..., "--models", help="Folder of diffusers pipeline folders, or s3://bucket/prefix."
    ),
    device: str = device_option("cuda[:N] or cpu (default: cuda if present)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = _port(8000),
    max_queue: int = typer.Option(
        16, callback=in_range(1), help="Requests allowed to wait; more get 429."
    ),
    gpu_budget_gb: float = typer.Option(
        None,
        help="Device tier (default: the GPU's free memory less the activation reserve and "
        "--embed-budget-gb).",
    ),
    host_budget_gb: float = typer.Option(None, help="Pinned host tier (default: half of RAM)."),
    host_tier: str = typer.Option(
        "private",
        help="private (this worker's own pinned pool) or shared:NAME (one tier for every "
        "worker of this host that names it: what one read is a memory hit for all).",
    ),
    dtype: str = typer.Option(None, help="bf16, fp16 or fp32 (default: as stored)."),
    variant: str = _variant(),
    watermark: float = _watermark(),
    wait_s: float = _wait(),
    cache_dir: str = _cache_dir(),
    lora_budget_gb: float = _lora_budget(),
    prepare: bool = typer.Option(
        True, "--prepare/--no-prepare", help="Build every pipeline's modules at boot."
    ),
    preempt: bool = typer.Option(
        True,
        "--preempt/--no-preempt",
        help="Pause a long job at a denoising step for a short image job of another "
        "pipeline that would miss its slo_ms otherwise (the paused job's output unchanged).",
    ),
    embed_budget_gb: float = typer.Option(
        None,
        callback=in_range(0.0),
        help="GPU memory an embedding service in another process on this GPU takes (its "
        "encoders; nostall embed-server prints it): left out of the default device tier.",
    ),
    activation_reserve_gb: float = typer.Option(
        None,
        callback=in_range(0.0),
        help="GPU memory kept free for activations (default: the largest peak remembered "
        "for these pipelines, with a margin; at least 10% of free memory, 2 GiB).",
    ),
    lora_room_gb: float = typer.Option(
        0.0,
        callback=in_range(0.0),
        help="GPU memory for the base copies of the weights fused LoRAs change (a FLUX "
        "LoRA on all 418 block linears: 17.2 GB); without it they wait in host memory and each "
        "LoRA switch copies them back over the link.",
    ),
    embed_url: str = typer.Option(
        None, help="An embedding service (nostall embed-server) for FLUX, SDXL and SD3 prompts."
    ),
    api_token: str = _token(),
    time_limit_s: float = _time_limit(),
    max_connections: int = typer.Option(
        256, callback=in_range(1), help="Open connections and requests at once; more get 503."
    ),
    batch: int = typer.Option(
        1,
        callback=in_range(1),
        help="Run up to this many queued image requests of one model, size and steps as one "
        "pipeline call (1: each alone; batched images can differ in their last bits from "
        "the same requests run alone).",
    ),
    max_overtaken: int = typer.Option(
        8,
        callback=in_range(0),
        help="Requests for a model already on the GPU go first, but no request is overtaken "
        "by more than this many later ones (0: arrival order).",
    ),
    max_delay_s: float = typer.Option(
        30.0,
        callback=in_range(0.0),
        help="...nor pushed back by more than this many (estimated) seconds.",
    ),
    video_dir: str = typer.Option(
        None,
        help="Folder of the generated videos and their jobs' index (POST /v1/videos), one "
        "worker's alone; default: <cache-dir>/videos.",
    ),
    video_max_gb: float = typer.Option(
        20.0,
        callback=in_range(0.0),
        help="Generated videos kept at most; past it the oldest are removed.",
    ),
    grace_s: float = _grace(
        "On SIGTERM/SIGINT: not ready and no new work at once; queued and running requests "
        "go on for most of this, then get 503 (the running one at its next step); the process "
        "has exited by then (an orchestrator's grace period: 30 s by default)."
    ),
) -> None:
    """Serve image and video generation and video decoding over HTTP (OpenAI's images and
    videos API shapes), switching pipelines through the model cache. Status page at /, metrics at /metrics."""
    from nostall.serve.app import create_app
    from nostall.serve.config import WorkerConfig
    from nostall.serve.http import check_server, resolve_token, run_server, uvicorn_config
    from nostall.serve.schedule import Policy
    from nostall.serve.worker import Worker

    with _config_errors():  # every value checked once, before a byte is read
        config = WorkerConfig.from_kwargs(
            **_cache_options(
                device=device,
                gpu_budget_gb=gpu_budget_gb,
                host_budget_gb=host_budget_gb,
                host_tier=host_tier,
                dtype=dtype,
                variant=variant,
                watermark=watermark,
                wait_s=wait_s,
                cache_dir=cache_dir,
                lora_budget_gb=lora_budget_gb,
            ),
            max_queue=max_queue,
            prepare=prepare,
            preempt=preempt,
            embed_url=embed_url,
            reserve=None if activation_reserve_gb is None else int(activation_reserve_gb * 1e9),
            external=int((embed_budget_gb or 0) * 1e9),
            lora_room=int(lora_room_gb * 1e9),
            schedule=Policy(batch=batch, overtake=max_overtaken, delay_s=max_delay_s),
            video_dir=video_dir or (os.path.join(cache_dir, "videos") if cache_dir else None),
            video_max_bytes=max(1, int(video_max_gb * 1e9)),
        )
    with usage_errors("--api-token"):
        # checked (and the exposure warned of) before the worker reads a byte
        token = resolve_token(api_token)
        check_server(host=host, port=port, token=token, what="the worker")
    with usage_errors():
        worker = Worker(models, config=config)
    # Refused here, before the server binds, when a pipeline can never fit the device
    # tier (BudgetExceeded, printed as an error naming it); the app's start is then a no-op.
    worker.start()
    console.print(f"nostall worker: device budget {worker.budget.describe()}")
    app_ = create_app(worker, token=token, time_limit=time_limit_s)
    server = uvicorn_config(
        app_,
        host=host,
        port=port,
        token=token,
        limit_concurrency=max_connections,
        # once drained (Worker.drain leaves a margin), answers still being written get a
        # moment; then they are cut
        graceful_shutdown=min(1.0, grace_s / 20),
        warn=False,  # check_server said it
    )
    # a client that leaves, a refused body: one INFO line each
    logging.getLogger("nostall.serve").setLevel(logging.INFO)
    console.print(
        f"nostall worker: {len(worker.names())} pipelines on {worker.device}; "
        f"http://{host}:{port}/ (status), /v1/images/generations, /v1/videos/decode"
    )
    run_server(server, drain=lambda done: worker.drain(grace_s, on_done=done))


@app.command()
def fleet(
    models: str = typer.Option(
        ..., "--models", help="Folder of diffusers pipeline folders, or s3://bucket/prefix."
    ),
    replicas: int = typer.Option(..., "--replicas", help="Workers, one per GPU."),
    device: str = typer.Option("cuda", help="cuda (one GPU per worker) or cpu."),
    host: str = typer.Option("127.0.0.1", help="Address of Ray Serve's HTTP proxy."),
    port: int = _port(8000),
    gpu_budget_gb: float = typer.Option(
        None, help="Each worker's device tier (default: 80% of its GPU's free memory)."
    ),
    host_budget_gb: float = typer.Option(
        None,
        help="The pinned host tier (default: half the memory; with --host-tier private, "
        "divided by the workers).",
    ),
    host_tier: str = typer.Option(
        "shared:fleet",
        help="shared:NAME (default: one tier for all the workers of a host, in /dev/shm) or "
        "private (each worker its own).",
    ),
    dtype: str = typer.Option(None, help="bf16, fp16 or fp32 (default: as stored)."),
    variant: str = _variant(),
    watermark: float = _watermark(),
    wait_s: float = _wait(),
    cache_dir: str = _cache_dir(),
    lora_budget_gb: float = _lora_budget(),
    address: str = typer.Option(None, help="A running Ray cluster (default: start one here)."),
    embed: bool = typer.Option(
        False,
        "--embed/--no-embed",
        help="Also run the embedding service (at /embed, beside a worker on its GPU); the "
        "workers encode FLUX, SDXL and SD3 prompts there and leave their text encoders out.",
    ),
    api_token: str = _token(),
    time_limit_s: float = _time_limit(),
    grace_s: float = _grace(
        "On SIGTERM/SIGINT: seconds the workers may take to stop before Ray is stopped."
    ),
) -> None:
    """Run workers on Ray Serve, one per GPU, behind a router that sends each request to
    the worker that can serve its model soonest (GPU, then host memory, then disk)."""
    # The workers' GPUs may be on other hosts of the cluster: only the kind is checked here.
    check_choices([device], ("cuda", "cpu"), "--device")
    from nostall.serve.config import WorkerConfig
    from nostall.serve.http import check_server, resolve_token

    embed_url, share = None, 1.0
    if embed:
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        embed_url, share = f"http://{local}:{port}/embed", 0.9
    with _config_errors():  # every worker's config, checked before Ray starts
        config = WorkerConfig.from_kwargs(
            **_cache_options(
                device=device,
                gpu_budget_gb=gpu_budget_gb,
                host_budget_gb=host_budget_gb,
                host_tier=host_tier,
                dtype=dtype,
                variant=variant,
                watermark=watermark,
                wait_s=wait_s,
                cache_dir=cache_dir,
                lora_budget_gb=lora_budget_gb,
            ),
            embed_url=embed_url,
        )
    with usage_errors("--api-token"):
        token = resolve_token(api_token)
        check_server(host=host, port=port, token=token, what="the fleet")

    import ray
    from ray import serve as ray_serve

    from nostall.serve.config import EmbedConfig
    from nostall.serve.fleet import build_embed, build_fleet

    with usage_errors():
        app_ = build_fleet(
            models,
            replicas=replicas,
            config=config,
            gpu_share=share,
            token=token,
            time_limit=time_limit_s,
        )
        embed_app = None
        if embed:
            embed_app = build_embed(
                models,
                config=EmbedConfig(device=device, dtype=config.cache.dtype),
                gpu_share=1 - share,
            )
    ray.init(address=address, include_dashboard=False)
    with _stopped_quietly("nostall fleet", grace_s):
        ray_serve.start(http_options={"host": host, "port": port})
        if embed_app is not None:
            ray_serve.run(embed_app, name="embed", route_prefix="/embed")
            console.print(f"nostall fleet: embedding service at http://{host}:{port}/embed")
        ray_serve.run(app_, name="nostall", route_prefix="/")
        console.print(
            f"nostall fleet: {replicas} workers; http://{host}:{port}/ (status), "
            "/v1/images/generations, /v1/videos/decode"
        )
        signal.pause()  # until SIGTERM or SIGINT (_stopped_quietly's handler)


@contextlib.contextmanager
def _stopped_quietly(what: str, grace: float) -> Iterator[None]:
    """Run the body until it ends or SIGTERM/SIGINT arrive, then stop Ray Serve and Ray
    with one line: no stack dump for a signal an orchestrator sends as a matter of course."""
    import ray
    from ray import serve as ray_serve

    class _Stop(Exception):
        def __init__(self, sig: int):
            self.sig = sig

    def stop(sig: int, frame: Any) -> None:
        raise _Stop(sig)

    watched = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.signal(s, stop) for s in watched}
    sig = None
    try:
        yield
    except _Stop as e:
        sig = e.sig
    except KeyboardInterrupt:
        sig = signal.SIGINT
    finally:
        for s in watched:
            signal.signal(s, signal.SIG_IGN)  # (no second stack dump while stopping)
        why = "ended" if sig is None else signal.Signals(sig).name
        console.print(f"{what}: {why}; stopping the workers (at most {grace:g} s)")
        # Serve's own shutdown lets the workers finish what they run; it can hang on a
        # cluster whose processes got the signal too (a terminal's Ctrl-C reaches the
        # whole process group): bounded, then Ray is stopped regardless.
        # Before Ray is up there is nothing to stop (Serve's shutdown would start a Ray
        # instance to find that out: 5 s and more on two cores).
        if ray.is_initialized():
            stopping = threading.Thread(target=ray_serve.shutdown, daemon=True)
            stopping.start()
            stopping.join(grace)
            with contextlib.suppress(Exception):
                ray.shutdown()
        for s, handler in before.items():
            signal.signal(s, handler)
        console.print(f"{what}: stopped")
    if sig is not None:
        sys.exit(128 + sig)  # the shell's convention for "ended by a signal"


@app.command("embed-server")
def embed_server(
    models: str = typer.Option(
        ..., "--models", help="Folder of diffusers pipeline folders, or s3://bucket/prefix."
    ),
    device: str = device_option("cuda[:N] or cpu (default: cuda if present)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = _port(8001),
    dtype: str = typer.Option(None, help="bf16, fp16 or fp32 (default: as stored)."),
    cache_gb: float = typer.Option(
        1.0, callback=in_range(0.0), help="Byte budget of the embedding cache (keys and values)."
    ),
    token_budget: int = typer.Option(
        8192, callback=in_range(1), help="A batch closes at this many tokens..."
    ),
    max_wait_ms: float = typer.Option(
        5.0, callback=in_range(0.0), help="...or this long after its first text."
    ),
    max_queue: int = typer.Option(
        1024, callback=in_range(1), help="Texts allowed to wait; more get 429 with Retry-After."
    ),
    max_text_chars: int = typer.Option(
        8192, callback=in_range(1), help="Longest text in characters; longer ones get 422."
    ),
    api_token: str = _token(),
    grace_s: float = _grace(
        "On SIGTERM/SIGINT: seconds open requests may take to finish before they are cut."
    ),
) -> None:
    """Serve the store's text encoders (T5, UMT5, CLIP): unpooled and pooled embeddings as
    safetensors, dynamic batching, an exact-match cache."""
    from nostall.serve.config import EmbedConfig
    from nostall.serve.embed import EmbeddingService, create_embed_app
    from nostall.serve.http import check_server, resolve_token, run_server, uvicorn_config

    dt = parse_dtype(dtype)
    with usage_errors("--api-token"):
        token = resolve_token(api_token)
    with _config_errors():
        config = EmbedConfig(
            device=device,
            dtype=dt,
            cache_bytes=int(cache_gb * 1e9),
            token_budget=token_budget,
            max_wait_s=max_wait_ms / 1e3,
            max_queue=max_queue,
            max_text_chars=max_text_chars,
            max_texts=min(256, max_queue),  # a request must fit the queue
        )
    with usage_errors():  # the token and the address before a model is read
        check_server(host=host, port=port, token=token, what="the embedding service")
        service = EmbeddingService(models, config=config)
        app_ = create_embed_app(service, api_token=token)
        server = uvicorn_config(
            app_, host=host, port=port, token=token, graceful_shutdown=int(grace_s), warn=False
        )
    console.print(
        f"nostall embeddings: {len(service.names())} encoders on {service.device}; "
        f"POST http://{host}:{port}/v1/embeddings"
    )
    if service.device.type == "cuda":
        console.print(
            f"its encoders take {service.encoder_bytes / 1e9:.2f} GB of {service.device} once "
            f"loaded: a worker on this GPU leaves them out with --embed-budget-gb "
            f"{service.encoder_bytes / 1e9 + 0.01:.2f}"
        )
    run_server(server)
