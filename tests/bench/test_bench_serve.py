"""``nostall bench serve`` on the CPU, tiny pipelines: the worker and embedding parts
(issue #11), the image check and the targets (every part of the real-size run at tiny
size: test_bench_serve_full.py, a module of its own so that another worker takes it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bench_support import FULL_TARGETS, TINY_TARGETS
from typer.testing import CliRunner

from nostall.cli import app

pytest.importorskip("fastapi")


@pytest.mark.slow
def test_tiny_serve_bench_runs_from_the_cli(tmp_path):
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(
        app,
        ["bench", "serve", "--device", "cpu", "--part", "worker", "--part", "embed",
         "--requests", "12", "--clients", "6", "--resolution", "32", "--steps", "2",
         "--embed-clients", "8", "--texts-each", "1", "--work", str(tmp_path), "--out", str(out)],
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
    assert set(t) == TINY_TARGETS | FULL_TARGETS
    assert t["worker_lost_or_mixed_up"]["met"] is True
    assert t["fleet_throughput_vs_one"]["met"] is None  # the fleet part did not run
    assert t["full_gpu_busy_share"]["met"] is None


def test_the_image_check_counts_a_swapped_image_and_refuses_alike_references():
    import base64
    import io

    from PIL import Image

    from nostall.bench import references

    rng = np.random.default_rng(0)
    refs = {("flux", s): rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for s in range(3)}

    def b64(img):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    near = np.clip(refs[("flux", 0)].astype(int) + 1, 0, 255).astype(np.uint8)  # a level off
    answers = [
        {"model": "flux", "seed": 0, "b64": b64(near)},
        {"model": "flux", "seed": 1, "b64": b64(refs[("flux", 2)])},  # another's image
        {"model": "sdxl", "seed": 2, "b64": b64(refs[("flux", 2)])},  # no reference
    ]
    got = references.check(answers, refs)
    assert got["checked"] is True and 0 < got["own_max"] <= 1.0
    assert [(w["model"], w["seed"]) for w in got["wrong"]] == [("flux", 1), ("sdxl", 2)]
    grey = {k: np.full((64, 64, 3), 128, np.uint8) for k in refs}
    assert references.check(answers, grey)["checked"] is False  # cannot tell: not passed
    assert references.check(answers, None)["checked"] is False


def test_a_failed_stream_part_leaves_the_targets_to_the_part_that_ran():
    from nostall.bench.serve import evaluate_targets, stream_targets_from

    ran = {"requests": 64, "lost_or_mixed_up": 0, "throughput_per_s": 2.0,
           "gpu_busy_share": 0.9, "p99_over_p50": 1.2}  # fmt: skip
    res = {"peer": {"throughput_per_s": 0.5}, "stream": ran,
           "stream-batched": {"error": "RuntimeError: uvicorn did not start"}}  # fmt: skip
    assert stream_targets_from(res) == "stream"
    t = evaluate_targets({"config": {}, "results": res})
    assert t["full_worker_lost_or_mixed_up"]["met"] is True
    assert t["full_throughput_vs_diffusers_worker"]["value"] == 4.0
    res["stream-batched"] = {**ran, "throughput_per_s": 3.0, "lost_or_mixed_up": 1}
    t = evaluate_targets({"config": {}, "results": res})
    assert t["full_throughput_vs_diffusers_worker"]["value"] == 6.0
    assert t["full_worker_lost_or_mixed_up"]["value"] == 1
