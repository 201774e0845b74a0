"""``nostall serve`` as a process: boots, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from nostall.serve.local import free_port as _free_port


def test_serve_boots_answers_and_stops_on_sigterm(store):
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nostall.cli", "serve", "--models", str(store),
         "--device", "cpu", "--port", str(port), "--gpu-budget-gb", "0.1",
         "--host-budget-gb", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the worker did not become ready"
            time.sleep(0.2)
        body = {"model": "sdxl", "prompt": "a cat", "size": "32x32", "steps": 2, "seed": 1}
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["data"][0]["b64_json"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn shuts the app down (the worker finishes, the cache closes), then re-raises
    # the signal it caught, so the process ends "by SIGTERM" after a clean shutdown
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out
    assert "nostall worker: 4 pipelines on cpu" in out


def test_fleet_options_are_checked_before_ray_starts(store):
    pytest.importorskip("ray")
    from typer.testing import CliRunner

    from nostall.cli import app

    r = CliRunner().invoke(app, ["fleet", "--models", str(store), "--replicas", "0", "--embed"])
    assert r.exit_code != 0 and "replicas=0" in r.output


def _invoke(*args, env=None):
    from typer.testing import CliRunner

    from nostall.cli import app

    return CliRunner().invoke(app, list(args), env=env)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--port", "0"], "0 is out of range"),
        (["--port", "70000"], "70000 is out of range"),
        (["--dtype", "fp7"], "not a cast target"),
        (["--gpu-budget-gb", "-1"], "positive number of GB"),
        (["--max-queue", "0"], "0 is out of range"),
        (["--embed-url", "localhost:8001"], "not an http(s) URL"),
        (["--embed-url", "http://127.0.0.1:99999"], "not a URL"),
        (["--api-token", " padded "], "API token"),
        (["--time-limit-s", "0"], "out of range"),
        (["--batch", "0"], "0 is out of range"),
        (["--max-overtaken", "-1"], "-1 is out of range"),
        (["--max-delay-s", "inf"], "delay_s=inf"),
    ],
)
def test_serve_options_are_checked_before_the_worker_loads(store, monkeypatch, extra, says):
    from nostall.serve import worker as worker_mod

    def no_worker(*a, **kw):
        raise AssertionError("the worker was built before the options were checked")

    monkeypatch.setattr(worker_mod, "Worker", no_worker)
    r = _invoke("serve", "--models", str(store), "--device", "cpu", *extra)
    assert r.exit_code == 2 and says in r.output, r.output


@pytest.mark.parametrize(
    "extra, says", [(["--port", "0"], "out of range"), (["--dtype", "fp7"], "not a cast target")]
)
def test_embed_server_options_are_checked_before_it_loads(store, monkeypatch, extra, says):
    from nostall.serve import embed as embed_mod

    def no_service(*a, **kw):
        raise AssertionError("the service was built before the options were checked")

    monkeypatch.setattr(embed_mod, "EmbeddingService", no_service)
    r = _invoke("embed-server", "--models", str(store), "--device", "cpu", *extra)
    assert r.exit_code == 2 and says in r.output, r.output


def test_serve_beyond_loopback_warns_without_a_token_and_takes_one_from_the_env(
    store, monkeypatch, caplog
):
    import logging

    import uvicorn
    from fastapi.testclient import TestClient

    configs = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: configs.append(self.config))
    args = ("serve", "--models", str(store), "--device", "cpu", "--host", "0.0.0.0",
            "--gpu-budget-gb", "0.1", "--host-budget-gb", "0.1", "--no-prepare")  # fmt: skip
    caplog.set_level(logging.WARNING, logger="nostall.serve.http")
    r = _invoke(*args, env={"NOSTALL_API_TOKEN": ""})
    assert r.exit_code == 0, r.output
    warned = [x.getMessage() for x in caplog.records if "--api-token" in x.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]
    assert configs[-1].limit_concurrency == 256 and configs[-1].h11_max_incomplete_event_size
    caplog.clear()
    r = _invoke(*args, env={"NOSTALL_API_TOKEN": "from-env"})
    assert r.exit_code == 0, r.output
    assert not [x for x in caplog.records if "--api-token" in x.getMessage()]
    client = TestClient(configs[-1].app)  # no lifespan: the worker is not started
    assert client.get("/v1/models").status_code == 401
    ok = client.get("/v1/models", headers={"Authorization": "Bearer from-env"})
    assert ok.status_code == 200 and {m["id"] for m in ok.json()["data"]} >= {"flux", "wan"}
