"""``nostall quantize``: the conversion and its check; under bad input and faults one clean
line, no traceback, and no output (final or partial) left behind."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from nostall.cli import app, main

from support import squashed

runner = CliRunner()


def test_quantize_command_converts_and_refuses_bad_input(tmp_path):
    from safetensors.torch import load_file

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


def test_quantize_check_prints_sqnr_per_component(tiny_store, tmp_path):
    flux = str(tiny_store / "flux")
    result = runner.invoke(app, ["quantize", flux, str(tmp_path / "fp8"), "--check"])
    assert result.exit_code == 0, result.output
    assert "SQNR" in result.output and "text_encoder_2" in result.output
    assert "random token ids" in result.output and "per layer only" in result.output


def _weights(rows=512):
    g = torch.Generator().manual_seed(0)
    return {
        "lin.weight": torch.randn(rows, 256, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(256),
    }


def _source(tmp_path, kind):
    """(input, output): a file, or a component folder; the FP8 output is 128 KiB + header."""
    if kind == "file":
        src = tmp_path / "in.safetensors"
        save_file(_weights(), str(src))
        return src, tmp_path / "out.safetensors"
    src = tmp_path / "in"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file(_weights(), str(src / "model.safetensors"))
    return src, tmp_path / "out"


def _left(tmp_path, *inputs):
    return sorted(set(os.listdir(tmp_path)) - set(inputs))


def test_an_invalid_skip_pattern_is_a_usage_error(tmp_path):
    src, out = _source(tmp_path, "file")
    result = runner.invoke(app, ["quantize", str(src), str(out), "--skip", "blocks.("])
    assert result.exit_code == 2, result.output
    assert "'blocks.('" in result.output and "missing )" in result.output
    assert _left(tmp_path, src.name) == []


def test_non_finite_weights_are_one_clean_line(tmp_path, monkeypatch, capsys):
    w = _weights(rows=32)
    w["lin.weight"][5, 7] = float("nan")
    src = tmp_path / "in.safetensors"
    save_file(w, str(src))
    monkeypatch.setattr(
        sys, "argv", ["nostall", "quantize", str(src), str(tmp_path / "o.safetensors")]
    )
    with pytest.raises(SystemExit) as e:
        main()
    text = capsys.readouterr()
    assert e.value.code == 2
    flat = squashed(text.out)
    assert "CheckpointError" in flat and squashed(str(src)) in flat and "'lin.weight'" in flat
    assert squashed("1 of 8192 values are not finite (1 NaN") in flat
    assert "Traceback" not in text.out + text.err
    assert _left(tmp_path, src.name) == []


def _start(fork_python, code: str, *argv: str):
    """``python -c code argv`` as a process of its own, forked by the conftest's fixture."""
    return fork_python(code, *argv, stderr=True)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_file_size_limit_is_a_clean_error_and_leaves_nothing(tmp_path, kind, fork_python):
    # RLIMIT_FSIZE makes write() fail with EFBIG (Python ignores SIGXFSZ), as a full
    # disk fails it with ENOSPC: the output needs 128 KiB, the limit allows 64.
    src, out = _source(tmp_path, kind)
    code = (
        "import resource, sys\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))\n"
        "from nostall.cli import main\n"
        "main()\n"
    )
    proc = _start(fork_python, code, "quantize", str(src), str(out))
    stdout, stderr = proc.communicate(timeout=120)
    flat = squashed(stdout)
    assert proc.returncode == 2, stdout + stderr
    assert "CheckpointError" in flat and squashed("File too large (EFBIG)") in flat
    assert os.path.basename("model.safetensors" if kind == "folder" else out.name) in flat
    assert "Traceback" not in stdout + stderr
    assert _left(tmp_path, src.name) == []


@pytest.mark.parametrize("kind", ["file", "folder"])
@pytest.mark.slow
def test_sigterm_mid_write_removes_the_partial_output_and_exits_143(tmp_path, kind, fork_python):
    src, out = _source(tmp_path, kind)
    partial = tmp_path / (out.name + ".partial")
    ready = tmp_path / "ready"
    script = tmp_path / "slow_quantize.py"
    # Holds the conversion mid-write (header written, a weight being converted) until the
    # signal comes; time.sleep returns early when the SIGTERM handler raises.
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from nostall.quant import convert

            real, ready = convert.quantize_weight, sys.argv[1]

            def slow(w):
                open(ready, "w").close()
                time.sleep(60)
                return real(w)

            convert.quantize_weight = slow
            from nostall.cli import main

            sys.argv = ["nostall", "quantize", *sys.argv[2:]]
            main()
            """
        )
    )
    proc = _start(fork_python, script.read_text(), str(ready), str(src), str(out))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the conversion never started"
            time.sleep(0.02)
        assert partial.exists() and not out.exists()  # mid-write
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr
    assert "stopped by SIGTERM" in stdout and "Traceback" not in stdout + stderr
    assert _left(tmp_path, src.name, script.name, ready.name) == []
