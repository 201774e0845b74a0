"""Running a service on loopback for the benchmarks, the checks and the tests: an ASGI
app in a thread (:class:`BackgroundServer`), or ``nostall serve`` as a process
(:func:`start_serve`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from nostall.errors import ServeError

__all__ = ["BackgroundServer", "free_port", "start_serve"]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn serving ``app`` on ``127.0.0.1`` in a thread: real HTTP. ``with`` starts it
    (waiting until it listens) and stops it (the app's shutdown runs)."""

    def __init__(self, app, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(120)


def start_serve(
    models: str | os.PathLike,
    *args: str,
    device: str = "cpu",
    output: IO | None = None,
    timeout: float = 120.0,
) -> tuple[subprocess.Popen, str]:
    """``nostall serve --models models --device device *args`` on a free loopback port,
    once ``/readyz`` says it is ready: the process and its URL. Its output goes to
    ``output`` (a file), else to a pipe (``proc.stdout``, text). A process that exits,
    or is not ready within ``timeout`` seconds, is killed: :class:`~nostall.ServeError`
    with what it printed (or where)."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "nostall.cli", "serve", "--models", os.fspath(models)]
    proc = subprocess.Popen(
        [*command, "--device", device, "--port", str(port), *args],
        stdout=output if output is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            said = proc.communicate()[0] if output is None else f"see {output.name}"
            raise ServeError(f"nostall serve did not become ready on {url}:\n{said}")
        time.sleep(0.1)
