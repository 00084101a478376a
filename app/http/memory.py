"""An in-process server for `HTTPClient`: requests go to an ASGI app through memory, no socket.

    client = HTTPClient(connector=ASGIConnector(app))

Each connection the client opens is a `MemoryTransport`: the request bytes the
client writes are parsed (httptools), the app is called with the request, and
its answer is framed as HTTP/1.1 (chunked unless the app gives Content-Length)
and fed to the client's protocol, so the client's own parsing, keep-alive,
streaming, backpressure (the app's `send` waits while the client has paused
reading) and errors all run as over a socket. An app that raises drops the
connection, as a server would; a client that closes the connection cancels the
app. For tests of code above the client (the upstream pool, the proxy) without
sockets; the client's own tests and the e2e tests use real ones.
"""

from __future__ import annotations

import asyncio
import http
from typing import Any
from urllib.parse import unquote

import httptools

from app.http.asgi import ASGIApp, Message
from app.http.client import Origin


class ASGIConnector:
    """A `Connector` serving every connection with `app`; counts connections made and open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.connections = 0
        self.open = 0

    async def __call__(self, origin: Origin, protocol: asyncio.Protocol) -> asyncio.BaseTransport:
        transport = MemoryTransport(self, origin, protocol)
        self.connections += 1
        self.open += 1
        protocol.connection_made(transport)
        return transport


class MemoryTransport(asyncio.Transport):
    """One connection: the client's side is `protocol`, the server's is the connector's app."""

    def __init__(self, connector: ASGIConnector, origin: Origin, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self._connector = connector
        self._origin = origin
        self._protocol = protocol
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._closing = False
        self._reading = asyncio.Event()
        self._reading.set()
        self._disconnected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    # -- the client writes a request
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        try:
            self._parser.feed_data(bytes(data))
        except httptools.HttpParserError:
            self._lose()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url = httptools.parse_url(self._url)
        method = self._parser.get_method().decode("ascii")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": self._origin.scheme,
            "path": unquote(url.path.decode("latin-1")),
            "raw_path": url.path,
            "query_string": url.query or b"",
            "root_path": "",
            "headers": self._headers,
            "server": (self._origin.host, self._origin.port),
            "client": ("memory", 0),
        }
        body = b"".join(self._body)
        self._url, self._headers, self._body = b"", [], []
        # The client sends one request at a time; a request arriving early waits for the one before.
        self._task = self._loop.create_task(self._serve(scope, body, self._task))

    # -- the app answers
    async def _serve(self, scope: dict[str, Any], body: bytes, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])
        received = False
        chunked = False
        finished = False
        head_only = scope["method"] == "HEAD"

        async def receive() -> Message:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self._disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal chunked, finished
            if self._closing:
                raise ConnectionResetError("the client closed the connection")
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers: list[tuple[bytes, bytes]] = list(message.get("headers", []))
                chunked = not any(name.lower() == b"content-length" for name, _ in headers)
                lines = [f"HTTP/1.1 {status} {_reason(status)}\r\n".encode()]
                lines += [name + b": " + value + b"\r\n" for name, value in headers]
                if chunked and not head_only:
                    lines.append(b"transfer-encoding: chunked\r\n")
                self._deliver(b"".join(lines) + b"\r\n")
            elif message["type"] == "http.response.body":
                data: bytes = message.get("body", b"")
                more = bool(message.get("more_body", False))
                if head_only:
                    data = b""
                elif chunked:
                    data = (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"" if more else b"0\r\n\r\n")
                self._deliver(data)
                finished = not more
                await self._reading.wait()  # the client paused reading: the app waits, as on a full socket

        try:
            await self.app(scope, receive, send)
        except Exception:
            self._lose()  # the server drops the connection: the client sees its answer cut
            return
        if not finished:
            self._lose()

    @property
    def app(self) -> ASGIApp:
        return self._connector.app

    def _deliver(self, data: bytes) -> None:
        if data and not self._closing:
            self._protocol.data_received(data)

    def _lose(self) -> None:
        """The server's side closes the connection."""
        if self._closing:
            return
        self._closing = True
        self._connector.open -= 1
        self._disconnected.set()
        self._reading.set()
        self._loop.call_soon(self._protocol.connection_lost, None)

    # -- asyncio.Transport, as the client uses it
    def close(self) -> None:
        task = self._task
        self._lose()
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # nobody will read what the app says next

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def is_reading(self) -> bool:
        return self._reading.is_set()

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": (self._origin.host, self._origin.port)}.get(name, default)


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
