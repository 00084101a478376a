"""A raw asyncio server on a loopback port answering each request with canned bytes: for what
no well-behaved server sends (101, endless heads, close-delimited bodies, stray answers)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

MODELS = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\nConnection: close\r\n\r\n{"data":[]}'
)


@dataclass
class Canned:
    """The server's URL, and what it saw: connections made, still open, and the request heads."""

    url: str = ""
    connections: int = 0
    open: int = 0
    heads: list[bytes] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def count_open(self, delta: int) -> None:
        self.open += delta
        self.changed.set()

    async def until_open(self, count: int) -> None:
        """Until exactly `count` connections are open (the test's own timeout bounds it)."""
        while self.open != count:
            self.changed.clear()
            await self.changed.wait()


@asynccontextmanager
async def canned_server(
    answers: list[bytes | None],
    *,
    close_after: bool = False,
    silent: bool = False,
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[Canned]:
    """Answers each request (read up to its blank line + body) with the next canned bytes;
    None closes the connection instead of answering. `silent`: reads and never answers.
    `tls`: serves https (at https://localhost:PORT) with that server context."""
    seen = Canned()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            first: bytes | None = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if first is not None and first.startswith(b"GET /v1/models "):
            # The proxy's start-up probe, as a real upstream answers it: not one of the test's requests.
            writer.write(MODELS)
            writer.close()
            return
        seen.connections += 1
        seen.count_open(+1)
        try:
            if silent:
                await reader.read()  # never answers; returns when the client gives up
            while answers:
                head = first if first is not None else await reader.readuntil(b"\r\n\r\n")
                first = None
                seen.heads.append(head)
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                answer = answers.pop(0)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
            else:
                await reader.read()  # nothing left to say: wait for the client to close
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            seen.count_open(-1)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    seen.url = f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
    try:
        yield seen
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.01)  # let the handlers and transports finish closing
