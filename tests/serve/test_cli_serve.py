"""``nostall serve`` as a process: boots, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

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
    import pytest

    pytest.importorskip("ray")
    from typer.testing import CliRunner

    from nostall.cli import app

    r = CliRunner().invoke(app, ["fleet", "--models", str(store), "--replicas", "0", "--embed"])
    assert r.exit_code != 0 and "replicas=0" in r.output
