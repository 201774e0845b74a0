"""What lets a nostall service face a network: a token, body and time limits, slow-client
timeouts, and one error shape. The worker app (:mod:`nostall.serve.app`) and the embedding
service (:mod:`nostall.serve.embed`) share it.

- :class:`TokenAuth`: ``Authorization: Bearer <token>`` on every path but the probes,
  compared in constant time; 401 otherwise. :func:`resolve_token` refuses an empty one.
- :class:`BodyLimit`: 413 from ``Content-Length`` before a byte of the body is read, and
  from the running count for a chunked body; 408 when the body does not arrive in time;
  a client that leaves during its upload is one INFO line, not a traceback.
- :class:`TimeLimit`: a request that has not started its answer after ``seconds`` is
  cancelled and answered 504 (a handler waiting on a queued job sees the cancellation).
- :func:`uvicorn_config`: keep-alive and header timeouts, a header size cap and a
  connection limit for slow clients (the probes are answered beyond it), and a warning
  when a token-less service binds beyond loopback.
- :func:`run_server`: uvicorn that, on SIGTERM or SIGINT, lets the service drain before
  it stops taking connections.
- :func:`harden` puts the three middlewares on an app in the right order.

Errors are JSON ``{"error": {"type", "message", ...}}`` (:func:`error_response`).

>>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
(True, True, False)
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from nostall.errors import ArgumentError

__all__ = [
    "OPEN_PATHS",
    "TOKEN_ENV",
    "BodyLimit",
    "TimeLimit",
    "TokenAuth",
    "check_server",
    "error_response",
    "exposure_warning",
    "harden",
    "is_loopback",
    "resolve_token",
    "run_server",
    "uvicorn_config",
]

log = logging.getLogger(__name__)

#: Paths answered without a token: the probes an orchestrator calls.
OPEN_PATHS = ("/healthz", "/readyz")
#: The environment variable ``nostall serve`` and ``embed-server`` read a token from.
TOKEN_ENV = "NOSTALL_API_TOKEN"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_response(status: int, kind: str, message: str, **extra: Any):
    """A JSON error answer ``{"error": {"type": kind, "message": message, **extra}}``;
    ``headers=`` in ``extra`` become response headers."""
    from fastapi.responses import JSONResponse

    headers = extra.pop("headers", None)
    body = {"error": {"type": kind, "message": message, **extra}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _send_error(
    send: Send, status: int, kind: str, message: str, *, headers: Mapping[str, str] | None = None
) -> None:
    """:func:`error_response` straight onto an ASGI ``send`` (from a middleware)."""
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _client(scope: Scope) -> str:
    """``host:port`` of the client, for log lines (each names its client: a log filter
    that shows a repeated line once must not merge two clients' lines)."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


# ---- the token ----------------------------------------------------------------------------


def _token_ok(authorization: bytes | None, token: str) -> bool:
    scheme, _, given = (authorization or b"").partition(b" ")
    # compare_digest takes time independent of where the strings differ: a client cannot
    # find the token byte by byte from response times
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())


def _check_token(token: str | None) -> str | None:
    if token is None:
        return None
    if not isinstance(token, str) or not token.strip() or token != token.strip():
        got = f"{len(token)} chars" if isinstance(token, str) else type(token).__name__
        raise ArgumentError(
            f"the API token must be a non-empty string without surrounding spaces (got "
            f"{got}); an empty one would turn authentication off: give a token, or none "
            f"(and unset ${TOKEN_ENV})",
            field="token",
        )
    return token


def resolve_token(given: str | None) -> str | None:
    """The token a service runs with: ``given`` (``--api-token``), else
    ``$NOSTALL_API_TOKEN`` when it is set, checked either way: an empty or padded token
    (``--api-token ''``, ``NOSTALL_API_TOKEN=``) is an :class:`~nostall.ArgumentError`,
    never a service without authentication. ``None``: no token was asked for.

    >>> resolve_token("s3cret")
    's3cret'
    """
    if given is None:
        given = os.environ.get(TOKEN_ENV)  # set but empty: refused below, not "unset"
    return _check_token(given)


class TokenAuth:
    """ASGI middleware: every HTTP request outside ``open_paths`` must carry
    ``Authorization: Bearer <token>``; others get 401 (``WWW-Authenticate: Bearer``).
    ``token=None`` lets everything through."""

    def __init__(
        self, app: ASGIApp, *, token: str | None, open_paths: tuple[str, ...] = OPEN_PATHS
    ):
        self.app = app
        self.token = _check_token(token)
        self.open_paths = tuple(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.token is None
            or scope["type"] not in ("http", "websocket")
            or scope["path"] in self.open_paths
            or _token_ok(_header(scope, b"authorization"), self.token)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _send_error(
            send,
            401,
            "unauthorized",
            "this service needs 'Authorization: Bearer <token>' (the token it was started "
            f"with: --api-token or ${TOKEN_ENV})",
            headers={"WWW-Authenticate": "Bearer"},
        )


# ---- the body -----------------------------------------------------------------------------


class _TooLarge(Exception):
    def __init__(self, seen: int, limit: int):
        self.seen, self.limit = seen, limit


class _BodyTimeout(Exception):
    pass


class BodyLimit:
    """ASGI middleware capping request bodies at ``max_bytes`` (``limits`` maps a path to
    its own cap, e.g. a latents upload). A ``Content-Length`` above the cap is answered
    413 before the body is read (and the connection closed, so the rest is never taken
    in); a chunked body is counted as it arrives and refused once past the cap. A body
    that has not fully arrived ``timeout`` seconds after the request began gets 408. A
    client that disconnects during its upload is logged as one INFO line."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        limits: Mapping[str, int] | None = None,
        timeout: float | None = None,
    ):
        for name, v in {"max_bytes": max_bytes, **(limits or {})}.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ArgumentError(f"body limit {name}={v!r}: give a number of bytes >= 0")
        if timeout is not None and not timeout > 0:
            raise ArgumentError(f"body timeout={timeout!r}: give seconds > 0, or None")
        self.app = app
        self.max_bytes = max_bytes
        self.limits = dict(limits or {})
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.requests import ClientDisconnect

        where = f"{_client(scope)} {scope['method']} {scope['path']}"
        limit = self.limits.get(scope["path"], self.max_bytes)
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(
                    send,
                    400,
                    "malformed_request",
                    "Content-Length is not a number",
                    headers={"Connection": "close"},
                )
                return
            if int(declared) > limit:
                log.info("%s refused: Content-Length %s > %d", where, int(declared), limit)
                await _send_error(
                    send,
                    413,
                    "too_large",
                    f"a body of {int(declared)} bytes; {scope['path']} takes at most {limit}",
                    headers={"Connection": "close"},
                )
                return
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        seen = 0
        started = False
        complete = False  # the whole body is in: later receives wait for a disconnect

        async def counted() -> dict[str, Any]:
            nonlocal seen, complete
            if deadline is None or complete:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    raise _BodyTimeout from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(seen, limit)
                complete = not message.get("more_body", False)
            return message

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge as e:
            log.info("%s refused: body past %d bytes", where, e.limit)
            if not started:
                await _send_error(
                    send,
                    413,
                    "too_large",
                    f"a body of more than {e.limit} bytes; {scope['path']} takes at most {e.limit}",
                    headers={"Connection": "close"},
                )
        except _BodyTimeout:
            log.info("%s: the body did not arrive within %g s", where, self.timeout)
            if not started:
                await _send_error(
                    send,
                    408,
                    "body_timeout",
                    f"the request body did not arrive within {self.timeout:g} s",
                    headers={"Connection": "close"},
                )
        except ClientDisconnect:
            log.info("%s: the client left during its upload (%d bytes received)", where, seen)


# ---- the time limit -----------------------------------------------------------------------


class TimeLimit:
    """ASGI middleware: a request whose answer has not started ``seconds`` after it
    arrived is cancelled and answered 504 (an answer already under way is let finish).
    ``limits`` maps a path to its own limit (``None`` there: no limit)."""

    def __init__(
        self, app: ASGIApp, *, seconds: float, limits: Mapping[str, float | None] | None = None
    ):
        for name, v in {"seconds": seconds, **(limits or {})}.items():
            if v is not None and (isinstance(v, bool) or not v > 0):
                raise ArgumentError(f"time limit {name}={v!r}: give seconds > 0")
        self.app = app
        self.seconds = seconds
        self.limits = dict(limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        seconds = self.limits.get(scope.get("path"), self.seconds)
        if scope["type"] != "http" or seconds is None:
            await self.app(scope, receive, send)
            return
        started = asyncio.Event()

        async def tracked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.set()
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracked))
        answering = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait(
                {task, answering}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
            if task.done() or started.is_set():
                await task  # finished, or answering: its own pace from here
                return
            task.cancel()
            # wait, not `await task`: its CancelledError would look like one aimed at us
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                log.info(
                    "%s %s ended with %r after its time limit",
                    scope["method"],
                    scope["path"],
                    task.exception(),
                )
            if started.is_set():  # it answered while being cancelled
                return
            log.info(
                "%s %s %s: no answer within %g s; cancelled",
                _client(scope),
                scope["method"],
                scope["path"],
                seconds,
            )
            await _send_error(
                send, 504, "time_limit", f"no answer within the {seconds:g} s request limit"
            )
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            answering.cancel()


def harden(
    app: Any,
    *,
    token: str | None = None,
    max_body: int = 1 << 20,
    body_limits: Mapping[str, int] | None = None,
    body_timeout: float | None = 120.0,
    time_limit: float | None = None,
    time_limits: Mapping[str, float | None] | None = None,
) -> Any:
    """Add :class:`TimeLimit` (if ``time_limit``), :class:`TokenAuth` and
    :class:`BodyLimit` to a Starlette/FastAPI ``app`` and return it. Order, outermost
    first: the body cap and upload errors, then the token (a token-less request is
    refused before its body is read), then the time limit around the handler."""
    if time_limit is not None:
        app.add_middleware(TimeLimit, seconds=time_limit, limits=time_limits)
    app.add_middleware(TokenAuth, token=token)
    app.add_middleware(BodyLimit, max_bytes=max_body, limits=body_limits, timeout=body_timeout)
    return app


# ---- the server -----------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the service on this machine (``localhost``,
    127.0.0.0/8, ``::1``); ``0.0.0.0``, ``::`` and other names are not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, token: str | None, *, what: str = "the service") -> str | None:
    """The warning to show when ``what`` binds beyond loopback without a token, else
    ``None``."""
    if token or is_loopback(host):
        return None
    return (
        f"{what} binds {host}, beyond this machine, and takes requests without a token: "
        f"anyone who reaches the port can use it; pass --api-token (or set ${TOKEN_ENV})"
    )


def check_server(
    *, host: str, port: int, token: str | None, what: str = "the service", warn: bool = True
) -> None:
    """:class:`~nostall.ArgumentError` for a port outside 0..65535 (0: any free one) or a
    blank token; logs :func:`exposure_warning` when there is one (and ``warn``). A
    command calls it before it loads anything."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ArgumentError(f"port={port!r}: give 1..65535")
    if not isinstance(host, str) or not host.strip():
        raise ArgumentError(f"host={host!r}: give an address to bind, e.g. 127.0.0.1")
    warning = exposure_warning(host, _check_token(token), what=what)
    if warning and warn:
        log.warning(warning)


def _protocol(header_timeout: float, limit: int | None) -> type:
    """uvicorn's h11 protocol with a deadline for a request's headers: a connection that
    has not sent a complete head ``header_timeout`` seconds after it opened, or after its
    previous answer, is closed. (uvicorn's keep-alive timer stops at the first byte, so a
    client sending a header a byte at a time would hold its connection for ever.)

    And uvicorn's concurrency limit, but for the probes: beyond ``limit`` open
    connections or requests, a request gets 503, except :data:`OPEN_PATHS`, which are
    answered (an orchestrator must not restart a worker that idle or slow clients
    crowd; uvicorn's own ``limit_concurrency`` answers 503 to everything)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        # uvicorn internals relied on (0.3x–0.5x): loop, cycle, transport, handle_events,
        # on_response_complete, connection_made/lost, app, connections, tasks;
        # tests/serve/test_http.py covers them.
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            if limit is not None:  # (one protocol object per connection)
                self.app = self._within_limit(self.app)
            self._arm()

        def _within_limit(self, app: ASGIApp) -> ASGIApp:
            async def limited(scope: Scope, receive: Receive, send: Send) -> None:
                # (this request's connection and task are among those counted)
                if (
                    scope["type"] == "http"
                    and scope["path"] not in OPEN_PATHS
                    and (len(self.connections) > limit or len(self.tasks) > limit)
                ):
                    log.warning(
                        "%s %s refused: more than %d connections or requests at once",
                        _client(scope),
                        scope["path"],
                        limit,
                    )
                    await _send_error(
                        send,
                        503,
                        "too_many_connections",
                        f"more than {limit} connections or requests at once; retry shortly",
                        headers={"Retry-After": "1"},
                    )
                    return
                await app(scope, receive, send)

            return limited

        def _arm(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a pipelined request's head is already here
            self._waiting_after = self.cycle
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                log.info(
                    "closed a connection from %s: no request head within %g s",
                    self.client,
                    header_timeout,
                )
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self._deadline is not None and self.cycle is not self._waiting_after:
                self._deadline.cancel()  # a new request's head arrived
                self._deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._deadline is None:
                self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return HeaderDeadline


def uvicorn_config(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    limit_concurrency: int | None = 256,
    timeout_keep_alive: int = 5,
    header_timeout: float = 10.0,
    max_header_bytes: int = 16 << 10,
    graceful_shutdown: int | None = None,
    log_level: str = "info",
    what: str = "the service",
    warn: bool = True,
):
    """A ``uvicorn.Config`` for facing slow or hostile clients: h11 with a header deadline
    (``header_timeout``) and a cap on a request head's size (``max_header_bytes``, 400
    beyond), idle keep-alive connections closed after ``timeout_keep_alive`` seconds,
    and at most ``limit_concurrency`` connections and requests at once (503 beyond, the
    probes excepted). ``graceful_shutdown``: seconds uvicorn waits for open requests
    once it stops (then cancels them). :func:`check_server` first (``warn=False``: a
    caller that already called it)."""
    import uvicorn

    check_server(host=host, port=port, token=token, what=what, warn=warn)
    for name, v in (
        ("timeout_keep_alive", timeout_keep_alive),
        ("header_timeout", header_timeout),
        ("max_header_bytes", max_header_bytes),
    ):
        if isinstance(v, bool) or not v > 0:
            raise ArgumentError(f"{name}={v!r}: must be > 0")
    if limit_concurrency is not None and (
        isinstance(limit_concurrency, bool) or not limit_concurrency >= 1
    ):
        raise ArgumentError(f"limit_concurrency={limit_concurrency!r}: give >= 1, or None")
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_protocol(header_timeout, limit_concurrency),
        h11_max_incomplete_event_size=max_header_bytes,
        limit_concurrency=None,  # the protocol's own limit, which answers the probes
        timeout_keep_alive=timeout_keep_alive,
        timeout_graceful_shutdown=graceful_shutdown,
        log_level=log_level,
    )


def run_server(config: Any, *, drain: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Run uvicorn with ``config`` until a signal stops it.

    With ``drain``, the first SIGTERM or SIGINT calls ``drain(done)`` instead of stopping:
    the server keeps its port and its connections (the app answers new work 503 and its
    readiness probe 503 meanwhile), and shuts down as usual once ``done()`` is called
    (from any thread). A second signal stops it at once, as uvicorn does. As with plain
    uvicorn, the process then ends by the signal it was sent."""
    import uvicorn

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if drain is None or self.draining:
                super().handle_exit(sig, frame)
                return
            self.draining = True
            self._captured_signals.append(sig)  # re-raised once uvicorn has stopped
            log.info("signal %d: draining before shutdown (a second signal stops at once)", sig)
            drain(self._done)

        def _done(self) -> None:
            self.should_exit = True  # the main loop polls it every 0.1 s

    Server(config).run()
