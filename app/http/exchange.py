"""One request and its answer on a connection: the ASGI cycle `app.connection` runs per request.

`Request.receive()` hands the app the body as it arrives (`http.disconnect` once the client is
gone or the answer is complete); `Request.send()` frames the answer: `Content-Length` or
chunked (never chunks for HTTP/1.0: the close ends the body), `Date`, `Connection`. The last
part of an answer is queued to go out at the end of the event loop's turn with the other
answers made in it (`Channel.write_soon`); a stream's parts go out at once.

The connection drives its requests (body arriving, disconnect, refusal); a request reaches
back only through the `Channel` it was made with, never into the connection's state.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
import typing
from http import HTTPStatus
from urllib.parse import unquote

from app.http.asgi import ASGIApp, CutConnection, Headers, Message

logger = logging.getLogger(__name__)

HIGH_WATER = 1 << 20  # request body bytes buffered before the socket stops being read

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"date"})  # the server's to write


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))
        _STATUS_LINES[status] = line
    return line


class Clock:
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


CLOCK = Clock()  # one Date header for the process, whichever server answers


class Site(typing.Protocol):
    """What a request needs of the server it runs on."""

    @property
    def app(self) -> ASGIApp: ...
    @property
    def state(self) -> dict[str, typing.Any]: ...
    def error_answer(self, status: int, message: str, headers: bytes = b"") -> bytes:
        """The server's own error answer; `headers`: more header lines, each ending in CRLF."""


class Channel(typing.Protocol):
    """What a request may ask of the connection it came on (`HTTPConnection` implements it)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def client(self) -> tuple[str, int] | None: ...
    @property
    def local(self) -> tuple[str, int] | None: ...
    @property
    def gone(self) -> bool:
        """The client has left: nothing more can be written."""

    def write(self, data: bytes) -> None:
        """Write now, after what is queued."""

    def write_soon(self, data: bytes) -> None:
        """Queue `data` to go out at the end of this turn of the loop, with the other answers made in it."""

    def take_back(self, data: bytes) -> bool:
        """Unqueue `data` if it has not left yet; True if it was."""

    async def drain(self) -> None:
        """Return once the client reads again (streamed answers wait on it)."""

    def body_taken(self, request: Request) -> None:
        """The app took the buffered body: reading may go on."""

    def answered(self, request: Request) -> None:
        """The answer is complete: on to the next request, or close."""

    def cut(self, request: Request) -> None:
        """The answer cannot be completed: drop the connection so the client sees it cut short."""


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
    bodiless = False  # a HEAD request's answer, a 204 or a 304: what the app sends as body is not written
    queued_head: bytes | None = None  # the answer's head while it waits in the connection's outbox
    expected_length: int | None = None
    written = 0
    discarded = 0
    waiter: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None

    def __init__(
        self,
        conn: Channel,
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
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake()

    # -- ASGI ------------------------------------------------------------------

    def scope(self, site: Site) -> dict[str, typing.Any]:
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
            "state": site.state.copy(),
            "extensions": self.extensions,
        }

    async def run(self, site: Site) -> None:
        try:
            await site.app(self.scope(site), self.receive, self.send)
        except asyncio.CancelledError:
            self._cut()
            raise
        except CutConnection:
            self._unfinished(site)
        except BaseException:
            if not self.malformed:
                logger.exception("%s %s failed", self.method, self.path)
            self._unfinished(site)
        else:
            if not self.response_complete and not self.disconnected:
                logger.error("%s %s: the application did not finish its answer", self.method, self.path)
            self._unfinished(site)

    def _unfinished(self, site: Site) -> None:
        """The app is done with the request: if its answer is not complete, end it as best as can be."""
        if self.response_complete:
            return
        self.retract_head()  # if none of it has left yet, an error can still be answered instead
        if self.malformed and not self.response_started:
            self.response_complete = True
            self.conn.answered(self)  # the refusal is written in its turn
        elif not self.response_started and not self.disconnected:
            self._internal_error(site)
        else:
            self._cut()

    async def receive(self) -> Message:
        conn = self.conn
        if self.expect_continue and not self.continue_sent and not self.response_started and not conn.gone:
            self.continue_sent = True
            conn.write(_CONTINUE)
        while True:
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            if self.body or (self.body_complete and not self.request_sent):
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body = []
                self.body_size = 0
                conn.body_taken(self)
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
            headers: Headers = message.get("headers", [])
            length: int | None = None
            for name, value in headers:
                name = name.lower()
                if name == b"content-length":
                    length = int(value)
                    if length < 0:
                        raise ValueError(f"a negative Content-Length: {value!r}")
                elif name == b"connection" and value.lower() == b"close":
                    self.keep_alive = False
            status: int = message["status"]
            self.expected_length = length
            self.bodiless = self.method == "HEAD" or status == 204 or status == 304
            self.chunked = length is None and not self.bodiless
            if self.chunked and self.http_version == "1.0":
                self.chunked = self.keep_alive = False  # HTTP/1.0 has no chunks: the close ends the body
            if self.expect_continue and not self.continue_sent and not self.body_complete:
                self.keep_alive = False  # the client may never send the body it announced
            # Queued: it goes out with the first body part if that comes in this turn of the
            # loop (one write for a whole answer), else on its own at the end of the turn.
            self.queued_head = self.head(status, headers, length)  # raises before anything is started
            self.response_started = True
            self.conn.write_soon(self.queued_head)
        elif kind == "http.response.body":
            if not self.response_started:
                raise RuntimeError("http.response.body sent before http.response.start")
            if self.response_complete:
                raise RuntimeError("http.response.body sent after the response was complete")
            body: bytes = message.get("body", b"")
            more = bool(message.get("more_body", False))
            conn = self.conn
            if self.bodiless:
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
            self.queued_head = None  # body follows it: it can no longer be taken back
            if data and not conn.gone:
                # The last part goes out with the other answers of this turn; a stream's
                # parts go out at once, as they come.
                if more:
                    conn.write(data)
                else:
                    conn.write_soon(data)
            if not more:
                self.response_complete = True
                self.wake()
                if expected is not None and not self.bodiless and self.written != expected:
                    logger.error("%s %s: %d bytes of a %d-byte answer", self.method, self.path, self.written, expected)
                    self.keep_alive = False  # the client is waiting for the rest: only a close tells it
                conn.answered(self)
            else:
                await conn.drain()
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def head(self, status: int, headers: Headers, length: int | None) -> bytes:
        """Status line and headers; adds Content-Length or chunked framing, Date and Connection.

        Raises `UnsafeHeader` if a header name or value holds CR, LF or NUL: written, it
        would end the head early and let whoever chose the value write a response of its own.
        """
        kept = [b"%b: %b\r\n" % (n, v) for n, v in headers if n.lower() not in _FRAMING]
        lines = b"".join(kept)
        # One pass over the whole block, not one per header: the CRLF ending each line must be its only CR, LF or NUL.
        if len(lines.translate(None, b"\r\n\0")) != len(lines) - 2 * len(kept):
            bad = [n for n, v in headers if any(c in n + v for c in (b"\r", b"\n", b"\0"))]
            raise UnsafeHeader(f"the answer's header {bad[0]!r} holds CR, LF or NUL")
        if length is not None and status != 204:  # a 204 has no Content-Length (RFC 9110 §8.6)
            lines += b"content-length: %d\r\n" % length
        elif self.chunked:
            lines += b"transfer-encoding: chunked\r\n"
        if not self.keep_alive:
            lines += b"connection: close\r\n"
        elif self.http_version == "1.0":
            lines += b"connection: keep-alive\r\n"
        return status_line(status) + lines + CLOCK.date() + b"\r\n"

    def retract_head(self) -> bool:
        """Take back a started answer's head if none of it has left yet; True if it was."""
        if self.queued_head is None or not self.conn.take_back(self.queued_head):
            return False
        self.queued_head = None
        self.response_started = False
        return True

    def _internal_error(self, site: Site) -> None:
        self.keep_alive = False
        if not self.conn.gone:
            self.conn.write(site.error_answer(500, "the server failed on this request"))
        self.response_started = self.response_complete = True
        self.conn.answered(self)

    def _cut(self) -> None:
        """The answer cannot be completed: drop the connection so the client sees it cut short."""
        if self.response_complete:
            return  # answered already; what failed came after
        self.response_complete = True
        self.keep_alive = False
        self.conn.cut(self)


class UnsafeHeader(ValueError):
    """An answer's header would split the response (CR, LF or NUL in its name or value)."""
