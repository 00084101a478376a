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
DISCARD_BYTES = 64 * 1024 * 1024  # of a body left unread by an early answer, read and dropped before closing
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
REQUEST_STALL_S = 30.0  # a request that stops arriving part-way, with nothing in flight, is dropped after this

# (status, header lines, body) of a complete answer, or None: let the ASGI app answer. The
# header lines are rendered already (b"name: value\r\n" each); the server adds the framing.
FastAnswer = tuple[int, bytes, bytes]
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
        self.forced = False  # a second signal: stop waiting for anything
        self.flushing: list[HTTPConnection] = []  # connections with fast answers to write this turn
        self.wakeup = asyncio.Event()  # set when a connection closes or a second signal comes, while stopping
        self.started = asyncio.Event()
        self._exit: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._lifespan = _Lifespan(app)
        self.state = self._lifespan.state

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
        except BaseException as exc:
            await self._lifespan.shutdown()
            if isinstance(exc, OSError):
                raise CannotListen(f"cannot listen on {self.host}:{self.port}: {exc}") from exc
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("listening on http://%s:%d", self.host, self.port)
        self.started.set()

    def flush(self) -> None:
        connections, self.flushing = self.flushing, []
        for connection in connections:
            try:
                connection.flush()
            except Exception:  # one broken connection must not strand the others' answers
                logger.exception("writing to %s failed", connection.client)
                connection.abort()

    def request_exit(self) -> None:
        if self._exit is not None:
            self._exit.set()

    def _on_signal(self, signum: int) -> None:
        if self._exit is not None and self._exit.is_set():
            logger.warning("%s again: not waiting for requests in flight", signal.Signals(signum).name)
            self.forced = True
            self.wakeup.set()
            return
        logger.info("%s: finishing requests in flight, then stopping", signal.Signals(signum).name)
        self.request_exit()

    async def shutdown(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their answer; then the lifespan.

        Within `shutdown_grace_s` (or until a second signal): requests still arriving and
        requests in flight are answered, work an app does after its answer ends, and
        answers still in the socket's buffer reach their clients. What is left then is cut.
        """
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = time.monotonic() + self.shutdown_grace_s

        def pending() -> bool:
            return bool(self.tasks) or any(c.parsing is not None for c in self.connections)

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


class CannotListen(OSError):
    """The address could not be bound (in use, not ours)."""


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


class HTTPConnection(asyncio.Protocol):
    """One client connection: parses requests, runs them in order, writes their answers."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.parsing: Request | None = None  # whose body is arriving (or, once answered, being thrown away)
        self.active: Request | None = None  # whose answer is being produced
        self.waiting: collections.deque[Request] = collections.deque()  # pipelined behind it
        self.url = b""
        self.headers: Headers = []
        self.header_bytes = 0  # of the request line and headers parsed so far
        self.in_head = False  # between a request's first byte and the end of its headers
        self.head_bytes = 0  # bytes received while in_head, whole chunks after the first
        self.raw_body_left = 0  # body bytes of an Upgrade request, read past the parser
        self.refusal: bytes | None = None  # an error answer owed after the answers before it
        self.closed = False
        self.closing = False
        self.reading_paused = False
        self.writable: asyncio.Event | None = None  # set while the transport accepts writes
        self.idle_timer: asyncio.TimerHandle | None = None
        self.requests = 0  # begun on this connection; the idle timer compares it with its last look
        self.requests_seen = -1
        self.bytes_in = 0
        self.bytes_seen = -1
        self.stalled_ticks = 0
        self.lingering = False  # refused and half-closed: what still arrives is dropped
        self.outbox: list[bytes] = []  # fast answers waiting for the end of the loop's turn

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
        if self.lingering:
            return
        self.bytes_in += len(data)
        if self.raw_body_left:
            data = self._raw_body(data)
            if not data:
                return
        was_in_head, requests = self.in_head, self.requests
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # Upgrades (h2c, websocket) are not spoken here: the request is answered as plain
            # HTTP/1.1, as RFC 9110 §7.8 allows. llhttp stops parsing at the end of its head;
            # its body and the requests after it are read on with a fresh parser.
            self.parser = httptools.HttpRequestParser(self)
            rest = data[upgrade.args[0] :]
            if rest:
                self.data_received(rest)
            return
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Rejected):  # else: refused and closing already
                logger.error("a request on %s broke the server", self.client, exc_info=exc.__context__)
                self.abort()
            return
        except httptools.HttpParserError as exc:
            with contextlib.suppress(_Rejected):
                self._reject(400, f"malformed HTTP request: {exc}")
            return
        # httptools hands over a header only once its line ends: a line that never ends is
        # caught here, counting the chunks that were all head (at most one chunk is not counted).
        if self.in_head and was_in_head and self.requests == requests:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEADER_BYTES:
                with contextlib.suppress(_Rejected):
                    self._reject(431, f"the request headers are over {MAX_HEADER_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.server.closing:
            self.server.wakeup.set()
        self._cancel_idle_timer()
        for request in (self.active, *self.waiting, self.parsing):
            if request is not None:
                request.disconnect()
        self.waiting.clear()
        if self.writable is not None:
            self.writable.set()

    def pause_writing(self) -> None:
        # The client does not read its answers: stop reading its requests too, or a
        # pipelining client that never reads would make the server buffer without end.
        if self.writable is None:
            self.writable = asyncio.Event()
        self.writable.clear()
        self.pause_reading()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()
        self.resume_reading()

    def eof_received(self) -> None:
        """The client closed its side: the answers queued already go out, then the connection closes.

        As with uvicorn, that end is taken for the client leaving (an app streaming to it, or
        waiting for its body, hears http.disconnect): a client that only half-closes gets the
        answers made by now and no later one.
        """
        self.flush()

    # -- httptools callbacks -------------------------------------------------

    def on_message_begin(self) -> None:
        self.requests += 1
        self.url = b""
        self.headers = []
        self.header_bytes = self.head_bytes = 0
        self.in_head = True

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > MAX_HEADER_BYTES:
            self._reject(414, f"the request line is over {MAX_HEADER_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self.header_bytes > MAX_HEADER_BYTES:
            self._reject(431, f"the request headers are over {MAX_HEADER_BYTES} bytes")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        parser = self.parser
        try:
            url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "the request target is not a valid URL")
        method = parser.get_method().decode("ascii")
        request = Request(
            self,
            method,
            url.path or b"/",
            url.query or b"",
            self.headers,
            parser.get_http_version(),
            parser.should_keep_alive() and not self.closing,
        )
        self.parsing = request
        if parser.should_upgrade():
            self._read_past_upgrade(request)
        elif method == "POST" and self.server.fast_paths and request.path in self.server.fast_paths:
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
        if request is not None and not self.raw_body_left:
            self._message_complete(request)

    # -- requests: in order, one at a time ---------------------------------------

    def _message_complete(self, request: Request) -> None:
        self.parsing = None
        request.body_complete = True
        if request.deferred:
            request.deferred = False
            if self.active is None and not self.waiting and self._answer_fast(request):
                return
            self._schedule(request)
            return
        request.wake()
        if request.response_complete and not self.busy and not self.closed:
            # Answered before its body was all read (413, 401): the body has been thrown away.
            if self.closing or self.server.closing:
                self._close()
            else:
                self._arm_idle_timer()

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
        status, lines, content = answer
        self.write_soon(request.head_from_lines(status, lines, len(content)) + content)
        self._finished(request)
        return True

    def _schedule(self, request: Request) -> None:
        if self.active is None:
            self._start(request)
        else:
            self.waiting.append(request)
            self.pause_reading()  # one request queued is enough: the client waits for its answers

    def _start(self, request: Request) -> None:
        self.active = request
        task = request.task = self.loop.create_task(request.run())
        tasks = self.server.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _finished(self, request: Request) -> None:
        """The answer to `request` is complete: next request, refusal, keep-alive, or close."""
        if self.active is request:
            self.active = None
        if not request.keep_alive or self.closed:
            self.closing = True
            self.waiting.clear()
            if not self.closed:
                self._close()
            return
        if self.waiting:
            self._start(self.waiting.popleft())
            if not self.waiting and self.refusal is None:
                self.resume_reading()
        elif self.active is None:
            if self.refusal is not None:
                self._send_refusal()
            elif self.parsing is None and (self.closing or self.server.closing):
                self._close()
            else:
                self.resume_reading()
                self._arm_idle_timer()

    def _read_past_upgrade(self, request: Request) -> None:
        """llhttp skips the body of an Upgrade request: a Content-Length body is read here instead."""
        length = b"0"
        for name, value in request.headers:
            if name == b"transfer-encoding":
                self._reject(400, "an Upgrade request cannot have a chunked body here: send it without Upgrade")
            if name == b"content-length":
                length = value
        self.raw_body_left = int(length) if length.isdigit() else 0

    def _raw_body(self, data: bytes) -> bytes:
        """Feed an Upgrade request's body from `data`; return what comes after it."""
        piece, rest = data[: self.raw_body_left], data[self.raw_body_left :]
        self.raw_body_left -= len(piece)
        request = self.parsing
        if request is not None:
            self.on_body(piece)
            if not self.raw_body_left:
                self._message_complete(request)
        return rest

    # -- writing, flow control and closing ----------------------------------------

    def write(self, data: bytes) -> None:
        """Write now, after what the fast path queued on this connection."""
        if self.outbox:
            self.flush()
        self.transport.write(data)

    def write_soon(self, data: bytes) -> None:
        """Queue `data` for one write at the end of this turn of the event loop.

        Each write to a socket whose reader sleeps pays for waking it up (~10 µs here,
        half a hit's cost): the answers made in one turn go out back to back, so that
        the client wakes once for all of them rather than once per answer.
        """
        if not self.outbox:
            server = self.server
            if not server.flushing:
                self.loop.call_soon(server.flush)
            server.flushing.append(self)
        self.outbox.append(data)

    def flush(self) -> None:
        outbox = self.outbox
        if outbox:
            self.outbox = []
            if not self.closed:
                self.transport.write(outbox[0] if len(outbox) == 1 else b"".join(outbox))

    def _close(self) -> None:
        self.flush()
        self.transport.close()

    def pause_reading(self) -> None:
        if not self.reading_paused and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if (
            self.reading_paused
            and not self.closed
            and not self.waiting
            and self.refusal is None
            and (self.writable is None or self.writable.is_set())
        ):
            self.reading_paused = False
            self.transport.resume_reading()

    async def drain(self) -> None:
        if self.writable is not None and not self.writable.is_set() and not self.closed:
            await self.writable.wait()

    def close_when_idle(self) -> None:
        """Shutdown: no more requests on this connection; close it now if nothing is owed."""
        self.closing = True
        for request in (self.active, *self.waiting, self.parsing):
            if request is not None and not request.response_started:
                request.keep_alive = False
        if not self.busy and self.parsing is None and not self.closed:
            self._close()

    def close(self) -> None:
        """Close once the buffered output is sent."""
        if not self.closed:
            self._close()

    def abort_requests(self) -> None:
        """Shutdown past its grace period: cut the connection if an answer is still owed on it."""
        if self.busy or self.parsing is not None:
            self.abort()

    def abort(self) -> None:
        self.abort_transport()
        for request in (self.active, *self.waiting):
            if request is not None and request.task is not None:
                request.task.cancel()

    def abort_transport(self) -> None:
        self.outbox = []
        if not self.closed:
            self.transport.abort()

    def _arm_idle_timer(self) -> None:
        # One timer per connection, not one per request: when it fires it closes the
        # connection only if no request began since it was armed (idle keep_alive_s to 2x).
        if self.idle_timer is None and not self.closed:
            self.requests_seen = self.requests
            self.bytes_seen = self.bytes_in
            self.idle_timer = self.loop.call_later(self.server.keep_alive_s, self._idle_timeout)

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _idle_timeout(self) -> None:
        self.idle_timer = None
        if self.closed:
            return
        if self.busy:
            self.stalled_ticks = 0
        elif self.parsing is not None or self.in_head:
            # A request that stopped arriving part-way, with nothing owed to its client.
            self.stalled_ticks = 0 if self.bytes_in != self.bytes_seen else self.stalled_ticks + 1
            if self.stalled_ticks * self.server.keep_alive_s >= REQUEST_STALL_S:
                logger.info("closing a connection from %s: its request stopped arriving", self.client)
                self._close()
                return
        elif self.requests == self.requests_seen:
            self._close()
            return
        self._arm_idle_timer()

    def _reject(self, status: int, message: str) -> typing.NoReturn:
        """Refuse a request this server cannot take: an error answer, in its turn, then close.

        Raised out of the parser callbacks (`_Rejected`): nothing more is parsed.
        """
        if self.closed or self.transport.is_closing():
            # Closing after an answer with `connection: close`: what follows it is not a request.
            self.parsing = None
            raise _Rejected(message)
        body = _ERROR_TEMPLATE % (message.replace('"', "'").encode("latin-1", "replace"), status)
        self.refusal = (
            status_line(status)
            + b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n" % len(body)
            + self.server.clock.date()
            + b"\r\n"
            + body
        )
        bad, self.parsing, self.in_head, self.raw_body_left = self.parsing, None, False, 0
        if bad is not None and bad in self.waiting:
            self.waiting.remove(bad)  # never started
        elif bad is not None and bad is self.active:
            bad.malformed = True  # its app hears a disconnect; the refusal is its answer
            if bad.flush_handle is not None:  # a head not yet written is not written now
                bad.flush_handle.cancel()
                bad.flush_handle, bad.head_pending, bad.response_started = None, b"", False
            bad.disconnect()
        self.pause_reading()
        if self.active is None and not self.waiting:
            self._send_refusal()
        raise _Rejected(message)

    def _send_refusal(self) -> None:
        """Write the refusal and close, lingering: a client still sending gets to read it."""
        if self.refusal is not None and not self.closed:
            self.write(self.refusal)
            # Closing with its bytes unread would reset the connection and could destroy the
            # answer before the client reads it: stop writing, read and drop, then close.
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.lingering = True
                self.loop.call_later(LINGER_S, self.close)
                self.reading_paused = True  # so that resume_reading acts
                self.refusal = None
                self.resume_reading()
            else:
                self._close()
        self.refusal = None
        self.closing = True


class _Rejected(Exception):
    """Raised out of a parser callback: the connection is closing, stop parsing."""


class Request:
    """One request's ASGI cycle: its `receive()` and `send()`."""

    # What every request starts with, as class attributes: a request answered on the
    # fast path sets only what it uses (measured: ~1 µs less per hit than 25 slots).
    deferred = False
    malformed = False
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
    discarded = 0
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
        if self.response_complete:
            # Answered without reading it all (413, 401): the rest is read and thrown away,
            # so that the client, still sending, gets to read its answer; up to a limit.
            self.discarded += len(chunk)
            if self.discarded > DISCARD_BYTES:
                self.conn.close()
            return
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
            "state": conn.server.state.copy(),
            "extensions": self.extensions,
        }

    async def run(self) -> None:
        try:
            await self.conn.server.app(self.scope(), self.receive, self.send)
        except asyncio.CancelledError:
            self._cut()
            raise
        except BaseException:
            if not self.malformed:
                logger.exception("%s %s failed", self.method, self.path)
            self._unfinished()
        else:
            if not self.response_complete and not self.disconnected:
                logger.error("%s %s: the application did not finish its answer", self.method, self.path)
            self._unfinished()

    def _unfinished(self) -> None:
        """The app is done with the request: if its answer is not complete, end it as best as can be."""
        if self.response_complete:
            return
        if self.head_pending and self.flush_handle is not None:
            # Started but not a byte written yet: an error can still be answered instead.
            self.flush_handle.cancel()
            self.flush_handle, self.head_pending, self.response_started = None, b"", False
        if self.malformed and not self.response_started:
            self.response_complete = True
            self.conn._finished(self)  # the refusal is written in its turn
        elif not self.response_started and not self.disconnected:
            self._internal_error()
        else:
            self._cut()

    async def receive(self) -> Message:
        conn = self.conn
        if self.expect_continue and not self.continue_sent and not self.response_started and not conn.closed:
            self.continue_sent = True
            conn.write(_CONTINUE)
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
        if self.malformed:
            return  # the rest of its request was garbage: the refusal is its answer
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
            status: int = message["status"]
            self.expected_length = length
            self.chunked = length is None and self.method != "HEAD" and status not in (204, 304)
            if self.chunked and self.http_version == "1.0":
                self.chunked = self.keep_alive = False  # HTTP/1.0 has no chunks: the close ends the body
            if self.expect_continue and not self.continue_sent and not self.body_complete:
                self.keep_alive = False  # the client may never send the body it announced
            self.head_pending = self.head(status, headers, length)
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
            expected = self.expected_length
            if expected is not None and self.written > expected:
                raise RuntimeError(f"the answer is longer than its Content-Length {expected}")
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
                # The last part goes out with the other answers of this turn; a stream's
                # parts go out at once, as they come.
                if more:
                    conn.write(data)
                else:
                    conn.write_soon(data)
            if not more:
                self.response_complete = True
                self.wake()
                if expected is not None and self.method != "HEAD" and self.written != expected:
                    logger.error("%s %s: %d bytes of a %d-byte answer", self.method, self.path, self.written, expected)
                    self.keep_alive = False  # the client is waiting for the rest: only a close tells it
                conn._finished(self)
            else:
                await conn.drain()
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def head(self, status: int, headers: Headers, length: int | None) -> bytes:
        """Status line and headers; adds Content-Length or chunked framing, Date and Connection."""
        lines = b"".join([b"%b: %b\r\n" % (n, v) for n, v in headers if n.lower() not in _FRAMING])
        return self.head_from_lines(status, lines, length)

    def head_from_lines(self, status: int, lines: bytes, length: int | None) -> bytes:
        if length is not None:
            lines += b"content-length: %d\r\n" % length
        elif self.chunked:
            lines += b"transfer-encoding: chunked\r\n"
        if not self.keep_alive:
            lines += b"connection: close\r\n"
        elif self.http_version == "1.0":
            lines += b"connection: keep-alive\r\n"
        return status_line(status) + lines + self.conn.server.clock.date() + b"\r\n"

    def _flush_head(self) -> None:
        self.flush_handle = None
        if self.head_pending and not self.conn.closed:
            self.conn.write(self.head_pending)
        self.head_pending = b""

    def _internal_error(self) -> None:
        body = _ERROR_TEMPLATE % (b"inferproxy failed on this request", 500)
        self.keep_alive = False
        head = self.head(500, [(b"content-type", b"application/json")], len(body))
        if not self.conn.closed:
            self.conn.write(head + body)
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
        conn.abort_transport()
        if conn.active is self:
            conn.active = None
