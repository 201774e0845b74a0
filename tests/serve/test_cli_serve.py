"""``nostall serve`` as a process: boots, serves, drains and stops on SIGTERM within its
grace period; hostile images and idle connections; options checked before it loads."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx
import pytest


def _start(start_serve, store, *args: str) -> tuple[subprocess.Popen, str]:
    """``nostall serve`` over the tiny store on a free port, once it is ready (started by
    the conftest's ``start_serve``)."""
    return start_serve(store, "--gpu-budget-gb", "0.1", "--host-budget-gb", "0.1", *args)


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM (if it still runs) and everything it printed (kept: asked again, the same)."""
    if getattr(proc, "said", None) is None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.said = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return proc.said


def _flux(steps: int, seed: int, size: int = 256) -> dict:
    return {
        "model": "flux",
        "prompt": "a cat",
        "size": f"{size}x{size}",
        "steps": steps,
        "seed": seed,
        "max_sequence_length": 16,
    }


GRACE = 6  # seconds


@pytest.fixture(scope="module")
def worker_process(store, controlnets, tmp_path_factory, start_serve):
    """One ``nostall serve`` for the tests of a running worker; the last ends it with
    SIGTERM. Its log must then hold no traceback."""
    # --no-prepare and one small image instead: what the tests below run is then built
    # and read (the other pipelines are not: 10 s less to wait for on two cores)
    videos = tmp_path_factory.mktemp("served-videos")
    options = ("--grace-s", str(GRACE), "--max-overtaken", "0", "--max-connections", "16",
               "--video-dir", str(videos))  # fmt: skip
    proc, url = _start(start_serve, store, *options, "--no-prepare")
    warm = httpx.post(f"{url}/v1/images/generations", json=_flux(1, 0, 32), timeout=120)
    assert warm.status_code == 200, warm.text
    proc.videos = videos
    yield proc, url
    out = _stop(proc)
    assert "Traceback" not in out and "DecompressionBomb" not in out, out


@pytest.fixture(scope="module")
def bomb() -> str:
    """A real 9000x9000 PNG (about 80 KB): 81 M pixels to decode."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_the_served_worker_generates_a_video_into_its_video_dir(worker_process):
    import time

    proc, url = worker_process
    body = {"model": "wan", "prompt": "a cat", "size": "32x32", "frames": 5, "steps": 2,
            "seed": 1, "max_sequence_length": 16}  # fmt: skip
    vid = httpx.post(f"{url}/v1/videos", json=body, timeout=60).json()["id"]
    deadline = time.monotonic() + 120
    while (job := httpx.get(f"{url}/v1/videos/{vid}").json())["status"] != "completed":
        assert job["status"] in ("queued", "in_progress"), job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert (proc.videos / f"{vid}.mp4").stat().st_size > 0
    assert (proc.videos / "videos.sqlite").exists()


@pytest.mark.slow
def test_control_image_bombs_are_422_and_the_probes_answered_meanwhile(worker_process, bomb):
    import threading

    proc, url = worker_process
    body = {
        "model": "sdxl",
        "prompt": "a cat",
        "size": "32x32",
        "steps": 2,
        "seed": 1,
        "controlnet": {"name": "edges", "image": bomb},
    }
    answers: list[httpx.Response] = []
    probes: list[float] = []

    def attack() -> None:
        answers.append(httpx.post(f"{url}/v1/images/generations", json=body, timeout=120))

    attackers = [threading.Thread(target=attack) for _ in range(8)]
    for t in attackers:
        t.start()
    with httpx.Client(base_url=url, timeout=30) as probe:
        while any(t.is_alive() for t in attackers):
            t0 = time.perf_counter()
            assert probe.get("/healthz").status_code == 200
            probes.append(time.perf_counter() - t0)
    for t in attackers:
        t.join()
    assert [r.status_code for r in answers] == [422] * 8, answers[0].text
    error = answers[0].json()["error"]
    assert error["field"] == "controlnet.image" and "9000x9000" in error["message"]
    assert max(probes) < 1.0, probes  # the event loop never waited for a decode
    # idle connections beyond the limit: work is refused, the probes still answered
    idle = [socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) for _ in range(20)]
    try:
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        busy = httpx.get(f"{url}/v1/models", timeout=10)
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "too_many_connections"
    finally:
        for c in idle:
            c.close()
    assert proc.poll() is None  # (its log is read when it stops: no traceback there)


@pytest.mark.slow
def test_sigterm_drains_within_the_grace_period_and_loses_no_finished_job(worker_process):
    # (this test ends the module's worker: it comes after the others that use it)
    import threading

    proc, url = worker_process
    answers: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        answers[name] = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)

    try:
        # a: running at SIGTERM, done well inside the grace period; b: ~15 s of steps,
        # running when the grace period runs out; c: still queued behind b then
        jobs = {"a": _flux(8, 1), "b": _flux(150, 2), "c": _flux(2, 3)}
        threads = []
        for name, body in jobs.items():
            threads.append(threading.Thread(target=post, args=(name, body)))
            threads[-1].start()
            while True:  # each in the worker's hands before the next is sent
                s = httpx.get(f"{url}/status.json", timeout=10).json()
                if len(s["queue"]) + (s["running"] is not None) == len(threads):
                    break
                time.sleep(0.02)
        assert s["running"] is not None and len(s["queue"]) == 2, s
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        # at once: not ready, no new work; the port still answers
        ready = httpx.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["draining"]
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 503
        late = httpx.post(f"{url}/v1/images/generations", json=_flux(2, 4, 32), timeout=30)
        assert late.status_code == 503 and late.json()["error"]["type"] == "shutting_down"
        proc.wait(30)
        took = time.monotonic() - sent
        for t in threads:
            t.join(30)
    finally:
        out = _stop(proc)
    assert took < GRACE, f"exited {took:.1f} s after SIGTERM, past its {GRACE} s grace:\n{out}"
    assert answers["a"].status_code == 200 and answers["a"].json()["data"][0]["b64_json"]
    for name in ("b", "c"):
        assert answers[name].status_code == 503, (name, answers[name].text)
        assert answers[name].json()["error"]["type"] == "shutting_down"
    assert "stopped after" in answers["b"].json()["error"]["message"]  # at a step boundary
    assert "grace period ended" in answers["c"].json()["error"]["message"]
    # uvicorn shut the app down (the worker closed its cache), then the signal it caught
    # ended the process: "by SIGTERM", after a clean shutdown
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Application shutdown complete" in out and "stopped by SIGTERM" in out
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
        (["--api-token", ""], "an empty one would turn authentication off"),
        (["--time-limit-s", "0"], "out of range"),
        (["--batch", "0"], "0 is out of range"),
        (["--max-overtaken", "-1"], "-1 is out of range"),
        (["--max-delay-s", "inf"], "delay_s=inf"),
        (["--video-max-gb", "-1"], "-1.0 is out of range"),
    ],
)
def test_serve_options_are_checked_before_the_worker_loads(store, monkeypatch, extra, says):
    from nostall.serve import worker as worker_mod

    def no_worker(*a, **kw):
        raise AssertionError("the worker was built before the options were checked")

    monkeypatch.setattr(worker_mod, "Worker", no_worker)
    r = _invoke("serve", "--models", str(store), "--device", "cpu", *extra)
    assert r.exit_code == 2 and says in _plain(r.output), r.output


def _plain(output: str) -> str:
    """``output`` on one line, without the boxes and wrapping rich adds to messages."""
    return " ".join(output.replace("│", " ").split())


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
    r = _invoke(*args, env={"NOSTALL_API_TOKEN": None})
    assert r.exit_code == 0, r.output
    warned = [x.getMessage() for x in caplog.records if "--api-token" in x.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]
    assert configs[-1].h11_max_incomplete_event_size
    assert configs[-1].limit_concurrency is None  # the protocol's own, which answers probes
    caplog.clear()
    r = _invoke(*args, env={"NOSTALL_API_TOKEN": "from-env"})
    assert r.exit_code == 0, r.output
    assert not [x for x in caplog.records if "--api-token" in x.getMessage()]
    client = TestClient(configs[-1].app)  # no lifespan: the worker is not started
    assert client.get("/v1/models").status_code == 401
    ok = client.get("/v1/models", headers={"Authorization": "Bearer from-env"})
    assert ok.status_code == 200 and {m["id"] for m in ok.json()["data"]} >= {"flux", "wan"}


@pytest.mark.parametrize("command", ["serve", "embed-server", "fleet"])
def test_an_empty_token_in_the_environment_is_refused_at_start(store, command):
    extra = ["--replicas", "1"] if command == "fleet" else []
    if command == "fleet":
        pytest.importorskip("ray")
    r = _invoke(
        command, "--models", str(store), "--device", "cpu", *extra, env={"NOSTALL_API_TOKEN": ""}
    )
    assert r.exit_code == 2, r.output
    assert "an empty one would turn authentication off" in _plain(r.output), r.output


@pytest.mark.slow
def test_the_fleet_stops_quietly_on_sigterm(fork_python):
    # What `nostall fleet` runs under once Ray is up (the whole fleet on Ray takes half a
    # minute to start here; the context's behaviour is the same): one line per step, the
    # exit status of a process ended by SIGTERM, no stack dump.
    pytest.importorskip("ray")
    code = (
        "import signal, sys\n"
        "from nostall.cli.serve import _stopped_quietly\n"
        "with _stopped_quietly('nostall fleet', 5):\n"
        "    print('up', flush=True)\n"
        "    signal.pause()\n"
    )
    # a process of its own (its signals, its exit status), forked by the conftest's fixture
    proc = fork_python(code, stderr=subprocess.STDOUT)
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert "SIGTERM; stopping the workers" in out and "nostall fleet: stopped" in out, out
    assert "Traceback" not in out
    assert proc.returncode == 128 + signal.SIGTERM, out
