"""The HTTP/1.1 server `inferproxy serve` runs: asyncio protocol + httptools, ASGI inside.

Why not uvicorn: measured on a 2-core machine, uvicorn's per-request work
(scope, task, send/receive messages, header encoding) is ~17 µs more than a
bare httptools protocol answering the same request, more than a whole cache
hit costs (bench/README.md). A hit must cost no more than the upstream's own
fake generation, so the hot path cannot afford it.

This server speaks just the HTTP/1.1 the proxy's clients use and runs any
ASGI 3 app (lifespan included) with it:

- keep-alive (closed after `keep_alive_s` idle), `Connection: close`,
  HTTP/1.0, pipelined requests answered in order, `Expect: 100-continue`;
- request bodies streamed to `receive()` with backpressure; responses with
  `Content-Length` or chunked, written as they are sent, with backpressure
  on every answer, fast ones included: while a client does not read (its
  unsent answers over `MAX_UNSENT` plus the transport's high-water mark), no
  further answer is made and its requests are not read;
  `http.disconnect` once the client is gone;
- refused, and the connection closed after the answers owed before: a
  malformed request (400), an `Upgrade` request with a body (400: one without
  is answered as plain HTTP/1.1), `CONNECT` and `TRACE` (501), a request line
  or headers or trailers over `MAX_HEADER_BYTES` (414, 431), a head not
  complete `head_timeout_s` after its first byte (408; checked on the
  keep-alive tick, so up to two `keep_alive_s` later), a body not complete
  `body_timeout_s` after the tick that first sees it arriving (408, or the
  connection cut if its answer has begun);
- past `max_connections` open at once, a new connection gets `503` with
  `Retry-After: 1` at once, before anything of it is read, and is closed;
- trailer fields of a chunked body are dropped, never made headers;
- an app that fails before its answer started gives 500 (so does an answer
  whose header holds CR, LF or NUL), after it started the connection is cut;
- graceful shutdown: stop accepting, close idle connections, let requests
  in flight finish within the grace period, then the lifespan shutdown.

The server is three modules: this one (listening, lifespan, shutdown),
`app.http.connection` (one client connection: parsing, order, limits, writes) and
`app.http.exchange` (one request's ASGI cycle and the framing of its answer).

The fast path: for `POST` to one of `fast_paths`, the body is buffered (up
to `fast_body_bytes`, at most `FAST_BODY_BYTES`) and the whole request handed to `fast(...)`
synchronously, inside the protocol callback, before any task, scope or
message exists. It returns the complete answer (a cache hit) or None, in
which case the request goes to the ASGI app like any other. The server
keeps the framing (date, length, keep-alive) in both cases. The server's own
errors are rendered by the app's `render_error` (`app.http.asgi`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import socket
import time
import typing
from collections.abc import Awaitable, Callable, Iterable

from app.http.asgi import ASGIApp, ErrorRenderer, FastHandler, Message, plain_error
from app.http.connection import FAST_BODY_BYTES, MAX_TURNED_AWAY_LINGERING, HTTPConnection
from app.http.exchange import CLOCK, status_line

logger = logging.getLogger(__name__)


class HTTPServer:
    """Serves `app` on `host:port`. `serve()` runs until `request_exit()` (or SIGTERM/SIGINT)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        fast: FastHandler | None = None,
        fast_paths: Iterable[str] = (),
        fast_body_bytes: int = FAST_BODY_BYTES,
        render_error: ErrorRenderer = plain_error,
        keep_alive_s: float = 5.0,
        head_timeout_s: float = 30.0,
        body_timeout_s: float = 300.0,
        max_connections: int | None = None,
        shutdown_grace_s: float = 30.0,
        backlog: int = 2048,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        #: called as the shutdown begins, before requests in flight are waited for (the app's background
        #: work stops taking new work then, not once the requests are done)
        self.on_shutdown = on_shutdown
        self.host, self.port = host, port
        self.fast = fast
        self.fast_paths = frozenset(fast_paths) if fast is not None else frozenset()
        self.fast_body_bytes = min(fast_body_bytes, FAST_BODY_BYTES)
        self.render_error = render_error
        self.keep_alive_s = keep_alive_s
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections or _UNLIMITED
        self.turned_away = 0  # connections refused for being past `max_connections`, since the start
        self.lingering_turned_away = 0  # of them, those still open: their 503 sent, the client's bytes dropped
        self.shutdown_grace_s = shutdown_grace_s
        self.backlog = backlog
        self.clock = CLOCK
        self.connections: set[HTTPConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # requests' ASGI cycles, running on past their answer too
        self.closing = False
        self.forced = False  # a second signal: stop waiting for anything
        self.flushing: list[HTTPConnection] = []  # connections with fast answers to write this turn
        self.wakeup = asyncio.Event()  # set when a connection closes or a second signal comes, while stopping
        self.started = asyncio.Event()
        self.exit = ExitSignal(force=self._force)
        self._server: asyncio.Server | None = None
        self._lifespan = _Lifespan(app)
        self.state = self._lifespan.state

    # -- running -------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        """Lifespan startup, listen, wait for the exit request, shut down gracefully."""
        await self.exit.serve(self.start, self.shutdown, install_signal_handlers=install_signal_handlers)

    async def start(self) -> None:
        await self._lifespan.startup()
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: HTTPConnection(self), self.host, self.port, backlog=self.backlog
            )
        except BaseException as exc:
            await self._lifespan.shutdown()
            if isinstance(exc, OSError):
                raise CannotListen(f"cannot listen on {self.host}:{self.port}: {exc}") from exc
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("listening on http://%s:%d", self.host, self.port)
        self.started.set()

    def error_answer(self, status: int, message: str, headers: bytes = b"") -> bytes:
        """The server's own error answer, rendered by the app; the connection closes after it.

        `headers`: more header lines, each ending in CRLF.
        """
        content_type, body = self.render_error(status, message)
        head = b"content-type: %b\r\ncontent-length: %d\r\nconnection: close\r\n" % (content_type, len(body))
        return status_line(status) + head + headers + self.clock.date() + b"\r\n" + body

    # -- what its connections ask of it (`app.http.connection.Host`) ----------

    def admit(self, connection: HTTPConnection) -> bool:
        if len(self.connections) >= self.max_connections:
            return False
        self.connections.add(connection)
        return True

    def turn_away(self, connection: HTTPConnection) -> str | None:
        self.turned_away += 1
        self.lingering_turned_away += 1
        if self.turned_away & (self.turned_away - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            logger.warning(
                "turned away a connection from %s: max_connections (%d) are open; %d turned away so far",
                connection.client,
                len(self.connections),
                self.turned_away,
            )
        if self.lingering_turned_away > MAX_TURNED_AWAY_LINGERING:
            return None
        return f"the server has max_connections ({len(self.connections)}) connections open: retry later"

    def release(self, connection: HTTPConnection) -> None:
        if connection.turned_away:
            self.lingering_turned_away -= 1
        self.connections.discard(connection)
        if self.closing:
            self.wakeup.set()

    def track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def flush_soon(self, connection: HTTPConnection) -> None:
        if not self.flushing:
            connection.loop.call_soon(self.flush)
        self.flushing.append(connection)

    def flush(self) -> None:
        connections, self.flushing = self.flushing, []
        for connection in connections:
            try:
                connection.flush()
            except Exception:  # one broken connection must not strand the others' answers
                logger.exception("writing to %s failed", connection.client)
                connection.abort()

    def request_exit(self) -> None:
        self.exit.request_exit()

    def _force(self) -> None:
        self.forced = True
        self.wakeup.set()

    async def shutdown(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their answer; then the lifespan.

        Within `shutdown_grace_s` (or until a second signal): requests still arriving and
        requests in flight are answered, work an app does after its answer ends, and
        answers still in the socket's buffer reach their clients. What is left then is cut.
        """
        self.closing = True
        if self.on_shutdown is not None:
            self.on_shutdown()
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = time.monotonic() + self.shutdown_grace_s

        def pending() -> bool:
            # A request waiting for its client to read earlier answers has no task yet.
            return bool(self.tasks) or any(c.owes_answers for c in self.connections)

        while pending() and time.monotonic() < deadline and not self.forced:
            waiting = set(self.tasks) or {asyncio.ensure_future(asyncio.sleep(0.01))}
            await asyncio.wait(waiting, timeout=max(0.0, min(0.05, deadline - time.monotonic())))
        if pending():
            logger.warning("%d requests still in flight: cut off", len(self.tasks))
        for connection in list(self.connections):
            connection.abort_requests()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=5.0)
        # Closed, not aborted: what is still in a connection's buffer is sent first.
        for connection in list(self.connections):
            connection.close()
        while self.connections and time.monotonic() < deadline and not self.forced:
            self.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), max(0.0, deadline - time.monotonic()))
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
        await self._lifespan.shutdown()


_UNLIMITED = 1 << 62
#: A SIGTERM this soon after the first is the same stop, not a second one that cuts the requests in flight.
_SAME_STOP_S = 1.0


class ExitSignal:
    """When a server's `serve()` stops: at `request_exit()` or SIGTERM/SIGINT; a second signal
    calls `force` (stop waiting for the requests in flight). Shared by the built-in server and
    `app.service.uvicorn_server`, so that both stop alike."""

    def __init__(self, *, force: Callable[[], None]) -> None:
        self.force = force
        self._event: asyncio.Event | None = None
        self._first_at = -_SAME_STOP_S

    def request_exit(self) -> None:
        if self._event is not None:
            self._event.set()

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._event is not None and self._event.is_set():
            if signum == signal.SIGTERM and time.monotonic() - self._first_at < _SAME_STOP_S:
                # one stop sent twice: to the process and to its group (`timeout`, Slurm's scancel)
                logger.info(
                    "%s again within %g s: the same stop, still finishing requests in flight", name, _SAME_STOP_S
                )
                return
            logger.warning("%s again: not waiting for requests in flight", name)
            self.force()
            return
        self._first_at = time.monotonic()
        logger.info("%s: finishing requests in flight, then stopping", name)
        self.request_exit()

    async def serve(
        self,
        start: Callable[[], Awaitable[None]],
        shutdown: Callable[[], Awaitable[None]],
        *,
        install_signal_handlers: bool,
    ) -> None:
        """`start()`, wait for the exit request, `shutdown()`."""
        self._event = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signal_handlers else ()
        for signum in signals:
            loop.add_signal_handler(signum, self.on_signal, signum)
        try:
            await start()
            await self._event.wait()
            await shutdown()
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)


class CannotListen(OSError):
    """The address could not be bound (in use, not ours)."""


#: Where the kernel's ephemeral ports begin where /proc does not say (Linux's default).
_EPHEMERAL_LOW = 32768


def restartable_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server that will be stopped and started again on it (a proxy killed
    and restarted): below the kernel's ephemeral range, so that no bind to port 0 and no outgoing connection
    of another process is handed it while the server is down. A port of that range if none below is free."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = _EPHEMERAL_LOW
    below = range(max(1024, low - 12_000), low)
    for port in random.sample(below, min(len(below), 50)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        found: int = s.getsockname()[1]
        return found


class _Lifespan:
    """The ASGI lifespan protocol: startup before the first request, shutdown after the last."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.outbox: asyncio.Queue[Message] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.state: dict[str, typing.Any] = {}  # the app's lifespan state; each request's scope gets a copy

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.3"}, "state": self.state}
        self.task = asyncio.create_task(self._run(scope))
        await self.inbox.put({"type": "lifespan.startup"})
        message = await self._answer()
        if message["type"] != "lifespan.startup.complete":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.task), 5.0)
            if self.error is not None:
                raise self.error  # the app's own exception, as if it had been called directly
            raise RuntimeError(f"the application failed to start: {message.get('message', '')}")

    async def shutdown(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        message = await self._answer()
        if message["type"] != "lifespan.shutdown.complete":
            logger.error("the application failed to shut down cleanly: %s", message.get("message", ""))
        await asyncio.wait({self.task})
        if self.error is not None and not isinstance(self.error, asyncio.CancelledError):
            logger.error("the application's lifespan failed", exc_info=self.error)

    async def _answer(self) -> Message:
        assert self.task is not None
        getter = asyncio.ensure_future(self.outbox.get())
        await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        return {"type": "lifespan.failed", "message": "the lifespan ended without answering"}

    async def _run(self, scope: dict[str, typing.Any]) -> None:
        try:
            await self.app(scope, self.inbox.get, self.outbox.put)
        except BaseException as exc:
            self.error = exc
            await self.outbox.put({"type": "lifespan.failed", "message": f"{type(exc).__name__}: {exc}"})
