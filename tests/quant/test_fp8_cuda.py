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
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"this GPU has no FP8 tensor cores: {why}")
    if how != "tensor-cores":
        pytest.fail(f"this GPU machine should run FP8 on tensor cores: {why}")


@pytest.fixture(scope="module")
def flux_store(tmp_path_factory):
    from nostall.synthetic import write_store

    root = tmp_path_factory.mktemp("fp8")
    flux = write_store(root, ("flux",))["flux"]
    dst = root / "models"
    dst.mkdir()
    nostall.quantize(flux, dst / "flux8")
    return flux, dst


def test_fp8_transformer_runs_on_tensor_cores_close_to_bf16(tmp_path):
    _fits_tensor_cores()
    from nostall.synthetic import step_inputs, write_transformer
    from nostall.verify import sqnr_db

    src = write_transformer(str(tmp_path / "bf16"), "tiny", torch.device("cuda"))
    nostall.quantize(src, tmp_path / "fp8")
    ref = nostall.load_model(src, device="cuda").eval()
    fp8 = nostall.load_model(tmp_path / "fp8", device="cuda").eval()
    cores = [m for m in fp8.modules() if getattr(m, "_fp8_tensor_cores", False)]
    assert len(cores) > 10 and all(m.weight.dtype == torch.float8_e4m3fn for m in cores)
    inputs = step_inputs(ref, "tiny", torch.device("cuda"))
    with torch.inference_mode():
        a, b = ref(**inputs)[0], fp8(**inputs)[0]
    assert b.dtype == torch.bfloat16 and b.isfinite().all()
    assert sqnr_db(a, b) > 20
    # the weights are the loaded e4m3 bytes: half of bf16's
    fp8_bytes = sum(m.weight.numel() for m in cores)
    bf16_bytes = sum(
        m.weight.numel() * 2 for n, m in ref.named_modules()
        if isinstance(m, nn.Linear) and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0
    )  # fmt: skip
    assert fp8_bytes < 0.55 * bf16_bytes


def test_the_row_quantization_kernel_equals_the_reference_ops():
    _fits_tensor_cores()
    from nostall.quant.kernels import quantize_rows, quantize_rows_reference, triton_available

    assert triton_available()
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in ((1, 3072), (333, 3000), (4608, 15360)):
        x = (torch.randn(m, k, generator=g, device="cuda") * 4).to(torch.bfloat16)
        x[0, :7] = torch.tensor([1e4, -3e4, 1e-8, 0.0, -0.0, 448.0, 3.0], device="cuda")
        if m > 1:
            x[1] = 0  # an all-zero row
        q, s = quantize_rows(x)
        qr, sr = quantize_rows_reference(x)
        bad = (s != sr).flatten().nonzero().flatten()[:4].tolist()
        assert not bad, [(r, s[r].item(), sr[r].item()) for r in bad]
        diff = (q.view(torch.uint8) != qr.view(torch.uint8)).nonzero()[:6].tolist()
        assert not diff, [
            (r, c, x[r, c].item(), (x[r, c].float() / s[r]).item(), q[r, c].float().item(),
             qr[r, c].float().item())
            for r, c in diff
        ]  # fmt: skip


@pytest.mark.parametrize("kind", ["t5", "umt5", "clip-l", "clip-g"])
def test_each_encoder_runs_fp8_on_tensor_cores(tmp_path, kind):
    _fits_tensor_cores()
    from nostall.verify import sqnr_db

    from test_encoders import _run, build_encoder

    build_encoder(kind).save_pretrained(tmp_path / "src")
    nostall.quantize(tmp_path / "src", tmp_path / "fp8")
    ref = nostall.load_model(tmp_path / "src", device="cuda", dtype=torch.bfloat16)
    fp8 = nostall.load_model(tmp_path / "fp8", device="cuda", dtype=torch.bfloat16)
    assert sum(getattr(m, "_fp8_tensor_cores", False) for m in fp8.modules()) > 0
    out = _run(fp8, "cuda")
    assert out.isfinite().all() and sqnr_db(_run(ref, "cuda"), out) > 15


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "as-stored"])
def test_model_cache_serves_fp8_on_tensor_cores_as_load_model_builds_it(flux_store, dtype):
    # bf16: the FP8 layers compute on tensor cores; as stored (float32 here): upcast.
    _fits_tensor_cores()
    from diffusers import DiffusionPipeline

    _, models = flux_store
    folder = models / "flux8"
    # Every FP8 component as load_model builds it (diffusers' own from_pretrained would
    # read e4m3 weights without their scales).
    parts = {
        sub: nostall.load_model(folder / sub, device="cuda", dtype=dtype)
        for sub in os.listdir(folder)
        if os.path.isfile(folder / sub / "config.json")
        and any(e.dtype.startswith("F8") for _, e in _entries(folder / sub))
    }
    assert {"transformer", "text_encoder", "text_encoder_2"} <= set(parts)
    assert "vae" not in parts  # quantize copies the VAE as it is
    pipe = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=dtype, **parts).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    cores = sum(getattr(m, "_fp8_tensor_cores", False) for m in pipe.transformer.modules())
    assert (cores > 0) == (dtype == torch.bfloat16) or dtype is None

    def image(p):
        g = torch.Generator(device="cuda").manual_seed(0)
        return p(prompt="a cat", num_inference_steps=2, height=32, width=32, generator=g,
                 output_type="np", max_sequence_length=16).images  # fmt: skip

    ref = image(pipe)
    assert np.array_equal(image(pipe), ref)  # the reference itself is deterministic
    with nostall.ModelCache(
        models, device="cuda", gpu_budget=64 << 20, host_budget=64 << 20, dtype=dtype
    ) as c:
        for k in range(2):
            with c.use("flux8") as p:
                p.set_progress_bar_config(disable=True)
                got = image(p)
                if not np.array_equal(got, ref):
                    pytest.fail(f"use {k}: " + _differences(pipe, p))
            c.evict("gpu")  # the second use rebinds from the host tier


def _entries(folder):
    from nostall.errors import CheckpointError
    from nostall.store import resolve

    try:
        return resolve(folder).entries()
    except CheckpointError:
        return []


def _differences(ref_pipe, pipe) -> str:
    """Which component differs between the two pipelines, and where (for the report)."""
    out = []
    for role in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = getattr(ref_pipe, role), getattr(pipe, role)
        sa = {**dict(a.named_parameters()), **dict(a.named_buffers())}
        sb = {**dict(b.named_parameters()), **dict(b.named_buffers())}
        if set(sa) != set(sb):
            out.append(f"{role}: names differ {sorted(set(sa) ^ set(sb))[:5]}")
            continue
        bad = [
            n for n in sa
            if sa[n].dtype != sb[n].dtype or sa[n].shape != sb[n].shape
            or not torch.equal(sa[n].view(torch.uint8) if sa[n].dtype.itemsize == 1 else sa[n],
                               sb[n].view(torch.uint8) if sb[n].dtype.itemsize == 1 else sb[n])
        ]  # fmt: skip
        cls = (type(a).__name__, type(b).__name__)
        fp8 = [
            (n, getattr(m, "_fp8_tensor_cores", None)) for n, m in b.named_modules()
            if type(m).__name__.startswith("FP8")
        ][:2]  # fmt: skip
        fp8_ref = [
            (n, getattr(m, "_fp8_tensor_cores", None)) for n, m in a.named_modules()
            if type(m).__name__.startswith("FP8")
        ][:2]  # fmt: skip
        out.append(f"{role} {cls}: {len(bad)} tensors differ {bad[:4]}; fp8 {fp8} vs {fp8_ref}")
    return "; ".join(out)
