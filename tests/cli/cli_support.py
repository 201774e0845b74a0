"""Running ``nostall`` in the CLI tests: in this process (``runner``) or as a process."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from support import CLI_MAIN

runner = CliRunner()


def plain(output: str) -> str:
    """``output`` on one line, without the boxes and wrapping rich adds to messages."""
    return " ".join(output.replace("│", " ").split())


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """``python -m nostall.cli ARGS`` in a new process, as a user runs ``nostall``."""
    return subprocess.run(
        [sys.executable, "-m", "nostall.cli", *args], capture_output=True, text=True, **kw
    )


def fork_cli(fork_python, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m nostall.cli ARGS`` as :func:`run_cli` runs it (a process of its own: its
    exit status, stdout and stderr), forked by the conftest's ``fork_python`` from a
    process that has imported torch and diffusers, so the imports cost it nothing."""
    p = fork_python(CLI_MAIN, *args, stderr=True)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(["nostall", *args], p.returncode, out, err)


def usage_error(result, *says: str) -> None:
    """``result`` (a runner result) is a usage error: exit 2, no exception raised past the
    command, and a message holding each of ``says``."""
    text = plain(result.output)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for s in says:
        assert s in text, (s, text)
