"""app.http.server, connection, exchange over raw sockets: framing, order, errors, backpressure, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest

import app.http.connection
from app.http.asgi import Answer
from app.http.connection import MAX_HEADER_BYTES, HTTPConnection
from app.http.exchange import HIGH_WATER
from app.http.server import HTTPServer
from app.service.asgi import Message, Receive, Scope, Send
from tests.servers import lifespan_optional
from tests.waiting import eventually


class App:
    """A small ASGI app whose paths exercise the server; it records what it saw."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.events: list[str] = []
        self.lifespan: list[str] = []
        self.fail_startup = False
        self.go_on = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.run_lifespan(receive, send)
            return
        path = scope["path"]
        self.calls.append(path)
        if path == "/echo":
            body = await read_all(receive)
            await answer(send, 200, body, [(b"x-method", scope["method"].encode())])
        elif path == "/slow":
            await asyncio.sleep(float(scope["query_string"] or b"0.05"))
            await answer(send, 200, b"slow")
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path == "/fail-before":
            raise RuntimeError("boom before")
        elif path == "/fail-after":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("boom after")
        elif path == "/fail-after-start":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise RuntimeError("boom between start and body")
        elif path == "/nothing":
            return
        elif path == "/until-disconnect":
            await read_all(receive)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"waiting", "more_body": True})
            message = await receive()
            self.events.append(message["type"])
        elif path == "/work-after":
            await answer(send, 200, b"answered")
            await asyncio.sleep(0.1)
            self.events.append("work done")
        elif path == "/refuse":
            await answer(send, 401, b"no")  # without reading the body
        elif path == "/big":
            await answer(send, 200, b"x" * (8 * HIGH_WATER))
        elif path == "/overlong":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"okHTTP/1.1 200 OK\r\n\r\nforged"})
        elif path == "/head-first":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await self.go_on.wait()  # the test lets it go on once it has read the headers
            await send({"type": "http.response.body", "body": b"body", "more_body": False})
        elif path == "/fast":
            await read_all(receive)
            seen = scope["extensions"].get("seen")
            await answer(send, 200, b"asgi saw " + (seen or b"nothing"))
        else:
            await answer(send, 404, b"no such path")

    async def run_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.fail_startup:
                    raise ValueError("cannot start: the disk is gone")
                self.lifespan.append("startup")
                await send({"type": "lifespan.startup.complete"})
            else:
                self.lifespan.append("shutdown")
                await send({"type": "lifespan.shutdown.complete"})
                return


async def read_all(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    head = [(b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def fast(path: str, headers: list[tuple[bytes, bytes]], body: bytes, extensions: dict[str, Any]) -> Answer | None:
    if body == b"explode":
        raise RuntimeError("fast path bug")
    if body == b"hit":
        return Answer(200, [(b"x-cache", b"HIT")], b"from the fast path")
    extensions["seen"] = body
    return None


def render_error(status: int, message: str) -> tuple[bytes, bytes]:
    """The app's error format for the server's own refusals (the server itself knows none)."""
    return b"application/json", json.dumps({"error": message, "status": status}).encode()


@contextlib.asynccontextmanager
async def serving(app: Any, **options: Any) -> AsyncIterator[HTTPServer]:
    server = HTTPServer(app, port=0, **{"render_error": render_error, **options})
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown()


class Conn:
    """A raw client connection: bytes out, parsed responses in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, server: HTTPServer) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", server.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        async with asyncio.timeout(5):
            status_line = await self.reader.readuntil(b"\r\n")
            status = int(status_line.split()[1])
            headers: dict[bytes, bytes] = {}
            while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.rstrip(b"\r\n").partition(b": ")
                headers[name.lower()] = value
            if status == 100:
                return status, headers, b""
            if b"content-length" in headers:
                return status, headers, await self.reader.readexactly(int(headers[b"content-length"]))
            body = b""
            if headers.get(b"transfer-encoding") == b"chunked":
                while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                    body += (await self.reader.readexactly(size + 2))[:-2]
                await self.reader.readexactly(2)
            return status, headers, body

    async def closed_by_server(self) -> bool:
        async with asyncio.timeout(5):
            at_end = await self.reader.read() == b""
        self.close()
        return at_end

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode() + body


def get(path: str, *extra: str, version: str = "1.1") -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"GET {path} HTTP/{version}\r\nHost: t\r\n{head}\r\n".encode()


async def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        for text in (b"first", b"second", b"third"):
            await conn.send(post("/echo", text))
            status, headers, body = await conn.response()
            assert (status, body) == (200, text)
            assert b"date" in headers
            assert b"connection" not in headers
        conn.close()


@pytest.mark.parametrize("ending", ["connection: close", "the client leaves mid-answer"])
async def test_a_closed_connection_is_freed_at_once_without_the_cyclic_collector(ending: str) -> None:
    """A connection held in a reference cycle (its parser holds its methods) waits for a full collection,
    and under steady load thousands wait at once (bench/README.md, soak): refcounting must free it."""
    app = App()
    async with serving(app) as server:
        gc.disable()
        try:
            conn = await Conn.open(server)
            await eventually(lambda: bool(server.connections), "the connection is never accepted")
            ref = weakref.ref(next(iter(server.connections)))
            if ending == "connection: close":
                await conn.send(post("/echo", b"bye", "Connection: close"))
                assert (await conn.response())[0] == 200
            else:
                await conn.send(post("/until-disconnect", b""))
                await eventually(lambda: "/until-disconnect" in app.calls, "the request never reaches the app")
            conn.close()
            await eventually(lambda: not server.connections and not server.tasks, "the connection never closes")
            # (its ended task's last references go a loop turn or two later)
            await eventually(lambda: ref() is None, "the closed connection is left for the cyclic collector")
        finally:
            gc.enable()


async def test_pipelined_requests_are_answered_in_order_even_when_a_fast_answer_could_overtake() -> None:
    app = App()
    async with serving(app, fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(get("/slow?0.1") + post("/fast", b"hit") + post("/echo", b"last"))
        bodies = [(await conn.response())[2] for _ in range(3)]
        # The hit behind a slow request is not answered out of turn: it goes the ordinary way.
        assert bodies == [b"slow", b"asgi saw nothing", b"last"]
        conn.close()


async def test_http_1_0_closes_unless_keep_alive_is_asked_for() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/echo", version="1.0"))
        status, headers, _ = await conn.response()
        assert status == 200
        assert headers[b"connection"] == b"close"
        assert await conn.closed_by_server()

        conn = await Conn.open(server)
        await conn.send(get("/echo", "Connection: keep-alive", version="1.0"))
        status, headers, _ = await conn.response()
        assert headers[b"connection"] == b"keep-alive"
        await conn.send(get("/echo", "Connection: keep-alive", version="1.0"))
        assert (await conn.response())[0] == 200
        conn.close()


async def test_connection_close_from_the_client_is_honoured() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(post("/echo", b"bye", "Connection: close"))
        status, headers, body = await conn.response()
        assert (status, body, headers[b"connection"]) == (200, b"bye", b"close")
        assert await conn.closed_by_server()


async def test_expect_100_continue_is_answered_when_the_app_reads_the_body() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert (await conn.response())[0] == 100
        await conn.send(b"hello")
        assert (await conn.response())[2] == b"hello"
        conn.close()


async def test_a_chunked_request_body_reaches_the_app_whole() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        head = b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        await conn.send(head + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        assert (await conn.response())[2] == b"hello world"
        conn.close()


async def test_a_body_larger_than_the_buffer_is_read_with_backpressure_and_arrives_intact() -> None:
    big = bytes(range(256)) * (3 * HIGH_WATER // 256)
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(post("/echo", big))
        status, _, body = await conn.response()
        assert status == 200
        assert body == big
        await conn.send(post("/echo", b"after"))
        assert (await conn.response())[2] == b"after"
        conn.close()


async def test_a_streamed_answer_is_sent_chunked() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/stream"))
        _status, headers, body = await conn.response()
        assert headers[b"transfer-encoding"] == b"chunked"
        assert body == b"one two three"
        await conn.send(get("/stream"))
        assert (await conn.response())[2] == b"one two three"
        conn.close()


async def test_a_streams_headers_are_sent_before_its_first_part_exists() -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(get("/head-first"))
        async with asyncio.timeout(5):
            head = await conn.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        app.go_on.set()
        async with asyncio.timeout(5):
            assert await conn.reader.readuntil(b"0\r\n\r\n") == b"4\r\nbody\r\n0\r\n\r\n"
        conn.close()


async def test_head_gets_the_headers_without_a_body() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n" + get("/echo"))
        status_line = await conn.reader.readuntil(b"\r\n\r\n")
        assert b"content-length: 0" in status_line
        assert b"x-method: HEAD" in status_line
        assert (await conn.response())[0] == 200  # the next answer follows right away: no body in between
        conn.close()


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n", 431),
        (b"GET /" + b"a" * (MAX_HEADER_BYTES + 1) + b" HTTP/1.1\r\n\r\n", 414),
    ],
    ids=["malformed", "headers too large", "request line too long"],
)
async def test_a_request_the_server_cannot_take_gets_an_error_and_the_connection_closes(
    data: bytes, status: int
) -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(data)
        got, headers, body = await conn.response()
        assert got == status
        assert headers[b"connection"] == b"close"
        assert b'"error"' in body
        assert await conn.closed_by_server()
    assert app.calls == []


async def test_an_app_failing_before_its_answer_gives_a_500_envelope(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(App()) as server:
        for path in ("/fail-before", "/nothing"):
            conn = await Conn.open(server)
            await conn.send(get(path))
            status, headers, body = await conn.response()
            assert status == 500
            assert b'"error"' in body
            assert headers[b"connection"] == b"close"
            assert await conn.closed_by_server()
    assert "boom before" in caplog.text
    assert "did not finish its answer" in caplog.text


async def test_an_app_failing_before_a_byte_of_its_answer_left_still_gets_a_500() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/fail-after-start"))
        status, headers, body = await conn.response()
        assert (status, headers[b"connection"]) == (500, b"close")
        assert b'"error"' in body
        assert await conn.closed_by_server()


async def test_an_app_failing_mid_answer_cuts_the_connection() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/fail-after"))
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        assert received.startswith(b"HTTP/1.1 200 OK")
        assert b"partial" in received
        assert not received.endswith(b"0\r\n\r\n")  # no terminating chunk: the client sees it cut short
        conn.close()


async def test_the_app_hears_the_client_leave() -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(get("/until-disconnect"))
        await conn.reader.readuntil(b"waiting")
        conn.close()
        for _ in range(100):
            if app.events:
                break
            await asyncio.sleep(0.01)
    assert app.events == ["http.disconnect"]


async def test_idle_keep_alive_connections_are_closed() -> None:
    async with serving(App(), keep_alive_s=0.05) as server:
        conn = await Conn.open(server)
        await conn.send(get("/echo"))
        await conn.response()
        assert await conn.closed_by_server()


async def test_shutdown_lets_requests_in_flight_finish_and_refuses_new_connections() -> None:
    app = App()
    server = HTTPServer(app, port=0, shutdown_grace_s=5)
    await server.start()
    busy, idle = await Conn.open(server), await Conn.open(server)
    await busy.send(get("/slow?0.2"))
    await idle.send(get("/work-after"))
    assert (await idle.response())[2] == b"answered"
    await eventually(lambda: any(c.active is not None for c in server.connections), "/slow never started")
    stopping = asyncio.create_task(server.shutdown())
    await eventually(lambda: server.closing, "the shutdown never began")
    status, headers, body = await busy.response()
    assert (status, body, headers[b"connection"]) == (200, b"slow", b"close")
    assert await busy.closed_by_server()
    assert await idle.closed_by_server()
    with pytest.raises(ConnectionRefusedError):
        await Conn.open(server)
    await stopping
    # Work an app does after its answer is waited for too, before the lifespan ends.
    assert app.events == ["work done"]
    assert app.lifespan == ["startup", "shutdown"]


async def test_shutdown_cuts_requests_that_outlast_the_grace_period(caplog: pytest.LogCaptureFixture) -> None:
    server = HTTPServer(App(), port=0, shutdown_grace_s=0.05)
    await server.start()
    conn = await Conn.open(server)
    await conn.send(get("/slow?30"))
    await eventually(lambda: bool(server.tasks), "/slow never started")
    async with asyncio.timeout(5):
        await server.shutdown()
    assert await conn.closed_by_server()
    assert "still in flight" in caplog.text


async def test_a_failing_startup_raises_the_apps_own_error_and_serves_nothing() -> None:
    app = App()
    app.fail_startup = True
    server = HTTPServer(app, port=0)
    with pytest.raises(ValueError, match="the disk is gone"):
        await server.start()
    assert not server.started.is_set()


async def test_the_fast_path_answers_whole_requests_without_the_app() -> None:
    app = App()
    async with serving(app, fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(post("/fast", b"hit"))
        status, headers, body = await conn.response()
        assert (status, body, headers[b"x-cache"]) == (200, b"from the fast path", b"HIT")
        assert app.calls == []
        # What it does not answer goes to the app with what the fast path left in the extensions.
        await conn.send(post("/fast", b"miss"))
        assert (await conn.response())[2] == b"asgi saw miss"
        assert app.calls == ["/fast"]
        conn.close()


async def test_a_failing_fast_path_falls_back_to_the_app(caplog: pytest.LogCaptureFixture) -> None:
    app = App()
    async with serving(app, fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(post("/fast", b"explode"))
        assert (await conn.response())[2] == b"asgi saw nothing"
        conn.close()
    assert "fast path bug" in caplog.text


async def test_the_fast_path_is_skipped_for_expect_continue_and_other_methods() -> None:
    app = App()
    async with serving(app, fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(b"POST /fast HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert (await conn.response())[0] == 100
        await conn.send(b"hit")
        assert (await conn.response())[2] == b"asgi saw nothing"
        await conn.send(get("/fast"))
        assert (await conn.response())[2] == b"asgi saw nothing"
        conn.close()
    assert app.calls == ["/fast", "/fast"]


async def test_percent_encoded_paths_are_decoded_and_the_raw_path_kept() -> None:
    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await App().run_lifespan(receive, send)
            return
        seen.append({"path": scope["path"], "raw_path": scope["raw_path"], "query": scope["query_string"]})
        await answer(send, 200, b"")

    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(get("/v1/a%2Fb%20c?x=1&y=%20"))
        await conn.response()
        conn.close()
    assert seen == [{"path": "/v1/a/b c", "raw_path": b"/v1/a%2Fb%20c", "query": b"x=1&y=%20"}]


async def test_an_answer_given_before_the_body_is_read_reaches_a_client_still_sending() -> None:
    big = b"x" * (4 * HIGH_WATER)
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(post("/refuse", big))  # the server reads on (and drops) the body it did not need
        assert (await conn.response())[2] == b"no"
        await conn.send(get("/echo"))  # and the connection is still usable
        assert (await conn.response())[0] == 200
        conn.close()


async def test_an_answer_given_before_100_continue_closes_the_connection() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(b"POST /refuse HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        status, headers, _ = await conn.response()
        # The client may now send its next request instead of the body: only a close keeps them apart.
        assert (status, headers[b"connection"]) == (401, b"close")
        assert await conn.closed_by_server()


async def test_many_pipelined_requests_are_all_answered_in_order() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/slow?0.05") + b"".join(post("/echo", b"%d" % i) for i in range(200)))
        assert (await conn.response())[2] == b"slow"
        assert [(await conn.response())[2] for _ in range(200)] == [b"%d" % i for i in range(200)]
        conn.close()


async def test_a_header_line_that_never_ends_is_refused_with_431() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(b"GET / HTTP/1.1\r\nX-Endless: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(2 * MAX_HEADER_BYTES // 4096 + 8):
                await conn.send(b"a" * 4096)
                await asyncio.sleep(0)
        assert (await conn.response())[0] == 431
        conn.close()


async def test_http_1_0_gets_a_streamed_answer_ended_by_the_close_not_chunks() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/stream", "Connection: keep-alive", version="1.0"))
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        head, _, body = received.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head
        assert b"connection: close" in head
        assert body == b"one two three"
        conn.close()


async def test_a_malformed_body_of_a_running_request_gets_400() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        status, headers, _ = await conn.response()
        assert (status, headers[b"connection"]) == (400, b"close")
        assert await conn.closed_by_server()


async def test_a_malformed_request_behind_a_good_one_is_refused_after_its_answer() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/slow?0.05") + b"GARBAGE\r\n\r\n")
        assert (await conn.response())[2] == b"slow"
        assert (await conn.response())[0] == 400
        assert await conn.closed_by_server()


async def test_an_answer_longer_than_its_content_length_is_never_sent() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(get("/overlong"))
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        assert b"forged" not in received
        assert received.startswith(b"HTTP/1.1 500")
        conn.close()


async def test_shutdown_delivers_a_large_answer_to_a_slow_reader_in_full() -> None:
    server = HTTPServer(App(), port=0, shutdown_grace_s=10)
    await server.start()
    conn = await Conn.open(server)
    await conn.send(get("/big"))
    # answered into the socket's buffer (and the transport's), not yet read
    answered = lambda: any(c.requests == 1 and not c.owes_answers for c in server.connections)  # noqa: E731
    await eventually(answered, "/big was never answered")
    stopping = asyncio.create_task(server.shutdown())
    await eventually(lambda: server.closing, "the shutdown never began")
    assert len((await conn.response())[2]) == 8 * HIGH_WATER
    assert await conn.closed_by_server()
    await stopping


async def test_shutdown_waits_for_a_fast_path_request_whose_body_is_still_arriving() -> None:
    app = App()
    server = HTTPServer(app, port=0, fast=fast, fast_paths=["/fast"], shutdown_grace_s=5)
    await server.start()
    conn = await Conn.open(server)
    request = post("/fast", b"miss")
    await conn.send(request[:-2])
    await eventually(lambda: any(c.parsing is not None for c in server.connections), "the body never began")
    stopping = asyncio.create_task(server.shutdown())
    await eventually(lambda: server.closing, "the shutdown never began")
    await conn.send(request[-2:])
    status, headers, body = await conn.response()
    assert (status, body, headers[b"connection"]) == (200, b"asgi saw miss", b"close")
    assert await conn.closed_by_server()
    await stopping


async def test_a_client_that_half_closes_still_gets_the_answers_already_made() -> None:
    async with serving(App(), fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(post("/fast", b"hit") + post("/echo", b"quick"))
        conn.writer.write_eof()
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        assert b"from the fast path" in received
        assert received.endswith(b"quick")
        conn.close()


async def test_a_client_that_pipelines_without_reading_is_not_buffered_without_end() -> None:
    # A short grace: the server, no longer reading, cannot tell that this client has left.
    async with serving(App(), fast=fast, fast_paths=["/fast"], shutdown_grace_s=0.2) as server:
        conn = await Conn.open(server)
        requests = post("/fast", b"hit") * 5000

        async def flood() -> None:
            while True:
                conn.writer.write(requests)
                await conn.writer.drain()  # blocks once the server stops reading

        flooding = asyncio.create_task(flood())
        seen_paused, most_buffered = False, 0
        loop = asyncio.get_running_loop()
        start = loop.time()
        # A deadline, not a duration: filling the client's and the server's socket buffers with answers
        # takes ~100k of them, seconds on a machine busy with other tests.
        while loop.time() - start < 60 and not (seen_paused and loop.time() - start > 0.5):
            await asyncio.sleep(0.01)
            for connection in server.connections:
                seen_paused = seen_paused or connection.reading_paused
                most_buffered = max(most_buffered, connection.transport.get_write_buffer_size())
        flooding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flooding
        assert seen_paused  # it stopped reading requests while their answers could not be written
        assert most_buffered < 4 * HIGH_WATER
        conn.close()


async def test_pipelined_requests_in_large_reads_are_not_mistaken_for_huge_headers() -> None:
    async with serving(App(), fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(post("/fast", b"hit") * 3000 + post("/echo", b"x" * (3 * MAX_HEADER_BYTES)) + get("/echo"))
        answers = [await conn.response() for _ in range(3002)]
        assert {status for status, _, _ in answers} == {200}
        conn.close()


async def test_nothing_is_answered_after_a_connection_close_answer() -> None:
    async with serving(App(), fast=fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(post("/fast", b"hit", "Connection: close") + b"GARBAGE\r\n\r\n")
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        assert received.count(b"HTTP/1.1") == 1
        assert received.endswith(b"from the fast path")
        conn.close()


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1)


async def test_fast_answers_made_in_one_turn_are_written_together_at_its_end() -> None:
    """Each write wakes a sleeping client: the answers of one turn go out back to back, in order."""
    server = HTTPServer(App(), port=0, fast=fast, fast_paths=["/fast"])
    transports = [RecordingTransport() for _ in range(3)]
    connections = [HTTPConnection(server) for _ in transports]
    for connection, transport in zip(connections, transports, strict=True):
        connection.connection_made(transport)
        connection.data_received(post("/fast", b"hit") + post("/fast", b"hit"))
    assert all(t.writes == [] for t in transports)  # nothing written while requests are being parsed
    await asyncio.sleep(0)
    for transport in transports:
        assert len(transport.writes) == 1
        assert transport.writes[0].count(b"from the fast path") == 2
    # A write that cannot wait (an error, a stream) sends what was queued before it first.
    connections[0].write_soon(b"first ")
    connections[0].write(b"second")
    assert transports[0].writes[1:] == [b"first second"]


@pytest.fixture(autouse=True)
def _log_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="app")


async def test_a_client_reading_a_big_answer_slowly_is_not_taken_for_one_that_reads_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stall cut (`SEND_STALL_S`) timed one wait for the whole buffered piece: a client below a piece per
    stall (a MiB of a file's content in 60 s: 17 KB/s) was cut part-way though it read all along."""
    monkeypatch.setattr(app.http.connection, "SEND_STALL_S", 1.0)
    piece = b"x" * (256 << 10)  # over the write buffer's high water, and well over a stall at the client's pace
    small_buffers = asyncio.Event()

    async def big(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await small_buffers.wait()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % (2 * len(piece)))]}
        )
        await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": piece, "more_body": False})

    async with serving(lifespan_optional(big)) as server:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", server.port))
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await eventually(lambda: len(server.connections) == 1, "the connection was never accepted")
        # the kernel's buffers small on both ends, as across a slow link: the pieces wait in the server's
        (connection,) = server.connections
        connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        small_buffers.set()
        received = 0
        while chunk := await loop.sock_recv(client, 4096):  # some 200 KB/s
            received += len(chunk)
            await asyncio.sleep(0.02)
        client.close()
    assert received > 2 * len(piece)  # the head, and the whole body
