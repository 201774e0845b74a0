"""``nostall bench fp8``: a FLUX-size transformer in bf16 and in nostall's FP8, side by side.

One run, one process, one GPU:

1. write a random FLUX.1-dev transformer (bf16, diffusers' layout; ``size="tiny"``: a
   small FLUX for CPU runs) and convert it with :func:`nostall.quantize`;
2. **bytes** of each folder's weights;
3. **page-cache load**: ``nostall.load_model(folder, device)`` with the files in the OS
   page cache (read once before), median of ``repeat``;
4. **memory hit**: the same through a pinned :class:`~nostall.PinnedPool` that already
   holds the bytes (``load_model``: module built too), and the **switch** a model cache
   makes for a component whose module already views its device memory (the pool's bytes
   copied into that memory, nothing built: the issue's memory-hit switch), medians;
5. **forward**: one denoising forward at 1024x1024 (4096 image tokens, 512 text tokens,
   batch 1), eager and ``torch.compile``d, bf16 against FP8 (FP8 tensor cores where the
   GPU has them, see :mod:`nostall.quant.modules`), median of ``repeat`` after warm-up;
   compile time reported apart;
6. **SQNR** of the FP8 forward's output against bf16's on the same inputs.

The report's ``targets`` are issue #10's; :func:`evaluate_targets` recomputes them.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from nostall.bench.load import _commit, _hardware
from nostall.quant.check import sqnr_db

__all__ = ["evaluate_targets", "run_fp8_bench"]

SIZES = ("full", "tiny")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _folder_bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.endswith(".safetensors")
    )


def _transformer(size: str):
    import diffusers

    if size == "full":
        with torch.device("meta"):
            return diffusers.FluxTransformer2DModel(guidance_embeds=True)
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=128,
        pooled_projection_dim=64,
        axes_dims_rope=(8, 12, 12),
        guidance_embeds=True,
    )


def write_transformer(folder: str, size: str, device: torch.device, progress=None) -> str:
    """A random FLUX transformer folder (config + bf16 safetensors) at ``folder``."""
    from nostall.bench.fullstores import _write_weights

    module = _transformer(size)
    os.makedirs(folder, exist_ok=True)
    module.save_config(folder)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    _write_weights(
        module,
        folder,
        "diffusion_pytorch_model",
        torch.bfloat16,
        gen_device,
        1,
        progress,
        "transformer",
    )
    return folder


def _inputs(module, size: str, dev: torch.device, seed: int = 0) -> dict:
    """One denoising step's inputs: 1024x1024 (64x64 latent patches = 4096 tokens), 512
    text tokens (``tiny``: 256 and 32)."""
    cfg = module.config
    tokens, text = (4096, 512) if size == "full" else (256, 32)
    side = int(tokens**0.5)
    g = torch.Generator(device=dev).manual_seed(seed)
    bf16 = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(bf16)

    img_ids = torch.zeros(side, side, 3, device=dev)
    img_ids[..., 1] = torch.arange(side, device=dev)[:, None]
    img_ids[..., 2] = torch.arange(side, device=dev)[None, :]
    return {
        "hidden_states": randn(1, tokens, cfg.in_channels),
        "encoder_hidden_states": randn(1, text, cfg.joint_attention_dim),
        "pooled_projections": randn(1, cfg.pooled_projection_dim),
        "timestep": torch.full((1,), 0.5, device=dev, dtype=bf16),
        "img_ids": img_ids.reshape(-1, 3).to(bf16),
        "txt_ids": torch.zeros(text, 3, device=dev, dtype=bf16),
        "guidance": torch.full((1,), 3.5, device=dev, dtype=bf16),
        "return_dict": False,
    }


def _time_forward(fn: Callable, dev: torch.device, repeat: int) -> tuple[list[float], object]:
    out = None
    times = []
    for _ in range(repeat):
        _sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            out = fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return times, out


def _switch_hits(folder: str, dev: torch.device, repeat: int, nbytes: int) -> float:
    """Median seconds of a memory-tier switch as the model cache makes one for a component
    whose module already views its device memory: the checkpoint's bytes from a pinned
    pool (filled by a first load) into that memory, nothing built."""
    from nostall.checkpoint import resolve
    from nostall.memory.pool import PinnedPool
    from nostall.transfer.loader import Loader
    from nostall.transfer.plan import LoadPlan

    ckpt = resolve(folder)
    plan = LoadPlan(ckpt, None, mirror_file=dev.type == "cpu")
    flat = torch.empty(plan.target_bytes, dtype=torch.uint8, device=dev)
    key = ("nostall-bench-fp8", folder)
    times = []
    with PinnedPool(int(nbytes * 1.1) + (64 << 20)) as pool, Loader() as loader:
        loader.start(ckpt, device=dev, pool=pool, key=key, into=flat).wait()
        for _ in range(repeat):
            _sync(dev)
            t = time.perf_counter()
            loader.start(ckpt, device=dev, pool=pool, key=key, into=flat, views=False).wait()
            _sync(dev)
            times.append(time.perf_counter() - t)
    del flat
    return statistics.median(times)


def run_fp8_bench(
    *,
    size: str = "full",
    device: str = "cuda",
    work: str | None = None,
    repeat: int = 5,
    compile: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the benchmark; return the JSON-able report (see the module docstring)."""
    import nostall
    from nostall.api import load_model_with_stats
    from nostall.errors import ArgumentError
    from nostall.memory.pool import PinnedPool
    from nostall.quant.modules import fp8_compute
    from nostall.transfer.loader import Loader

    if size not in SIZES:
        raise ArgumentError(f"size={size!r}; choose one of {', '.join(SIZES)}")
    if repeat < 1:
        raise ArgumentError(f"repeat={repeat}; time at least one run")
    dev = torch.device(device)
    work = work or tempfile.mkdtemp(prefix="nostall-fp8-")
    src = os.path.join(work, "transformer-bf16")
    dst = os.path.join(work, "transformer-fp8")
    report: dict = {
        "benchmark": "fp8",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "hardware": _hardware(dev),
        "config": {
            "model": "FluxTransformer2DModel (FLUX.1-dev config), random weights"
            if size == "full"
            else "tiny FluxTransformer2DModel",
            "size": size,
            "forward": "1024x1024: 4096 image + 512 text tokens, batch 1"
            if size == "full"
            else "256 image + 32 text tokens, batch 1",
            "repeat": repeat,
            "compile": compile,
            "fp8_compute": list(fp8_compute(dev)),
        },
        "results": {},
    }
    res = report["results"]
    if not os.path.exists(os.path.join(src, "config.json")):
        t = time.perf_counter()
        write_transformer(src, size, dev, progress=log)
        log(f"wrote the bf16 transformer in {time.perf_counter() - t:.1f} s")
    if not os.path.exists(os.path.join(dst, "config.json")):
        t = time.perf_counter()
        q = nostall.quantize(src, dst)
        res["quantize_s"] = time.perf_counter() - t
        res["quantized_tensors"] = q.quantized
        log(f"quantized {q.quantized} tensors in {res['quantize_s']:.1f} s")
    res["bytes"] = {"bf16": _folder_bytes(src), "fp8": _folder_bytes(dst)}
    res["bytes"]["ratio"] = res["bytes"]["fp8"] / res["bytes"]["bf16"]
    log(f"bytes: bf16 {res['bytes']['bf16'] / 1e9:.2f} GB, fp8 {res['bytes']['fp8'] / 1e9:.2f} GB")

    # Loads: page cache (files read once first), then pool hits.
    res["page_cache_load_s"], res["memory_hit_s"], res["switch_hit_s"] = {}, {}, {}
    for name, folder in (("bf16", src), ("fp8", dst)):
        for f in os.listdir(folder):  # into the page cache
            with open(os.path.join(folder, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass
        times = []
        with Loader() as loader:
            for _ in range(repeat):
                _sync(dev)
                t = time.perf_counter()
                m, _ = load_model_with_stats(folder, device=dev, loader=loader)
                _sync(dev)
                times.append(time.perf_counter() - t)
                del m
        res["page_cache_load_s"][name] = statistics.median(times)
        hits = []
        with PinnedPool(int(res["bytes"][name] * 1.1) + (64 << 20)) as pool, Loader() as loader:
            load_model_with_stats(folder, device=dev, loader=loader, pool=pool)  # fills the pool
            for _ in range(repeat):
                _sync(dev)
                t = time.perf_counter()
                m, _ = load_model_with_stats(folder, device=dev, loader=loader, pool=pool)
                _sync(dev)
                hits.append(time.perf_counter() - t)
                del m
        res["memory_hit_s"][name] = statistics.median(hits)
        res["switch_hit_s"][name] = _switch_hits(folder, dev, repeat, res["bytes"][name])
        log(
            f"{name}: page-cache load {res['page_cache_load_s'][name]:.3f} s, memory hit "
            f"{res['memory_hit_s'][name]:.3f} s (load_model), {res['switch_hit_s'][name]:.3f} s "
            "(into resident memory)"
        )
    for key in ("page_cache_load_s", "memory_hit_s", "switch_hit_s"):
        res[key]["ratio"] = res[key]["fp8"] / res[key]["bf16"]

    # Forwards on the same inputs.
    models = {
        "bf16": nostall.load_model(src, device=dev, dtype=torch.bfloat16).eval(),
        "fp8": nostall.load_model(dst, device=dev, dtype=torch.bfloat16).eval(),
    }
    inputs = _inputs(models["bf16"], size, dev)
    fwd: dict = {}
    outs: dict = {}
    for name, model in models.items():
        _time_forward(lambda m=model: m(**inputs)[0], dev, 2)  # warm-up
        times, out = _time_forward(lambda m=model: m(**inputs)[0], dev, repeat)
        fwd[f"{name}_eager_s"] = statistics.median(times)
        outs[f"{name}_eager"] = out
        log(f"{name} eager forward {fwd[f'{name}_eager_s'] * 1e3:.1f} ms")
    if compile:
        torch._dynamo.reset()
        for name, model in models.items():
            compiled = torch.compile(model)
            t = time.perf_counter()
            _time_forward(lambda m=compiled: m(**inputs)[0], dev, 2)  # compiles
            fwd[f"{name}_compile_s"] = time.perf_counter() - t
            times, out = _time_forward(lambda m=compiled: m(**inputs)[0], dev, repeat)
            fwd[f"{name}_compiled_s"] = statistics.median(times)
            outs[f"{name}_compiled"] = out
            log(
                f"{name} compiled forward {fwd[f'{name}_compiled_s'] * 1e3:.1f} ms "
                f"(compile {fwd[f'{name}_compile_s']:.1f} s)"
            )
    fwd["fp8_vs_bf16_eager"] = fwd["bf16_eager_s"] / fwd["fp8_eager_s"]
    if compile:
        fwd["fp8_compiled_vs_bf16_compiled"] = fwd["bf16_compiled_s"] / fwd["fp8_compiled_s"]
        fwd["fp8_compiled_vs_bf16_eager"] = fwd["bf16_eager_s"] / fwd["fp8_compiled_s"]
    res["forward"] = fwd
    res["sqnr_db"] = {"eager": sqnr_db(outs["bf16_eager"], outs["fp8_eager"])}
    if compile:
        res["sqnr_db"]["compiled"] = sqnr_db(outs["bf16_compiled"], outs["fp8_compiled"])
    log(f"output SQNR vs bf16: {res['sqnr_db']}")
    report["targets"] = evaluate_targets(report)
    return report


def evaluate_targets(report: dict) -> dict[str, dict]:
    """Issue #10's targets, each ``{"value", "threshold", "op", "met"}`` (``met`` is
    ``None`` where the figure was not measured)."""
    res = report["results"]
    fwd = res.get("forward", {})
    t: dict[str, dict] = {}

    def target(name: str, value, op: str, threshold: float) -> None:
        met = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
        t[name] = {"value": value, "threshold": threshold, "op": op, "met": met}

    target("bytes_fp8_vs_bf16", res.get("bytes", {}).get("ratio"), "<=", 0.52)
    # a switch in the model cache's sense: bytes from the host tier into resident memory
    target("memory_hit_switch_fp8_s", res.get("switch_hit_s", {}).get("fp8"), "<=", 0.25)
    target("page_cache_load_fp8_vs_bf16", res.get("page_cache_load_s", {}).get("ratio"), "<=", 0.55)
    target("forward_fp8_compiled_vs_bf16_compiled", fwd.get("fp8_compiled_vs_bf16_compiled"),
           ">=", 1.3)  # fmt: skip
    # the fastest FP8 forward (compiled where it ran) against eager bf16
    best = fwd.get("fp8_compiled_vs_bf16_eager", fwd.get("fp8_vs_bf16_eager"))
    target("forward_fp8_vs_bf16_eager", best, ">=", 1.8)
    sq = res.get("sqnr_db", {})
    target("output_sqnr_db", min(sq.values()) if sq else None, ">=", 20.0)
    return t
