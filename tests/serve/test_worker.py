"""The worker's queue on the CPU with tiny random pipelines: resident pipelines first within
the fairness bound, like requests batched into one pipeline call, and a 429's wait."""

from __future__ import annotations

import io
import math
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from nostall.errors import Cancelled, QueueFull
from nostall.serve.schedule import Policy

MB = 1 << 20


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.01)


def _body(model="flux", **kw):
    body = {"model": model, "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 0}
    if model == "flux":
        body["max_sequence_length"] = 16
    body.update(kw)
    return body


@pytest.fixture
def worker(store):
    """``worker(**kw)``: a started CPU worker over the tiny store; shut down after the test."""
    from nostall.serve.worker import Worker

    made = []

    def make(**kw):
        kw = {"device": "cpu", "gpu_budget": 64 * MB, "host_budget": 64 * MB,
              "prepare": False, **kw}  # fmt: skip
        w = Worker(store, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


@pytest.fixture
def gate(monkeypatch):
    """The first job of a test blocks in ``_image`` until ``gate.set()``; every model a
    single job ran for is appended to ``gate.ran``, every batch's size to ``gate.calls``."""
    from nostall.serve import runner as runner_mod

    event = threading.Event()
    event.ran, event.calls, event.started = [], [], threading.Event()
    event.seeds = []
    image, generate = runner_mod.Runner._image, runner_mod.Runner._generate

    def gated(self, job, start):
        event.ran.append(job.model)
        event.seeds.append(job.seed)
        if not event.started.is_set():
            event.started.set()
            assert event.wait(60)
        return image(self, job, start)

    def counted(self, pipe, job, embeds):
        event.calls.append(len(job) if isinstance(job, list) else 1)
        return generate(self, pipe, job, embeds)

    monkeypatch.setattr(runner_mod.Runner, "_image", gated)
    monkeypatch.setattr(runner_mod.Runner, "_generate", counted)
    return event


def _submit(w, **body):
    return w.submit(w.image_job(_body(**body)))


def _png(result) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(result.body)))


@pytest.mark.parametrize(
    "overtake, order",
    [
        (8, ["flux", "flux", "flux", "sdxl"]),  # flux is on the device: both go first
        (1, ["flux", "flux", "sdxl", "flux"]),  # sdxl may be overtaken once only
        (0, ["flux", "sdxl", "flux", "flux"]),  # arrival order
    ],
)
def test_a_resident_pipeline_runs_first_within_the_overtake_bound(worker, gate, overtake, order):
    # (no prefetch: it would make sdxl resident too, and then arrival order decides)
    w = worker(schedule=Policy(overtake=overtake), prefetch=False)
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    queued = [_submit(w, model="sdxl", seed=2), _submit(w, seed=3), _submit(w, seed=4)]
    gate.set()
    results = [f.result(120) for f, _ in [(first, None), *queued]]
    assert gate.ran == order
    by_order = sorted(results, key=lambda r: r.info["order"])
    seeds = {"flux": [1, 3, 4], "sdxl": [2]}  # each model's requests in arrival order
    assert [r.info["seed"] for r in by_order] == [seeds[m].pop(0) for m in order]
    assert gate.calls == [1, 1, 1, 1]  # batch=1 (the default): every job alone


def test_a_pushed_back_request_goes_next_once_the_delay_bound_is_spent(worker, gate):
    # No time to spare beyond arrival order: only an arrival-order run is allowed,
    # however resident flux is.
    w = worker(schedule=Policy(overtake=100, delay_s=0.0), prefetch=False)
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    queued = [_submit(w, model="sdxl", seed=2), _submit(w, seed=3)]
    gate.set()
    for f, _ in [(first, None), *queued]:
        f.result(120)
    assert gate.ran == ["flux", "sdxl", "flux"]


def test_like_requests_run_as_one_call_each_with_its_own_image(worker, gate, store):
    from diffusers import DiffusionPipeline

    w = worker(schedule=Policy(batch=4))
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    seeds = [11, 12, 13]
    queued = [_submit(w, seed=s, prompt=f"a cat number {s}") for s in seeds]
    other = _submit(w, seed=14, size="48x48")  # another shape: a call of its own
    gate.set()
    first.result(120)
    results = [f.result(120) for f, _ in queued]
    assert other[0].result(120).info["size"] == (48, 48)
    assert gate.calls == [1, 3, 1]
    assert [r.info["seed"] for r in results] == seeds
    assert [r.info["batch"] for r in results] == [3, 3, 3]
    assert len({r.info["order"] for r in results}) == 3
    # each image is its own request's: the pipeline alone, for that prompt and seed, gives
    # the same picture (batched float math may move a pixel by one level, no more)
    pipe = DiffusionPipeline.from_pretrained(str(store / "flux"))
    pipe.set_progress_bar_config(disable=True)
    kw = {"height": 32, "width": 32, "num_inference_steps": 2, "max_sequence_length": 16}
    alone = []
    for s in seeds:
        out = pipe(f"a cat number {s}", generator=torch.Generator().manual_seed(s), **kw)
        alone.append(np.asarray(out.images[0]))
    for i, r in enumerate(results):
        diffs = [np.abs(_png(r).astype(int) - a).max() for a in alone]
        assert diffs[i] <= 1, diffs
        assert all(d > 1 for j, d in enumerate(diffs) if j != i), diffs


def test_a_client_that_leaves_before_its_batch_starts_is_left_out(worker, gate):
    w = worker(schedule=Policy(batch=4))
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    queued = [_submit(w, seed=s) for s in (2, 3, 4)]
    queued[1][1].set()  # its client left
    gate.set()
    first.result(120)
    with pytest.raises(Cancelled):
        queued[1][0].result(120)
    kept = [queued[0][0].result(120), queued[2][0].result(120)]
    assert [r.info["seed"] for r in kept] == [2, 4] and gate.calls == [1, 2]


def test_a_failed_batch_runs_its_jobs_alone_and_after_oom_that_shape_stays_alone(
    worker, gate, monkeypatch
):
    from nostall.serve import runner as runner_mod

    failures = []

    def broken(self, jobs, start):
        failures.append(len(jobs))
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(runner_mod.Runner, "images", broken)
    w = worker(schedule=Policy(batch=4))
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    queued = [_submit(w, seed=s) for s in (2, 3)]
    gate.set()
    first.result(120)
    assert [f.result(120).info["seed"] for f, _ in queued] == [2, 3]  # one by one
    assert failures == [2] and gate.ran == ["flux"] * 3
    # that pipeline and shape are not batched again: the next like pair runs alone
    gate.started.clear()
    gate.clear()
    blocker, _ = _submit(w, seed=5)
    assert gate.started.wait(60)
    later = [_submit(w, seed=s) for s in (6, 7)]
    gate.set()
    blocker.result(120)
    assert [f.result(120).info["seed"] for f, _ in later] == [6, 7]
    assert failures == [2] and gate.ran == ["flux"] * 6


def test_a_full_queue_says_when_to_come_back(worker, gate):
    w = worker(max_queue=2)
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    queued = [_submit(w, seed=2), _submit(w, model="sdxl", seed=3)]
    with pytest.raises(QueueFull, match="retry in about") as e:
        _submit(w, seed=4)
    assert e.value.retry_after is not None and 0 < e.value.retry_after < 60
    assert w.status()["running"] == "flux" and w.status()["running_batch"] == 1
    gate.set()
    for f, _ in [(first, None), *queued]:
        f.result(120)


def test_the_wait_estimate_grows_with_the_work_queued(worker, gate):
    # after one measured flux run, a queue of more flux work is estimated to take longer
    w = worker(max_queue=4)
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    gate.set()
    first.result(120)
    gate.clear()
    gate.started.clear()
    waits = []
    blocker, _ = _submit(w, seed=2)
    assert gate.started.wait(60)
    queued = []
    for steps in (2, 20):
        while len(queued) < 4:
            try:
                queued.append(_submit(w, seed=10 + len(queued), steps=steps))
            except QueueFull:
                break
        with pytest.raises(QueueFull) as e:
            _submit(w, seed=99)
        waits.append(e.value.retry_after)
        if steps == 2:  # make room for the longer jobs: their clients leave
            for _, gone in queued:
                gone.set()
            queued = []
            gate.set()
            blocker.result(120)
            # the worker drops the tickets whose clients left when it next takes a batch
            _wait_for(lambda: not w.status()["queue"], "the cancelled tickets to be dropped")
            gate.clear()
            gate.started.clear()
            blocker, _ = _submit(w, seed=3)
            assert gate.started.wait(60)
    assert waits[1] > waits[0] > 0
    gate.set()
    for f, _ in [(blocker, None), *queued]:
        f.result(120)


def test_a_429_carries_retry_after_from_the_estimate(serve, gate):
    server, w = serve(max_queue=1, prepare=False)
    results: list[httpx.Response] = []

    def post(seed):
        results.append(httpx.post(f"{server.url}/v1/images/generations",
                                  json=_body(seed=seed), timeout=120))  # fmt: skip

    first = threading.Thread(target=post, args=(1,))
    first.start()
    assert gate.started.wait(60)
    second = threading.Thread(target=post, args=(2,))
    second.start()
    _wait_for(lambda: w.status()["queue"], "the second request to be queued")
    r = httpx.post(f"{server.url}/v1/images/generations", json=_body(seed=3), timeout=120)
    assert r.status_code == 429
    wait = r.json()["error"]["retry_after_s"]
    assert wait > 0 and r.headers["retry-after"] == str(max(1, math.ceil(wait)))
    gate.set()
    first.join(120)
    second.join(120)
    assert sorted(x.status_code for x in results) == [200, 200]


def test_the_next_batchs_pipeline_is_prefetched_once_however_many_ask(worker, gate):
    w = worker()
    first, _ = _submit(w, seed=1)
    assert gate.started.wait(60)
    queued = [_submit(w, model="sdxl", seed=s) for s in (2, 3, 4)]

    def prefetches():
        return [r for r in w.cache.reports if r.prefetch and r.pipeline == "sdxl"]

    _wait_for(prefetches, "the sdxl prefetch")
    gate.set()
    for f, _ in [(first, None), *queued]:
        f.result(120)
    assert len(prefetches()) == 1
    assert not [r for r in w.cache.reports if r.prefetch and r.pipeline == "flux"]


def _views_of(ptr: int) -> int:
    """Live tensors whose storage is the one at ``ptr``."""
    import gc

    import torch

    gc.collect()
    n = 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor):
            continue
        try:
            n += o.untyped_storage().data_ptr() == ptr
        except RuntimeError:  # a fake tensor an earlier torch.compile left: no storage
            continue
    return n


def test_a_stopped_worker_keeps_no_view_of_its_device_tier(store):
    """A benchmark (or a test) runs workers one after another in one process: the one
    before must give its device memory back. FastAPI keeps every endpoint it saw (a
    module-level cache), so the worker object outlives its app; its cache must not hold
    the modules whose weights view the tier."""
    import httpx

    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    def run() -> int:
        worker = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20)
        with BackgroundServer(create_app(worker)) as srv:
            for model in ("flux", "sdxl"):
                body = {"model": model, "prompt": "x", "size": "32x32", "steps": 1, "seed": 1}
                r = httpx.post(f"{srv.url}/v1/images/generations", json=body, timeout=300)
                assert r.status_code == 200, r.text
            stats = worker.cache.stats()
            assert stats.gpu_bytes > 0
            ptr = worker.cache.pipeline("flux").transformer.proj_out.weight.untyped_storage()
            return ptr.data_ptr()

    ptr = run()
    assert _views_of(ptr) == 0


def test_a_shutdown_that_cannot_wait_closes_the_cache_once_the_running_job_ends(worker, gate):
    """A job that reaches no denoising step within the shutdown's time keeps the cache
    open under it; the cache is closed, and the budget given back, as that job ends."""
    from nostall.errors import ShuttingDown

    w = worker(prefetch=False)
    running, _ = _submit(w, seed=1)
    assert gate.started.wait(60)  # held before its pipeline call: no step to stop at
    queued, _ = _submit(w, seed=2)
    w.shutdown(timeout=0.2)
    assert isinstance(queued.exception(10), ShuttingDown)  # the queue failed at once
    assert not w.cache._closed and "model cache" in w.budget.status()["claims"]
    gate.set()
    stopped = running.exception(60)  # at its first step, the cache still open under it
    assert isinstance(stopped, ShuttingDown) and "stopped after" in str(stopped), stopped
    _wait_for(lambda: w.cache._closed, "the cache closed as the running job ended", 30)
    _wait_for(lambda: w.closed, "the rest closed after it", 30)
    claims = w.budget.status()["claims"]
    assert "model cache" not in claims and "LoRA base copies" not in claims


@pytest.mark.parametrize(
    ("slo", "says"),
    [(0, "slo_ms: 0"), (-5.0, "slo_ms: -5.0"), (math.inf, "slo_ms: inf"), (1e12, "slo_ms: ")],
)
def test_a_bad_slo_is_refused_naming_the_field(worker, slo, says):
    from nostall.errors import ArgumentError

    w = worker()
    with pytest.raises(ArgumentError, match=says) as e:
        w.image_job(_body(slo_ms=slo))
    assert e.value.field == "slo_ms"
    with pytest.raises(ArgumentError, match="slo_ms"):
        w.image_job(_body(slo_ms="100"))  # a string is not milliseconds
    assert w.image_job(_body(slo_ms=250)).slo_s == 0.25


def test_a_request_whose_slo_cannot_be_met_is_refused_and_one_that_can_goes_first(worker, gate):
    w = worker(max_queue=8)
    first, _ = _submit(w, seed=1)  # measured: the estimates are this machine's from now on
    assert gate.started.wait(60)
    gate.set()
    first.result(120)
    gate.clear()
    gate.started.clear()
    blocker, _ = _submit(w, seed=2)
    assert gate.started.wait(60)
    plain = [_submit(w, seed=s) for s in (3, 4, 5)]
    # an hour is far enough to be met, close enough to go before the jobs without an SLO
    urgent, _ = _submit(w, seed=6, slo_ms=3.6e6)
    with pytest.raises(QueueFull, match=r"after its slo_ms \(1 ms\)") as e:
        _submit(w, seed=7, slo_ms=1)
    assert e.value.retry_after > 0
    assert len(w.status()["queue"]) == 4  # the refused one was never queued
    gate.set()
    for f, _ in [(blocker, None), *plain, (urgent, None)]:
        f.result(120)
    assert gate.seeds == [1, 2, 6, 3, 4, 5]


def test_the_status_tells_a_router_each_models_switch_price_and_the_wait(worker, gate):
    w = worker(max_queue=8)
    before = w.status()
    assert before["switch_s"]["flux"] > 0 and before["queue_by_model"] == {}
    gate.set()
    _submit(w, seed=1)[0].result(120)  # flux is on the device now
    gate.clear()
    gate.started.clear()
    first, _ = _submit(w, seed=2)
    assert gate.started.wait(60)  # held before its switch (none needed)
    queued = [_submit(w, seed=3), _submit(w, model="sdxl", seed=4), _submit(w, seed=5)]
    running = w.status()
    assert running["queue_by_model"] == {"flux": 2, "sdxl": 1}
    assert running["estimated_wait_s"] > 0
    assert running["switch_s"]["flux"] == 0.0  # on the device: a switch moves nothing
    assert running["switch_s"]["sdxl"] > 0
    assert set(running["tier_rates_gbps"]) == {"host", "disk"}
    gate.set()
    for f, _ in [(first, None), *queued]:
        f.result(120)
    after = w.status()
    assert after["estimated_wait_s"] == 0.0 and after["queue_by_model"] == {}


def test_a_pipeline_larger_than_the_gpu_tier_is_served_streamed_the_same_image(store):
    """Issue #32: a worker whose device tier cannot hold SDXL whole serves it with its
    UNet resident in part (a pipeline it once refused to start with)."""
    from nostall.cache.partial import least_pipeline_bytes
    from nostall.errors import BudgetExceeded
    from nostall.serve.worker import Worker

    models = {"sdxl": store / "sdxl"}
    whole = Worker(models, device="cpu", prepare=False).start()
    try:
        ref = _png(_submit(whole, model="sdxl")[0].result(60))
        need = whole.cache.stats().gpu_bytes
        least = least_pipeline_bytes(whole.cache, "sdxl")
    finally:
        whole.shutdown()
    assert least is not None and least < need
    tight = Worker(models, device="cpu", gpu_budget=(least + need) // 2, prepare=False).start()
    try:
        for _ in range(2):
            result = _submit(tight, model="sdxl")[0].result(60)
            np.testing.assert_array_equal(_png(result), ref)
        unet = next(c for c in result.switch["components"] if c["role"] == "unet")
        assert unet["streamed"] > 0 and unet["tier"] == "device"  # resident, in part
        assert any(c.streamed for r in tight.cache.reports for c in r.components)
    finally:
        tight.shutdown()
    with pytest.raises(BudgetExceeded, match="can never hold"):
        Worker(models, device="cpu", gpu_budget=least // 2, prepare=False).start()
