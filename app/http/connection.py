"""One client connection of `app.http.server`: parses requests with httptools, runs them in order.

Requests are answered one at a time, in the order they came (pipelining); a request queued
behind another stops the reading until its turn. The fast path (`HTTPServer.fast`) answers a
whole `POST` inside `on_message_complete`, when nothing earlier is owed on the connection.
What cannot be parsed gets its error answer in its turn, then the connection closes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import typing

import httptools

from app.http.asgi import Headers
from app.http.exchange import Request, UnsafeHeader

if typing.TYPE_CHECKING:
    from app.http.server import HTTPServer

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
FAST_BODY_BYTES = 256 * 1024
MAX_UNSENT = 256 * 1024  # answers queued in the outbox past this go to the transport at once, and its flow control
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
REQUEST_STALL_S = 30.0  # a request that stops arriving part-way, with nothing in flight, is dropped after this


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
        self.refusal: bytes | None = None  # an error answer owed after the answers before it
        self.closed = False
        self.closing = False
        self.reading_paused = False
        self.write_paused = False  # the transport's buffer is over its high-water mark: no new answer is made
        self.writable: asyncio.Event | None = None  # set while the transport accepts writes (for drain)
        self.idle_timer: asyncio.TimerHandle | None = None
        self.requests = 0  # begun on this connection; the idle timer compares it with its last look
        self.requests_seen = -1
        self.bytes_in = 0
        self.bytes_seen = -1
        self.stalled_ticks = 0
        self.head_watched = 0  # the request whose head the idle timer saw arriving, and when it first did
        self.head_since = 0.0
        self.lingering = False  # refused and half-closed: what still arrives is dropped
        self.outbox: list[bytes] = []  # fast answers waiting for the end of the loop's turn
        self.outbox_bytes = 0

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
        was_in_head, requests = self.in_head, self.requests
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # Upgrades (h2c, websocket) are not spoken here: the request is answered as plain
            # HTTP/1.1, as RFC 9110 §7.8 allows. llhttp stops parsing at the end of its head
            # (one with a body was refused in on_headers_complete): the requests after it are
            # read on with a fresh parser.
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
        if self.active is None and self.waiting and not self.closed:
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
        # httptools reports a chunked body's trailer fields here too, after the head: they
        # are dropped (counted against the limit all the same), never taken for headers, or
        # an Authorization or X-Doc-Id sent after the body would be acted on.
        if self.in_head:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.in_head = False
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
            parser.should_keep_alive() and not self.closing,
        )
        self.parsing = request
        if parser.should_upgrade():
            self._check_upgrade(request)
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
        if request is not None:
            self._message_complete(request)

    # -- requests: in order, one at a time ---------------------------------------

    def _message_complete(self, request: Request) -> None:
        self.parsing = None
        request.body_complete = True
        if request.deferred:
            request.deferred = False
            if self.active is None and not self.waiting and not self.write_paused and self._answer_fast(request):
                return
            self._schedule(request)
            return
        request.wake()
        if request.response_complete and not self.busy and not self.closed:
            # Answered before its body was all read (413, 401): the body has been thrown away.
            if self.closing or self.server.closing:
                self.close()
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
        status, headers, content = answer
        try:
            head = request.head(status, headers, len(content))
        except UnsafeHeader:
            logger.exception("the fast path's answer to %s %s cannot be sent", request.method, request.path)
            request.keep_alive = False
            self.write_soon(self.server.error_answer(500, "the server failed on this request"))
        else:
            self.write_soon(head + content)
        self._finished(request)
        return True

    def _schedule(self, request: Request) -> None:
        if self.active is None and not self.waiting and not self.write_paused:
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
                self.close()
            return
        if self.waiting:
            if not self.write_paused:  # else resume_writing starts it
                self._start(self.waiting.popleft())
                if not self.waiting and self.refusal is None:
                    self.resume_reading()
        elif self.active is None:
            if self.refusal is not None:
                self._send_refusal()
            elif self.parsing is None and (self.closing or self.server.closing):
                self.close()
            else:
                self.resume_reading()
                self._arm_idle_timer()

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

    # -- writing, flow control and closing ----------------------------------------

    def write(self, data: bytes) -> None:
        """Write now, in one write with what is queued on this connection (which goes first)."""
        if self.outbox:
            outbox, self.outbox, self.outbox_bytes = self.outbox, [], 0
            data = b"".join([*outbox, data])
        self.transport.write(data)

    def write_soon(self, data: bytes) -> None:
        """Queue `data` for one write at the end of this turn of the event loop.

        Each write to a socket whose reader sleeps pays for waking it up (~10 µs here,
        half a hit's cost): the answers made in one turn go out back to back, so that
        the client wakes once for all of them rather than once per answer. Past
        `MAX_UNSENT` bytes they go at once: the transport's buffer then tells (`pause_writing`)
        whether the client reads them.
        """
        if not self.outbox:
            server = self.server
            if not server.flushing:
                self.loop.call_soon(server.flush)
            server.flushing.append(self)
        self.outbox.append(data)
        self.outbox_bytes += len(data)
        if self.outbox_bytes > MAX_UNSENT:
            self.flush()

    def flush(self) -> None:
        outbox = self.outbox
        if outbox:
            self.outbox, self.outbox_bytes = [], 0
            if not self.closed:
                self.transport.write(outbox[0] if len(outbox) == 1 else b"".join(outbox))

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
            and not self.write_paused
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
            self.close()

    def close(self) -> None:
        """Close once the queued and buffered output is sent."""
        if not self.closed:
            self.flush()
            self.transport.close()

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
        self.outbox, self.outbox_bytes = [], 0
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
            self.head_watched = 0  # a head arriving behind answers owed is not timed: reading may be paused
        elif self.in_head and self._head_overdue():
            logger.info("refusing a request from %s: its head took over %g s", self.client, self.server.head_timeout_s)
            with contextlib.suppress(_Rejected):
                self._reject(408, f"the request head was not complete within {self.server.head_timeout_s:g} s")
            return
        elif self.parsing is not None or self.in_head:
            # A request that stopped arriving part-way, with nothing owed to its client.
            self.stalled_ticks = 0 if self.bytes_in != self.bytes_seen else self.stalled_ticks + 1
            if self.stalled_ticks * self.server.keep_alive_s >= REQUEST_STALL_S:
                logger.info("closing a connection from %s: its request stopped arriving", self.client)
                self.close()
                return
        elif self.requests == self.requests_seen:
            self.close()
            return
        self._arm_idle_timer()

    def _head_overdue(self) -> bool:
        """Whether the head arriving now began over `head_timeout_s` ago, bytes arriving or not.

        Timed from the first tick that sees it (no clock read per request on the hit path):
        a head is refused between `head_timeout_s` and that plus two ticks after its first byte.
        """
        now = self.loop.time()
        if self.head_watched != self.requests:
            self.head_watched, self.head_since = self.requests, now
            return False
        return now - self.head_since >= self.server.head_timeout_s

    def _reject(self, status: int, message: str) -> typing.NoReturn:
        """Refuse a request this server cannot take: an error answer, in its turn, then close.

        Raised out of the parser callbacks (`_Rejected`): nothing more is parsed.
        """
        if self.closed or self.transport.is_closing():
            # Closing after an answer with `connection: close`: what follows it is not a request.
            self.parsing = None
            raise _Rejected(message)
        self.refusal = self.server.error_answer(status, message)
        bad, self.parsing, self.in_head = self.parsing, None, False
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
                self.close()
        self.refusal = None
        self.closing = True


_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})


class _Rejected(Exception):
    """Raised out of a parser callback: the connection is closing, stop parsing."""
