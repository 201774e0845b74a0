"""``nostall bench fp8`` end to end on the CPU with the tiny FLUX pipeline."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nostall.bench.fp8 import evaluate_targets
from nostall.cli import app

pytest.importorskip("diffusers")

TARGETS = {
    "bytes_fp8_vs_bf16",
    "memory_hit_switch_fp8_s",
    "page_cache_load_fp8_vs_bf16",
    "forward_fp8_eager_vs_bf16_eager",
    "forward_fp8_compiled_speedup",
    "sqnr_gap_to_torchao_db",
    "cache_fp8_equals_load_model",
    "e2e_fp8_speedup",
}


@pytest.mark.slow
def test_tiny_fp8_bench_runs_from_the_cli(tmp_path):
    out = tmp_path / "fp8.json"
    result = CliRunner().invoke(
        app,
        # --compile-budget 0: the compile part says it skipped both compiles (two fresh
        # processes compiling on a CPU are 17 s of CI; the GPU run compiles)
        ["bench", "fp8", "--size", "tiny", "--device", "cpu", "--repeat", "1",
         "--store", str(tmp_path / "s"), "--out", str(out), "--compile-budget", "0"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    res = report["results"]
    for part in ("loads", "forward", "cache", "e2e", "compile"):
        assert "error" not in res[part], res[part]
    assert 0 < res["bytes"]["fp8"] < res["bytes"]["bf16"]
    for key in ("page_cache_load_s", "memory_hit_s", "switch_hit_s"):
        assert res["loads"][key]["bf16"] > 0 and res["loads"][key]["fp8"] > 0
    fwd = res["forward"]
    assert fwd["bf16_eager_s"] > 0 and fwd["fp8_eager_s"] > 0 and fwd["sqnr_db"] > 20
    assert fwd["fp8_layers"] > 0 and fwd["fp8_layers_on_tensor_cores"] == 0  # CPU: upcast
    assert "eager_s" in fwd["torchao"] or "error" in fwd["torchao"]  # the peer, or why not
    assert "budget" in res["compile"]["bf16_skipped"] and "budget" in res["compile"]["fp8_skipped"]
    assert res["cache"]["equal"] == 1  # served as load_model builds it
    assert res["e2e"]["fp8_speedup"] > 0
    assert {"host"} == set(res["e2e"]["fp8"]["runs"][0]["tiers"])  # switched from the host tier
    assert report["config"]["fp8_compute"][0] == "upcast"
    t = report["targets"]
    assert set(t) == TARGETS
    assert t["cache_fp8_equals_load_model"]["met"] is True
    assert "transformer weights (GB)" in result.output and "targets" in result.output
    # the second run reuses the stores and refuses to overwrite the report
    again = CliRunner().invoke(
        app, ["bench", "fp8", "--size", "tiny", "--device", "cpu", "--out", str(out)]
    )
    assert again.exit_code != 0 and "exists" in again.output


def test_targets_read_the_figures():
    report = {
        "results": {
            "bytes": {"ratio": 0.503},
            "loads": {"switch_hit_s": {"fp8": 0.24}, "page_cache_load_s": {"ratio": 0.6}},
            "forward": {"fp8_vs_bf16_eager": 0.84, "sqnr_gap_to_torchao_db": 0.1},
            "compile": {"fp8_compiled_speedup": 1.2, "fp8_skipped": "budget"},
            "cache": {"equal": 1},
        }
    }
    t = evaluate_targets(report)
    assert set(t) == TARGETS
    assert t["bytes_fp8_vs_bf16"]["met"] and t["memory_hit_switch_fp8_s"]["met"]
    assert t["page_cache_load_fp8_vs_bf16"]["met"] is False
    assert t["forward_fp8_eager_vs_bf16_eager"]["met"] is True
    assert t["forward_fp8_compiled_speedup"]["met"] is False
    assert t["sqnr_gap_to_torchao_db"]["met"] and t["cache_fp8_equals_load_model"]["met"]
    assert t["e2e_fp8_speedup"]["met"] is None  # not run: not claimed
