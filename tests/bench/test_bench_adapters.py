"""``nostall bench adapters`` end to end on the CPU with the tiny FLUX pipeline: every part
from the CLI, the six targets, the LoRA and ControlNet files as the readers see them, and
the refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from nostall.bench.adapters import PARTS, evaluate_targets, write_loras
from nostall.bench.adapters_controlnet import CONTROLNET, LAYOUTS, write_controlnet
from nostall.cli import app

from support import squashed

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_controlnet_attach_fills_its_target_moving_only_the_controlnet(run):
    _, out, result = run
    report = json.loads(out.read_text())
    cn = report["controlnet"]
    ours, peer = cn["nostall"], cn["peer"]
    c = report["targets"]["controlnet_attach_gbps"]
    assert c["value"] > 0 and c["threshold"] == 45.0 and c["met"] is (c["value"] >= 45.0)
    gbps = ours["controlnet_bytes"] / ours["attach_s"] / 1e9
    assert c["value"] == cn["attach_gbps"] == pytest.approx(gbps)
    assert "note" not in c
    # the tiny ControlNet's tensors; the device tier aligns each one
    assert ours["controlnet_bytes"] == cn["model"]["nbytes"] > 0
    assert 0 <= ours["cache_bytes"] - ours["controlnet_bytes"] < 1024
    # measured attach: the base resident, the ControlNet from the pinned host tier only
    assert ours["moved_roles"] == ["controlnet"] and ours["attach_tiers"]["controlnet"] == "host"
    assert {t for r, t in ours["attach_tiers"].items() if r != "controlnet"} == {"device"}
    assert set(ours["attach_tiers"]) == {"controlnet", "transformer", "vae", "text_encoder",
                                         "text_encoder_2"}  # fmt: skip
    # the first attach read it from disk and kept it in the host tier
    assert ours["first_attach"]["controlnet"]["tier"] == "disk"
    assert ours["first_attach"]["controlnet"]["cached"] is True
    assert len(ours["attach_runs_s"]) == 1 and ours["attach_s"] > 0
    assert peer["attach_s"] > 0 and peer["from_pretrained_to_s"] > 0 and peer["attach_gbps"] > 0
    assert "FluxControlNetPipeline" in peer["how"]
    assert "ControlNet attach: FluxControlNetModel" in result.output


@pytest.mark.slow
def test_the_controlnet_image_equals_diffusers_and_shows_the_control(run):
    report = json.loads(run[1].read_text())
    cn = report["controlnet"]
    img = cn["image"]
    assert cn["nostall"]["pipeline_class"] == "FluxControlNetPipeline"
    assert img["shape"] == [32, 32, 3] and img["tolerance"] == 1e-5
    assert img["equal"] is True and img["max_abs_diff"] <= img["tolerance"]
    assert img["vs_base_max_abs_diff"] > 1e-2  # the ControlNet changed the image


@pytest.mark.slow
def test_the_controlnet_part_runs_alone_on_the_kept_files(run, tmp_path):
    tmp, _, _ = run
    out = tmp_path / "cn.json"
    result = CliRunner().invoke(app, _args(tmp / "work", out, "--part", "controlnet"))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["parts"] == ["controlnet"] and "peer" not in report
    assert report["controlnet"]["model"]["kept"] is True  # the first run's folder
    assert report["loras"] == {}  # no LoRA part: none written
    t = report["targets"]
    assert t["controlnet_attach_gbps"]["value"] > 0
    assert all(x["value"] is None for n, x in t.items() if n != "controlnet_attach_gbps")
    assert "LoRAs on" not in result.output  # no empty LoRA table


@pytest.mark.slow
def test_a_failed_peer_still_measures_the_attach(run, monkeypatch):
    from rich.console import Console

    from nostall.bench import adapters_controlnet as cnb

    def broken(self, nbytes):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(cnb.ControlNetPart, "peer", broken)
    store = str(run[0] / "work" / "store")
    part = cnb.ControlNetPart(store, "tiny", torch.device("cpu"), torch.float32, 1, lambda _: None)
    out = part.run()
    assert out["peer"] == {"error": "RuntimeError: CUDA out of memory (simulated)"}
    assert out["attach_gbps"] > 0 and out["nostall"]["moved_roles"] == ["controlnet"]
    assert out["image"]["equal"] is None and out["image"]["vs_base_max_abs_diff"] > 1e-2
    console = Console(width=200, record=True)
    console.print(cnb.table({"controlnet": out}))
    text = console.export_text()
    assert "not compared (diffusers failed)" in text and "CUDA out of memory" in text


@pytest.mark.slow
def test_the_controlnet_folder_loads_in_diffusers_and_is_rewritten_for_another_layout(
    run, tmp_path
):
    from diffusers import FluxControlNetModel

    store = run[0] / "work" / "store"
    cn = FluxControlNetModel.from_pretrained(str(store / "controlnets" / CONTROLNET))
    assert cn.config.num_layers == 1 and cn.config.num_mode == 10
    assert cn.controlnet_blocks[0].weight.abs().max() > 0  # random, not zero-initialised
    assert cn.config.in_channels == 16  # the tiny transformer's: the cache checks it
    args = (str(store / "flux"), str(tmp_path / "cn"))
    kw = {"dtype": torch.bfloat16, "log": lambda _: None}
    first = write_controlnet(*args, layout=LAYOUTS["tiny"], **kw)
    kept = write_controlnet(*args, layout=LAYOUTS["tiny"], **kw)
    assert first["kept"] is False and kept["kept"] is True and kept["write_s"] == 0.0
    bf16 = sum(p.numel() * 2 for p in cn.state_dict().values())  # the tiny run's is float32
    assert kept["nbytes"] == first["nbytes"] == bf16
    again = write_controlnet(*args, layout={**LAYOUTS["tiny"], "num_mode": 4}, **kw)
    assert again["kept"] is False and again["nbytes"] < kept["nbytes"]
    assert FluxControlNetModel.from_pretrained(args[1]).config.num_mode == 4


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_second_run_refuses_to_overwrite_the_report(run):
    tmp, out, _ = run
    text = out.read_text()
    again = CliRunner().invoke(app, _args(tmp / "work", out))
    assert again.exit_code == 2 and "alreadyexists" in squashed(again.output)
    assert out.read_text() == text


def test_a_bad_part_is_a_usage_error(tmp_path):
    out = tmp_path / "a.json"
    result = CliRunner().invoke(app, _args(tmp_path / "w", out, "--part", "ip-adapter"))
    assert result.exit_code == 2 and "ip-adapter" in result.output
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
        "controlnet": {"attach_gbps": 51.5, "nostall": {"attach_gbps": 1.0}},
    }
    t = evaluate_targets(report)
    assert set(t) == TARGETS
    assert t["lora_switch_s_r64"]["value"] == 0.025 and t["lora_switch_s_r64"]["met"] is False
    assert t["lora_switch_vs_diffusers_hotswap"]["value"] == pytest.approx(8.0)
    assert t["lora_switch_vs_diffusers_hotswap"]["met"] is False
    assert t["lora_forward_overhead"]["met"] is True
    assert t["lora_recompiles"]["met"] is False
    assert t["lora_base_restored_bit_exact"]["met"] is True
    assert t["controlnet_attach_gbps"] == {"value": 51.5, "threshold": 45.0, "op": ">=",
                                           "met": True}  # fmt: skip
    empty = evaluate_targets({})  # nothing ran: every figure unmeasured
    assert all(x["value"] is None and x["met"] is None for x in empty.values())


@pytest.mark.slow
def test_append_keeps_the_other_parts_and_names_them(run, tmp_path):
    tmp, out, _ = run
    first = json.loads(out.read_text())
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps({**first, "commit": "abc1234"}))
    result = CliRunner().invoke(app, _args(tmp / "work", path, "--part", "controlnet", "--append"))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report["appended"]["parts"] == ["peer", "nostall"]
    assert report["appended"]["commit"] == "abc1234" and report["config"]["parts"] == list(PARTS)
    assert report["peer"] == first["peer"] and report["nostall"] == first["nostall"]
    assert report["controlnet"]["part_s"] != first["controlnet"]["part_s"]  # this run's
    assert report["targets"] == evaluate_targets(report)
    assert report["targets"]["lora_base_restored_bit_exact"]["met"] is True
    args = _args(tmp / "work", path, "--part", "controlnet", "--append")
    args[args.index("--repeat") + 1] = "2"  # not the run it would add to
    other = CliRunner().invoke(app, args)
    assert other.exit_code != 0 and "--repeat" in other.output
