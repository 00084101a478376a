"""app.http's server against hostile or sloppy clients, over raw sockets: smuggling, methods, limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from typing import Any

import pytest

from app.http.asgi import Answer, Receive, Scope, Send
from app.http.connection import MAX_HEADER_BYTES
from app.http.server import HTTPServer, restartable_port
from tests.http.test_server import App, Conn, answer, get, post, read_all, serving

UPGRADE = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA")


async def wait_for_calls(app: App, count: int) -> None:
    for _ in range(50):
        if len(app.calls) >= count:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("whitespace", [" ", "\t", ""], ids=["trailing space", "trailing tab", "none"])
async def test_an_upgrade_request_with_a_body_is_refused_and_its_body_never_runs_as_a_request(whitespace: str) -> None:
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
    head = f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {len(smuggled)}{whitespace}\r\n"
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(head.encode() + "".join(f"{h}\r\n" for h in UPGRADE).encode() + b"\r\n" + smuggled)
        status, headers, _ = await conn.response()
        assert (status, headers[b"connection"]) == (400, b"close")
        assert await conn.closed_by_server()
        await wait_for_calls(app, 1)
    assert app.calls == []


async def test_an_upgrade_request_with_a_chunked_body_is_refused() -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        head = b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        await conn.send(head + "".join(f"{h}\r\n" for h in UPGRADE).encode() + b"\r\n0\r\n\r\n" + get("/smuggled"))
        assert (await conn.response())[0] == 400
        assert await conn.closed_by_server()
    assert app.calls == []


async def test_an_upgrade_request_without_a_body_is_answered_as_plain_http_and_the_connection_goes_on() -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(get("/echo", *UPGRADE) + post("/echo", b"next"))
        status, headers, _ = await conn.response()
        assert (status, headers[b"x-method"]) == (200, b"GET")
        assert (await conn.response())[2] == b"next"
        await conn.send(post("/echo", b"", *UPGRADE)[:-3])  # split: the rest arrives later
        await asyncio.sleep(0.01)
        await conn.send(b"\r\n\r\n"[-3:] + post("/echo", b"after"))
        assert (await conn.response())[0] == 200
        assert (await conn.response())[2] == b"after"
        conn.close()
    assert app.calls == ["/echo"] * 4


async def test_a_request_refused_after_an_upgrade_is_refused_not_taken_for_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        # Found by the fuzz run: the requests after an Upgrade were parsed inside the handler of
        # llhttp's upgrade exception, so the refusal of one of them was logged as a crash and the
        # connection cut without the answer owed to the first.
        await conn.send(get("/echo", *UPGRADE) + b"TRACE /x HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await conn.response())[0] == 200
        assert (await conn.response())[0] == 501
        assert await conn.closed_by_server()
    assert "broke the server" not in caplog.text


@pytest.mark.parametrize(
    "request_",
    [b"CONNECT upstream:443 HTTP/1.1\r\nHost: upstream:443\r\n\r\n", b"TRACE /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"],
    ids=["CONNECT", "TRACE"],
)
async def test_connect_and_trace_are_refused_by_the_server_itself(request_: bytes) -> None:
    app = App()
    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(request_ + get("/echo"))
        status, headers, body = await conn.response()
        assert (status, headers[b"connection"]) == (501, b"close")
        assert b"not supported" in body
        assert await conn.closed_by_server()
    assert app.calls == []


async def test_a_content_length_with_trailing_whitespace_is_accepted() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        for length in ("5 ", "5\t"):
            await conn.send(f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n\r\nhello".encode())
            assert (await conn.response())[:3:2] == (200, b"hello")
        conn.close()


@pytest.fixture(autouse=True)
def _log_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="app")


async def test_trailer_fields_never_become_request_headers() -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    def recording_fast(path: str, headers: list[tuple[bytes, bytes]], body: bytes, extensions: dict[str, Any]) -> None:
        seen.append(list(headers))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await App().run_lifespan(receive, send)
            return
        body = await read_all(receive)
        seen.append(list(scope["headers"]))
        await answer(send, 200, body)

    head = b"POST %b HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nTrailer: Authorization, X-Doc-Id\r\n\r\n"
    trailers = b"0\r\nAuthorization: Bearer from-the-trailer\r\nX-Doc-Id: 7\r\n\r\n"
    async with serving(app, fast=recording_fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        for path in (b"/echo", b"/fast"):
            await conn.send(head % path + b"5\r\nhello\r\n" + trailers)
            assert (await conn.response())[:3:2] == (200, b"hello")
        conn.close()
    assert len(seen) == 3  # the ASGI path, then the fast path and the ASGI path it fell back to
    for headers in seen:
        assert {name for name, _ in headers} == {b"host", b"transfer-encoding", b"trailer"}


SPLITTING = [
    (b"x-note", b"ok\r\nx-forged: 1"),
    (b"x-note", b"ok\nx-forged: 1"),
    (b"x-note", b"ok\rx-forged: 1"),
    (b"x-note", b"ok\0"),
    (b"x-forged: 1\r\nx-note", b"ok"),
]
SPLITTING_IDS = ["CRLF in a value", "LF in a value", "CR in a value", "NUL in a value", "CRLF in a name"]


@pytest.mark.parametrize("header", SPLITTING, ids=SPLITTING_IDS)
async def test_an_asgi_answer_whose_header_holds_cr_lf_or_nul_becomes_a_500(
    header: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await App().run_lifespan(receive, send)
            return
        await answer(send, 200, b"fine", [header])

    async with serving(app) as server:
        conn = await Conn.open(server)
        await conn.send(get("/"))
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        assert received.startswith(b"HTTP/1.1 500 ")
        assert b"x-forged" not in received
        assert received.count(b"HTTP/1.1") == 1
        conn.close()
    assert "CR, LF or NUL" in caplog.text


@pytest.mark.parametrize("header", SPLITTING, ids=SPLITTING_IDS)
async def test_a_fast_answer_whose_header_holds_cr_lf_or_nul_becomes_a_500(
    header: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    def splitting_fast(
        path: str, headers: list[tuple[bytes, bytes]], body: bytes, extensions: dict[str, Any]
    ) -> Answer:
        return Answer(200, [header], b"fine")

    app = App()
    async with serving(app, fast=splitting_fast, fast_paths=["/fast"]) as server:
        conn = await Conn.open(server)
        await conn.send(post("/fast", b"hit") + post("/fast", b"hit"))
        async with asyncio.timeout(5):
            received = await conn.reader.read()
        assert received.startswith(b"HTTP/1.1 500 ")
        assert b"x-forged" not in received
        assert received.count(b"HTTP/1.1") == 1
        conn.close()
    assert app.calls == []
    assert "CR, LF or NUL" in caplog.text


async def response_while_trickling(conn: Conn) -> tuple[int, dict[bytes, bytes], bytes]:
    """The server's answer while one byte a time keeps arriving, faster than any idle or stall timeout."""

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await conn.send(b"a")
                await asyncio.sleep(0.01)

    trickling = asyncio.create_task(trickle())
    try:
        return await conn.response()
    finally:
        trickling.cancel()


async def test_a_head_trickled_byte_by_byte_is_refused_with_408_once_its_deadline_passes() -> None:
    app = App()
    async with serving(app, keep_alive_s=0.05, head_timeout_s=0.3) as server:
        conn = await Conn.open(server)
        await conn.send(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        status, headers, body = await response_while_trickling(conn)
        assert (status, headers[b"connection"]) == (408, b"close")
        assert b"0.3 s" in body
        conn.close()
    assert app.calls == []


async def test_the_head_deadline_spares_a_body_that_arrives_slowly() -> None:
    async with serving(App(), keep_alive_s=0.05, head_timeout_s=0.1) as server:
        conn = await Conn.open(server)
        await conn.send(post("/echo", b"first"))
        assert (await conn.response())[2] == b"first"
        request = post("/echo", b"a slow body")
        await conn.send(request[:-5])  # the head whole, the body part-way
        await asyncio.sleep(0.4)
        await conn.send(request[-5:])
        assert (await conn.response())[:3:2] == (200, b"a slow body")
        conn.close()


def unsent_bytes(server: HTTPServer) -> int:
    """What the server holds for its clients and has not handed to the kernel: queued answers and transport buffers."""
    return sum(c.unsent_bytes for c in server.connections)


ANSWER_BYTES = 64 * 1024


def big_fast(path: str, headers: list[tuple[bytes, bytes]], body: bytes, extensions: dict[str, Any]) -> Answer:
    return Answer(200, [(b"x-seq", body)], body.ljust(ANSWER_BYTES, b"."))


async def big_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await App().run_lifespan(receive, send)
        return
    body = await read_all(receive)
    await answer(send, 200, body.ljust(4 * ANSWER_BYTES, b"."), [(b"x-seq", body)])


@pytest.mark.parametrize(
    ("options", "path", "count"),
    [({"fast": big_fast, "fast_paths": ["/fast"]}, "/fast", 500), ({}, "/big", 150)],
    ids=["fast path", "ASGI app"],
)
async def test_a_client_that_pipelines_and_never_reads_is_not_answered_past_a_bound(
    options: dict[str, Any], path: str, count: int
) -> None:
    # Each answer is far larger than its request: every answer made at once would be
    # count x answer size (over 30 MB) held for a client that reads none of them.
    async with serving(big_app, **options) as server:
        conn = await Conn.open(server)
        await conn.send(b"".join(post(path, b"%d" % i) for i in range(count)))
        most = 0
        for _ in range(30):  # while the client reads nothing
            await asyncio.sleep(0.01)
            most = max(most, unsent_bytes(server))
        assert most < 1024 * 1024
        # Then it reads: every answer arrives, whole and in order.
        for i in range(count):
            status, headers, body = await conn.response()
            assert (status, headers[b"x-seq"]) == (200, b"%d" % i)
            assert body.startswith(b"%d." % i)
        conn.close()


async def test_a_trailer_line_that_never_ends_is_refused_with_431() -> None:
    async with serving(App()) as server:
        conn = await Conn.open(server)
        await conn.send(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Endless: "
        )
        with contextlib.suppress(ConnectionError):
            for _ in range(2 * MAX_HEADER_BYTES // 4096 + 8):
                await conn.send(b"a" * 4096)
                await asyncio.sleep(0)
        assert (await conn.response())[0] == 431
        conn.close()


class NoContent(App):
    """Answers 204 with a Content-Length and a body, as a careless app (or a replayed cache entry) might."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/no-content":
            await read_all(receive)
            await answer(send, 204, b"stray")
            return
        await super().__call__(scope, receive, send)


def no_content_fast(path: str, headers: list[tuple[bytes, bytes]], body: bytes, extensions: dict[str, Any]) -> Answer:
    return Answer(204, [(b"x-cache", b"HIT")], b"stray")


@pytest.mark.parametrize("via", ["asgi", "fast"])
async def test_a_204_is_written_without_content_length_or_body_and_the_connection_goes_on(via: str) -> None:
    options: dict[str, Any] = {"fast": no_content_fast, "fast_paths": ["/no-content"]} if via == "fast" else {}
    async with serving(NoContent(), **options) as server:
        conn = await Conn.open(server)
        await conn.send(post("/no-content", b"x") + post("/echo", b"after"))
        status, headers, body = await conn.response()
        assert (status, body) == (204, b"")
        assert b"content-length" not in headers  # RFC 9110 §8.6
        status, _, body = await conn.response()
        assert (status, body) == (200, b"after")  # nothing of the 204's "body" was taken for this answer
        conn.close()


def test_a_port_to_restart_on_is_free_and_below_the_ports_the_kernel_hands_out() -> None:
    # The demo restarts its killed proxy on the same port: one the kernel gave out (a bind to port 0) could be
    # given to another process's server in between ("address already in use", once under a loaded test run).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = restartable_port()
    assert 1024 <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
