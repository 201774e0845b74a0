"""``nostall bench adapters`` end to end on the CPU with the tiny FLUX pipeline: every part
from the CLI, the six targets, the LoRA files as both readers see them, and the refusals."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from nostall.bench.adapters import PARTS, evaluate_targets, write_loras
from nostall.cli import app

pytest.importorskip("diffusers")
pytest.importorskip("peft")

TARGETS = {
    "lora_switch_s_r64",
    "lora_switch_vs_diffusers_hotswap",
    "lora_forward_overhead",
    "lora_recompiles",
    "lora_base_restored_bit_exact",
    "controlnet_attach_gbps",
}


def _args(work, out, *more: str) -> list[str]:
    return ["bench", "adapters", "--size", "tiny", "--device", "cpu", "--repeat", "1",
            "--work", str(work), "--out", str(out), *more]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run of every part (the default), through the CLI."""
    tmp = tmp_path_factory.mktemp("adapters")
    out = tmp / "adapters.json"
    result = CliRunner().invoke(app, _args(tmp / "work", out))
    assert result.exit_code == 0, result.output
    return tmp, out, result


def test_every_part_runs_and_the_report_names_the_six_targets(run):
    _, out, result = run
    report = json.loads(out.read_text())
    assert report["benchmark"] == "adapters" and report["config"]["parts"] == list(PARTS)
    for part in PARTS:
        assert "error" not in report[part], report[part]
    peer, ours = report["peer"], report["nostall"]
    assert set(peer["ranks"]) == {"2", "4"} and set(ours["switch"]) == {"2", "4", "8"}
    for row in peer["ranks"].values():
        for key in ("first_load_s", "next_load_s", "hotswap_s", "hotswap_from_memory_s",
                    "fuse_s", "unfuse_s"):  # fmt: skip
            assert row[key] > 0, key
        assert row["unfused_forward_s"] > 0 and len(row["hotswap_runs_s"]) == 1
    for row in ours["switch"].values():
        assert row["switch_s"] > 0 and row["to_base_s"] > 0 and len(row["first_switch_s"]) == 2
    t = report["targets"]
    assert set(t) == TARGETS
    # the tiny run's middle rank stands for rank 64, against diffusers' hotswap at that rank
    assert t["lora_switch_s_r64"]["value"] == ours["switch"]["4"]["switch_s"]
    ratio = peer["ranks"]["4"]["hotswap_s"] / ours["switch"]["4"]["switch_s"]
    assert t["lora_switch_vs_diffusers_hotswap"]["value"] == pytest.approx(ratio)
    assert t["lora_forward_overhead"]["value"] == pytest.approx(ours["forward"]["overhead"])
    assert "lora_recompiles" in result.output and "base restored bit for bit" in result.output


def test_the_base_comes_back_bit_for_bit_and_switches_never_recompile(run):
    report = json.loads(run[1].read_text())
    t, ours = report["targets"], report["nostall"]
    assert t["lora_base_restored_bit_exact"] == {"value": 1, "threshold": 1, "op": ">=",
                                                 "met": True}  # fmt: skip
    assert ours["base_restored"]["parameters"] > 0 and ours["base_restored"]["same_module"]
    compiled = ours["compiled"]
    assert compiled["backend"] == "eager" and compiled["how"] == "compile_repeated_blocks"
    assert compiled["graphs_after_warm_up"] > 0  # it did compile, then never again
    assert len(compiled["runs"]) == compiled["switches"] == 20
    assert {tuple(r["loras"]) for r in compiled["runs"]} >= {(), ("r2-a",), ("r8-b",)}
    assert t["lora_recompiles"]["value"] == 0 and t["lora_recompiles"]["met"] is True


def test_controlnet_attach_is_reported_as_not_built(run):
    report = json.loads(run[1].read_text())
    c = report["targets"]["controlnet_attach_gbps"]
    assert c["value"] is None and c["met"] is None and c["threshold"] == 45.0
    assert "not built" in c["note"] and report["controlnet"]["built"] is False


def test_the_lora_files_read_as_written_and_are_kept(run):
    from nostall.adapters import read_lora

    tmp, out, _ = run
    store = tmp / "work" / "store"
    lora = read_lora(store / "loras" / "r4-a.safetensors", "FluxPipeline")
    report = json.loads(out.read_text())
    assert len(lora.layers) == report["loras"]["r4-a"]["layers"] == 17  # every block linear
    assert {x.rank for x in lora.layers} == {4}
    assert {x.scale for x in lora.layers} == {1.0}  # lora_alpha = r, from the metadata
    path = store / "loras" / "r2-b.safetensors"
    before = os.stat(path).st_mtime_ns
    again = write_loras(str(store / "flux"), str(store / "loras"), (2,), log=lambda _: None)
    assert set(again) == {"r2-a", "r2-b"} and os.stat(path).st_mtime_ns == before


def test_a_second_run_refuses_to_overwrite_the_report(run):
    tmp, out, _ = run
    text = out.read_text()
    again = CliRunner().invoke(app, _args(tmp / "work", out))
    assert again.exit_code == 2 and "already exists" in again.output
    assert out.read_text() == text


def test_a_bad_part_is_a_usage_error(tmp_path):
    out = tmp_path / "a.json"
    result = CliRunner().invoke(app, _args(tmp_path / "w", out, "--part", "controlnet"))
    assert result.exit_code == 2 and "controlnet" in result.output
    assert not out.exists() and not (tmp_path / "w").exists()  # refused before any work


def test_targets_read_the_figures_at_the_switch_rank():
    report = {
        "config": {"switch_rank": 64},
        "peer": {"ranks": {"64": {"hotswap_s": 0.2}, "16": {"hotswap_s": 0.1}}},
        "nostall": {
            "switch": {"64": {"switch_s": 0.025}, "16": {"switch_s": 0.001}},
            "forward": {"overhead": 0.001},
            "compiled": {"frames_compiled": 1},
            "base_restored": {"bit_exact": 1},
        },
    }
    t = evaluate_targets(report)
    assert set(t) == TARGETS
    assert t["lora_switch_s_r64"]["value"] == 0.025 and t["lora_switch_s_r64"]["met"] is False
    assert t["lora_switch_vs_diffusers_hotswap"]["value"] == pytest.approx(8.0)
    assert t["lora_switch_vs_diffusers_hotswap"]["met"] is False
    assert t["lora_forward_overhead"]["met"] is True
    assert t["lora_recompiles"]["met"] is False
    assert t["lora_base_restored_bit_exact"]["met"] is True
    empty = evaluate_targets({})  # nothing ran: every figure unmeasured
    assert all(x["value"] is None and x["met"] is None for x in empty.values())
