"""``nostall serve``, ``nostall fleet`` and ``nostall embed-server``: the HTTP services."""

from __future__ import annotations

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


@app.command()
def serve(
    models: str = typer.Option(..., "--models", help="Folder of diffusers pipeline folders."),
    device: str = device_option("cuda[:N] or cpu (default: cuda if present)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = _port(8000),
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
    import uvicorn

    from nostall.serve.app import create_app
    from nostall.serve.worker import Worker

    gpu_budget = gigabytes(gpu_budget_gb, "--gpu-budget-gb")
    host_budget = gigabytes(host_budget_gb, "--host-budget-gb")
    dt = parse_dtype(dtype)
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
    port: int = _port(8000),
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
    # The workers' GPUs may be on other hosts of the cluster: only the kind is checked here.
    check_choices([device], ("cuda", "cpu"), "--device")
    opts = {}
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
    device: str = device_option("cuda[:N] or cpu (default: cuda if present)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = _port(8001),
    dtype: str = typer.Option(None, help="bf16, fp16 or fp32 (default: as stored)."),
    cache_gb: float = typer.Option(
        1.0, callback=in_range(0.0), help="Byte budget of the embedding cache."
    ),
    token_budget: int = typer.Option(
        8192, callback=in_range(1), help="A batch closes at this many tokens..."
    ),
    max_wait_ms: float = typer.Option(
        5.0, callback=in_range(0.0), help="...or this long after its first text."
    ),
) -> None:
    """Serve the store's text encoders (T5, UMT5, CLIP): unpooled and pooled embeddings as
    safetensors, dynamic batching, an exact-match cache."""
    import uvicorn

    from nostall.serve.embed import EmbeddingService, create_embed_app

    dt = parse_dtype(dtype)
    with usage_errors():
        service = EmbeddingService(
            models,
            device=device,
            dtype=dt,
            cache_bytes=int(cache_gb * 1e9),
            token_budget=token_budget,
            max_wait_s=max_wait_ms / 1e3,
        )
    console.print(
        f"nostall embeddings: {len(service.names())} encoders on {service.device}; "
        f"POST http://{host}:{port}/v1/embeddings"
    )
    uvicorn.run(create_embed_app(service), host=host, port=port, log_level="info")
