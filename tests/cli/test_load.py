"""``nostall load``: phases printed, options checked before anything is read."""

from __future__ import annotations

import json

import pytest
from cli_support import fork_cli, plain, runner, usage_error

from nostall.cli import app


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


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--dtype", "int8", "'int8' is not a cast target; use one of bf16, fp16"),
        ("--dtype", "fp7", "'fp7' is not a cast target"),
        ("--threads", "0", "Invalid value for '--threads': 0 is out of range; give at least 1"),
        ("--threads", "-2", "-2 is out of range"),
        ("--read-mode", "foo", "--read-mode: read_mode='foo'; choose one of 'auto'"),
        ("--pool-gb", "-1", "Invalid value for '--pool-gb': -1.0 is out of range"),
        ("--device", "tpu", "Invalid value for '--device': 'tpu' is not a device"),
    ],
)
def test_bad_load_options_are_usage_errors(ckpt_file, option, value, says):
    result = runner.invoke(app, ["load", str(ckpt_file), option, value])
    usage_error(result, says)


def test_a_pool_beyond_the_machine_is_a_one_line_error(ckpt_file, fork_python):
    args = ["load", str(ckpt_file), "--device", "cpu", "--pool-gb", str(10**6)]
    proc = fork_cli(fork_python, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--pool-gb" in plain(proc.stdout + proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_load_reads_a_bucket_and_keeps_the_disk_tier(ckpt_file, s3_env, tmp_path):
    import os
    import shutil

    os.makedirs(f"{s3_env.root}/cli", exist_ok=True)
    shutil.copyfile(ckpt_file, f"{s3_env.root}/cli/model.safetensors")
    args = ["load", "s3://cli/model.safetensors", "--device", "cpu", "--json"]
    result = runner.invoke(app, [*args, "--cache-dir", str(tmp_path / "c"), "--connections", "4"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["read_mode"] == "s3"
    assert next((tmp_path / "c").rglob("model.safetensors")).read_bytes() == ckpt_file.read_bytes()
    missing = runner.invoke(app, ["load", "s3://cli/absent.safetensors", "--device", "cpu"])
    assert missing.exit_code != 0
    assert "no objects under absent.safetensors/ in bucket 'cli'" in str(missing.exception)
