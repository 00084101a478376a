"""One client connection of `app.http.server`: parses requests with httptools, runs them in order.

Requests are answered one at a time, in the order they came (pipelining); a request queued
behind another stops the reading until its turn. The fast path (`HTTPServer.fast`) answers a
whole `POST` inside `on_message_complete`, when nothing earlier is owed on the connection.
What cannot be parsed gets its error answer in its turn, then the connection closes.

The reading side is one `State` (as h11 keeps one per side): IDLE -> HEAD -> BODY -> IDLE
per request; REFUSED once a request is refused (nothing more is parsed, the refusal waits
for the answers owed before it); LINGERING once the refusal is out; CLOSING once the
transport is asked to close; CLOSED once it has. The answering side is the `active` request
and the `waiting` line behind it. Calls go one way: the connection drives its `Request`s,
which reach back only through the narrow `Channel` the connection implements; the connection
reaches its server only through the narrow `Host` the server implements.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import typing

import httptools

from app.http.asgi import FastHandler, Headers
from app.http.exchange import HIGH_WATER, Request, Site, UnsafeHeader
from app.http.outbox import Outbox
from app.http.watchdog import Watchdog

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
FAST_BODY_BYTES = 256 * 1024
#: Seconds a client may take nothing of an answer written to it (its buffers full) before it is cut.
SEND_STALL_S = 60.0
MAX_UNSENT = 256 * 1024  # answers queued in the outbox past this go to the transport at once, and its flow control
DISCARD_BYTES = 64 * 1024 * 1024  # of a body left unread by an early answer, read and dropped before closing
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
REQUEST_STALL_S = 30.0  # a request that stops arriving part-way, with nothing in flight, is dropped after this
#: Connections turned away past `max_connections` that may linger at once (their 503 out, the client's bytes
#: read and dropped so that it gets to read the 503); past it they are closed at once, and may be reset.
MAX_TURNED_AWAY_LINGERING = 16


class Host(Site, typing.Protocol):
    """What a connection needs of the server that accepted it (`HTTPServer` implements it)."""

    @property
    def closing(self) -> bool:
        """The server is stopping: idle connections close, nothing new is kept alive."""

    @property
    def fast(self) -> FastHandler | None: ...
    @property
    def fast_paths(self) -> frozenset[str]:
        """The paths whose whole `POST`s are offered to `fast` first."""

    @property
    def fast_body_bytes(self) -> int:
        """The largest body offered to `fast` (one declared, or found, larger goes to the app at once)."""

    @property
    def keep_alive_s(self) -> float: ...
    @property
    def head_timeout_s(self) -> float: ...
    @property
    def body_timeout_s(self) -> float: ...

    def admit(self, connection: HTTPConnection) -> bool:
        """Count `connection` among the open ones; False if that would pass `max_connections`."""

    def turn_away(self, connection: HTTPConnection) -> str | None:
        """Count a connection turned away (past `max_connections`) and say why, for its 503; None if
        too many turned-away ones linger already (it is closed at once)."""

    def release(self, connection: HTTPConnection) -> None:
        """`connection` has closed (admitted or turned away): no longer counted."""

    def track(self, task: asyncio.Task[None]) -> None:
        """A request's ASGI cycle: the server waits for it (or cancels it) when it stops."""

    def flush_soon(self, connection: HTTPConnection) -> None:
        """Call `connection.flush()` at the end of this turn of the loop, with the others'."""


class State(enum.Enum):
    """Where a connection's reading side is (the module docstring has the transitions)."""

    IDLE = "idle"  # before a request's first byte (answers to earlier ones may still be owed)
    HEAD = "head"  # a request's line and headers are arriving
    BODY = "body"  # its body is arriving: `parsing` is it (answered already, or not)
    REFUSED = "refused"  # a request was refused: nothing more is parsed, the refusal waits its turn
    LINGERING = "lingering"  # the refusal is out and writing shut: what arrives is dropped, then close
    CLOSING = "closing"  # the transport sends what it holds, then closes
    CLOSED = "closed"


# Module constants: compared by identity on the hit path, without the Enum class lookup.
IDLE, HEAD, BODY, REFUSED, LINGERING, CLOSING, CLOSED = State


class HTTPConnection(asyncio.Protocol):
    """One client connection: parses requests, runs them in order, writes their answers."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.state = IDLE
        self.parsing: Request | None = None  # whose body is arriving (or, once answered, being thrown away)
        self.active: Request | None = None  # whose answer is being produced
        self.waiting: collections.deque[Request] = collections.deque()  # in line behind it
        self.url = b""
        self.headers: Headers = []
        self.header_bytes = 0  # of the request line and headers parsed so far
        self.stuck_bytes = 0  # received since the last request began or body part came, whole chunks
        self.refusal: bytes | None = None  # the error answer owed, in REFUSED, after the answers before it
        self.reading_paused = False
        self.write_paused = False  # the transport's buffer is over its high-water mark: no new answer is made
        self.writable: asyncio.Event | None = None  # for `drain`, made the first time writing pauses
        self.outbox = Outbox()  # answers waiting for the end of the loop's turn
        self.watchdog = Watchdog(
            self.loop,
            keep_alive_s=server.keep_alive_s,
            head_timeout_s=server.head_timeout_s,
            body_timeout_s=server.body_timeout_s,
            stall_s=REQUEST_STALL_S,
        )
        self.requests = 0  # begun on this connection; the idle timer compares it with its last look
        self.bytes_in = 0
        self.turned_away = False  # past `max_connections`: answered 503 and closed, nothing read

    @property
    def busy(self) -> bool:
        """An answer is owed: one is being made, or requests wait for their turn."""
        return self.active is not None or bool(self.waiting)

    @property
    def owes_answers(self) -> bool:
        """A request is in flight here: being answered, waiting, or its body arriving."""
        return self.busy or self.parsing is not None

    @property
    def gone(self) -> bool:
        return self.state is CLOSED

    @property
    def unsent_bytes(self) -> int:
        """Answers made and not yet taken by the kernel: the outbox and the transport's buffer."""
        return self.outbox.size + self.transport.get_write_buffer_size()

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.local = (str(sock[0]), int(sock[1])) if isinstance(sock, tuple) else None
        if not self.server.admit(self):
            self._turn_away()
            return
        if self.server.closing:
            self.abort()
            return
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        if self.state is LINGERING:
            return
        self.bytes_in += len(data)
        self.stuck_bytes += len(data)
        rest = b""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # Upgrades (h2c, websocket) are not spoken here: the request is answered as plain
            # HTTP/1.1, as RFC 9110 §7.8 allows. llhttp stops parsing at the end of its head
            # (one with a body was refused in on_headers_complete): the requests after it are
            # read on with a fresh parser, outside this handler (whose exception would otherwise
            # become the context of theirs, and a refusal among them be taken for a crash).
            self.parser = httptools.HttpRequestParser(self)
            rest = data[upgrade.args[0] :]
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Rejected):  # else: refused and closing already
                logger.error("a request on %s broke the server", self.client, exc_info=exc.__context__)
                self.abort()
            return
        except httptools.HttpParserError as exc:
            with contextlib.suppress(_Rejected):
                self._reject(400, f"malformed HTTP request: {exc}")
            return
        if rest:
            self.bytes_in -= len(rest)  # counted again
            self.stuck_bytes -= len(rest)
            self.data_received(rest)
            return
        # httptools hands over a header or trailer field only once its line ends, and keeps
        # the line until then: a line that never ends is caught here, counting the chunks
        # since the request began or its body last moved (at most one chunk is not counted).
        if self.stuck_bytes > MAX_HEADER_BYTES and (self.state is HEAD or self.state is BODY):
            with contextlib.suppress(_Rejected):
                self._reject(431, f"the request headers or trailers are over {MAX_HEADER_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = CLOSED
        # The parser holds this connection's bound methods, a cycle: without it, refcounting frees the
        # connection (its transport, buffers, timers) as soon as its requests let go, instead of the
        # cyclic collector, which lets thousands pile up between full collections (bench/README.md, soak).
        self.parser = _CLOSED
        self.server.release(self)
        self._cancel_idle_timer()
        for request in (self.active, *self.waiting, self.parsing):
            if request is not None:
                request.disconnect()
        self.waiting.clear()
        if self.writable is not None:
            self.writable.set()

    def pause_writing(self) -> None:
        # The client does not read its answers: stop making them (a request whose turn comes
        # waits, its app not started) and stop reading requests, or a pipelining client that
        # never reads would make the server buffer answers without end.
        self.write_paused = True
        if self.writable is None:
            self.writable = asyncio.Event()
        self.writable.clear()
        self.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.writable is not None:
            self.writable.set()
        if self.active is None and self.waiting and self.state is not CLOSED:
            self._start(self.waiting.popleft())
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
        if self.state is not IDLE:
            # Bytes after an answer that closes the connection, in the same read: not a request.
            raise _Rejected("closing")
        self.state = HEAD
        self.requests += 1
        self.url = b""
        self.headers = []
        self.header_bytes = self.stuck_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > MAX_HEADER_BYTES:
            self._reject(414, f"the request line is over {MAX_HEADER_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self.header_bytes > MAX_HEADER_BYTES:
            self._reject(431, f"the request headers are over {MAX_HEADER_BYTES} bytes")
        # llhttp keeps a value's trailing whitespace, which is not part of it (RFC 9110 §5.5).
        self.headers.append((name.lower(), value.rstrip(b" \t")))  # after the head, into _DROPPED

    def on_headers_complete(self) -> None:
        parser = self.parser
        method = parser.get_method().decode("ascii")
        if method != "POST":
            self._check_method(method)
        try:
            url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "the request target is not a valid URL")
        request = Request(
            self,
            method,
            url.path or b"/",
            url.query or b"",
            self.headers,
            parser.get_http_version(),
            parser.should_keep_alive() and not self.server.closing,
        )
        self.state = BODY
        self.parsing = request
        # httptools reports a chunked body's trailer fields through on_header too: they are
        # dropped (counted against the limit all the same), never taken for headers, or an
        # Authorization or X-Doc-Id sent after the body would be acted on.
        self.headers = _DROPPED
        if parser.should_upgrade():
            self._check_upgrade(request)
        elif method == "POST" and self.server.fast_paths and request.path in self.server.fast_paths:
            # Buffered whole and answered in on_message_complete if the fast path can; one declared larger
            # than it takes goes to the app at once, which refuses one over its limit (413) before its body.
            limit = self.server.fast_body_bytes
            request.deferred = not request.expect_continue and _declared_length(request.headers) <= limit
        if not request.deferred:
            self._schedule(request)

    def on_body(self, body: bytes) -> None:
        self.stuck_bytes = 0
        request = self.parsing
        if request is None:
            return
        if request.response_complete:
            # Answered without reading it all (413, 401): the rest is read and thrown away,
            # so that the client, still sending, gets to read its answer; up to a limit.
            request.discarded += len(body)
            if request.discarded > DISCARD_BYTES:
                self.close()
            return
        request.add_body(body)
        if request.deferred:
            if request.body_size > self.server.fast_body_bytes:
                request.deferred = False
                self._schedule(request)
        elif request.body_size > HIGH_WATER:
            self.pause_reading()  # until the app takes what is buffered

    def on_message_complete(self) -> None:
        request = self.parsing
        if request is None:
            return
        self.parsing = None
        self.state = IDLE
        request.body_complete = True
        if request.deferred:
            request.deferred = False
            if self.active is None and not self.waiting and not self.write_paused and self._answer_fast(request):
                return
            self._schedule(request)
            return
        request.wake()
        if request.response_complete and not self.busy:
            # Answered before its body was all read (413, 401): the body has been thrown away.
            if self.server.closing:
                self.close()
            else:
                self._arm_idle_timer()

    # -- requests: in order, one at a time ---------------------------------------

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
        if status == 204 or status == 304:
            content = b""  # no body, whatever the handler gave
        try:
            head = request.head(status, headers, len(content))
        except UnsafeHeader:
            logger.exception("the fast path's answer to %s %s cannot be sent", request.method, request.path)
            request.keep_alive = False
            self.write_soon(self.server.error_answer(500, "the server failed on this request"))
        else:
            self.write_soon(head + content)
        self.answered(request)
        return True

    def _schedule(self, request: Request) -> None:
        if self.active is None and not self.waiting and not self.write_paused:
            self._start(request)
        else:
            self.waiting.append(request)
            self.pause_reading()  # one request in line is enough: the client waits for its answers

    def _start(self, request: Request) -> None:
        self.active = request
        task = request.task = self.loop.create_task(request.run(self.server))
        self.server.track(task)

    def _check_method(self, method: str) -> None:
        # CONNECT asks for a tunnel and TRACE echoes the request back (headers and cookies
        # included); an origin server owes neither. 501, not nginx's 405: RFC 9110 §15.6.2 makes
        # 501 the answer to a method the server supports for no resource, while a 405 must
        # carry an Allow header the server cannot know (the app's routes decide). The
        # connection closes after it: what follows a CONNECT is tunnel bytes, not a request.
        if method in _REFUSED_METHODS:
            self._reject(501, f"{method} is not supported by this server")

    def _check_upgrade(self, request: Request) -> None:
        """An Upgrade request is answered as plain HTTP/1.1, but only if it has no body.

        llhttp skips the body of an Upgrade request, taking it for the new protocol's bytes.
        Framing it here instead is how request smuggling starts (a `Content-Length: 38 `
        read as 0 makes the body the next request): such a request is refused.
        """
        for name, value in request.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" \t").strip(b"0")):
                self._reject(400, "an Upgrade request cannot have a body here: send it without Upgrade")

    # -- the Channel a Request reaches back through --------------------------------

    def answered(self, request: Request) -> None:
        """The answer to `request` is complete: next request, refusal, keep-alive, or close."""
        if self.active is request:
            self.active = None
        if not request.keep_alive or self.state is CLOSED:
            self.waiting.clear()
            self.close()
            return
        if self.waiting:
            if not self.write_paused:  # else resume_writing starts it
                self._start(self.waiting.popleft())
                if not self.waiting:
                    self.resume_reading()
        elif self.active is None:
            if self.state is REFUSED:
                self._send_refusal()
            elif self.state is IDLE and self.server.closing:
                self.close()
            else:
                self.resume_reading()
                self._arm_idle_timer()

    def cut(self, request: Request) -> None:
        """`request`'s answer cannot be completed: drop the connection so the client sees it cut short."""
        self.abort_transport()
        if self.active is request:
            self.active = None

    def body_taken(self, request: Request) -> None:
        """The app took `request`'s buffered body: read on, if it is the one being answered."""
        if self.active is request:
            self.resume_reading()

    def write(self, data: bytes) -> None:
        """Write now, in one write with what is queued on this connection (which goes first)."""
        if self.outbox.parts:
            data = self.outbox.take(data)
        self.transport.write(data)

    def write_soon(self, data: bytes) -> None:
        """Queue `data` for one write at the end of this turn of the event loop (`app.http.outbox`).

        Past `MAX_UNSENT` bytes they go at once: the transport's buffer then tells
        (`pause_writing`) whether the client reads them.
        """
        outbox = self.outbox
        if not outbox.parts:
            self.server.flush_soon(self)
        outbox.add(data)
        if outbox.size > MAX_UNSENT:
            self.flush()

    def take_back(self, data: bytes) -> bool:
        """Take `data` back if it is the last thing queued and has not left yet; True if it was."""
        return self.outbox.take_back(data)

    async def drain(self) -> None:
        """Until the client takes what is buffered for it. One that takes nothing for `SEND_STALL_S` (a process
        frozen by SIGSTOP or a suspended job, its connection still open) is cut: its answer's writer (a
        stream's leader, which identical requests wait for) must not wait on it for ever."""
        writable = self.writable
        if writable is None or writable.is_set() or self.state is CLOSED:
            return
        buffered = self.transport.get_write_buffer_size()
        while True:
            try:
                await asyncio.wait_for(writable.wait(), SEND_STALL_S)
                return
            except TimeoutError:
                if self.state is CLOSED:
                    return
                now = self.transport.get_write_buffer_size()
                if now < buffered:  # it reads, if slowly (a big answer's pieces take a while on a slow link)
                    buffered = now
                    continue
                logger.info(
                    "closing a connection from %s: it took nothing of its answer for %g s", self.client, SEND_STALL_S
                )
                self.abort_transport()
                return

    # -- writing, flow control and closing ----------------------------------------

    def flush(self) -> None:
        if self.outbox.parts:
            data = self.outbox.take()
            if self.state is not CLOSED:
                self.transport.write(data)

    def pause_reading(self) -> None:
        if not self.reading_paused and self.state is not CLOSED:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and not self.waiting and not self.write_paused and self._reads_requests():
            self.reading_paused = False
            self.transport.resume_reading()

    def _reads_requests(self) -> bool:
        state = self.state
        return state is IDLE or state is HEAD or state is BODY or state is LINGERING

    def close_when_idle(self) -> None:
        """Shutdown: no more requests on this connection; close it now if nothing is owed."""
        for request in (self.active, *self.waiting, self.parsing):
            if request is not None and not request.response_started:
                request.keep_alive = False
        if not self.owes_answers:
            self.close()

    def close(self) -> None:
        """Close once the queued and buffered output is sent."""
        if self.state is not CLOSED and self.state is not CLOSING:
            self.flush()
            self.state = CLOSING
            self.parsing = None
            self.transport.close()

    def abort_requests(self) -> None:
        """Shutdown past its grace period: cut the connection if an answer is still owed on it."""
        if self.owes_answers:
            self.abort()

    def abort(self) -> None:
        self.abort_transport()
        for request in (self.active, *self.waiting):
            if request is not None and request.task is not None:
                request.task.cancel()

    def abort_transport(self) -> None:
        self.outbox.clear()
        if self.state is not CLOSED:
            self.transport.abort()

    # -- the timer (`app.http.watchdog`) ---------------------------------------------

    def _arm_idle_timer(self) -> None:
        if self.state is not CLOSED:
            self.watchdog.arm(self.requests, self.bytes_in, self._tick)

    def _cancel_idle_timer(self) -> None:
        self.watchdog.cancel()

    def _tick(self) -> None:
        state, watchdog = self.state, self.watchdog
        watchdog.fired()
        if state is CLOSED:
            return
        if state is BODY and watchdog.body_overdue(self.requests, self.reading_paused):
            self._refuse_body()
            return
        if self.busy:
            watchdog.waiting_on_answers()
        elif state is HEAD and watchdog.head_overdue(self.requests):
            limit = watchdog.head_timeout_s
            logger.info("refusing a request from %s: its head took over %g s", self.client, limit)
            with contextlib.suppress(_Rejected):
                self._reject(408, f"the request head was not complete within {limit:g} s")
            return
        elif state is HEAD or state is BODY:
            # A request that stopped arriving part-way, with nothing owed to its client.
            if watchdog.stopped_arriving(self.bytes_in):
                logger.info("closing a connection from %s: its request stopped arriving", self.client)
                self.close()
                return
        elif watchdog.idle(self.requests):
            self.close()
            return
        self._arm_idle_timer()

    def _refuse_body(self) -> None:
        request, limit = self.parsing, self.watchdog.body_timeout_s
        logger.info("refusing a request from %s: its body took over %g s", self.client, limit)
        if request is not None and request.response_complete:
            self.close()  # answered already (413, 401): only the rest of its body was being thrown away
        elif request is not None and request.response_started:
            self.abort_transport()  # its answer has begun: cut, so that the client sees it was not complete
        else:
            with contextlib.suppress(_Rejected):
                self._reject(408, f"the request body was not complete within {limit:g} s")

    # -- refusing ------------------------------------------------------------------

    def _turn_away(self) -> None:
        """Past `max_connections`: `503` with `Retry-After` at once, nothing read or parsed, then close.

        Answered rather than closed bare: an OpenAI client retries a 503 after its `Retry-After`, and
        its log says the server is busy, not that it broke. It is not counted among the connections.
        """
        self.turned_away = True
        message = self.server.turn_away(self)
        if message is None:
            self.abort_transport()
            return
        self.state = REFUSED
        self.refusal = self.server.error_answer(503, message, b"retry-after: 1\r\n")
        self._send_refusal()

    def _reject(self, status: int, message: str) -> typing.NoReturn:
        """Refuse a request this server cannot take: an error answer, in its turn, then close.

        Raised out of the parser callbacks (`_Rejected`): nothing more is parsed.
        """
        if not self._reads_requests() or self.transport.is_closing():
            # Closing after an answer with `connection: close`: what follows it is not a request.
            self.parsing = None
            raise _Rejected(message)
        self.state = REFUSED
        self.refusal = self.server.error_answer(status, message)
        bad, self.parsing = self.parsing, None
        if bad is not None and bad in self.waiting:
            self.waiting.remove(bad)  # never started
        elif bad is not None and bad is self.active:
            bad.malformed = True  # its app hears a disconnect; the refusal is its answer
            bad.retract_head()  # a head not yet written is not written now
            bad.disconnect()
        self.pause_reading()
        if self.active is None and not self.waiting:
            self._send_refusal()
        raise _Rejected(message)

    def _send_refusal(self) -> None:
        """Write the refusal and close, lingering: a client still sending gets to read it."""
        refusal, self.refusal = self.refusal, None
        if refusal is None or self.state is CLOSED:
            return
        self.write(refusal)
        # Closing with its bytes unread would reset the connection and could destroy the
        # answer before the client reads it: stop writing, read and drop, then close.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.state = LINGERING
            self.loop.call_later(LINGER_S, self.close)
            self.resume_reading()
        else:
            self.close()


_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})


#: A closed connection's parser: one without callbacks, never fed.
_CLOSED = httptools.HttpRequestParser(None)


class _Dropped(list[tuple[bytes, bytes]]):
    """Where trailer fields go: nowhere."""

    def append(self, field: tuple[bytes, bytes]) -> None:
        pass


_DROPPED = _Dropped()


class _Rejected(Exception):
    """Raised out of a parser callback: the connection is closing, stop parsing."""


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The request's Content-Length (0 without one: chunked, or no body); the parser checked its form."""
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return 0
