from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nostall.cli.main import app

runner = CliRunner()


def test_demo_runs_and_checks_equality(tmp_path):
    import av

    video = tmp_path / "demo.mp4"
    result = runner.invoke(
        app, ["demo", "--device", "cpu", "--size-mb", "8", "--video", str(video)]
    )
    assert result.exit_code == 0, result.output
    assert "memory-cache hit" in result.output
    assert "All tensors equal" in result.output
    with av.open(str(video)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 17


def test_load_prints_phases(ckpt_file):
    result = runner.invoke(
        app, ["load", str(ckpt_file), "--device", "cpu", "--pool-gb", "0.05", "--json"]
    )
    assert result.exit_code == 0, result.output
    records = json.loads(result.output)
    assert [r["scenario"] for r in records] == ["read", "memory-cache hit"]
    assert all(r["nbytes"] > 0 for r in records)


def test_load_model_from_folder(tmp_path):
    from nostall.bench.checkpoints import make_checkpoint

    make_checkpoint(str(tmp_path), preset="tiny")
    result = runner.invoke(app, ["load", str(tmp_path), "--device", "cpu", "--model"])
    assert result.exit_code == 0, result.output
    assert "build s" in result.output


def test_bad_input_is_a_one_line_error_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00")
    proc = subprocess.run(
        [sys.executable, "-m", "nostall.cli.main", "load", str(bad), "--device", "cpu"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "CheckpointError" in proc.stdout and str(bad) in proc.stdout.replace("\n", "")
    assert "Traceback" not in proc.stdout + proc.stderr


def test_bad_dtype_option(ckpt_file):
    result = runner.invoke(app, ["load", str(ckpt_file), "--device", "cpu", "--dtype", "fp7"])
    assert result.exit_code != 0


@pytest.mark.timeout(300)
def test_bench_load_tiny_on_cpu_writes_json(tmp_path):
    out = tmp_path / "load.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "load",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--folder",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
            "--scenario",
            "page-cache",
            "--scenario",
            "memory-cache",
            "--repeat",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    recs = {(r["method"], r["scenario"]): r for r in report["records"]}
    assert recs[("nostall (staging ring)", "page-cache")]["equal"] is True
    assert recs[("nostall (pool, memory-cache hit)", "memory-cache")]["equal"] is True
    assert recs[("nostall load_model (pool hit)", "memory-cache")]["equal"] is True
    assert recs[("diffusers device_map", "page-cache")]["equal"] is True
    # peers that cannot run here are reported, not dropped
    assert recs[("fastsafetensors (no GDS)", "page-cache")]["note"].startswith("skipped")
    assert report["commit"] and report["date"]


@pytest.mark.timeout(300)
def test_bench_decode_tiny_on_cpu_writes_json_and_table(tmp_path):
    pytest.importorskip("av")
    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--size", "tiny", "--dtype", "fp32", "--device", "cpu"]
    args += ["--latent-frames", "2", "--repeat", "1", "--work", str(tmp_path / "w")]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["frames"] == 5
    assert set(report["results"]["fp32"]) >= {"decode-only", "sync", "async", "raw_npy"}
    assert "async" in result.output and "1.02x decode-only" in result.output
    assert "back to back" in result.output and "submit_decode" in result.output


def test_bench_decode_memory_only_needs_cuda(tmp_path):
    m = str(tmp_path / "m.json")
    result = runner.invoke(
        app,
        ["bench", "decode", "--size", "tiny", "--device", "cpu", "--part", "memory", "--out", m],
    )
    assert result.exit_code != 0
    assert "CUDA" in str(result.exception) or "CUDA" in result.output
    assert not (tmp_path / "m.json").exists()


# ---- nostall decode -------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    folder = tmp_path_factory.mktemp("wan") / "vae"
    vae.save_pretrained(folder)
    return folder


def _latents(path, channels=16, seed=1):
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.save(torch.randn(1, channels, 4, 6, 8, generator=g), path)
    return str(path)


def test_decode_one_file_to_mp4(tmp_path, wan_folder):
    import av

    z = _latents(tmp_path / "z.pt")
    out = tmp_path / "v.mp4"
    result = runner.invoke(
        app, ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    assert "13 frames" in result.output
    with av.open(str(out)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 13


@pytest.mark.parametrize("sync", [False, True])
def test_decode_several_files_back_to_back(tmp_path, wan_folder, sync):
    import numpy as np

    zs = [_latents(tmp_path / f"clip{i}.pt", seed=i) for i in range(3)]
    out = tmp_path / "out"
    out.mkdir()
    args = ["decode", *zs, "--vae", str(wan_folder), "-o", str(out), "--suffix", ".npy"]
    result = runner.invoke(app, [*args, "--device", "cpu"] + (["--sync"] if sync else []))
    assert result.exit_code == 0, result.output
    videos = [np.load(out / f"clip{i}.npy") for i in range(3)]
    assert all(v.shape == (13, 48, 64, 3) and v.dtype == np.uint8 for v in videos)
    assert not np.array_equal(videos[0], videos[1])  # each file got its own latents
    assert sorted(p.name for p in out.iterdir()) == ["clip0.npy", "clip1.npy", "clip2.npy"]


def test_decode_checks_every_input_before_decoding(tmp_path, wan_folder):
    good = _latents(tmp_path / "a.pt")
    bad = _latents(tmp_path / "b.pt", channels=12)
    out = tmp_path / "out"
    out.mkdir()
    cmd = ["decode", good, bad, "--vae", str(wan_folder), "-o", str(out), "--device", "cpu"]
    proc = subprocess.run(
        [sys.executable, "-m", "nostall.cli.main", *cmd], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert "b.pt" in proc.stdout and "channels" in proc.stdout and "Traceback" not in proc.stderr
    assert list(out.iterdir()) == []  # not even the good one was started


def test_decode_several_files_needs_an_output_folder(tmp_path, wan_folder):
    zs = [_latents(tmp_path / f"c{i}.pt") for i in range(2)]
    result = runner.invoke(
        app, ["decode", *zs, "--vae", str(wan_folder), "-o", str(tmp_path / "v.mp4")]
    )
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())  # rich wraps the message
    assert "must be an existing folder" in text
