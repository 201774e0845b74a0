"""``nostall bench remote`` end to end on the CPU: a tiny FLUX transformer from rclone's
S3 server, nostall against the peers, and the shared host tier between two processes."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

from nostall.bench.remote import evaluate_targets, tables
from nostall.cli import app

pytest.importorskip("diffusers")
pytest.importorskip("boto3")

TARGETS = {
    "remote_vs_single_stream",
    "remote_vs_boto3",
    "remote_first_bytes_overlap",
    "shared_pool_second_process_gbps",
}


# ``python -m nostall.bench.remote ARGS`` (sys.argv[1:]) in a process forked by the
# conftest's ``fork_python``
_BENCH_MAIN = (
    "import runpy; runpy.run_module('nostall.bench.remote', run_name='__main__', alter_sys=True)"
)


def _forked_runs(monkeypatch, fork_python) -> None:
    """The shared part's two processes forked by ``fork_python``: each a process of its
    own (its pid, its mapping of the shared tier), without the seconds of CPU a new Python
    spends importing torch again."""
    from nostall.bench import remote

    def run(cmd, *, capture_output, text, timeout):
        assert cmd[:3] == [sys.executable, "-m", "nostall.bench.remote"], cmd
        assert capture_output and text
        p = fork_python(_BENCH_MAIN, *cmd[3:], stderr=True)
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    forked = types.SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(remote, "subprocess", forked)


@pytest.mark.slow
def test_tiny_remote_bench_runs_from_the_cli(tmp_path, monkeypatch, fork_python):
    monkeypatch.setenv("NOSTALL_SHM_DIR", str(tmp_path))
    _forked_runs(monkeypatch, fork_python)
    out = tmp_path / "remote.json"
    result = CliRunner().invoke(
        app,
        ["bench", "remote", "--size", "tiny", "--device", "cpu", "--connections", "4",
         "--single-cap-s", "0.5", "--work", str(tmp_path / "w"), "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    res = report["results"]
    for link in ("loopback", "throttled"):
        r = res[link]
        assert r["nostall"]["read_mode"] == "s3"
        assert 0 < r["nostall"]["nbytes"] <= report["object"]["nbytes"]  # tensors, files
        assert r["boto3"]["equal_to_nostall"] is True
        assert r["single"]["bytes"] > 0 and r["vs_boto3"] > 0
    shared = res["shared"]
    assert "error" not in shared, shared
    assert shared["first"]["scenario"] == "read"
    assert shared["second"]["scenario"] == "memory-cache hit"
    assert set(report["targets"]) == TARGETS
    assert report["targets"] == evaluate_targets(report)
    assert report["targets"]["shared_pool_second_process_gbps"]["value"] > 0
    assert tables(report)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("nostall-")]  # destroyed
