"""The serve bench's peer: a plain diffusers worker behind the worker's HTTP shape.

What a team without nostall would run: each pipeline loaded once with diffusers'
``from_pretrained``, one on the device at a time, one job at a time in arrival order.
``POST /v1/images/generations`` takes the worker's body (``model, prompt, size, steps,
seed, max_sequence_length``) and answers as the worker does: ``{"created", "data":
[{"b64_json"}], "nostall": {"model", "seed", "order", "phases", "switch"}}``, so the
bench's clients drive both alike. Its images are the stream's references: plain
diffusers, one request at a time.

A switch is one of :data:`MODES`:

* ``to``: every pipeline kept in CPU memory; the one asked for moved in with
  ``.to(device)`` (pageable memory: the driver stages the copy). The one on the device
  goes back by pointing its parameters at the CPU tensors kept for it, which costs
  nothing: moving weights back out with ``.to("cpu")`` re-allocates them in pageable
  memory, and that made a FLUX → SDXL switch 27 s on the H200 (see the design notes);
* ``from_pretrained``: the one on the device dropped, the one asked for loaded from the
  store (the page cache, after the first time) and moved in.

:func:`probe` times one round of switches in each, so the bench can run the stream with
the faster (the issue asks for whichever is).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nostall.bench.timing import sync
from nostall.errors import ArgumentError

__all__ = [
    "MODES",
    "PeerJob",
    "PeerWorker",
    "create_peer_app",
    "pipeline_bytes",
    "probe",
    "run_job",
]

MODES = ("to", "from_pretrained")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class PeerJob:
    model: str
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    max_sequence_length: int | None = None


def stored_dtype(folder: str) -> torch.dtype:
    """The dtype a pipeline folder's denoiser is stored in (what it is loaded in)."""
    from safetensors import safe_open

    for role in ("transformer", "unet"):
        sub = os.path.join(folder, role)
        files = (
            sorted(f for f in os.listdir(sub) if f.endswith(".safetensors"))
            if (os.path.isdir(sub))
            else []
        )
        if files:
            with safe_open(os.path.join(sub, files[0]), framework="pt") as f:
                key = next(iter(f.keys()))
                return _DTYPES.get(f.get_slice(key).get_dtype(), torch.float32)
    return torch.float32


def pipeline_bytes(folder: str) -> int:
    """Bytes of a pipeline folder's weight files (links followed): what the pipeline takes
    in CPU memory as stored."""
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(folder, followlinks=True)
        for f in files
        if f.endswith(".safetensors")
    )


class PeerWorker:
    """Plain diffusers pipelines, switched by ``mode`` (:data:`MODES`); one job at a time.

    ``folders``: pipeline name → diffusers folder. :meth:`load` reads them into CPU memory
    (mode ``to``); :meth:`generate` switches if needed and runs one job; :meth:`close`
    frees everything. Not thread-safe: one caller at a time (the app's one thread)."""

    def __init__(self, folders: dict[str, str], *, device: str | torch.device, mode: str = "to"):
        from nostall.transfer.loader import resolve_device

        if mode not in MODES:
            raise ArgumentError(f"mode={mode!r}; choose one of {', '.join(MODES)}")
        self.folders = dict(folders)
        self.device = resolve_device(device)
        self.mode = mode
        self.dtypes = {n: stored_dtype(f) for n, f in self.folders.items()}
        self.on_host: dict[str, Any] = {}  # mode "to": name → pipeline
        self.kept: dict[str, list[tuple[torch.nn.Module, str, bool, torch.Tensor]]] = {}
        self.current: str | None = None
        self.pipe: Any = None
        self.order = 0
        self.load_s = 0.0

    def _from_pretrained(self, name: str) -> Any:
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        # a bar per component and per shard on every switch would bury the bench's lines
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        try:
            pipe = DiffusionPipeline.from_pretrained(
                self.folders[name], torch_dtype=self.dtypes[name]
            )
        finally:
            diffusers_logging.enable_progress_bar()
            transformers_logging.enable_progress_bar()
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load(self) -> float:
        """Mode ``to``: every pipeline into CPU memory (a server's boot; not timed as a
        switch). Returns the seconds it took."""
        t = time.perf_counter()
        if self.mode == "to":
            for name in self.folders:
                if name not in self.on_host:
                    pipe = self._from_pretrained(name)
                    self.on_host[name] = pipe
                    self.kept[name] = _tensors(pipe)
        self.load_s = time.perf_counter() - t
        return self.load_s

    def switch(self, name: str) -> float:
        """Make ``name`` the pipeline on the device; the seconds it took (0 if it is)."""
        if name == self.current:
            return 0.0
        sync(self.device)
        t = time.perf_counter()
        if self.mode == "to":
            if self.current is not None:
                point_back(self.kept[self.current])
            self.pipe = None
            self.pipe = self.on_host[name].to(self.device)
        else:
            self.pipe = None
            gc.collect()  # the last pipeline's device memory, before the next one's
            self.pipe = self._from_pretrained(name).to(self.device)
        sync(self.device)
        self.current = name
        return time.perf_counter() - t

    def generate(self, job: PeerJob, arrived: float) -> tuple[bytes, dict[str, Any]]:
        """Run ``job``; its PNG and ``{"order", "phases"}``."""
        start = time.perf_counter()
        switch_s = self.switch(job.model)
        self.order += 1
        return run_job(self.pipe, job, self.device, arrived, start, switch_s, self.order)

    def close(self) -> None:
        if self.current is not None and self.mode == "to":
            point_back(self.kept[self.current])
        self.pipe = None
        self.on_host.clear()
        self.kept.clear()
        self.current = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_heap()


def run_job(
    pipe: Any,
    job: PeerJob,
    device: torch.device,
    arrived: float,
    start: float,
    switch_s: float,
    order: int,
) -> tuple[bytes, dict[str, Any]]:
    """Run ``job`` on ``pipe`` as plain diffusers would (switched to since ``start``,
    ``switch_s`` of it the switch); its PNG and ``{"order", "phases"}`` (``queue``,
    ``switch``, ``run``, ``total``: seconds, ``arrived`` a perf_counter)."""
    kwargs: dict[str, Any] = {
        "prompt": job.prompt,
        "height": job.height,
        "width": job.width,
        "num_inference_steps": job.steps,
        # seeded on the device, as the worker seeds its generator
        "generator": torch.Generator(device=device.type).manual_seed(job.seed),
        "output_type": "pil",
    }
    if job.max_sequence_length is not None:
        kwargs["max_sequence_length"] = job.max_sequence_length
    t = time.perf_counter()
    with torch.inference_mode():
        image = pipe(**kwargs).images[0]
    sync(device)
    run_s = time.perf_counter() - t
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    end = time.perf_counter()
    phases = {"queue": start - arrived, "switch": switch_s, "run": run_s, "total": end - arrived}
    return buf.getvalue(), {"order": order, "phases": phases}


def trim_heap() -> None:
    """Give the freed CPU copies back to the system: glibc keeps tensors below its mmap
    threshold (up to 32 MiB, most of a pipeline's) in its heap, where the parts that
    follow the peer in this process could not use them."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to give back
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _tensors(pipe: Any) -> list[tuple[torch.nn.Module, str, bool, torch.Tensor]]:
    """Every parameter and buffer of ``pipe``'s modules with the tensor it holds now, so
    they can be pointed back at these after a ``.to(device)``."""
    out = []
    for comp in pipe.components.values():
        if isinstance(comp, torch.nn.Module):
            for m in comp.modules():
                out += [(m, n, True, p.data) for n, p in m.named_parameters(recurse=False)]
                out += [(m, n, False, b) for n, b in m.named_buffers(recurse=False)]
    return out


def point_back(kept: list[tuple[torch.nn.Module, str, bool, torch.Tensor]]) -> None:
    """Point each kept module's parameter or buffer back at the tensor kept for it."""
    # .to() assigned each parameter's .data (torch does not swap the Parameter objects
    # by default), so assigning the kept CPU tensors back undoes it without a copy.
    for module, name, is_param, tensor in kept:
        if is_param:
            getattr(module, name).data = tensor
        else:
            setattr(module, name, tensor)


def probe(
    folders: dict[str, str], names: tuple[str, ...], device: str
) -> tuple[dict[str, Any], PeerWorker]:
    """One round of switches (``names``, then back to the first) in each mode, the first
    switch (from nothing) left out of the sum: ``{"from_pretrained": {...}, "to": {...},
    "faster": mode}``, and the ``to`` peer, its pipelines loaded (the caller closes it)."""
    order = (*names, names[0])
    out: dict[str, Any] = {}
    peer = PeerWorker(folders, device=device, mode="from_pretrained")
    try:
        s = [peer.switch(n) for n in order]
    finally:
        peer.close()
    out["from_pretrained"] = {
        "switch_s": dict(zip(order[1:], s[1:], strict=True)),
        "sum_s": sum(s[1:]),
    }
    peer = PeerWorker(folders, device=device, mode="to")
    peer.load()
    s = [peer.switch(n) for n in order]
    out["to"] = {
        "load_s": peer.load_s,
        "switch_s": dict(zip(order[1:], s[1:], strict=True)),
        "sum_s": sum(s[1:]),
    }
    out["faster"] = min(MODES, key=lambda m: out[m]["sum_s"])
    return out, peer


def create_peer_app(peer: PeerWorker):
    """The worker's images endpoint over ``peer`` (and ``/healthz``); one job at a time,
    in arrival order."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="nostall-peer")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            pool.shutdown(wait=True)

    app = FastAPI(title="diffusers worker (nostall bench peer)", lifespan=lifespan)

    def error(status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        arrived = time.perf_counter()
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(400, "malformed_json", f"body is not JSON: {e}")
        if not isinstance(body, dict) or body.get("model") not in peer.folders:
            what = body.get("model") if isinstance(body, dict) else None
            return error(404, "unknown_model", f"no model {what!r}; {sorted(peer.folders)}")
        try:
            w, h = (int(v) for v in str(body.get("size") or "1024x1024").lower().split("x"))
            job = PeerJob(
                body["model"],
                str(body["prompt"]),
                w,
                h,
                int(body.get("steps", 28)),
                int(body.get("seed", 0)),
                body.get("max_sequence_length"),
            )
        except (KeyError, TypeError, ValueError) as e:
            return error(422, "invalid_value", f"{type(e).__name__}: {e}")
        loop = asyncio.get_running_loop()
        try:
            png, info = await loop.run_in_executor(pool, peer.generate, job, arrived)
        except ValueError as e:
            return error(422, "rejected_by_pipeline", str(e))
        except Exception as e:  # the thread carries on; say what happened
            return error(500, type(e).__name__, f"{type(e).__name__}: {e}")
        return JSONResponse(
            {
                "created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(png).decode()}],
                "nostall": {
                    "model": job.model,
                    "seed": job.seed,
                    "order": info["order"],
                    "phases": info["phases"],
                    "switch": {
                        "components": info.get("components", []),  # (LruPeer names them)
                        "total_s": info["phases"]["switch"],
                    },
                    "peer": peer.mode,
                },
            }
        )

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return app
