"""``nostall.cli.app`` (named apart from tests/serve/test_app.py): the entry point, the option
helpers, errors and warnings."""

from __future__ import annotations

import textwrap
from importlib.metadata import entry_points

import pytest
import typer
from cli_support import fork_cli, run_cli, runner

from nostall.cli import app
from nostall.cli.app import check_output, gigabytes, in_range, main, parse_dtype

from support import CLI_MAIN


def test_version():
    import nostall

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"nostall {nostall.__version__}"


def test_the_console_script_is_the_cli_main():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "nostall"]
    assert script.load() is main


def test_every_command_group_is_registered():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("demo", "synthetic", "load", "switch", "index", "quantize", "decode",
                    "serve", "fleet", "embed-server", "bench"):  # fmt: skip
        assert f" {command} " in result.output, command
    bench = runner.invoke(app, ["bench", "--help"])
    for command in ("load", "decode", "serve", "fp8", "switch"):
        assert f" {command} " in bench.output, command


def test_a_library_error_is_one_line_not_a_traceback(tmp_path, fork_python):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00")
    proc = fork_cli(fork_python, "load", str(bad), "--device", "cpu")
    assert proc.returncode == 2
    assert "CheckpointError" in proc.stdout and str(bad) in proc.stdout.replace("\n", "")
    assert "Traceback" not in proc.stdout + proc.stderr


def test_third_party_warnings_are_shown_once():
    # Two call sites: Python's default filter shows a warning once per line, not once.
    code = textwrap.dedent(
        """
        import logging, sys, warnings
        from nostall.cli.app import setup_logging

        setup_logging()
        def here(): warnings.warn("a library's deprecation", FutureWarning)
        def there(): warnings.warn("a library's deprecation", FutureWarning)
        for call in (here, there, here):
            call()
        for _ in range(3):
            logging.getLogger("somelib").warning("a library's notice")
        logging.getLogger("somelib").error("an error is never held back")
        logging.getLogger("somelib").error("an error is never held back")
        """
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("a library's deprecation") == 1, proc.stderr
    assert proc.stderr.count("a library's notice") == 1, proc.stderr
    assert proc.stderr.count("an error is never held back") == 2, proc.stderr


def test_parse_dtype_names_the_choices():
    import torch

    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float16") is torch.float16
    assert parse_dtype(None) is None
    with pytest.raises(typer.BadParameter, match=r"'int8' is not a cast target.*bf16, fp16"):
        parse_dtype("int8")


def test_check_output_refuses_folders_existing_files_and_files_as_folders(tmp_path):
    check_output(str(tmp_path / "new" / "report.json"), hint="--out", overwrite=False)
    with pytest.raises(typer.BadParameter, match="is a folder, but a file is written there"):
        check_output(str(tmp_path), hint="--out", overwrite=True)
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(typer.BadParameter, match="already exists; pass --overwrite"):
        check_output(str(tmp_path / "r.json"), hint="--out", overwrite=False)
    check_output(str(tmp_path / "r.json"), hint="--out", overwrite=True)
    with pytest.raises(typer.BadParameter, match="is a file, so"):
        check_output(str(tmp_path / "r.json" / "x.json"), hint="--out", overwrite=True)


def test_numbers_out_of_range_name_the_value_and_the_range():
    assert in_range(1, 65535)(8000) == 8000 and in_range(0)(None) is None
    with pytest.raises(
        typer.BadParameter, match=r"70000 is out of range; give a number in 1\.\.65535"
    ):
        in_range(1, 65535)(70000)
    with pytest.raises(typer.BadParameter, match="0 is out of range; give at least 1"):
        in_range(1)(0)
    assert gigabytes(None, "--gpu-gb") is None and gigabytes(0.5, "--gpu-gb") == 500_000_000
    with pytest.raises(typer.BadParameter, match="positive number of GB, got 0"):
        gigabytes(0, "--gpu-gb")


def test_python_m_nostall_cli_runs_the_command():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("nostall "), proc.stderr


@pytest.mark.slow
def test_sigterm_stops_a_command_as_ctrl_c_does_leaving_no_partial_file(
    tmp_path, wan_folder, fork_python
):
    import signal
    import subprocess
    import time

    import torch

    z = tmp_path / "z.pt"
    torch.save(torch.randn(1, 16, 21, 30, 52, generator=torch.Generator().manual_seed(0)), z)
    out = tmp_path / "out"
    out.mkdir()
    args = ["decode", str(z), "--vae", str(wan_folder), "-o", str(out / "clip.mp4")]
    args += ["--no-denormalize", "--device", "cpu"]
    # python -m nostall.cli, its stderr on its stdout, forked as fork_cli's are
    proc = fork_python(CLI_MAIN, *args, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not list(out.iterdir()):  # the writer opened its partial file: frames are flowing
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no partial file appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    said = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, said
    assert list(out.iterdir()) == [], said  # neither the partial file nor a final one
    assert "stopped by SIGTERM" in said and "Traceback" not in said, said
