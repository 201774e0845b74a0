"""``nostall bench serve`` on the CPU, tiny pipelines: the worker and embedding parts
(issue #11), and every part of the real-size run (issue #18) at tiny size: the diffusers
peer, the stream alone and with the embedding service in-process and as a process, the
soak and the prefetch, run as two commands into one report."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from nostall.cli import app

pytest.importorskip("fastapi")

FULL_TARGETS = {
    "full_worker_lost_or_mixed_up",
    "full_worker_with_embed_lost_or_mixed_up",
    "full_throughput_vs_diffusers_worker",
    "full_gpu_busy_share",
    "full_p99_over_p50",
    "full_prefetch_inference_slowdown",
    "soak_good_requests_lost",
    "soak_memory_growth",
}
TINY_TARGETS = {
    "worker_lost_or_mixed_up",
    "worker_warm_switches_from_memory_share",
    "fleet_warm_on_holding_worker_share",
    "fleet_throughput_vs_one",
    "embed_batching_speedup",
    "embed_cache_hit_ms",
}


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


def _serve(tmp_path, out, *parts, extra=()):
    args = ["bench", "serve", "--device", "cpu", "--requests", "4", "--clients", "3",
            "--resolution", "32", "--steps", "2", "--soak-s", "2", "--work",
            str(tmp_path / "work"), "--out", str(out), *extra]  # fmt: skip
    for p in parts:
        args += ["--part", p]
    return CliRunner().invoke(app, args)


@pytest.mark.slow
def test_every_part_of_the_real_size_run_works_at_tiny_size_in_two_commands(tmp_path):
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
