"""The network-facing guards through real HTTP and raw sockets: token, body cap, body and
header deadlines, time limit, connection limit, the exposure warning."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
from fastapi import Request

from nostall.errors import ArgumentError
from nostall.serve.http import (
    BodyLimit,
    TimeLimit,
    exposure_warning,
    harden,
    is_loopback,
    uvicorn_config,
)
from nostall.serve.local import free_port

TOKEN = "s3cret-token"


class _Server:
    """uvicorn on loopback in a thread, built by :func:`uvicorn_config`."""

    def __init__(self, app, **kw):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw.setdefault("log_level", "warning")
        self.server = uvicorn.Server(uvicorn_config(app, port=self.port, **kw))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)


def _app(seen: dict, *, token=TOKEN, time_limit=None, body_timeout=5.0):
    """A small app: /echo answers its body's length, /slow waits on an event that is never
    set, /upload takes a larger body. ``seen`` records what the handlers got to see."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        seen["echo"] = seen.get("echo", 0) + 1
        return {"n": len(await request.body())}

    @app.post("/upload")
    async def upload(request: Request) -> dict:
        return {"n": len(await request.body())}

    @app.get("/slow")
    async def slow() -> dict:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen["slow_cancelled"] = True
            raise
        return {}

    @app.post("/wait")
    async def wait(request: Request) -> dict:
        # a handler that watches for its client leaving long after the body arrived (as
        # the worker's does while a job is queued): the body deadline is not for this
        n = len(await request.body())
        end = asyncio.get_running_loop().time() + 1.0
        while asyncio.get_running_loop().time() < end:
            assert not await request.is_disconnected()
            await asyncio.sleep(0.05)
        return {"n": n}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return harden(
        app, token=token, max_body=1000, body_limits={"/upload": 100_000},
        body_timeout=body_timeout, time_limit=time_limit,
    )  # fmt: skip


def _auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def _raw(port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_request_without_the_token_gets_401_and_the_probes_stay_open():
    seen: dict = {}
    with _Server(_app(seen)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/echo", content=b"hi")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "unauthorized"
        assert c.post("/echo", content=b"hi", headers=_auth("s3cret-tokeX")).status_code == 401
        assert c.post("/echo", content=b"hi", headers={"Authorization": TOKEN}).status_code == 401
        assert "echo" not in seen  # refused before the handler
        assert c.post("/echo", content=b"hi", headers=_auth()).json() == {"n": 2}
        assert c.get("/healthz").status_code == 200


def test_a_gigabyte_content_length_is_refused_413_before_the_body_is_read():
    seen: dict = {}
    with _Server(_app(seen)) as srv:
        head = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {10**9}\r\n\r\n".encode()
        )
        t = time.monotonic()
        out = _raw(srv.port, head + b"{" * 100)  # 100 bytes of the promised 1 GB
        assert out.startswith(b"HTTP/1.1 413"), out[:200]
        assert b"at most 1000" in out and time.monotonic() - t < 5
        assert "echo" not in seen
        # the per-path cap: /upload takes 100 kB, /echo 1000 bytes
        with httpx.Client(base_url=srv.url, timeout=30, headers=_auth()) as c:
            assert c.post("/upload", content=b"x" * 50_000).json() == {"n": 50_000}
            assert c.post("/echo", content=b"x" * 1001).status_code == 413
            assert c.post("/echo", content=b"x" * 1000).json() == {"n": 1000}


def test_a_chunked_body_is_counted_as_it_arrives():
    with _Server(_app({})) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:

        def chunks(n):
            for _ in range(n):
                yield b"x" * 300

        r = c.post("/echo", content=chunks(10), headers=_auth())  # no Content-Length
        assert r.status_code == 413 and "more than 1000" in r.json()["error"]["message"]
        assert c.post("/echo", content=chunks(3), headers=_auth()).json() == {"n": 900}


def test_a_body_that_stalls_gets_408(caplog):
    caplog.set_level(logging.INFO, logger="nostall.serve.http")
    with _Server(_app({}, body_timeout=0.5)) as srv:
        head = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 500\r\n\r\n".encode()
        )
        out = _raw(srv.port, head + b"x" * 10)  # and nothing more
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert any("did not arrive within 0.5 s" in r.getMessage() for r in caplog.records)


def test_the_body_deadline_ends_once_the_body_is_in():
    with _Server(_app({}, body_timeout=0.5)) as srv:
        r = httpx.post(f"{srv.url}/wait", content=b"abc", headers=_auth(), timeout=30)
        assert r.status_code == 200 and r.json() == {"n": 3}


def test_an_aborted_upload_is_one_info_line_and_no_traceback(caplog):
    caplog.set_level(logging.INFO)
    with _Server(_app({})) as srv:
        head = (
            b"POST /upload HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 50000\r\n\r\n".encode()
        )
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(head + b"x" * 1000)

        def logged():
            return [r for r in caplog.records if "left during its upload" in r.getMessage()]

        deadline = time.monotonic() + 10
        while not logged():
            assert time.monotonic() < deadline, "no log line for the aborted upload"
            time.sleep(0.01)
        # the server is fine afterwards
        assert httpx.post(f"{srv.url}/upload", content=b"ab", headers=_auth()).status_code == 200
    [line] = logged()
    assert line.levelno == logging.INFO and line.exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_a_request_past_its_time_limit_is_cancelled_and_answered_504():
    seen: dict = {}
    with _Server(_app(seen, time_limit=0.5)) as srv:
        t = time.monotonic()
        r = httpx.get(f"{srv.url}/slow", headers=_auth(), timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "time_limit"
        assert 0.4 < time.monotonic() - t < 10
        assert seen.get("slow_cancelled")  # the handler saw the cancellation
        assert httpx.post(f"{srv.url}/echo", content=b"a", headers=_auth()).status_code == 200


def test_a_client_that_sends_its_head_a_byte_at_a_time_is_cut_off():
    with _Server(_app({}), header_timeout=0.5) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            t = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # and then nothing
            assert s.recv(100) == b""  # closed by the server
            assert 0.4 < time.monotonic() - t < 5
        # a keep-alive connection that starts a second head and stalls is cut off too
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(1000).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
            t = time.monotonic()
            assert s.recv(100) == b""
            assert time.monotonic() - t < 5
        # a normal request on a connection kept alive is not affected by the deadline
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
            assert c.get("/healthz").status_code == 200


def test_an_oversized_head_is_refused():
    # h11 caps what it buffers of an unfinished head: a head past the cap gets 400 once
    # that much has arrived, however slowly the rest would follow
    with _Server(_app({}), max_header_bytes=4096) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000)
            out = s.recv(1000)
        assert out.startswith(b"HTTP/1.1 400"), out[:100]


def test_connections_beyond_the_limit_get_503_but_the_probes_are_answered():
    with _Server(_app({}, token=None), limit_concurrency=2) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
        try:
            deadline = time.monotonic() + 10
            while len(srv.server.server_state.connections) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            work = (
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            out = _raw(srv.port, work)
            assert out.startswith(b"HTTP/1.1 503") and b"too_many_connections" in out, out[:200]
            for probe in (b"/healthz", b"/readyz"):
                head = b"GET " + probe + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                out = _raw(srv.port, head)
                # (the tiny app has no probe routes: 404 is its answer, not the limit's 503)
                assert not out.startswith(b"HTTP/1.1 503"), out[:200]
        finally:
            for s in held:
                s.close()


def test_binding_beyond_loopback_without_a_token_warns(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", TOKEN) is None
    assert "--api-token" in exposure_warning("0.0.0.0", None)
    caplog.set_level(logging.WARNING, logger="nostall.serve.http")
    uvicorn_config(object(), host="0.0.0.0", port=8000)
    assert any("0.0.0.0" in r.getMessage() for r in caplog.records)
    caplog.clear()
    uvicorn_config(object(), host="0.0.0.0", port=8000, token=TOKEN)
    assert not caplog.records


@pytest.mark.parametrize(
    "make",
    [
        lambda: uvicorn_config(object(), port=70000),
        lambda: uvicorn_config(object(), port="80"),
        lambda: uvicorn_config(object(), header_timeout=0),
        lambda: uvicorn_config(object(), limit_concurrency=0),
        lambda: uvicorn_config(object(), token=" padded "),
        lambda: uvicorn_config(object(), token=""),
        lambda: BodyLimit(None, max_bytes=-1),
        lambda: BodyLimit(None, max_bytes=1.5),
        lambda: TimeLimit(None, seconds=0),
    ],
)
def test_bad_settings_are_argument_errors(make):
    with pytest.raises(ArgumentError):
        make()
