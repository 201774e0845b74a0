"""The services' configs (:mod:`nostall.serve.config`): every cache option a server takes
reaches its cache, from the flags of ``nostall serve`` and ``nostall fleet`` or from
keyword arguments; a bad value is refused once, naming its field (or flag); ``config=``
and keyword options together are refused; the configs are frozen."""

from __future__ import annotations

import dataclasses

import pytest

from nostall.cache.config import CacheConfig
from nostall.errors import ArgumentError
from nostall.serve.config import EmbedConfig, WorkerConfig

MB = 1 << 20


@pytest.mark.parametrize(
    "kw, field, says",
    [
        ({"max_queue": 0}, "max_queue", "max_queue=0"),
        ({"max_queue": None}, "max_queue", "max_queue=None"),
        ({"recent": -1}, "recent", "recent=-1"),
        ({"prepare": "yes"}, "prepare", "True or False"),
        ({"embed_url": "localhost:8001"}, "embed_url", "not an http(s) URL"),
        ({"embed_url": "http://127.0.0.1:99999"}, "embed_url", "not a URL"),
        ({"reserve": -5}, "reserve", "reserve=-5"),
        ({"external": 1.5}, "external", "external=1.5"),
        ({"lora_room": -1}, "lora_room", "lora_room=-1"),
        ({"limits": {"max_steps": 4}}, "limits", "give a Limits"),
        ({"schedule": 3}, "schedule", "give a Policy"),
        ({"cache": {"device": "cpu"}}, "cache", "give a CacheConfig"),
    ],
)
def test_a_bad_worker_value_is_refused_naming_its_field(kw, field, says):
    with pytest.raises(ArgumentError) as e:
        WorkerConfig(**kw)
    assert e.value.field == field and says in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"cache_bytes": -1}, "cache_bytes"),
        ({"token_budget": 0}, "token_budget"),
        ({"max_texts": True}, "max_texts"),
        ({"max_queue": 2, "max_texts": 4}, "max_queue"),
        ({"max_wait_s": -0.1}, "max_wait_s"),
        ({"max_wait_s": float("inf")}, "max_wait_s"),
        ({"dtype": "bf16"}, "dtype"),
    ],
)
def test_a_bad_embedding_value_is_refused_naming_its_field(kw, field):
    with pytest.raises(ArgumentError) as e:
        EmbedConfig(**kw)
    assert e.value.field == field, str(e.value)


def test_the_configs_are_frozen_and_flat_keywords_split_between_them():
    config = WorkerConfig.from_kwargs(device="cpu", watermark=0.5, max_queue=3)
    assert config.cache == CacheConfig(device="cpu", watermark=0.5) and config.max_queue == 3
    for c in (config, config.cache, EmbedConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.device = "cuda"  # type: ignore[misc]
    with pytest.raises(TypeError, match="'max_queeu'; did you mean max_queue"):
        WorkerConfig.from_kwargs(max_queeu=3)
    with pytest.raises(ArgumentError, match="config= and the keyword options watermark"):
        WorkerConfig.from_kwargs(cache=CacheConfig(), watermark=0.5)


def test_worker_keywords_reach_its_cache_and_config_with_keywords_is_refused(store, tmp_path):
    from nostall.serve.worker import Worker

    kw = dict(device="cpu", gpu_budget=64 * MB, host_budget=64 * MB, prepare=False)
    worker = Worker(
        store, **kw, watermark=0.5, wait_s=3.0, lora_budget=0, cache_dir=tmp_path, max_queue=2
    )
    try:
        c = worker.cache
        assert (c.watermark, c.wait_s, c.stats().lora_budget, worker.max_queue) == (0.5, 3.0, 0, 2)
        assert c.store.index.path.startswith(str(tmp_path))
        assert worker.config.cache.cache_dir == tmp_path
    finally:
        worker.shutdown()
    with pytest.raises(ArgumentError, match="config= and the keyword options max_queue"):
        Worker(store, config=WorkerConfig.from_kwargs(**kw), max_queue=3)
    with pytest.raises(ArgumentError) as e:
        Worker(store, **kw, watermark=0)
    assert e.value.field == "watermark"


def test_embedding_service_keywords_or_a_config_not_both(store):
    from nostall.serve.embed import EmbeddingService

    service = EmbeddingService(store, device="cpu", max_queue=8, max_texts=8)
    assert service.config == EmbedConfig(device="cpu", max_queue=8, max_texts=8)
    assert (service.max_queue, service.max_texts) == (8, 8)
    with pytest.raises(ArgumentError, match="config= and the keyword options max_queue"):
        EmbeddingService(store, config=EmbedConfig(device="cpu"), max_queue=2)


def _serve(store, monkeypatch, *flags):
    """``nostall serve`` with ``flags`` up to the point it would listen: its worker."""
    import uvicorn
    from typer.testing import CliRunner

    from nostall.cli import app

    servers = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: servers.append(self.config))
    args = ["serve", "--models", str(store), "--device", "cpu", "--gpu-budget-gb", "0.1",
            "--host-budget-gb", "0.1", "--no-prepare", *flags]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    return servers[-1].app.state.worker


def test_each_cache_flag_of_serve_reaches_the_cache(store, monkeypatch, tmp_path):
    worker = _serve(
        store, monkeypatch,
        "--watermark", "0.5", "--wait-s", "7", "--cache-dir", str(tmp_path),
        "--lora-budget-gb", "0.01", "--dtype", "bf16",
    )  # fmt: skip
    try:
        import torch

        c = worker.cache
        assert (c.watermark, c.wait_s, c.dtype) == (0.5, 7.0, torch.bfloat16)
        assert c.stats().lora_budget == 10_000_000
        assert c.store.index.path.startswith(str(tmp_path))
    finally:
        worker.shutdown()
    worker = _serve(store, monkeypatch, "--variant", "fp16")
    try:
        assert worker.cache.store.variant == "fp16"
        assert "fp16" in worker.unavailable["flux"]  # (the tiny store has no fp16 files)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--watermark", "1.5"], "watermark=1.5"),
        (["--wait-s", "-1"], "wait_s=-1"),
        (["--lora-budget-gb", "-1"], "positive number of GB"),
        (["--host-tier", "global"], "host_tier='global'"),
    ],
)
def test_a_bad_cache_flag_is_a_usage_error_before_the_worker_is_built(
    store, monkeypatch, flags, says
):
    from typer.testing import CliRunner

    from nostall.cli import app
    from nostall.serve import worker as worker_mod

    def no_worker(*a, **kw):
        raise AssertionError("the worker was built before the options were checked")

    monkeypatch.setattr(worker_mod, "Worker", no_worker)
    r = CliRunner().invoke(app, ["serve", "--models", str(store), "--device", "cpu", *flags])
    output = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and says in output, r.output


def test_the_fleets_cache_flags_reach_every_workers_config(store, monkeypatch, tmp_path):
    pytest.importorskip("ray")
    from typer.testing import CliRunner

    from nostall.cli import app
    from nostall.serve import fleet as fleet_mod

    seen = {}

    def recorded(models, **kw):
        seen.update(kw)
        raise ArgumentError("recorded; Ray is not started")

    monkeypatch.setattr(fleet_mod, "build_fleet", recorded)
    args = ["fleet", "--models", str(store), "--replicas", "2", "--device", "cpu",
            "--watermark", "0.6", "--wait-s", "9", "--cache-dir", str(tmp_path),
            "--lora-budget-gb", "0.02", "--variant", "fp16", "--embed"]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "recorded" in r.output, r.output
    c = seen["config"].cache
    assert (c.watermark, c.wait_s, c.cache_dir, c.lora_budget, c.variant) == (
        0.6, 9.0, str(tmp_path), 20_000_000, "fp16"
    )  # fmt: skip
    assert c.host_tier == "shared:fleet" and seen["config"].embed_url.endswith("/embed")
    r = CliRunner().invoke(app, [*args[:7], "--watermark", "0"])
    output = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and "watermark=0" in output and "recorded" not in output, output
