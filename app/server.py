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
  `Content-Length` or chunked, written as they are sent, with backpressure;
  `http.disconnect` once the client is gone;
- a malformed request gets 400 and the connection is closed; headers over
  `MAX_HEADER_BYTES` get 431; an app that fails before its answer started
  gives 500, after it started the connection is cut;
- graceful shutdown: stop accepting, close idle connections, let requests
  in flight finish within the grace period, then the lifespan shutdown.

The fast path: for `POST` to one of `fast_paths`, the body is buffered (up
to `FAST_BODY_BYTES`) and the whole request handed to `fast(...)`
synchronously, inside the protocol callback, before any task, scope or
message exists. It returns the complete answer (a cache hit) or None, in
which case the request goes to the ASGI app like any other. The server
keeps the framing (date, length, keep-alive) in both cases.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import logging
import signal
import time
import typing
from collections.abc import Callable, Iterable
from http import HTTPStatus
from urllib.parse import unquote

import httptools

from app.asgi import ASGIApp, Headers, Message

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
FAST_BODY_BYTES = 256 * 1024
HIGH_WATER = 1 << 20  # request body bytes buffered before the socket stops being read

# (status, headers, body) of a complete answer, or None: let the ASGI app answer.
FastAnswer = tuple[int, Headers, bytes]
FastPath = Callable[[str, Headers, bytes, dict[str, typing.Any]], "FastAnswer | None"]

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"date"})  # the server's to write
_ERROR_TEMPLATE = b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":%d}}'


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))
        _STATUS_LINES[status] = line
    return line


class _Clock:
    """The `Date` header, formatted once a second."""

    def __init__(self) -> None:
        self.second = 0
        self.header = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.header = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.header


class HTTPServer:
    """Serves `app` on `host:port`. `serve()` runs until `request_exit()` (or SIGTERM/SIGINT)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        fast: FastPath | None = None,
        fast_paths: Iterable[str] = (),
        keep_alive_s: float = 5.0,
        shutdown_grace_s: float = 30.0,
        backlog: int = 2048,
    ) -> None:
        self.app = app
        self.host, self.port = host, port
        self.fast = fast
        self.fast_paths = frozenset(fast_paths) if fast is not None else frozenset()
        self.keep_alive_s = keep_alive_s
        self.shutdown_grace_s = shutdown_grace_s
        self.backlog = backlog
        self.clock = _Clock()
        self.connections: set[HTTPConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # requests' ASGI cycles, running on past their answer too
        self.closing = False
        self.started = asyncio.Event()
        self._exit: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._lifespan = _Lifespan(app)

    # -- running -------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        """Lifespan startup, listen, wait for the exit request, shut down gracefully."""
        self._exit = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signal_handlers else ()
        for signum in signals:
            loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            await self.start()
            await self._exit.wait()
            await self.shutdown()
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)

    async def start(self) -> None:
        await self._lifespan.startup()
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: HTTPConnection(self), self.host, self.port, backlog=self.backlog
            )
        except BaseException:
            await self._lifespan.shutdown()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("listening on http://%s:%d", self.host, self.port)
        self.started.set()

    def request_exit(self) -> None:
        if self._exit is not None:
            self._exit.set()

    def _on_signal(self, signum: int) -> None:
        if self._exit is not None and self._exit.is_set():
            logger.warning("%s again: not waiting for requests in flight", signal.Signals(signum).name)
            self.shutdown_grace_s = 0
            for connection in list(self.connections):
                connection.abort()
            return
        logger.info("%s: finishing requests in flight, then stopping", signal.Signals(signum).name)
        self.request_exit()

    async def shutdown(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their answer; then the lifespan."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = time.monotonic() + self.shutdown_grace_s
        while self.tasks and time.monotonic() < deadline:
            await asyncio.wait(set(self.tasks), timeout=max(0.0, min(0.1, deadline - time.monotonic())))
        if self.tasks:
            logger.warning("%d requests still in flight after %.0f s: cut off", len(self.tasks), self.shutdown_grace_s)
        for connection in list(self.connections):
            connection.abort()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=5.0)
        if self._server is not None:
            await self._server.wait_closed()
        await self._lifespan.shutdown()


class _Lifespan:
    """The ASGI lifespan protocol: startup before the first request, shutdown after the last."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.outbox: asyncio.Queue[Message] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.3"}, "state": {}}
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


class HTTPConnection(asyncio.Protocol):
    """One client connection: parses requests, runs them in order, writes their answers."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.parsing: Request | None = None  # whose headers/body are arriving
        self.active: Request | None = None  # whose answer is being produced
        self.waiting: collections.deque[Request] = collections.deque()  # pipelined behind it
        self.url = b""
        self.headers: Headers = []
        self.header_bytes = 0
        self.closed = False
        self.closing = False
        self.reading_paused = False
        self.writable: asyncio.Event | None = None  # set while the transport accepts writes
        self.idle_timer: asyncio.TimerHandle | None = None
        self.requests = 0  # begun on this connection; the idle timer compares it with its last look
        self.requests_seen = -1

    @property
    def busy(self) -> bool:
        return self.active is not None or bool(self.waiting)

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.local = (str(sock[0]), int(sock[1])) if isinstance(sock, tuple) else None
        self.server.connections.add(self)
        if self.server.closing:
            self.abort()
            return
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An Upgrade (h2c, websocket) is not spoken here: the request is answered as
            # plain HTTP/1.1 (which RFC 9110 allows) and the connection closed after it.
            if self.parsing is not None:
                self.parsing.keep_alive = False
            elif self.active is not None:
                self.active.keep_alive = False
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Rejected):  # else: answered and closing already
                logger.error("a request on %s broke the server", self.client, exc_info=exc.__context__)
                self.abort()
        except httptools.HttpParserError as exc:
            with contextlib.suppress(_Rejected):
                self._reject(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._cancel_idle_timer()
        for request in (self.active, *self.waiting, self.parsing):
            if request is not None:
                request.disconnect()
        self.waiting.clear()
        if self.writable is not None:
            self.writable.set()

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = asyncio.Event()
        self.writable.clear()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()

    # -- httptools callbacks -------------------------------------------------

    def on_message_begin(self) -> None:
        self.requests += 1
        self.url = b""
        self.headers = []
        self.header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > MAX_HEADER_BYTES:
            self._reject(414, f"the request line is over {MAX_HEADER_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            self._reject(431, f"the request headers are over {MAX_HEADER_BYTES} bytes")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        try:
            url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "the request target is not a valid URL")
        raw_path = url.path or b"/"
        method = parser.get_method().decode("ascii")
        request = Request(
            self,
            method,
            raw_path,
            url.query or b"",
            self.headers,
            parser.get_http_version(),
            parser.should_keep_alive() and not self.closing,
        )
        self.parsing = request
        if method == "POST" and self.server.fast_paths and request.path in self.server.fast_paths:
            # Buffered whole and answered in on_message_complete if the fast path can.
            request.deferred = not request.expect_continue
        if not request.deferred:
            self._schedule(request)

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        if request is None:
            return
        request.add_body(body)
        if request.deferred and request.body_size > FAST_BODY_BYTES:
            request.deferred = False
            self._schedule(request)

    def on_message_complete(self) -> None:
        request = self.parsing
        if request is None:
            return
        self.parsing = None
        request.body_complete = True
        if request.deferred:
            request.deferred = False
            if self.active is None and not self.waiting and self._answer_fast(request):
                return
            self._schedule(request)
        else:
            request.wake()
            if request.response_complete and not self.busy and not self.closed:
                self._arm_idle_timer()  # answered before its body was all read

    # -- request scheduling ----------------------------------------------------

    def _answer_fast(self, request: Request) -> bool:
        """The synchronous fast path; True if it answered."""
        fast = self.server.fast
        assert fast is not None
        body = b"".join(request.body) if len(request.body) != 1 else request.body[0]
        try:
            answer = fast(request.path, request.headers, body, request.extensions)
        except Exception:
            logger.exception("the fast path failed on %s %s; the app answers instead", request.method, request.path)
            answer = None
        if answer is None:
            request.body = [body]
            return False
        status, headers, content = answer
        self.transport.write(request.head(status, headers, len(content)) + content)
        self._finished(request)
        return True

    def _schedule(self, request: Request) -> None:
        if self.active is None:
            self._start(request)
        else:
            self.waiting.append(request)

    def _start(self, request: Request) -> None:
        self.active = request
        task = request.task = self.loop.create_task(request.run())
        tasks = self.server.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _finished(self, request: Request) -> None:
        """The answer to `request` is complete: next request, keep-alive, or close."""
        if self.active is request:
            self.active = None
        if not request.keep_alive or self.closed:
            self.closing = True
            self.waiting.clear()
            if not self.closed:
                self.transport.close()
            return
        if self.reading_paused and self.active is None:
            self.resume_reading()
        if self.waiting:
            self._start(self.waiting.popleft())
        elif self.active is None and self.parsing is None:
            if self.closing or self.server.closing:
                self.transport.close()
            else:
                self._arm_idle_timer()

    # -- flow control and closing ----------------------------------------------

    def pause_reading(self) -> None:
        if not self.reading_paused and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    async def drain(self) -> None:
        if self.writable is not None and not self.writable.is_set() and not self.closed:
            await self.writable.wait()

    def close_when_idle(self) -> None:
        self.closing = True
        for request in (self.active, *self.waiting, self.parsing):
            if request is not None and not request.response_started:
                request.keep_alive = False
        if not self.busy and self.parsing is None and not self.closed:
            self.transport.close()

    def abort(self) -> None:
        if not self.closed:
            self.transport.abort()
        for request in (self.active, *self.waiting):
            if request is not None and request.task is not None:
                request.task.cancel()

    def _arm_idle_timer(self) -> None:
        # One timer per connection, not one per request: when it fires it closes the
        # connection only if no request began since it was armed (idle keep_alive_s to 2x).
        if self.idle_timer is None and not self.closed:
            self.requests_seen = self.requests
            self.idle_timer = self.loop.call_later(self.server.keep_alive_s, self._idle_timeout)

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _idle_timeout(self) -> None:
        self.idle_timer = None
        if self.closed or self.busy or self.parsing is not None or self.requests != self.requests_seen:
            self._arm_idle_timer()
        else:
            self.transport.close()

    def _reject(self, status: int, message: str) -> typing.NoReturn:
        """Answer a request this server cannot take, close the connection and stop parsing."""
        if not self.closed and self.active is None and not self.waiting:
            body = _ERROR_TEMPLATE % (message.replace('"', "'").encode("latin-1", "replace"), status)
            head = (
                status_line(status)
                + b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n" % len(body)
                + self.server.clock.date()
                + b"\r\n"
            )
            self.transport.write(head + body)
            self.transport.close()
        elif not self.closed:
            self.transport.abort()  # an answer is still owed before this one: nothing can be said in order
        self.parsing = None
        raise _Rejected(message)


class _Rejected(Exception):
    """Raised out of a parser callback: the connection is closing, stop parsing."""


class Request:
    """One request's ASGI cycle: its `receive()` and `send()`."""

    # What every request starts with, as class attributes: a request answered on the
    # fast path sets only what it uses (measured: ~1 µs less per hit than 25 slots).
    deferred = False
    body_complete = False
    request_sent = False
    continue_sent = False
    disconnected = False
    response_started = False
    response_complete = False
    chunked = False
    head_pending = b""
    flush_handle: asyncio.Handle | None = None
    expected_length: int | None = None
    written = 0
    waiter: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None

    def __init__(
        self,
        conn: HTTPConnection,
        method: str,
        raw_path: bytes,
        query: bytes,
        headers: Headers,
        http_version: str,
        keep_alive: bool,
    ) -> None:
        self.conn = conn
        self.method = method
        self.raw_path = raw_path
        self.path = unquote(raw_path.decode("latin-1")) if b"%" in raw_path else raw_path.decode("latin-1")
        self.query = query
        self.headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.expect_continue = http_version == "1.1" and (b"expect", b"100-continue") in headers
        self.extensions: dict[str, typing.Any] = {}
        self.body: list[bytes] = []
        self.body_size = 0

    # -- body arriving -----------------------------------------------------------

    def add_body(self, chunk: bytes) -> None:
        self.body.append(chunk)
        self.body_size += len(chunk)
        if self.body_size > HIGH_WATER and not self.deferred:
            self.conn.pause_reading()
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake()

    # -- ASGI ------------------------------------------------------------------

    def scope(self) -> dict[str, typing.Any]:
        conn = self.conn
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "server": conn.local,
            "client": conn.client,
            "scheme": "http",
            "method": self.method,
            "root_path": "",
            "path": self.path,
            "raw_path": self.raw_path,
            "query_string": self.query,
            "headers": self.headers,
            "state": {},
            "extensions": self.extensions,
        }

    async def run(self) -> None:
        try:
            await self.conn.server.app(self.scope(), self.receive, self.send)
        except asyncio.CancelledError:
            self._cut()
            raise
        except BaseException:
            logger.exception("%s %s failed", self.method, self.path)
            if not self.response_started and not self.disconnected:
                self._internal_error()
            else:
                self._cut()
        else:
            if not self.response_complete:
                if not self.response_started and not self.disconnected:
                    logger.error("%s %s: the application returned without answering", self.method, self.path)
                    self._internal_error()
                else:
                    self._cut()

    async def receive(self) -> Message:
        conn = self.conn
        if self.expect_continue and not self.continue_sent and not self.response_started and not conn.closed:
            self.continue_sent = True
            conn.transport.write(_CONTINUE)
        while True:
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            if self.body or (self.body_complete and not self.request_sent):
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body = []
                self.body_size = 0
                if conn.active is self:
                    conn.resume_reading()
                self.request_sent = self.body_complete
                return {"type": "http.request", "body": body, "more_body": not self.body_complete}
            self.waiter = conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("http.response.start sent twice")
            self.response_started = True
            headers: Headers = message.get("headers", [])
            length: int | None = None
            for name, value in headers:
                name = name.lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.lower() == b"close":
                    self.keep_alive = False
            self.expected_length = length
            self.chunked = length is None and self.method != "HEAD" and message["status"] not in (204, 304)
            self.head_pending = self.head(message["status"], headers, length)
            # Written with the first body part if that comes before the loop turns (one
            # write for a whole answer), else on its own so that a stream's headers are not late.
            self.flush_handle = self.conn.loop.call_soon(self._flush_head)
        elif kind == "http.response.body":
            if not self.response_started:
                raise RuntimeError("http.response.body sent before http.response.start")
            if self.response_complete:
                raise RuntimeError("http.response.body sent after the response was complete")
            body: bytes = message.get("body", b"")
            more = bool(message.get("more_body", False))
            conn = self.conn
            if self.method == "HEAD":
                body = b""
            self.written += len(body)
            if self.chunked:
                data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
                if not more:
                    data += b"0\r\n\r\n"
            else:
                data = body
            if self.head_pending:
                data = self.head_pending + data
                self.head_pending = b""
                if self.flush_handle is not None:
                    self.flush_handle.cancel()
                    self.flush_handle = None
            if data and not conn.closed:
                conn.transport.write(data)
            if not more:
                self.response_complete = True
                self.wake()
                if self.expected_length is not None and self.method != "HEAD" and self.written != self.expected_length:
                    logger.error(
                        "%s %s: the answer had %d bytes, not its Content-Length %d",
                        self.method,
                        self.path,
                        self.written,
                        self.expected_length,
                    )
                    self.keep_alive = False
                conn._finished(self)
            else:
                await conn.drain()
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def head(self, status: int, headers: Headers, length: int | None) -> bytes:
        """Status line and headers; adds Content-Length or chunked framing, Date and Connection."""
        lines = b"".join([b"%b: %b\r\n" % (n, v) for n, v in headers if n.lower() not in _FRAMING])
        if length is not None:
            lines += b"content-length: %d\r\n" % length
        elif self.method != "HEAD" and status not in (204, 304) and status >= 200:
            lines += b"transfer-encoding: chunked\r\n"
        if not self.keep_alive:
            lines += b"connection: close\r\n"
        elif self.http_version == "1.0":
            lines += b"connection: keep-alive\r\n"
        return status_line(status) + lines + self.conn.server.clock.date() + b"\r\n"

    def _flush_head(self) -> None:
        self.flush_handle = None
        if self.head_pending and not self.conn.closed:
            self.conn.transport.write(self.head_pending)
        self.head_pending = b""

    def _internal_error(self) -> None:
        body = _ERROR_TEMPLATE % (b"inferproxy failed on this request", 500)
        self.keep_alive = False
        head = self.head(500, [(b"content-type", b"application/json")], len(body))
        if not self.conn.closed:
            self.conn.transport.write(head + body)
        self.response_started = self.response_complete = True
        self.conn._finished(self)

    def _cut(self) -> None:
        """The answer cannot be completed: drop the connection so the client sees it cut short."""
        if self.response_complete:
            return  # answered already; what failed came after
        self.response_complete = True
        self.keep_alive = False
        if self.flush_handle is not None:
            self.flush_handle.cancel()
        conn = self.conn
        if not conn.closed:
            conn.transport.abort()
        if conn.active is self:
            conn.active = None
