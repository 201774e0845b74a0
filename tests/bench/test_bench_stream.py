"""``nostall bench stream`` (issue #32) at tiny size: every system runs, the report names
the issue's targets, nostall's images equal the resident pipeline's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nostall.bench import stream
from nostall.cli import app

TARGETS = {
    "flux_24gb_vs_resident",
    "flux_24gb_vs_diffusers_group_offload",
    "wan14b_24gb_vs_resident",
    "stream_images_equal_resident",
    "cost_model_step_error",
    "stream_peak_device_bytes_within_budget",
}


@pytest.mark.slow
def test_the_stream_bench_runs_from_the_cli_and_nostall_draws_the_resident_images(tmp_path):
    out = tmp_path / "stream.json"
    args = ["bench", "stream", "--size", "tiny", "--device", "cpu", "--part", "flux"]
    # (one budget, one round: the suite's time; 16 GB and round 2 run the same code)
    args += ["--budget-gb", "24", "--rounds", "1"]
    args += ["--work", str(tmp_path / "work"), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["benchmark"] == "stream" and report["date"] and "commit" in report
    assert set(report["targets"]) == TARGETS
    flux = report["parts"]["flux"]
    assert len(flux["passes"]["resident"]) == 1 and len(flux["passes"]["group-offload"]) == 1
    assert set(flux["budgets"]) == {"24"}
    for gb in ("24",):
        run = flux["budgets"][gb]
        assert len(run["passes"]) == 1 and run["equal"] is True
        assert run["device_budget_bytes"] < flux["resident"]["weights_bytes"]
        den = [p for p in run["plans"] if p["role"] == "transformer"]
        assert den and den[0]["streamed_blocks"] > 0  # resident in part, for real
        assert run["predicted_period_s"] > 0 and run["measured_period_s"] > 0
    assert report["targets"]["stream_images_equal_resident"]["met"] is True
    assert report["targets"]["cost_model_step_error"]["value"] is not None
    assert flux["sequential"] == {"skipped": "enable_sequential_cpu_offload needs a GPU"}
    assert "group-offload" in result.output and "targets" in result.output


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    from nostall.errors import ArgumentError

    with pytest.raises(ArgumentError, match="parts"):
        stream.run_stream_bench(size="tiny", device="cpu", parts=("sd9",), work=str(tmp_path))
    with pytest.raises(ArgumentError, match="systems"):
        stream.run_stream_bench(
            size="tiny", device="cpu", systems=("resident",), work=str(tmp_path)
        )
    result = CliRunner().invoke(app, ["bench", "stream", "--part", "sd9"])
    assert result.exit_code == 2 and "sd9" in result.output
    result = CliRunner().invoke(app, ["bench", "stream", "--budget-gb", "0"])
    assert result.exit_code == 2 and "positive" in result.output
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.cuda
def test_the_stream_bench_runs_on_a_gpu_with_every_peer(tmp_path):
    report = stream.run_stream_bench(
        size="tiny", device="cuda", parts=("flux",), rounds=1, work=str(tmp_path)
    )
    flux = report["parts"]["flux"]
    assert all(r["equal"] for r in flux["budgets"].values())
    assert flux["sequential"]["per_step_s"] > 0
    assert report["targets"]["stream_peak_device_bytes_within_budget"]["met"] is True
