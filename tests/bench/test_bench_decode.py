"""``nostall bench decode`` end to end on CPU with a tiny VAE, and report merging."""

from __future__ import annotations

import json

import pytest

from nostall.bench.decode import evaluate_targets, merge_reports, run_decode_bench

pytest.importorskip("diffusers")
pytest.importorskip("av")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    work = tmp_path_factory.mktemp("decode")
    return run_decode_bench(
        size="tiny",
        dtypes=("fp32",),
        latent_frames=3,
        repeat=2,
        device="cpu",
        out_dir=str(work),
        log=lambda s: None,
    )


def test_tiny_bench_times_every_mode_on_cpu(tiny_report):
    res = tiny_report["results"]["fp32"]
    assert tiny_report["config"]["frames"] == 9
    for mode in ("decode-only", "sync", "async"):
        assert len(res[mode]["runs"]) == 2
        assert 0 < res[mode]["min"] <= res[mode]["mean"] <= max(res[mode]["runs"])
    for mode in ("sync", "async"):
        assert 0 < res[mode]["close_mean_s"] < res[mode]["mean"]
    assert res["mp4_bytes"] > 0 and set(res["raw_npy"]) == {"sync", "async"}
    assert "utilisation" not in res and "peak_memory_gib" not in res  # CUDA only
    b2b = res["back_to_back"]
    assert b2b["videos"] == 3 and len(b2b["close_s"]) == 3
    assert b2b["submit_s"] > 0 and b2b["decode_only_s"] > 0 and b2b["one_at_a_time_s"] > 0
    names = [t["target"] for t in tiny_report["targets"]]
    assert any("1.02x decode-only" in n for n in names)
    json.dumps(tiny_report)  # JSON-able


def _part(name, res, commit="abc"):
    return {
        "benchmark": "decode",
        "date": "2026-11-29T00:00:00+00:00",
        "commit": commit,
        "hardware": {},
        "config": {"latents": [1, 16, 41, 90, 160], "frames": 161, "size": "1280x720", "mp4": {}},
        "results": {name: res},
    }


def _modes(decode_only, sync, async_):
    return {
        "decode-only": {"mean": decode_only},
        "sync": {"mean": sync, "min": sync, "p99": sync, "rtf": 1.0},
        "async": {"mean": async_, "min": async_, "p99": async_, "rtf": 1.0},
    }


def test_merge_joins_precisions_and_memory_parts():
    bf16 = _part("bf16", _modes(8.0, 9.0, 8.1))
    fp32 = _part("fp32", _modes(13.0, 14.0, 13.5), commit="def")
    mem = _part("fp32", {"peak_memory_gib": {"41": 10.0, "81": 10.2}})
    merged = merge_reports([bf16, fp32, mem])
    assert set(merged["results"]) == {"bf16", "fp32"}
    assert merged["results"]["fp32"]["peak_memory_gib"] == {"41": 10.0, "81": 10.2}
    assert [p["commit"] for p in merged["runs"]] == ["abc", "def", "abc"]
    by_name = {t["target"]: t for t in merged["targets"]}
    assert by_name["bf16: async end-to-end <= 1.02x decode-only"]["met"] is True  # 1.0125
    assert by_name["fp32: async end-to-end <= 1.02x decode-only"]["met"] is False  # 1.038
    assert by_name["fp32: peak GPU memory at 2x latent frames within 5% of 1x"]["met"] is True


def test_merge_refuses_different_configurations():
    a = _part("bf16", _modes(8.0, 9.0, 8.1))
    b = _part("fp32", _modes(8.0, 9.0, 8.1))
    b["config"]["size"] = "832x480"
    with pytest.raises(ValueError, match="different configurations"):
        merge_reports([a, b])


def test_memory_target_fails_when_memory_grows():
    report = _part("bf16", {"peak_memory_gib": {"41": 10.0, "81": 11.0}})
    (t,) = evaluate_targets(report)
    assert t["met"] is False and t["measured"] == 1.1
