from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")


def test_switch_bench_runs_end_to_end_on_tiny_pipelines(tmp_path):
    from nostall.bench.switch import run_switch_bench

    saved = []
    report = run_switch_bench(
        folder=str(tmp_path / "store"),
        size="tiny",
        device="cpu",
        parts=("nostall", "same-arch", "prefetch", "peers"),
        log=lambda s: None,
        save=lambda r: saved.append(json.dumps(r)),
    )
    assert len(saved) == 4  # written after every part
    for part in ("nostall", "same-arch", "prefetch", "peers"):
        assert "error" not in report[part], report[part]
    passes = report["nostall"]["passes"]
    assert [s["pipeline"] for s in passes[1]["steps"]] == ["flux", "sdxl", "flux", "sdxl", "flux"]
    # The second pass switches from the host tier or the device, never from disk.
    tiers = {c["tier"] for s in passes[1]["steps"] for c in s["switch"]["components"]}
    assert "disk" not in tiers
    shared = report["nostall"]["shared_flux_b_after_flux"]["switch"]
    moved = [c["role"] for c in shared["components"] if c["tier"] not in ("gpu", "device")]
    assert moved == ["transformer"]
    assert any(r["transformer_in_place"] for r in report["same-arch"]["runs"])
    peers = report["peers"]
    assert {"diffusers_from_pretrained_to", "cpu_resident_to", "nostall_load_model"} <= set(peers)
    targets = report["targets"]
    assert set(targets["flux_memory_hit_s"]) == {"value", "threshold", "op", "met"}
    assert targets["cold_vs_disk_sequential_read"]["met"] is None  # not run: not claimed
    assert targets["shared_components_flux_b_moves_only_transformer"]["met"] is True


def test_cold_part_drops_the_cache_announced_and_compares_with_the_disk(tmp_path, monkeypatch):
    from nostall.bench import load as load_bench
    from nostall.bench.switch import run_switch_bench

    drops, lines = [], []
    monkeypatch.setattr(load_bench, "drop_caches", lambda: drops.append(1))
    monkeypatch.setattr(
        load_bench, "disk_limit", lambda path, *, direct, drop: drop("dd") or (2.0, 1.5)
    )
    report = run_switch_bench(
        folder=str(tmp_path / "store"), size="tiny", device="cpu", parts=("cold",), log=lines.append
    )
    cold = report["cold"]
    assert "error" not in cold, cold
    assert len(drops) == 2 and sum("dropping the OS page cache" in line for line in lines) == 2
    assert cold["disk"]["gbps"] == 1.5
    assert report["targets"]["cold_vs_disk_sequential_read"]["value"] == cold["gbps"] / 1.5
