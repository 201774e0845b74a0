"""``nostall bench video`` end to end on the CPU with the tiny Wan layouts: both parts
from the CLI, every target named, the A14B row under a budget that holds one expert."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nostall.cli import app

pytest.importorskip("diffusers")

TARGETS = {
    "t2v_served_vs_pipeline_alone",
    "t2v_e2e_vs_diffusers",
    "fp8_t2v_e2e_vs_diffusers_bf16",
    "a14b_44gb_e2e_vs_diffusers_offload",
    "a14b_boundary_visible_s",
    "fp8_a14b_boundary_visible_s",
    "video_job_kernel_busy_share",
    "video_frames_equal_pipeline",
}


def test_every_part_runs_tiny_on_the_cpu_and_names_every_target(tmp_path):
    out = tmp_path / "video.json"
    args = ["bench", "video", "--size", "tiny", "--device", "cpu", "--passes", "1",
            "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["benchmark"] == "video" and report["date"] and "commit" in report
    assert set(report["targets"]) == TARGETS
    t = report["targets"]
    # measured where the tiny run can, "not run" (None) where it cannot (FP8, profiler)
    assert t["video_frames_equal_pipeline"]["value"] == 1  # served frames = diffusers'
    for name in ("t2v_served_vs_pipeline_alone", "t2v_e2e_vs_diffusers",
                 "a14b_44gb_e2e_vs_diffusers_offload", "a14b_boundary_visible_s",
                 "fp8_t2v_e2e_vs_diffusers_bf16", "fp8_a14b_boundary_visible_s"):  # fmt: skip
        assert isinstance(t[name]["value"], float) and t[name]["met"] in (True, False)
    assert t["video_job_kernel_busy_share"]["value"] is None  # (the profiler: CUDA only)
    # the FP8 copies were written by nostall.quantize and served (the tiny UMT5 in FP8)
    fp8 = report["parts"]["fp8"]
    assert fp8["model"] == "wan-fp8" and fp8["rows"][0]["nostall_fp8_median_s"] > 0
    assert (tmp_path / "work" / "store-a14b" / "wan22-fp8" / "model_index.json").exists()
    wan = report["parts"]["wan21"]
    assert [(r["frames"], r["steps"]) for r in wan["rows"]] == [(5, 2), (9, 2)]
    a14b = report["parts"]["a14b"]["rows"][0]
    assert set(report["parts"]["a14b"]["systems"]) == {"nostall", "nostall_fp8", "diffusers"}
    # one expert at a time: the boundary's switch moved the second expert, evicting the first
    switch = a14b["boundary_switch"]
    assert switch["moved_bytes"] > 0 and any("transformer" in e for e in switch["evicted"])
    assert a14b["nostall_fp8_median_s"] > 0 and a14b["fp8_boundary_switch"] is not None
    assert "a14b" in result.output and "targets" in result.output


@pytest.mark.parametrize("option", ["--part", "--system"])
def test_an_unknown_part_or_system_is_a_usage_error(tmp_path, option):
    result = CliRunner().invoke(app, ["bench", "video", "--size", "tiny", "--device", "cpu",
                                      option, "ltx", "--out", str(tmp_path / "v.json")])  # fmt: skip
    assert result.exit_code == 2 and "ltx" in result.output


def test_the_a14b_part_on_a_card_budget_calibrates_first(tmp_path, monkeypatch):
    # the full run's path (a device budget made from the card's total, the activation
    # peak measured in a process of its own first), here in-process on the CPU
    from nostall.bench import video, video_a14b

    monkeypatch.setitem(video.SIZES["tiny"], "card", 256 << 20)
    calls = []
    real = video_a14b._calibrate
    monkeypatch.setattr(video_a14b, "_isolated", lambda args, fn="system": (
        calls.append(fn) or (real(*args) if fn == "calibrate" else video_a14b._a14b_system(*args))
    ))  # fmt: skip
    report = video.run_video_bench(size="tiny", device="cpu", parts=("a14b",), passes=1,
                                   work=str(tmp_path), log=lambda s: None,
                                   systems=("nostall",))  # fmt: skip
    row = report["parts"]["a14b"]["rows"][0]
    assert calls == ["calibrate"] and row["calibrated_s"]["nostall"] > 0  # (tiny: in-process)
    assert row["tier"]["nostall"]["gpu_budget"] > 0 and row["nostall_median_s"] > 0
