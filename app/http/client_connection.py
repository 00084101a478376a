"""One keep-alive connection of `app.http.client`: an asyncio protocol, httptools' response parser,
and the limits on what a server may send; plus the client's errors.

`HTTPClient` (`app.http.client`) owns the pool and the request API; this module holds what
happens on one connection: one request at a time, the answer parsed as it arrives, its body
buffered up to `MAX_BUFFER` (then the socket is not read until the consumer catches up).
"""

from __future__ import annotations

import asyncio
import collections
import typing
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

MAX_BUFFER = 1 << 20
#: A response head (status line and fields, interim answers included) larger than this is refused.
MAX_HEAD_BYTES = 64 * 1024
#: An answer with more header fields than this is refused (an upstream sends about ten).
MAX_HEADERS = 100
#: The default `max_response_bytes`: the largest body `read()` buffers.
MAX_RESPONSE_BYTES = 256 * 1024 * 1024


class HTTPClientError(Exception):
    """Base of the client's own errors."""


class ConnectError(HTTPClientError):
    """No connection could be made (refused, unreachable, timed out, TLS refused)."""


class ConnectTimeout(ConnectError):
    """The connection was not established within `connect_timeout`."""


class ConnectionLost(HTTPClientError):
    """The server closed the connection before the answer was complete."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class ReadTimeout(HTTPClientError):
    """The server was silent for longer than `read_timeout` while an answer was awaited."""


class InvalidResponse(HTTPClientError):
    """The server's answer is not HTTP/1.1 as this client takes it: malformed, over the head
    limits, `101 Switching Protocols`, or a status outside 100-599. Sending again will not help."""


class ResponseTooLarge(InvalidResponse):
    """`read()` met a body over `max_response_bytes`."""


class InvalidHeader(HTTPClientError, ValueError):
    """A header (or the method or target) to be sent holds a CR, LF or NUL; nothing was sent."""


#: A closed connection's parser: one without callbacks, never fed.
_CLOSED = httptools.HttpResponseParser(None)


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the reason is in the connection's `error`."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL with a host, got {url!r}")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        return (self.host if self.port == default else f"{self.host}:{self.port}").encode("idna")


class ConnectionPool(typing.Protocol):
    """What a connection needs of its client (`HTTPClient`): a place to go back to when it is idle."""

    def _put_idle(self, conn: ClientConnection) -> None: ...


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection, one request at a time; also the parser's callback object."""

    def __init__(self, client: ConnectionPool, origin: Origin) -> None:
        self.client = client
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self._reset()
        self.in_use = False

    def _reset(self, method: str = "GET") -> None:
        self.method = method
        self.in_use = True
        self.stray = False
        self.interim = False
        self.framed = False  # Content-Length or Transfer-Encoding seen
        self.framed_by_close = False
        self.head_size = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.received_any = False
        self.paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have the Transport methods without subclassing it
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_use:
            # Bytes on an idle connection belong to no request: never let them answer the next one.
            self.close()
            return
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # (a callback's own reason, if it refused, came first and is kept)
            self._fail(InvalidResponse(f"{self.origin.host}:{self.origin.port} sent invalid HTTP: {exc}"))
            self.close()
            return
        if not self.headers_done:
            # Counted only while the head is incomplete: httptools keeps a partial field whole in memory.
            self.head_size += len(data)
            if self.head_size > MAX_HEAD_BYTES:
                self._fail(
                    InvalidResponse(
                        f"{self.origin.host}:{self.origin.port} sent a response head over {MAX_HEAD_BYTES} bytes"
                    )
                )
                self.close()
                return
        elif self.stray:
            self.close()  # the answer read so far stays readable; the connection is not reused
        elif self.buffered > MAX_BUFFER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # The parser holds this connection's bound methods, a cycle: without it, refcounting frees the
        # connection as soon as its caller lets go, not the cyclic collector much later (as app.http.connection).
        self.parser = _CLOSED
        if self.framed_by_close and self.headers_done and exc is None:
            # A body without Content-Length or chunked framing ends when the server closes.
            self.complete = True
            self._wake()
        elif not self.complete:
            before = not self.headers_done
            reason = f": {exc}" if exc else ""
            self._fail(
                ConnectionLost(
                    f"{self.origin.host}:{self.origin.port} closed the connection{reason}", before_response=before
                )
            )

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            # A second answer to one request: it belongs to nothing; never let it answer another.
            self.stray = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done:
            return  # a chunked body's trailer field (or a stray answer's): never a header of the answer
        headers = self.headers
        if len(headers) >= MAX_HEADERS:
            self._fail(
                InvalidResponse(f"{self.origin.host}:{self.origin.port} sent more than {MAX_HEADERS} header fields")
            )
            raise _Refused
        name = name.lower()
        if name == b"content-length" or name == b"transfer-encoding":
            self.framed = True
        headers.append((name, value.rstrip(b" \t")))  # trailing whitespace is not the value's (RFC 9110 §5.5)

    def on_headers_complete(self) -> None:
        if self.stray:
            return
        status = self.parser.get_status_code()
        if not 200 <= status <= 599:
            if 100 <= status < 200 and status != 101:
                # An interim answer (100 Continue, 103 Early Hints, ...): the real one follows.
                self.interim = True
                self.headers = []
                self.framed = False
                return
            self._fail(
                InvalidResponse(
                    f"{self.origin.host}:{self.origin.port} answered with status {status}: this client takes "
                    f"final statuses 200-599 only (101 Switching Protocols would take the connection over)"
                )
            )
            raise _Refused
        self.status = status
        # Only meaningful now: the parser forgets it once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        if self.method == "HEAD":
            self.complete = True  # no body follows, whatever Content-Length says
            self.keep_alive = False  # and the parser, not knowing, would wait for one
        elif not self.framed and status != 204 and status != 304:
            self.framed_by_close = True
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self.stray or self.method == "HEAD":
            return  # a HEAD answer has no body, whatever its framing says: the parser cannot know it
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.stray:
            return
        if self.interim:
            self.interim = False
            return
        self.complete = True

    # -- used by Response and HTTPClient
    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, silence_s: float) -> None:
        """Until something new arrives (or the connection fails); ReadTimeout after `silence_s` of silence."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(silence_s, self._on_timeout, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None and not self.chunks and not self.complete:
            raise self.error

    def _on_timeout(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(ReadTimeout(f"{self.origin.host}:{self.origin.port} sent nothing in time"))

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
