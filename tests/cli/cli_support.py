"""Running ``nostall`` in the CLI tests: in this process (``runner``) or as a process."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

runner = CliRunner()


def plain(output: str) -> str:
    """``output`` on one line, without the boxes and wrapping rich adds to messages."""
    return " ".join(output.replace("│", " ").split())


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """``python -m nostall.cli ARGS`` in a new process, as a user runs ``nostall``."""
    return subprocess.run(
        [sys.executable, "-m", "nostall.cli", *args], capture_output=True, text=True, **kw
    )


def usage_error(result, *says: str) -> None:
    """``result`` (a runner result) is a usage error: exit 2, no exception raised past the
    command, and a message holding each of ``says``."""
    text = plain(result.output)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for s in says:
        assert s in text, (s, text)
