"""``nostall bench serve`` on the CPU: every part of the real-size run (issue #18) at tiny
size: the diffusers peer, the stream alone and with the embedding service in-process and
as a process, the soak and the prefetch, run as two commands into one report (the worker
and embedding parts: test_bench_serve.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from bench_support import FULL_TARGETS, TINY_TARGETS
from typer.testing import CliRunner

from nostall.cli import app

from support import CLI_MAIN

pytest.importorskip("fastapi")

# ``python -m nostall.cli ARGS`` with its output in the log file named first
_LOGGED_CLI = (
    "import os, sys\n"
    "log = os.open(sys.argv.pop(1), os.O_WRONLY | os.O_APPEND)\n"
    "os.dup2(log, 1)\n"
    "os.dup2(log, 2)\n"
) + CLI_MAIN


@pytest.fixture
def forked_embed_server(monkeypatch, fork_python):
    """The ``stream-embed-process`` part's ``nostall embed-server`` forked by the conftest's
    ``fork_python``: a process of its own (its port, its signals, its log file) that does
    not spend ~10 s of CPU importing torch and transformers again."""
    from nostall.bench import serve_full

    def popen(cmd, *, stdout, stderr):
        assert cmd[:3] == [sys.executable, "-m", "nostall.cli"], cmd
        assert stderr == subprocess.STDOUT
        return fork_python(_LOGGED_CLI, stdout.name, *cmd[3:])

    forked = types.SimpleNamespace(
        Popen=popen, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired
    )
    monkeypatch.setattr(serve_full, "subprocess", forked)


def _serve(tmp_path, out, *parts, extra=()):
    args = ["bench", "serve", "--device", "cpu", "--requests", "4", "--clients", "3",
            "--resolution", "32", "--steps", "2", "--soak-s", "2", "--work",
            str(tmp_path / "work"), "--out", str(out), *extra]  # fmt: skip
    for p in parts:
        args += ["--part", p]
    return CliRunner().invoke(app, args)


@pytest.mark.slow
def test_every_part_of_the_real_size_run_works_at_tiny_size_in_two_commands(
    tmp_path, forked_embed_server
):
    out = tmp_path / "serve.json"
    first = _serve(tmp_path, out, "peer", "stream", "stream-batched", extra=["--batch", "3"])
    assert first.exit_code == 0, first.output
    report = json.loads(out.read_text())
    peer, stream = report["results"]["peer"], report["results"]["stream"]
    batched = report["results"]["stream-batched"]
    assert stream["batch"] == 1 and batched["batch"] == 3 and report["config"]["batch"] == 3
    assert batched["answered_200"] == 4 and batched["wrong_images"] == 0
    for r in (stream, batched):  # every request once in the per-pipeline summary
        assert sum(m["requests"] for m in r["by_model"].values()) == 4
        for m in r["by_model"].values():
            sizes = {int(k): n for k, n in m["requests_per_call"].items()}
            assert sum(k * n for k, n in sizes.items()) == m["requests"]
            assert m["median_s"]["denoise"] > 0
    assert set(stream["by_model"]["flux"]["requests_per_call"]) == {"1"}  # batch 1: alone
    assert peer["answered_200"] == 4 and peer["mode"] in ("to", "from_pretrained")
    assert set(peer["probe"]) == {"to", "from_pretrained", "faster"}
    assert peer["references"]["count"] == 4  # one image per request: the references
    assert stream["answered_200"] == 4 and stream["images"]["checked"] is True
    assert stream["wrong_images"] == 0 and stream["lost_or_mixed_up"] == 0
    assert stream["images"]["references_min"] > 5  # the seeds' images tell apart
    assert 0 < stream["gpu_busy_share"] <= 1 and stream["p99_over_p50"] >= 1
    assert report["targets"]["full_worker_lost_or_mixed_up"]["met"] is True
    ratio = report["targets"]["full_throughput_vs_diffusers_worker"]["value"]
    assert ratio == pytest.approx(batched["throughput_per_s"] / peer["throughput_per_s"])
    assert report["targets"]["full_gpu_busy_share"]["value"] == batched["gpu_busy_share"]

    # Two references swapped on disk: every later stream must find exactly those two wrong.
    refs = peer["references"]["folder"]
    a, b = sorted(f for f in os.listdir(refs) if f.endswith(".png"))[:2]
    os.rename(os.path.join(refs, a), os.path.join(refs, "swap"))
    os.rename(os.path.join(refs, b), os.path.join(refs, a))
    os.rename(os.path.join(refs, "swap"), os.path.join(refs, b))
    second = _serve(tmp_path, out, "stream-embed", "stream-embed-process", "soak", "prefetch",
                    extra=["--append"])  # fmt: skip
    assert second.exit_code == 0, second.output
    report = json.loads(out.read_text())
    res, t = report["results"], report["targets"]
    assert set(res) == {"peer", "stream", "stream-batched", "stream-embed",
                        "stream-embed-process", "soak", "prefetch"}  # fmt: skip
    assert set(t) == TINY_TARGETS | FULL_TARGETS
    for name in ("stream-embed", "stream-embed-process"):
        r = res[name]
        assert r["answered_200"] == 4 and r["mixed_up"] == 0 and r["texts_encoded"] > 0, r
        assert sorted(f"{w['model']}-{w['seed']}.png" for w in r["images"]["wrong"]) == [a, b]
        assert r["lost_or_mixed_up"] == 2
    assert res["stream-embed"]["embedding_service"] == "in-process"
    assert all(s == 200 for s in res["stream-embed-process"]["encoders_warmed"].values())
    assert t["full_worker_with_embed_lost_or_mixed_up"]["value"] == 4
    assert t["full_worker_with_embed_lost_or_mixed_up"]["met"] is False
    soak = res["soak"]
    assert soak["good"]["sent"] > 0 and soak["good"]["lost"] == 0, soak["good"]
    assert soak["bad_answered_5xx"] == 0 and soak["bad_answered_2xx"] == 0, soak["bad"]
    assert soak["unexpected"] == {}
    assert {"gpu_allocated", "host_pinned"} <= set(soak["memory"]["growth"])
    assert t["soak_good_requests_lost"]["met"] is True
    assert t["soak_memory_growth"]["value"] == soak["memory_growth"]
    assert res["prefetch"]["switch_size"] == "tiny" and "slowdown" in res["prefetch"]
    assert t["full_prefetch_inference_slowdown"]["value"] == res["prefetch"]["slowdown"]
    assert t["full_worker_lost_or_mixed_up"]["met"] is True  # kept from the first command

    # a run of another configuration is not added to this report
    other = _serve(tmp_path, out, "stream", extra=["--append", "--steps", "3"])
    assert other.exit_code == 2 and "cannot be added" in other.output
