"""The device budget: the account (made-up numbers), measured and remembered activation
peaks, and the worker living by it: out-of-memory jobs retried once then 503, start-up
refusal of what can never fit, broken folders left out, one log line per job."""

from __future__ import annotations

import functools
import json
import logging
import shutil
import warnings

import httpx
import pytest
import torch

from nostall.cache.host import cpu_tier_bytes
from nostall.errors import ArgumentError, BudgetExceeded, NostallError
from nostall.serve.budget import (
    MIN_RESERVE,
    PEAKS_FILE,
    DeviceBudget,
    DeviceMemory,
    device_bytes,
    is_out_of_memory,
)

GB = 10**9


class FakeMemory(DeviceMemory):
    """A GPU of made-up numbers: the test sets what is allocated and the peak."""

    def __init__(self, *, free: int = 100 * GB, allocated: int | None = 0):
        super().__init__(torch.device("cpu"))
        self.cuda = True  # a GPU's rules (the reserve's floor); nothing here asks torch.cuda
        self._free = free
        self.now = allocated
        self.top = allocated
        self.releases = 0

    @property
    def name(self) -> str:
        return "Fake GPU"

    def free(self) -> int:
        return self._free

    def unreserved(self) -> int:
        return self._free

    def allocated(self) -> int | None:
        return self.now

    def peak(self) -> int | None:
        return self.top

    def reset_peak(self) -> None:
        self.top = self.now

    def release(self) -> None:
        self.releases += 1


def _budget(tmp_path=None, **kw) -> DeviceBudget:
    kw.setdefault("memory", FakeMemory())
    return DeviceBudget("cpu", cache_dir=tmp_path if tmp_path is not None else False, **kw)


# ---- the account ---------------------------------------------------------------------


def test_the_account_adds_up_and_each_claim_is_checked():
    b = _budget(total=100 * GB, external=10 * GB, reserve=5 * GB)
    assert b.claim("embedding service", 20 * GB) == 20 * GB
    assert b.claim_rest("model cache") == 65 * GB
    assert b.left == 0
    with pytest.raises(BudgetExceeded) as e:
        b.claim("decode scratch", 1)
    message = str(e.value)
    for part in ("100.00 GB free", "10.00 GB declared", "5.00 GB activation reserve",
                 "20.00 GB embedding service", "65.00 GB model cache"):  # fmt: skip
        assert part in message
    assert e.value.requested == 1 and e.value.budget == 100 * GB
    with pytest.raises(ArgumentError, match=r"holds 65\.00 GB"):
        b.claim("model cache", 1)  # one model cache per budget
    b.release("model cache")
    assert b.left == 65 * GB and b.claims() == {"embedding service": 20 * GB}
    with pytest.raises(ArgumentError):
        b.claim("x", -1)


def test_a_budget_that_leaves_nothing_refuses_at_once():
    with pytest.raises(BudgetExceeded, match="nothing of cpu is left"):
        _budget(total=10 * GB, external=6 * GB, reserve=4 * GB)
    with pytest.raises(ArgumentError, match="external"):
        _budget(total=10 * GB, external=-1)


def test_the_default_total_is_the_free_memory_and_the_reserve_a_floor():
    b = _budget(memory=FakeMemory(free=80 * GB))
    assert b.total == 80 * GB and b.reserve == 8 * GB  # 10% of it
    small = _budget(memory=FakeMemory(free=10 * GB))
    assert small.reserve == MIN_RESERVE
    cpu = DeviceBudget("cpu", total=4 * GB, cache_dir=False)
    assert cpu.reserve == 0 and cpu.status()["kind"] == "cpu"  # activations use the rest


# ---- activation peaks ------------------------------------------------------------------


def test_a_peak_is_measured_above_what_the_block_started_and_ended_with():
    mem = FakeMemory(allocated=30 * GB)
    b = _budget(total=100 * GB, memory=mem)
    with b.measure("flux", "512x512 b1"):
        mem.top = 36 * GB  # activations came and went
        mem.now = 31 * GB  # and 1 GB stayed (a module's buffers): not an activation
    assert b.peak("flux", "512x512 b1") == 5 * GB
    with b.measure("flux", "512x512 b1"):
        mem.top = 33 * GB
    assert b.peak("flux", "512x512 b1") == 5 * GB  # the larger stays
    with pytest.raises(ValueError), b.measure("sdxl", "64x64 b1"):
        mem.top = 40 * GB
        raise ValueError("the pipeline refused the size")
    assert b.peak("sdxl", "64x64 b1") is None  # not a measurement
    with pytest.raises(torch.OutOfMemoryError), b.measure("sdxl", "2048x2048 b1"):
        mem.top = 50 * GB
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    assert b.peak("sdxl", "2048x2048 b1") == 50 * GB - 31 * GB  # at least what it reached
    # without an allocator to ask (a CPU), nothing is measured
    cpu = DeviceBudget("cpu", total=4 * GB, cache_dir=False)
    with cpu.measure("flux", "32x32 b1"):
        pass
    assert cpu.peak("flux", "32x32 b1") is None


def test_before_a_job_cached_memory_is_given_back_when_its_known_peak_is_not_free():
    mem = FakeMemory(free=100 * GB, allocated=0)
    b = _budget(total=100 * GB, memory=mem)
    b.record("flux", "1024x1024 b1", 6 * GB)
    with b.measure("flux", "1024x1024 b1"):
        pass
    assert mem.releases == 0
    mem._free = 4 * GB
    with b.measure("flux", "1024x1024 b1"):
        pass
    assert mem.releases == 1


def test_peaks_are_remembered_and_size_the_next_reserve(tmp_path, caplog):
    b = _budget(tmp_path, total=100 * GB, reserve=10 * GB)
    with caplog.at_level(logging.WARNING, logger="nostall.serve.budget"):
        b.record("flux", "1024x1024 b1", 12 * GB)
        b.record("flux", "1024x1024 b1", 13 * GB)  # above the reserve again: said once
        b.record("sdxl", "1024x1024 b1", 4 * GB)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "flux at 1024x1024 b1 peaked at 12.00 GB" in said[0]
    assert "15.00 GB" in said[0]  # what the next start reserves (12 GB and a margin)
    data = json.loads((tmp_path / PEAKS_FILE).read_text())
    assert data["peaks"]["Fake GPU"] == {
        "flux": {"1024x1024 b1": 13 * GB},
        "sdxl": {"1024x1024 b1": 4 * GB},
    }
    # the next process: its reserve covers the peaks of the pipelines it serves; while
    # one of them was never measured, at least a share of the total
    assert _budget(tmp_path, total=100 * GB, pipelines=["flux"]).reserve == int(13 * GB * 1.25)
    assert _budget(tmp_path, total=100 * GB, pipelines=["sdxl"]).reserve == 5 * GB
    assert _budget(tmp_path, total=100 * GB, pipelines=["sdxl", "wan"]).reserve == 10 * GB
    assert _budget(tmp_path, total=100 * GB, pipelines=[]).reserve == MIN_RESERVE
    assert _budget(tmp_path, total=100 * GB).reserve == int(13 * GB * 1.25)  # every one
    # another kind of device has peaks of its own
    assert (
        DeviceBudget("cpu", total=4 * GB, cache_dir=tmp_path).peak("flux", "1024x1024 b1") is None
    )


def test_a_job_run_inside_a_paused_one_is_measured_as_its_own_and_not_as_the_paused_ones():
    mem = FakeMemory(allocated=30 * GB)
    b = _budget(total=100 * GB, memory=mem)
    with b.measure("flux", "1024x1024 b1"):
        mem.top = 34 * GB  # the paused job's own peak, before the pause
        with b.paused(), b.measure("sdxl", "512x512 b1"):
            mem.top = 39 * GB  # the preempting job's activations, above what flux keeps
        mem.top = 33 * GB  # after the pause: flux's steps again
    assert b.peak("sdxl", "512x512 b1") == 9 * GB
    assert b.peak("flux", "1024x1024 b1") == 4 * GB  # its own, kept across the pause


def test_an_unreadable_peaks_file_is_said_and_measured_again(tmp_path, caplog):
    (tmp_path / PEAKS_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="nostall.serve.budget"):
        b = _budget(tmp_path, total=100 * GB)
    assert b.reserve == 10 * GB and "unreadable" in caplog.text
    b.record("flux", "512x512 b1", GB)  # rewrites it whole
    assert json.loads((tmp_path / PEAKS_FILE).read_text())["version"] == 1


# ---- bytes on the device, out of memory --------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_device_bytes_cover_what_the_cache_places(store, dtype):
    from nostall import ModelCache

    with ModelCache(store, device="cpu", gpu_budget=64 << 20, dtype=dtype, cache_dir=False) as c:
        entry = c.store.entry("flux")
        with c.use("flux"):
            placed = {row.role: row.nbytes for row in c.last_report.components}
        for comp in entry.weights:
            got = device_bytes(comp, dtype)
            assert got >= placed[comp.role], comp.role
            assert got <= placed[comp.role] + 256 * comp.checkpoint.num_tensors + 4096
    transformer = entry.components["transformer"]
    assert device_bytes(transformer, torch.bfloat16) < device_bytes(transformer, None)


def test_out_of_memory_is_told_apart():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("expected scalar type"))
    assert not is_out_of_memory(ValueError("out of memory"))
    oom_budget = BudgetExceeded("out of memory", tier="gpu", requested=1, budget=1, in_use=0)
    assert not is_out_of_memory(oom_budget)  # typed errors keep their meaning


# ---- the worker by its budget ----------------------------------------------------------


def _body(**kw):
    body = {"model": "flux", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 0,
            "max_sequence_length": 16}  # fmt: skip
    body.update(kw)
    return body


def _flaky_flux(monkeypatch, fails: int | None, error=None):
    """FluxPipeline's call raises ``error`` (an OOM) ``fails`` times (None: always); the
    list it returns counts the calls."""
    from diffusers import FluxPipeline

    real = FluxPipeline.__call__
    calls: list[int] = []

    @functools.wraps(real)
    def call(self, *args, **kwargs):
        calls.append(1)
        if fails is None or len(calls) <= fails:
            raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FluxPipeline, "__call__", call)
    return calls


def test_a_job_out_of_memory_is_retried_once_after_freeing(serve, monkeypatch):
    mem = FakeMemory(allocated=None)  # no peaks measured: only the freeing is watched
    server, _ = serve(budget=_budget(total=100 * GB, memory=mem), prepare=False)
    calls = _flaky_flux(monkeypatch, fails=1)
    r = httpx.post(f"{server.url}/v1/images/generations", json=_body(), timeout=120)
    assert r.status_code == 200, r.text
    assert len(calls) == 2 and mem.releases == 1


def test_out_of_memory_twice_is_503_with_retry_after_and_the_worker_keeps_serving(
    serve, monkeypatch
):
    mem = FakeMemory(allocated=None)
    server, worker = serve(budget=_budget(total=100 * GB, memory=mem), prepare=False)
    calls = _flaky_flux(monkeypatch, fails=2)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/images/generations", json=_body())
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "device_busy" and "ran out of device memory twice" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert len(calls) == 2 and mem.releases == 1
        assert c.post("/v1/images/generations", json=_body(seed=1)).status_code == 200
        assert worker.ready


def test_other_errors_are_not_retried(serve, monkeypatch):
    server, _ = serve(
        budget=_budget(total=100 * GB, memory=FakeMemory(allocated=None)), prepare=False
    )
    calls = _flaky_flux(monkeypatch, fails=None, error=RuntimeError("expected scalar type"))
    r = httpx.post(f"{server.url}/v1/images/generations", json=_body(), timeout=120)
    assert r.status_code != 503 and len(calls) == 1


def test_each_jobs_peak_is_measured_and_shown(serve, tmp_path):
    class Growing(FakeMemory):  # every job peaks 3 MB above where it started
        def reset_peak(self) -> None:
            self.top = self.now + 3_000_000

    mem = Growing(allocated=GB)
    budget = _budget(tmp_path, total=100 * GB, reserve=GB, memory=mem)
    server, worker = serve(budget=budget, prepare=False)
    for size in ("32x32", "32x32", "64x32"):
        r = httpx.post(f"{server.url}/v1/images/generations", json=_body(size=size), timeout=120)
        assert r.status_code == 200, r.text
    peaks = httpx.get(f"{server.url}/status.json").json()["budget"]["peaks"]
    assert peaks == {"flux": {"32x32 b1": 3_000_000, "64x32 b1": 3_000_000}}
    claims = worker.status()["budget"]["claims"]
    assert claims == {"model cache": 64 << 20}
    assert json.loads((tmp_path / PEAKS_FILE).read_text())["peaks"]["Fake GPU"] == peaks


def test_the_model_cache_takes_what_the_embedding_service_leaves(store):
    from nostall.serve.embed import EmbeddingService
    from nostall.serve.worker import Worker

    budget = _budget(total=100 * GB, reserve=10 * GB)
    service = EmbeddingService(store, device="cpu", budget=budget)
    assert 0 < service.encoder_bytes < 5_000_000  # the tiny store's text encoders
    worker = Worker(store, device="cpu", budget=budget, host_budget=64 << 20, prepare=False)
    try:
        # on a CPU the cache takes what the store needs of what the service left (on a
        # GPU, all of it: claim_rest); the CPU tier is ordinary memory
        left = 90 * GB - service.encoder_bytes
        assert budget.claims() == {
            "embedding service": service.encoder_bytes,
            "model cache": cpu_tier_bytes(worker.cache.store, left),
        }
        assert 0 < budget.claims()["model cache"] < 256 << 20  # the tiny store, not 90 GB
        assert budget.left == left - budget.claims()["model cache"]
        with pytest.raises(BudgetExceeded, match="embedding service"):
            EmbeddingService(store, device="cpu", budget=_budget(total=GB, reserve=GB - 1000))
    finally:
        worker.shutdown()
    assert "model cache" not in budget.claims()  # given back


def test_a_worker_makes_its_own_budget_from_reserve_and_external(store):
    from nostall.serve.worker import Worker

    worker = Worker(store, device="cpu", host_budget=64 << 20, prepare=False,
                    reserve=1 << 20, external=2 << 20)  # fmt: skip
    try:
        s = worker.status()["budget"]
        assert s["reserve"] == 1 << 20 and s["external"] == 2 << 20
        left = s["total"] - (3 << 20)
        assert s["claims"]["model cache"] == cpu_tier_bytes(worker.cache.store, left)
    finally:
        worker.shutdown()
    with pytest.raises(ArgumentError, match="reserve and external"):
        Worker(store, device="cpu", budget=_budget(total=GB, reserve=0), reserve=1)


def test_lora_room_is_claimed_beside_the_cache_and_given_back(store):
    from nostall.serve.worker import Worker

    budget = _budget(total=100 * GB, reserve=10 * GB)
    worker = Worker(store, device="cpu", budget=budget, host_budget=64 << 20, prepare=False,
                    lora_room=3 * GB)  # fmt: skip
    try:
        assert budget.claims()["LoRA base copies"] == 3 * GB
        assert worker.cache.activation_reserve == 10 * GB  # base copies leave it free
    finally:
        worker.shutdown()
    assert budget.claims() == {}
    with pytest.raises(ArgumentError, match="lora_room=-1"):
        Worker(store, device="cpu", budget=budget, prepare=False, lora_room=-1)
    with pytest.raises(BudgetExceeded):  # no room left for the cache: nothing kept claimed
        Worker(store, device="cpu", budget=budget, prepare=False, gpu_budget=GB,
               lora_room=90 * GB - 1000)  # fmt: skip
    assert budget.claims() == {}


# ---- start-up validation -----------------------------------------------------------------


def test_start_refuses_a_store_whose_pipelines_can_never_fit_naming_them(store):
    from nostall.serve.worker import Worker

    # flux (0.69 MB) and wan (0.19 MB) fit; sdxl (1.61 MB) is served with its UNet
    # resident in part (issue #32); sd3 (1.94 MB, its transformer mostly a position
    # embedding: no block to spare) never can
    worker = Worker(store, device="cpu", gpu_budget=1_200_000, host_budget=64 << 20,
                    prepare=False)  # fmt: skip
    try:
        with pytest.raises(BudgetExceeded) as e:
            worker.start()
        message = str(e.value)
        assert "sd3 needs" in message and "sd3/transformer" in message
        assert "sdxl" not in message and "flux" not in message and "wan" not in message
        assert "--gpu-budget-gb" in message
        assert e.value.requested > 1_900_000 and e.value.budget >= 1_200_000
        assert not worker.ready
    finally:
        worker.shutdown()
    tight = Worker(store, device="cpu", gpu_budget=100_000, host_budget=64 << 20, prepare=False)
    try:
        with pytest.raises(BudgetExceeded) as e:
            tight.start()
        # wan's jobs generate videos: its whole pipeline (188 kB), not the VAE alone
        assert "wan needs" in str(e.value)
    finally:
        tight.shutdown()


def test_a_two_expert_pipeline_needs_one_expert_beside_the_rest_but_its_text_encoder(tmp_path):
    from nostall.serve.budget import device_bytes, unfit
    from nostall.store.catalog import Store
    from nostall.synthetic import write_store

    write_store(tmp_path, ("wan22",))
    entry = Store(tmp_path, cache_dir=tmp_path / "index").entry("wan22")
    sizes = {c.role: device_bytes(c, None) for c in entry.distinct_weights()}
    expert = max(sizes["transformer"], sizes["transformer_2"])
    # (the tiny text encoder is smaller than an expert: the expert's phase decides)
    need = sum(sizes.values()) - min(sizes["transformer"], sizes["transformer_2"])
    need -= sizes["text_encoder"]
    assert need == sizes["vae"] + expert
    assert unfit([(entry, ())], need, None) is None
    error = unfit([(entry, ())], need - 1, None)
    assert error is not None and error.requested == need


def test_a_broken_pipeline_folder_is_left_out_and_the_others_are_served(store, tmp_path):
    from nostall.serve.worker import ImageJob, Worker

    for name in ("flux", "sdxl"):
        shutil.copytree(store / name, tmp_path / name)
    unet = next((tmp_path / "sdxl" / "unet").glob("*.safetensors"))
    unet.write_bytes(b"\xff" * 64)  # not a safetensors header
    worker = Worker(tmp_path, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20)
    try:
        worker.start()
        assert set(worker.unavailable) == {"sdxl"}
        assert "CheckpointError" in worker.unavailable["sdxl"]
        assert worker.status()["unavailable"] == worker.unavailable
        future, _ = worker.submit(ImageJob("flux", "a cat", 32, 32, 2, 0, max_sequence_length=16))
        assert future.result(120).media_type == "image/png"
    finally:
        worker.shutdown()


# ---- the log ----------------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_one_info_line_per_job_and_a_library_warning_once(serve, monkeypatch, caplog):
    from diffusers import FluxPipeline

    real = FluxPipeline.__call__
    said: list[str] = []

    @functools.wraps(real)
    def call(self, *args, **kwargs):  # what diffusers says on every switch of an SDXL VAE
        logging.getLogger("diffusers.models.modeling_utils").warning(
            "There are modules in AutoencoderKL that should be kept in float32"
        )
        warnings.warn("a library's deprecation, once per call", FutureWarning, stacklevel=1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FluxPipeline, "__call__", call)
    library = logging.getLogger("diffusers")
    collect, level = _Collect(), library.level
    library.setLevel(logging.WARNING)  # (the store fixture quietened it)
    library.addHandler(collect)
    monkeypatch.setattr(warnings, "showwarning", lambda m, *a, **k: said.append(str(m)))
    try:
        server, _ = serve(prepare=False)
        with (
            caplog.at_level(logging.INFO, logger="nostall.serve.worker"),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("always")  # as libraries' catch_warnings blocks leave it
            for seed in range(3):
                r = httpx.post(f"{server.url}/v1/images/generations", json=_body(seed=seed),
                               timeout=120)  # fmt: skip
                assert r.status_code == 200, r.text
        # (a worker of another test may hold this session's default video folder: that
        # warning is not a job's line)
        lines = [r.getMessage() for r in caplog.records if r.name == "nostall.serve.worker"
                 and "video jobs are not served" not in r.getMessage()]  # fmt: skip
        assert len(lines) == 3
        for line in lines:
            assert line.startswith("flux 32x32 b1: switch moved ")
            assert "transformer=" in line and "denoise " in line and "total " in line
        kept = [r for r in collect.records if "float32" in r.getMessage()]
        assert len(kept) == 1
        assert [m for m in said if "once per call" in m] == [
            "a library's deprecation, once per call"
        ]
    finally:
        library.removeHandler(collect)
        library.setLevel(level)


def test_every_error_the_worker_adds_is_typed():
    from nostall.errors import DeviceBusy, ServeError

    e = DeviceBusy("out of memory twice", retry_after=3.0)
    assert isinstance(e, ServeError) and isinstance(e, NostallError) and e.retry_after == 3.0


def test_serve_refuses_to_start_naming_what_can_never_fit(store):
    from typer.testing import CliRunner

    from nostall.cli import app
    from nostall.serve.local import free_port

    r = CliRunner().invoke(app, ["serve", "--models", str(store), "--device", "cpu",
                                 "--gpu-budget-gb", "0.0012", "--port", str(free_port())])  # fmt: skip
    assert isinstance(r.exception, BudgetExceeded), r.output
    assert "sd3/transformer" in str(r.exception)  # (sdxl streams its UNet: it may start)
    assert "sdxl/unet" not in str(r.exception)


def test_fleet_workers_leave_out_an_embedding_service_beside_them():
    from nostall.serve.routing import worker_budgets

    beside = worker_budgets(2, gpu=True, options={}, limit=256 * GB, embed_bytes=10 * GB)
    assert beside == {"host_budget": 64 * GB, "external": 10 * GB}
    given = worker_budgets(2, gpu=True, options={"gpu_budget": 5}, embed_bytes=10 * GB)
    assert "external" not in given  # the tier given is the operator's
    assert "external" not in worker_budgets(2, gpu=False, options={}, embed_bytes=10 * GB)
