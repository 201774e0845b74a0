"""FP8 checkpoints through ``load_model``: e4m3 storage, upcast per call (CPU)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import nostall
from nostall.checkpoint import resolve
from nostall.errors import CheckpointError
from nostall.quant import modules as modules_mod
from nostall.quant.check import sqnr_db


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from nostall.bench.stores import write_store

    root = tmp_path_factory.mktemp("store")
    flux = write_store(root, ("flux",))["flux"]
    return {c: os.path.join(flux, c) for c in ("text_encoder", "text_encoder_2")}


def _run(model, seed=0):
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids)[0].float()


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("component", ["text_encoder", "text_encoder_2"])
def test_a_converted_encoder_loads_fp8_and_computes_close(encoders, tmp_path, component, caplog):
    src, dst = encoders[component], tmp_path / component
    report = nostall.quantize(src, dst)
    ref = nostall.load_model(src)
    modules_mod._said = False
    with caplog.at_level(logging.INFO, logger="nostall.quant.modules"):
        fp8 = nostall.load_model(dst)
        nostall.load_model(dst)
    fp8_layers = [m for m in _linears(fp8) if m.weight.dtype == torch.float8_e4m3fn]
    assert len(fp8_layers) == report.quantized
    assert all(type(m).__name__.startswith("FP8") and m.weight_scale.dtype == torch.float32
               for m in fp8_layers)  # fmt: skip
    assert sqnr_db(_run(ref), _run(fp8)) > 15
    size = sum(p.numel() * p.element_size() for p in fp8.parameters())
    assert size < sum(p.numel() * p.element_size() for p in ref.parameters())
    assert sum("upcast per call" in r.getMessage() for r in caplog.records) == 1


def test_dtype_casts_everything_but_the_fp8_weights(encoders, tmp_path):
    src, dst = encoders["text_encoder"], tmp_path / "te"
    nostall.quantize(src, dst)
    model = nostall.load_model(dst, dtype=torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float8_e4m3fn}
    assert _run(model).isfinite().all()


def test_community_scaled_fp8_files_load(encoders, tmp_path):
    # One scale per tensor, a scaled_fp8 marker and input_scale tensors beside the weights.
    src = encoders["text_encoder"]
    dst = tmp_path / "comfy"
    shutil.copytree(src, dst)
    (path,) = [f.path for f in resolve(dst).files]
    tensors = load_file(path)
    out = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2:
            scale = t.abs().max().float() / 448
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale.reshape(())
            out[name.replace(".weight", ".input_scale")] = torch.ones(())
        else:
            out[name] = t
    save_file(out, path)
    model = nostall.load_model(dst)
    assert any(m.weight.dtype == torch.float8_e4m3fn for m in _linears(model))
    assert sqnr_db(_run(nostall.load_model(src)), _run(model)) > 10


def test_fp8_layouts_it_does_not_know_are_typed_errors(encoders, tmp_path):
    src = encoders["text_encoder"]
    for case in ("no-scale", "not-linear"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        (path,) = [f.path for f in resolve(dst).files]
        t = load_file(path)
        if case == "no-scale":
            name = next(n for n in t if n.endswith("q_proj.weight"))
            t[name] = t[name].to(torch.float8_e4m3fn)
            says = "has no"
        else:
            name = next(n for n in t if n.endswith("token_embedding.weight"))
            t[name] = t[name].to(torch.float8_e4m3fn)
            t[name + "_scale"] = torch.ones(t[name].shape[0])
            says = "not a linear layer"
        save_file(t, path)
        with pytest.raises(CheckpointError, match=says) as e:
            nostall.load_model(dst)
        assert e.value.tensor and name in e.value.tensor
        assert str(dst) in str(e.value)  # the message names the checkpoint
