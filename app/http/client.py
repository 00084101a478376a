"""A small HTTP/1.1 client for the upstream pool: asyncio protocol + httptools' parser.

Why not aiohttp or httpx: measured on a 2-core machine against the fake
upstream, httpx's AsyncClient managed ~1% of the upstream's own rate and
aiohttp's ~40% (bench/README.md), too little for a proxy whose misses must
keep up with the server behind it. Forwarding needs very little of HTTP:
one request per keep-alive connection at a time, bodies sent whole,
answers read whole or streamed as they arrive. This client does exactly
that on an `asyncio.Protocol`, with the C parser uvicorn uses.

The contract:

- `async with client.request(method, url, headers=..., body=...) as response:`
  enters once the status and headers have arrived; inside, `await
  response.read()` or `async for chunk in response.iter_chunks()`. Leaving
  the block gives the connection back for reuse if the body was read to its
  end, and closes it otherwise (an exception, a timeout, a cancellation, a
  body left unread): nothing is released by hand;
- connections are kept alive and reused per (scheme, host, port), most
  recently used first, at most `max_idle` of them idle per origin; a reused
  connection that the server closed while idle is detected and the request
  sent again on a fresh one (nothing of it reached the server);
- `connect_timeout` bounds the connect, `read_timeout` any silence while
  an answer is awaited or streamed; there is no total timeout;
- a body is buffered up to `MAX_BUFFER` bytes, then the socket stops being
  read until the consumer catches up (backpressure); `read()` refuses a
  body over `max_response_bytes` (`iter_chunks()` has no limit: it buffers
  nothing);
- what the server sends is bounded: a head over `MAX_HEAD_BYTES` or with
  more than `MAX_HEADERS` fields, a `101 Switching Protocols`, a status
  outside 100-599 are refused (`InvalidResponse`); other 1xx answers are
  skipped (RFC 9110 §15.2); trailer fields of a chunked body are dropped,
  never taken as headers; `response.framed_by_close` says that the body
  ends where the connection does, so that a cut one reads as whole;
- headers are written as given: a CR, LF or NUL in one (or in the method or
  target) raises `InvalidHeader` before anything is sent;
- `connector` replaces the socket: an in-process server (`app.http.memory`)
  for tests; `ssl_context` is the TLS context of https origins.
- errors: `ConnectError` (no connection), `ConnectionLost` (dropped
  mid-answer), `ReadTimeout` (silence), `InvalidResponse` (not HTTP/1.1 as
  this client takes it), `ResponseTooLarge` (over `max_response_bytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from app.http.client_connection import (
    MAX_BUFFER,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_RESPONSE_BYTES,
    ClientConnection,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HTTPClientError,
    InvalidHeader,
    InvalidResponse,
    Origin,
    ReadTimeout,
    ResponseTooLarge,
)

__all__ = [
    "MAX_BUFFER",
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "MAX_RESPONSE_BYTES",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLost",
    "HTTPClient",
    "HTTPClientError",
    "InvalidHeader",
    "InvalidResponse",
    "Origin",
    "ReadTimeout",
    "Response",
    "ResponseTooLarge",
]


#: Connects `protocol` to `origin`: makes the transport, calls `protocol.connection_made(transport)`
#: and returns the transport; an `OSError` when it cannot. The default opens a TCP (or TLS) socket.
Connector = Callable[[Origin, asyncio.Protocol], Awaitable[asyncio.BaseTransport]]


@functools.lru_cache(maxsize=4096)
def _parse_target(url: str) -> tuple[Origin, bytes]:
    """The origin of `url`, and the request line after the method plus the Host header (cached:
    a proxy sends to a few URLs over and over)."""
    parts = urlsplit(url)
    origin = Origin.parse(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return origin, f"{target} HTTP/1.1\r\n".encode("latin-1") + b"host: " + origin.host_header + b"\r\n"


class Response:
    """An answer whose body is read with `read()` or streamed with `iter_chunks()` inside
    `async with client.request(...)`; leaving the block gives the connection back.

    `framed_by_close`: the body has neither Content-Length nor chunked framing and ends
    when the server closes the connection, so an answer cut short reads as a whole one.
    """

    def __init__(self, conn: ClientConnection, read_timeout: float, max_bytes: int) -> None:
        self._conn = conn
        self._read_timeout = read_timeout
        self._max_bytes = max_bytes
        self.status = conn.status
        self.headers = conn.headers
        self.framed_by_close = conn.framed_by_close

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body (the rest of it, after `iter_chunks()`); `ResponseTooLarge` past
        `max_bytes` (by default the client's `max_response_bytes`)."""
        conn = self._conn
        limit = self._max_bytes if max_bytes is None else max_bytes
        pieces: list[bytes] = []
        size = 0
        while True:
            if conn.chunks:
                piece = conn.take()
                size += len(piece)
                if size > limit:
                    raise ResponseTooLarge(
                        f"{conn.origin.host}:{conn.origin.port} sent a body over {limit} bytes (max_response_bytes)"
                    )
                pieces.append(piece)
            elif conn.complete:
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait(self._read_timeout)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in the pieces it arrives in."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout)

    def abort(self) -> None:
        """Drop the connection now (the server stops working for a client that left)."""
        self._conn.close()

    def _release(self) -> None:
        """Give the connection back for reuse if the answer was read to its end, else close it."""
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            conn.client._put_idle(conn)
        else:
            conn.close()


class _ResponseContext:
    """What `HTTPClient.request` returns: sends on entry, releases the connection on exit."""

    __slots__ = ("_body", "_client", "_headers", "_method", "_read_timeout", "_response", "_url")

    def __init__(
        self,
        client: HTTPClient,
        method: str,
        url: str,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        read_timeout: float | None,
    ) -> None:
        self._client = client
        self._method = method
        self._url = url
        self._headers = headers
        self._body = body
        self._read_timeout = read_timeout
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        self._response = await self._client._send(
            self._method, self._url, self._headers, self._body, self._read_timeout
        )
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        # Read to its end (whatever the block raised after that): reused; anything else: closed.
        if self._response is not None:
            self._response._release()
            self._response = None


class HTTPClient:
    """Keep-alive connections to any number of origins; see the module's docstring for the contract."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 900.0,
        max_idle: int = 512,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        connector: Connector | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.max_response_bytes = max_response_bytes
        self._idle: dict[Origin, list[ClientConnection]] = {}
        self._ssl = ssl_context
        self._connector = connector or self._connect_socket

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        read_timeout: float | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Response]:
        """`async with client.request(...) as response:` sends the request and enters once the
        answer's status and headers have arrived; leaving the block releases the connection:
        kept for reuse if the body was read to its end, closed otherwise."""
        return _ResponseContext(self, method, url, headers, body, read_timeout)

    async def _send(
        self,
        method: str,
        url: str,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        read_timeout: float | None,
    ) -> Response:
        origin, request_line_end = _parse_target(url)
        head = [method.encode("latin-1"), b" ", request_line_end]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n"]
        data = b"".join(head)
        # One line end per header, four more (request line, host, content-length, blank line):
        # anything else means a CR or LF inside a field. Counted on the joined head, in C.
        lines = (len(head) - 6) // 4 + 4
        if data.count(b"\n") != lines or data.count(b"\r") != lines or b"\0" in data:
            raise InvalidHeader(_forbidden_in(method, url, head))
        payload = data + body
        timeout = self.read_timeout if read_timeout is None else read_timeout
        while True:
            conn = await self._connection(origin)
            conn._reset(method)
            assert conn.transport is not None
            conn.transport.write(payload)
            try:
                while not conn.headers_done:
                    await conn.wait(timeout)
            except ConnectionLost as exc:
                conn.close()
                if conn.reused and exc.before_response and not conn.received_any:
                    continue  # the server had closed the idle connection: nothing was processed
                raise
            except BaseException:
                conn.close()
                raise
            return Response(conn, timeout, self.max_response_bytes)

    async def _connection(self, origin: Origin) -> ClientConnection:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        conn = ClientConnection(self, origin)
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport = await self._connector(origin, conn)
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"could not connect to {origin.host}:{origin.port} within {self.connect_timeout:g} s"
            ) from exc
        except OSError as exc:
            raise ConnectError(f"could not connect to {origin.host}:{origin.port}: {exc.strerror or exc}") from exc
        # uvloop may return before it has called connection_made()
        conn.transport = typing.cast(asyncio.Transport, transport)
        return conn

    async def _connect_socket(self, origin: Origin, protocol: asyncio.Protocol) -> asyncio.BaseTransport:
        context = None
        if origin.scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(lambda: protocol, origin.host, origin.port, ssl=context)
        return transport

    def _put_idle(self, conn: ClientConnection) -> None:
        conn.in_use = False
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        idle.append(conn)

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports close


def _forbidden_in(method: str, url: str, head: list[bytes]) -> str:
    """The message for a request whose head holds a CR, LF or NUL: which field."""
    for i in range(3, len(head) - 3, 4):
        name, value = head[i], head[i + 2]
        for what, text in (("name", name), ("value", value)):
            if any(c in text for c in b"\r\n\0"):
                return (
                    f"the header {name[:40]!r} has a CR, LF or NUL in its {what}: it would be read as another "
                    f"header (or cut the request); remove them before sending"
                )
    return f"the method {method[:20]!r} or the URL {url[:100]!r} has a CR, LF or NUL in it; remove them"
