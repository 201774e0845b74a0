"""FP8 on the GPU: tensor-core matmuls over the loaded bytes, and the model cache serving
FP8 pipelines (``cuda``: needs an NVIDIA GPU; FP8 tensor cores need compute capability
8.9+, which the H200 has)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn as nn

import nostall
from nostall.quant import modules as quant_modules

pytestmark = pytest.mark.cuda

pytest.importorskip("diffusers")


def _fits_tensor_cores():
    how, why = quant_modules.fp8_compute(torch.device("cuda"))
    if how != "tensor-cores":
        pytest.fail(f"this GPU machine should run FP8 on tensor cores: {why}")


@pytest.fixture(scope="module")
def flux_store(tmp_path_factory):
    from nostall.bench.stores import write_store

    root = tmp_path_factory.mktemp("fp8")
    flux = write_store(root, ("flux",))["flux"]
    dst = root / "models"
    dst.mkdir()
    nostall.quantize(flux, dst / "flux8")
    return flux, dst


def test_fp8_transformer_runs_on_tensor_cores_close_to_bf16(tmp_path):
    _fits_tensor_cores()
    from torchao.quantization import Float8Tensor

    from nostall.bench.fp8 import _inputs, write_transformer
    from nostall.quant.check import sqnr_db

    src = write_transformer(str(tmp_path / "bf16"), "tiny", torch.device("cuda"))
    nostall.quantize(src, tmp_path / "fp8")
    ref = nostall.load_model(src, device="cuda").eval()
    fp8 = nostall.load_model(tmp_path / "fp8", device="cuda").eval()
    wrapped = [
        m for m in fp8.modules() if isinstance(m, nn.Linear) and isinstance(m.weight, Float8Tensor)
    ]
    assert len(wrapped) > 10
    inputs = _inputs(ref, "tiny", torch.device("cuda"))
    with torch.inference_mode():
        a, b = ref(**inputs)[0], fp8(**inputs)[0]
    assert b.dtype == torch.bfloat16 and b.isfinite().all()
    assert sqnr_db(a, b) > 20
    # the weights are the loaded e4m3 bytes: half of bf16's
    fp8_bytes = sum(m.weight.qdata.numel() for m in wrapped)
    bf16_bytes = sum(
        m.weight.numel() * 2 for n, m in ref.named_modules()
        if isinstance(m, nn.Linear) and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0
    )  # fmt: skip
    assert fp8_bytes < 0.55 * bf16_bytes


def test_model_cache_serves_fp8_on_tensor_cores_as_load_model_builds_it(flux_store):
    _fits_tensor_cores()
    from diffusers import DiffusionPipeline

    _, models = flux_store
    folder = models / "flux8"
    parts = {
        sub: nostall.load_model(folder / sub, device="cuda")
        for sub in ("transformer", "text_encoder", "text_encoder_2")
        if os.path.isdir(folder / sub)
    }
    pipe = DiffusionPipeline.from_pretrained(str(folder), **parts).to("cuda")
    pipe.set_progress_bar_config(disable=True)

    def image(p):
        g = torch.Generator(device="cuda").manual_seed(0)
        return p(prompt="a cat", num_inference_steps=2, height=32, width=32, generator=g,
                 output_type="np", max_sequence_length=16).images  # fmt: skip

    ref = image(pipe)
    with nostall.ModelCache(models, device="cuda", gpu_budget=64 << 20, host_budget=64 << 20) as c:
        for _ in range(2):
            with c.use("flux8") as p:
                p.set_progress_bar_config(disable=True)
                assert np.array_equal(image(p), ref)
            c.evict("gpu")  # the second use rebinds from the host tier
