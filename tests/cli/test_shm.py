"""``nostall shm ls`` and ``nostall shm rm`` on a folder of segments held by another process."""

from __future__ import annotations

import contextlib
import os
import re

import pytest
from cli_support import fork_cli, plain, runner, usage_error

from nostall.cli import app

# Another process holding the segment "t" open until its stdin closes.
_HOLDER = """
import sys
from nostall.memory import SharedPool
pool = SharedPool("t", 8 << 20, root=sys.argv[1], keep=sys.argv[2] == "keep")
pool.allocate(1, key="k").release()
print("ready", flush=True)
sys.stdin.read()
pool.close()
"""


@contextlib.contextmanager
def holder(fork_python, root, keep=True):
    """The holder, a process forked by ``fork_python`` (the conftest's fixture)."""
    p = fork_python(_HOLDER, str(root), "keep" if keep else "-")
    try:
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.stdin.close()
        assert p.wait(30) == 0
        p.stdout.close()


def _files(root) -> list[str]:
    return sorted(os.listdir(root))


def test_ls_shows_a_live_segment_and_the_process_holding_it(tmp_path, fork_python):
    with holder(fork_python, tmp_path, keep=False) as p:
        result = runner.invoke(app, ["shm", "ls", "--root", str(tmp_path)])
        assert result.exit_code == 0, result.output
        text = plain(result.output)
        # name, size, in RAM, entries, pid, kept
        assert re.search(rf"\bt 8\.4 MB [0-9.]+ MB 1 {p.pid} no\b", text), text
    after = runner.invoke(app, ["shm", "ls", "--root", str(tmp_path)])
    assert after.exit_code == 0 and "no shared pool segments" in after.output  # the holder left


def test_rm_refuses_a_segment_in_use_and_removes_it_once_free(tmp_path, fork_python):
    args = ["shm", "rm", "t", "--root", str(tmp_path)]
    with holder(fork_python, tmp_path) as p:
        busy = runner.invoke(app, args)
        assert busy.exit_code == 2 and "Traceback" not in busy.output
        assert f"is open in process(es) {p.pid}-" in plain(busy.output)
        assert "--force" in busy.output
        assert _files(tmp_path)  # nothing removed
    # Kept: the segment outlived its holder, until removed.
    assert "t" in runner.invoke(app, ["shm", "ls", "--root", str(tmp_path)]).output
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "removed the shared pool segment 't'" in done.output and _files(tmp_path) == []
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "no shared pool segment 't'" in again.output


def test_rm_force_removes_a_segment_in_use(tmp_path, fork_python):
    with holder(fork_python, tmp_path):
        result = runner.invoke(app, ["shm", "rm", "t", "--root", str(tmp_path), "--force"])
        assert result.exit_code == 0, result.output
        assert _files(tmp_path) == []
    # The holder's close afterwards still exited 0 (holder() checks it), and left nothing.
    assert _files(tmp_path) == []


@pytest.mark.slow
def test_the_command_refuses_without_a_traceback(tmp_path, fork_python):
    with holder(fork_python, tmp_path) as p:
        result = fork_cli(fork_python, "shm", "rm", "t", "--root", str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        assert str(p.pid) in plain(result.stdout)
    assert runner.invoke(app, ["shm", "rm", "t", "--root", str(tmp_path)]).exit_code == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["rm", "a/b"], "Invalid value for NAME: shared pool name 'a/b'"),
        (["rm", "t", "--root", "/nonexistent-root"], "is not a folder"),
        (["ls", "--root", "/nonexistent-root"], "is not a folder"),
    ],
)
def test_bad_names_and_roots_are_usage_errors(tmp_path, args, says):
    usage_error(runner.invoke(app, ["shm", *args]), says)


def test_keep_marks_a_segment_to_outlive_its_last_worker_and_off_unmarks_it(tmp_path, fork_python):
    result = runner.invoke(app, ["shm", "keep", "t", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output  # before any worker made it
    with holder(fork_python, tmp_path, keep=False):
        pass
    assert any(f.startswith("nostall-") and f.endswith("-t") for f in _files(tmp_path))
    ls = plain(runner.invoke(app, ["shm", "ls", "--root", str(tmp_path)]).output)
    assert re.search(r"\bt 8\.4 MB .* - yes\b", ls), ls
    off = runner.invoke(app, ["shm", "keep", "t", "--off", "--root", str(tmp_path)])
    assert off.exit_code == 0, off.output
    with holder(fork_python, tmp_path, keep=False):
        pass
    assert _files(tmp_path) == []  # its last worker removed it this time
