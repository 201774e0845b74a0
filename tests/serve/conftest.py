from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="package")
def store(tmp_path_factory):
    """Tiny random FLUX, SDXL and Wan pipelines."""
    from nostall.bench.stores import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("serve-store")
    write_store(folder, ("flux", "sdxl", "wan"))
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving ``app`` on loopback in a thread: real HTTP."""

    def __init__(self, app):
        import uvicorn

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture
def serve(store):
    """Start a worker over the tiny store on loopback: ``serve(**worker_kwargs)``."""
    from nostall.serve.app import create_app
    from nostall.serve.worker import Worker

    started = []

    def start(**kw):
        kw.setdefault("device", "cpu")
        kw.setdefault("gpu_budget", 64 << 20)
        kw.setdefault("host_budget", 64 << 20)
        worker = Worker(store, **kw)
        server = Server(create_app(worker)).__enter__()
        started.append(server)
        return server, worker

    yield start
    for s in started:
        s.__exit__(None, None, None)
