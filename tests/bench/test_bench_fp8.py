"""``nostall bench fp8`` end to end on the CPU with a tiny FLUX transformer."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nostall.bench.fp8 import evaluate_targets
from nostall.cli.main import app

pytest.importorskip("diffusers")


def test_tiny_fp8_bench_runs_from_the_cli(tmp_path):
    out = tmp_path / "fp8.json"
    result = CliRunner().invoke(
        app,
        ["bench", "fp8", "--size", "tiny", "--device", "cpu", "--repeat", "2", "--no-compile",
         "--work", str(tmp_path / "w"), "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    res = report["results"]
    assert 0 < res["bytes"]["fp8"] < res["bytes"]["bf16"]
    for key in ("page_cache_load_s", "memory_hit_s", "switch_hit_s"):
        assert res[key]["bf16"] > 0 and res[key]["fp8"] > 0
    assert res["forward"]["bf16_eager_s"] > 0 and res["forward"]["fp8_eager_s"] > 0
    assert res["sqnr_db"]["eager"] > 20  # FP8 weights, upcast on the CPU
    assert report["config"]["fp8_compute"][0] == "upcast"
    t = report["targets"]
    assert set(t) == {
        "bytes_fp8_vs_bf16",
        "memory_hit_switch_fp8_s",
        "page_cache_load_fp8_vs_bf16",
        "forward_fp8_compiled_vs_bf16_compiled",
        "forward_fp8_vs_bf16_eager",
        "output_sqnr_db",
    }
    assert t["forward_fp8_compiled_vs_bf16_compiled"]["met"] is None  # not compiled: not run
    assert "weights (GB)" in result.output and "targets" in result.output
    # the second run reuses the written transformers and refuses to overwrite the report
    again = CliRunner().invoke(
        app, ["bench", "fp8", "--size", "tiny", "--device", "cpu", "--out", str(out)]
    )
    assert again.exit_code != 0 and "exists" in again.output


def test_targets_read_the_figures():
    report = {
        "results": {
            "bytes": {"ratio": 0.503},
            "switch_hit_s": {"fp8": 0.24},
            "page_cache_load_s": {"ratio": 0.6},
            "forward": {
                "fp8_compiled_vs_bf16_compiled": 1.31,
                "fp8_compiled_vs_bf16_eager": 1.7,
                "fp8_vs_bf16_eager": 1.1,
            },
            "sqnr_db": {"eager": 25.0, "compiled": 19.0},
        }
    }
    t = evaluate_targets(report)
    assert t["bytes_fp8_vs_bf16"]["met"] and t["memory_hit_switch_fp8_s"]["met"]
    assert t["page_cache_load_fp8_vs_bf16"]["met"] is False
    assert t["forward_fp8_compiled_vs_bf16_compiled"]["met"] is True
    assert t["forward_fp8_vs_bf16_eager"]["value"] == 1.7  # the compiled FP8 forward counts
    assert t["output_sqnr_db"]["value"] == 19.0 and t["output_sqnr_db"]["met"] is False
