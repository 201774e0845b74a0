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
    assert "decoder mode exact" in result.output and "bit-identical" in result.output
    assert "FP8: nostall quantize converted" in result.output
    assert "Every served image equal to the same diffusers pipeline's" in result.output
    assert "no model 'flux-pro'" in result.output
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
    from nostall.synthetic import make_checkpoint

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
    # a second run refuses to write over the first report, before running anything
    again = runner.invoke(app, [*args, "--out", str(out)])
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert json.loads(out.read_text()) == report
    assert set(report["results"]["fp32"]) >= {"decode-only", "sync", "async", "raw_npy"}
    assert "async" in result.output and "fp32_async_vs_decode_only" in result.output
    assert "back to back" in result.output and "submit_decode" in result.output
    assert "decoder modes" in result.output and "bit-identical" in result.output
    assert report["targets"]["exact_fp32_bit_identical_to_vae_decode"]["met"] is True
    bad = runner.invoke(app, [*args, "--out", str(tmp_path / "x.json"), "--mode", "turbo"])
    assert bad.exit_code == 2 and "exact" in bad.output


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
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--no-denormalize"]
    result = runner.invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "13 frames" in result.output
    with av.open(str(out)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 13


def test_decode_mode_exact_gives_the_eager_frames(tmp_path, wan_folder):
    import numpy as np

    z = _latents(tmp_path / "z.pt")
    frames = {}
    for mode in ("eager", "exact"):
        out = tmp_path / f"{mode}.npy"
        args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--no-denormalize"]
        result = runner.invoke(app, [*args, "--device", "cpu", "--mode", mode])
        assert result.exit_code == 0, result.output
        frames[mode] = np.load(out)
    assert frames["exact"].shape[0] == 13
    assert np.array_equal(frames["exact"], frames["eager"])
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(tmp_path / "x.npy")]
    result = runner.invoke(app, [*args, "--no-denormalize", "--mode", "turbo"])
    assert result.exit_code == 2 and "exact" in result.output
    assert not (tmp_path / "x.npy").exists()


def test_decode_devices_are_checked_before_the_vae_is_read(tmp_path, wan_folder):
    z = _latents(tmp_path / "z.pt")
    base = ["decode", z, "--vae", str(wan_folder), "-o", str(tmp_path / "x.npy")]
    result = runner.invoke(app, [*base, "--no-denormalize", "--devices", "cuda:0,cuda:1"])
    assert result.exit_code == 2 and "--mode exact" in result.output
    args = [*base, "--no-denormalize", "--mode", "exact", "--devices", "cuda:0,cuda:0"]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "twice" in result.output or "does not exist" in str(result.exception)
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("sync", [False, True])
def test_decode_several_files_back_to_back(tmp_path, wan_folder, sync):
    import numpy as np

    zs = [_latents(tmp_path / f"clip{i}.pt", seed=i) for i in range(3)]
    out = tmp_path / "out"
    out.mkdir()
    args = ["decode", *zs, "--vae", str(wan_folder), "-o", str(out), "--suffix", ".npy"]
    args += ["--device", "cpu", "--no-denormalize"]
    result = runner.invoke(app, args + (["--sync"] if sync else []))
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
    cmd.append("--no-denormalize")
    proc = subprocess.run(
        [sys.executable, "-m", "nostall.cli.main", *cmd], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert "b.pt" in proc.stdout and "channels" in proc.stdout and "Traceback" not in proc.stderr
    assert list(out.iterdir()) == []  # not even the good one was started


def test_decode_several_files_needs_an_output_folder(tmp_path, wan_folder):
    zs = [_latents(tmp_path / f"c{i}.pt") for i in range(2)]
    result = runner.invoke(
        app,
        ["decode", *zs, "--vae", str(wan_folder), "-o", str(tmp_path / "v.mp4"), "--denormalize"],
    )
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())  # rich wraps the message
    assert "must be an existing folder" in text


def test_decode_with_denormalize_decodes_the_denormalised_latents(tmp_path, wan_folder):
    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan

    from nostall.video import decode_to_file, denormalize

    z = _latents(tmp_path / "z.pt")
    out = tmp_path / "v.npy"
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--device", "cpu"]
    result = runner.invoke(app, [*args, "--denormalize"])
    assert result.exit_code == 0, result.output
    vae = AutoencoderKLWan.from_pretrained(wan_folder).eval()
    with torch.inference_mode():
        decode_to_file(vae, denormalize(vae, torch.load(z)), tmp_path / "ref.npy")
    assert np.array_equal(np.load(out), np.load(tmp_path / "ref.npy"))


# ---- one-line errors for bad options, checked before anything heavy -------------------


def _plain(output: str) -> str:
    return " ".join(output.replace("│", " ").split())  # rich wraps and boxes messages


def test_version():
    import nostall

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"nostall {nostall.__version__}"


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--dtype", "int8", "not a cast target"),
        ("--dtype", "fp7", "not a cast target"),
        ("--threads", "0", "--threads"),
        ("--threads", "-2", "--threads"),
        ("--read-mode", "foo", "unknown read mode 'foo'"),
        ("--pool-gb", "-1", "--pool-gb"),
    ],
)
def test_bad_load_options_are_usage_errors(ckpt_file, option, value, says):
    result = runner.invoke(app, ["load", str(ckpt_file), "--device", "cpu", option, value])
    assert result.exit_code == 2, result.output
    assert says in _plain(result.output)
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # click's usage error, nothing raised


def test_a_pool_beyond_the_machine_is_a_one_line_error(ckpt_file):
    cmd = ["load", str(ckpt_file), "--device", "cpu", "--pool-gb", str(10**6)]
    proc = subprocess.run(
        [sys.executable, "-m", "nostall.cli.main", *cmd], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--pool-gb" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_decode_requires_the_normalisation_choice(tmp_path, wan_folder):
    z = _latents(tmp_path / "z.pt")
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(tmp_path / "v.mp4")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    text = _plain(result.output)
    assert "--denormalize for latents a pipeline saved with output_type='latent'" in text
    assert "--no-denormalize" in text
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize(
    ("output", "extra", "says"),
    [
        ("v.avi", [], "unsupported output suffix '.avi'"),
        ("missing/v.mp4", [], "does not exist"),
        ("v.mp4", ["--crf", "60"], "crf must be a number in 0..51"),
        ("v.mp4", ["--fps", "0"], "fps must be positive"),
        ("v.mp4", ["--preset", "warp"], "unknown x264 preset 'warp'"),
        ("v.mp4", ["--dtype", "int8"], "not a cast target"),
    ],
)
def test_decode_checks_the_output_before_reading_the_vae(tmp_path, output, extra, says):
    z = _latents(tmp_path / "z.pt")
    no_vae = tmp_path / "no-such-vae"  # loading it would fail with a CheckpointError
    cmd = ["decode", z, "--vae", str(no_vae), "-o", str(tmp_path / output), "--denormalize"]
    proc = subprocess.run(
        [sys.executable, "-m", "nostall.cli.main", *cmd, *extra], capture_output=True, text=True
    )
    text = _plain(proc.stdout + proc.stderr)
    assert proc.returncode == 2, text
    assert says in text and "no-such-vae" not in text
    assert "Traceback" not in text


def test_bench_outputs_default_outside_docs():
    from typer.main import get_command

    bench = get_command(app).commands["bench"]
    for name, options in (("load", ("out",)), ("decode", ("out", "figure"))):
        params = {p.name: p for p in bench.commands[name].params}
        for option in options:
            assert params[option].default.startswith("bench-out/"), (name, option)
        assert params["overwrite"].default is False


@pytest.mark.parametrize("which", ["load", "decode"])
def test_bench_refuses_to_overwrite_a_report(tmp_path, which):
    out = tmp_path / "report.json"
    out.write_text("recorded")
    folder = tmp_path / "ckpt"
    args = ["bench", which, "--device", "cpu", "--out", str(out)]
    args += ["--preset", "tiny", "--folder", str(folder)] if which == "load" else ["--size", "tiny"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "already exists" in _plain(result.output) and "--overwrite" in result.output
    assert out.read_text() == "recorded"
    assert not folder.exists()  # refused before the benchmark started


def test_quantize_command_converts_and_refuses_bad_input(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "in.safetensors"
    save_file({"lin.weight": torch.randn(32, 16), "norm.weight": torch.ones(16)}, str(src))
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["quantize", str(src), str(out)])
    assert result.exit_code == 0, result.output
    assert "1 tensors → FP8, 1 kept" in result.output
    assert load_file(str(out))["lin.weight"].dtype == torch.float8_e4m3fn
    again = runner.invoke(app, ["quantize", str(src), str(out)])
    assert again.exit_code == 2 and "--overwrite" in again.output
    fp8 = runner.invoke(app, ["quantize", str(out), str(tmp_path / "x.safetensors")])
    assert fp8.exit_code != 0 and "already" in (fp8.output + str(fp8.exception))


def test_quantize_check_prints_sqnr_per_component(tmp_path):
    from nostall.synthetic import write_store

    flux = write_store(tmp_path / "store", ("flux",))["flux"]
    result = runner.invoke(app, ["quantize", flux, str(tmp_path / "fp8"), "--check"])
    assert result.exit_code == 0, result.output
    assert "SQNR" in result.output and "text_encoder_2" in result.output
    assert "random token ids" in result.output and "per layer only" in result.output


def test_index_hashes_a_store_once_and_says_what_is_shared(tmp_path):
    from nostall.synthetic import write_store
    from nostall.cache import Store

    write_store(tmp_path / "s", ("flux", "flux-b"))
    args = ["index", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "idx")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hashed" in result.output and "one copy: flux/text_encoder, flux-b/text_encoder" in (
        result.output.replace("\n", " ")
    )
    s = Store(tmp_path / "s", cache_dir=tmp_path / "idx")
    assert all(c.exact for n in ("flux", "flux-b") for c in s.entry(n).weights)
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "hashed 0.00 GB" in again.output  # nothing new
    bad = runner.invoke(app, [*args, "--name", "flx"])
    assert bad.exit_code != 0 and "did you mean 'flux'" in bad.output + str(bad.exception)
