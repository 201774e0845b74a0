"""``nostall quantize --check``: SQNR per layer and at a text encoder's output (CPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import nostall
from nostall.verify import check, sqnr_db


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from nostall.synthetic import write_store

    return write_store(tmp_path_factory.mktemp("store"), ("flux",))["flux"]


def test_sqnr():
    x = torch.ones(100)
    assert sqnr_db(x, x) == math.inf
    assert abs(sqnr_db(x, x * 1.1) - 20.0) < 1e-4  # noise 0.1 of the signal: 20 dB


@pytest.mark.parametrize("component", ["text_encoder", "text_encoder_2"])
def test_text_encoders_get_per_layer_and_output_sqnr(flux, tmp_path, component):
    src, dst = os.path.join(flux, component), tmp_path / component
    converted = nostall.quantize(src, dst)
    report = check(src, dst)
    assert len(report.layers) == converted.quantized > 0
    assert all(db > 25 for _, db in report.layers)  # e4m3, row scales: ~31 dB on N(0, 1)
    assert report.output_db is not None and report.output_db > 15
    assert "random token ids" in report.output_note


def test_a_diffusion_transformer_is_checked_per_layer_and_says_so(flux, tmp_path):
    src, dst = os.path.join(flux, "transformer"), tmp_path / "transformer"
    nostall.quantize(src, dst)
    report = check(src, dst)
    assert report.layers and report.output_db is None
    assert "per layer only" in report.output_note


def test_a_wrong_pairing_shows_in_the_numbers(flux, tmp_path):
    # the check compares with the original it is given: another model's weights score low
    src = os.path.join(flux, "text_encoder")
    dst = tmp_path / "te"
    nostall.quantize(src, dst)
    other = tmp_path / "other"
    from safetensors.torch import load_file, save_file

    from nostall.store import resolve

    other.mkdir()
    for f in resolve(src).files:
        t = {k: v.flip(0) if v.dim() == 2 else v for k, v in load_file(f.path).items()}
        save_file(t, str(other / os.path.basename(f.path)))
    report = check(other, dst)
    assert min(db for _, db in report.layers) < 5
