"""Step-level preemption through real HTTP (issue #31): a long FLUX job paused at a
denoising step for a short SDXL job with an SLO it would otherwise miss; the long one's
image equals the same request run straight through; off, the short one waits."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from nostall.serve.app import create_app
from nostall.serve.local import BackgroundServer as Server
from nostall.serve.worker import Worker


def _body(model, seed, steps, side, slo_ms=None):
    body = {"model": model, "prompt": "x", "size": f"{side}x{side}", "steps": steps, "seed": seed}
    if model.startswith("flux"):
        body["max_sequence_length"] = 16
    if slo_ms is not None:
        body["slo_ms"] = slo_ms
    return body


def _send(url, body):
    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    return r, time.perf_counter() - t


def _post(url, body):
    r, seconds = _send(url, body)
    assert r.status_code == 200, r.text
    return r.json(), seconds


def _warm(url, short_model="sdxl") -> tuple[float, int]:
    """Both pipelines warm and their estimates learned: the short job's SLO and the long
    job's steps (~15 SLOs)."""
    for _ in range(2):  # the second of each: warm
        _, flux_4 = _post(url, _body("flux", 1, 4, 128))
        _, short = _post(url, _body(short_model, 1, 2, 32))
    slo_s = max(0.3, 4 * short)  # on time only if it need not wait for the long job
    return slo_s, min(150, max(40, int(15 * slo_s / (flux_4 / 4))))


def _race(store, preempt: bool, short_model="sdxl", short_store=None, **options):
    """Warm both pipelines, then the long FLUX job straight, then again with a short job
    (SDXL) sent while it runs; everything measured. ``short_store``: the folder holding
    the short job's pipeline, when it is not ``store``'s (the worker serves the two)."""
    if short_store is not None:
        store = {"flux": store / "flux", short_model: short_store / short_model}
    worker = Worker(store, device="cpu", max_queue=8, preempt=preempt, **options)
    with Server(create_app(worker)) as srv:
        slo_s, steps = _warm(srv.url, short_model)
        straight, _ = _post(srv.url, _body("flux", 7, steps, 128))
        got = {}
        long = threading.Thread(
            target=lambda: got.update(long=_post(srv.url, _body("flux", 7, steps, 128)))
        )
        long.start()
        while worker.status()["running"] is None:  # it began
            time.sleep(0.01)
        time.sleep(0.1)
        short = _body(short_model, 3, 2, 32, slo_ms=int(slo_s * 1000))
        answer, latency = _send(srv.url, short)
        long.join()
        status = worker.status()
    return straight, got["long"], answer, latency, slo_s, status


@pytest.mark.slow
@pytest.mark.parametrize(
    "short_model, options",
    [
        # (beside the paused FLUX pipeline, an SDXL preemptor: the catalog CLI test's
        # preemption part, tests/bench/test_bench_catalog.py; the suite's time)
        # a device tier of one tiny FLUX pipeline: flux-b's own weights cannot sit beside
        # flux's, which is parked (leaves, and comes back into the paused call's modules)
        ("flux-b", {"gpu_budget": 800 << 10}),
    ],
    ids=["parked"],
)
def test_a_preempted_image_equals_the_straight_one_and_the_short_job_meets_its_slo(
    store, short_model, options, tmp_path
):
    short_store = None
    if short_model != "sdxl":  # (a budget this tight serves the two alone)
        from nostall.synthetic import write_store

        write_store(tmp_path, (short_model,))
        short_store = tmp_path
    straight, (paused, long_s), r, short_s, slo_s, status = _race(
        store, True, short_model, short_store, **options
    )
    assert r.status_code == 200, r.text  # admitted: it can preempt
    short = r.json()
    by = paused["nostall"]["preempted_by"]
    assert [b["model"] for b in by] == [short_model] and by[0]["at_step"] >= 1
    assert by[0]["parked"] is bool(options)
    assert short_s <= slo_s < long_s  # answered within its SLO, while the long one ran
    assert paused["data"][0]["b64_json"] == straight["data"][0]["b64_json"]  # bit for bit
    phases = paused["nostall"]["phases"]
    assert phases["preempted"] == pytest.approx(by[0]["seconds"])
    assert status["preemptions"] == 1
    assert short["nostall"]["order"] < paused["nostall"]["order"]  # it finished first


@pytest.mark.slow
def test_with_preemption_off_the_short_job_is_refused_at_once_as_it_would_be_late(store):
    straight, (paused, _long_s), r, short_s, slo_s, status = _race(store, preempt=False)
    assert r.status_code == 429 and float(r.headers["retry-after"]) > 0
    assert short_s < slo_s  # at once, not after waiting
    assert "preempted_by" not in paused["nostall"] and status["preemptions"] == 0
    assert paused["data"][0]["b64_json"] == straight["data"][0]["b64_json"]


@pytest.mark.slow
def test_a_paused_job_whose_client_left_is_dropped_at_its_next_step(store):
    from nostall.errors import Cancelled

    worker = Worker(store, device="cpu", max_queue=8)
    with Server(create_app(worker)) as srv:
        slo_s, steps = _warm(srv.url)
        future, left = worker.submit(worker.image_job(_body("flux", 7, steps, 128)))
        while worker.status()["running"] is None:
            time.sleep(0.01)
        time.sleep(0.1)
        r, _ = _send(srv.url, _body("sdxl", 3, 2, 32, slo_ms=int(slo_s * 1000)))
        assert r.status_code == 200 and worker.status()["preemptions"] == 1
        left.set()  # the long job's client goes away while it runs on
        with pytest.raises(Cancelled, match="went away"):
            future.result(timeout=120)
        assert worker.status()["running"] is None


@pytest.mark.slow
def test_a_drain_while_a_job_is_paused_ends_both_cleanly(store):
    from nostall.errors import ShuttingDown

    worker = Worker(store, device="cpu", max_queue=8)
    with Server(create_app(worker)) as srv:
        _, steps = _warm(srv.url)
        estimate = worker._lineup.schedule.run_estimate
        for _attempt in range(3):  # (a loaded machine can end the long job first: again)
            long, _ = worker.submit(worker.image_job(_body("flux", 7, steps, 128)))
            while worker.status()["running"] is None:
                time.sleep(0.01)
            time.sleep(0.1)
            # the preempting job is long itself, a sixth of the long one by the worker's
            # own estimates, its SLO twice its estimate (on time if it runs now, late
            # behind the long one): the drain comes while it runs inside the paused one
            long_s = estimate("flux", 128 * 128 * steps / 1e6)
            n = min(150, max(4, int(long_s / 6 / estimate("sdxl", 32 * 32 / 1e6))))
            slo_ms = int(2000 * estimate("sdxl", 32 * 32 * n / 1e6))
            short, _ = worker.submit(worker.image_job(_body("sdxl", 3, n, 32, slo_ms=slo_ms)))
            while not worker.preemption._inside and not long.done():
                time.sleep(0.005)
            if worker.preemption._inside:
                break
            short.result(timeout=60)
        else:
            pytest.fail("three long jobs ended without a pause for the short one")
        done = threading.Event()
        # (a grace short beside the short job's run: its cut comes while it runs; at 0.4 s
        # a short job already half done could finish inside it, as it once did)
        worker.drain(0.04, on_done=done.set)
        assert done.wait(60)
        for future in (short, long):  # each stopped at its next step, neither left hanging
            with pytest.raises(ShuttingDown):
                future.result(timeout=60)
        assert worker.status()["running"] is None
