"""The worker on the GPU: images equal diffusers' on cuda for the seed, phases measured."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.cuda


def test_images_on_cuda_equal_diffusers(serve, store):
    from diffusers import DiffusionPipeline

    server, _ = serve(device="cuda", gpu_budget=256 << 20)
    body = {"model": "sdxl", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 7}
    r = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
    pipe = DiffusionPipeline.from_pretrained(str(store / "sdxl")).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    ref = pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, generator=g,
               output_type="pil").images[0]  # fmt: skip
    assert np.array_equal(got, np.asarray(ref))
    phases = r.json()["nostall"]["phases"]
    assert phases["denoise"] > 0 and phases["copy"] > 0


def _fill_device() -> list[torch.Tensor]:
    """Take every byte torch can still allocate on the GPU (halving chunks down to its
    smallest block), so that the next allocation anywhere in the process fails."""
    # torch caches freed blocks per stream, and the worker's job runs on its own: give
    # every cached block back to the driver first, or the job finds room in its cache
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    hog: list[torch.Tensor] = []
    size = 1 << 30
    while size >= 512:
        try:
            hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return hog


def test_a_real_out_of_memory_is_answered_503_and_the_worker_keeps_serving(serve):
    server, worker = serve(device="cuda", gpu_budget=256 << 20)
    body = {"model": "sdxl", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 7}
    with httpx.Client(base_url=server.url, timeout=300) as c:
        assert c.post("/v1/images/generations", json=body).status_code == 200
        peaks = worker.status()["budget"]["peaks"]
        assert peaks["sdxl"]["32x32 b1"] > 0  # measured on first use
        hog = _fill_device()
        try:
            r = c.post("/v1/images/generations", json={**body, "size": "64x64"})
        finally:
            del hog
            torch.cuda.empty_cache()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "device_busy" and int(r.headers["retry-after"]) >= 1
        again = c.post("/v1/images/generations", json={**body, "size": "64x64"})
        assert again.status_code == 200, again.text
        assert worker.ready
