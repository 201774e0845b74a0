"""``nostall serve``, ``nostall fleet`` and ``nostall embed-server``: the HTTP services."""

from __future__ import annotations

import contextlib
import logging
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


def _http_url(value: str | None) -> str | None:
    """An ``http(s)://host[:port][/path]`` URL as given; a usage error otherwise."""
    if value is None:
        return None
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError as e:
        raise typer.BadParameter(f"{value!r} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise typer.BadParameter(
            f"{value!r} is not an http(s) URL; give e.g. http://127.0.0.1:8001"
        )
    return value


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
    prepare: bool = typer.Option(
        True, "--prepare/--no-prepare", help="Build every pipeline's modules at boot."
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
        None,
        callback=_http_url,
        help="An embedding service (nostall embed-server) for FLUX, SDXL and SD3 prompts.",
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
    grace_s: float = _grace(
        "On SIGTERM/SIGINT: not ready and no new work at once; queued and running requests "
        "go on for most of this, then get 503 (the running one at its next step); the process "
        "has exited by then (an orchestrator's grace period: 30 s by default)."
    ),
) -> None:
    """Serve image generation and video decoding over HTTP (OpenAI's images API shape),
    switching pipelines through the model cache. Status page at /, metrics at /metrics."""
    from nostall.cache.host import parse_host_tier
    from nostall.serve.app import create_app
    from nostall.serve.http import check_server, resolve_token, run_server, uvicorn_config
    from nostall.serve.schedule import Policy
    from nostall.serve.worker import Worker

    with usage_errors("--host-tier"):
        parse_host_tier(host_tier)
    gpu_budget = gigabytes(gpu_budget_gb, "--gpu-budget-gb")
    host_budget = gigabytes(host_budget_gb, "--host-budget-gb")
    dt = parse_dtype(dtype)
    with usage_errors("--api-token"):
        # checked (and the exposure warned of) before the worker reads a byte
        token = resolve_token(api_token)
        check_server(host=host, port=port, token=token, what="the worker")
    with usage_errors():
        worker = Worker(
            models,
            device=device,
            gpu_budget=gpu_budget,
            host_budget=host_budget,
            dtype=dt,
            max_queue=max_queue,
            prepare=prepare,
            embed_url=embed_url,
            reserve=None if activation_reserve_gb is None else int(activation_reserve_gb * 1e9),
            external=int((embed_budget_gb or 0) * 1e9),
            lora_room=int(lora_room_gb * 1e9),
            host_tier=host_tier,
            schedule=Policy(batch=batch, overtake=max_overtaken, delay_s=max_delay_s),
        )
    # Refused here, before the server binds, when a pipeline can never fit the device
    # tier (BudgetExceeded, printed as an error naming it); the app's start is then a no-op.
    worker.start()
    console.print(f"nostall worker: device budget {worker.budget.describe()}")
    app_ = create_app(worker, token=token, time_limit=time_limit_s)
    config = uvicorn_config(
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
    run_server(config, drain=lambda done: worker.drain(grace_s, on_done=done))


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
    from nostall.cache.host import parse_host_tier
    from nostall.serve.http import check_server, resolve_token

    with usage_errors("--host-tier"):
        parse_host_tier(host_tier)
    with usage_errors("--api-token"):
        token = resolve_token(api_token)
        check_server(host=host, port=port, token=token, what="the fleet")
    opts: dict = {"host_tier": host_tier}
    share = 1.0
    if embed:
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        opts["embed_url"] = f"http://{local}:{port}/embed"
        share = 0.9
    for key, value, hint in (
        ("gpu_budget", gpu_budget_gb, "--gpu-budget-gb"),
        ("host_budget", host_budget_gb, "--host-budget-gb"),
    ):
        if value is not None:
            opts[key] = gigabytes(value, hint)

    import ray
    from ray import serve as ray_serve

    from nostall.serve.fleet import build_embed, build_fleet

    with usage_errors():
        app_ = build_fleet(
            models,
            replicas=replicas,
            device=device,
            worker_options=opts,
            gpu_share=share,
            token=token,
            time_limit=time_limit_s,
        )
        embed_app = build_embed(models, device=device, gpu_share=1 - share) if embed else None
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
    from nostall.serve.embed import EmbeddingService, create_embed_app
    from nostall.serve.http import check_server, resolve_token, run_server, uvicorn_config

    dt = parse_dtype(dtype)
    with usage_errors("--api-token"):
        token = resolve_token(api_token)
    with usage_errors():  # the token and the address before a model is read
        check_server(host=host, port=port, token=token, what="the embedding service")
        service = EmbeddingService(
            models,
            device=device,
            dtype=dt,
            cache_bytes=int(cache_gb * 1e9),
            token_budget=token_budget,
            max_wait_s=max_wait_ms / 1e3,
            max_queue=max_queue,
            max_text_chars=max_text_chars,
            max_texts=min(256, max_queue),  # a request must fit the queue
        )
        app_ = create_embed_app(service, api_token=token)
        config = uvicorn_config(
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
    run_server(config)
