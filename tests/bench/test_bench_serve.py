"""``nostall bench serve`` on the CPU: the worker and embedding parts, tiny pipelines."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nostall.cli import app

pytest.importorskip("fastapi")


def test_tiny_serve_bench_runs_from_the_cli(tmp_path):
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(
        app,
        ["bench", "serve", "--device", "cpu", "--part", "worker", "--part", "embed",
         "--requests", "12", "--clients", "6", "--size", "32", "--steps", "2",
         "--texts-each", "1", "--work", str(tmp_path), "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    w = report["results"]["worker"]
    assert w["answered_200"] == 12 and w["mixed_up"] == 0 and w["lost_or_failed"] == 0
    assert w["rejected_429_retried"] > 0  # 6 clients, a queue of 3: 429s, honoured
    assert w["warm_switches_from_memory_share"] == 1.0, w["warm_switches_not_from_memory"]
    we = w["with_embedding_service"]  # the same stream, prompts encoded by the service
    assert we["answered_200"] == 12 and we["mixed_up"] == 0 and we["texts_encoded"] > 0
    assert 0 < we["moved_bytes_per_request"] < w["moved_bytes_per_request"]  # no encoders
    e = report["results"]["embed"]
    assert e["batched"]["batches"] < e["one_at_a_time"]["batches"]
    assert 0 < e["cache_hit_ms_p50"] < 1000
    t = report["targets"]
    assert t["worker_lost_or_mixed_up"]["met"] is True
    assert t["fleet_throughput_vs_one"]["met"] is None  # the fleet part did not run
