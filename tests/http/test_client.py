"""app.http.client against hand-written HTTP answers from a raw asyncio server on loopback."""

from __future__ import annotations

import asyncio
import gc
import ssl
import weakref

import pytest
import trustme

from app.http.client import (
    MAX_BUFFER,
    MAX_HEADERS,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HTTPClient,
    InvalidHeader,
    InvalidResponse,
    ReadTimeout,
    ResponseTooLarge,
)
from tests.canned import canned_server
from tests.servers import free_port

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("interim", [b"100 Continue", b"102 Processing", b"103 Early Hints"])
async def test_an_interim_1xx_answer_is_skipped_for_the_real_answer(interim: bytes) -> None:
    answer = b"HTTP/1.1 " + interim + b"\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with canned_server([answer, b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\ntwo"]) as server:
        client = HTTPClient()
        async with client.request("POST", server.url + "/x", body=b"{}") as first:
            assert (first.status, await first.read()) == (200, b"ok")
        async with client.request("POST", server.url + "/x", body=b"{}") as second:
            assert (second.status, await second.read()) == (200, b"two")
        assert server.connections == 1
        await client.close()


async def test_bytes_arriving_on_an_idle_connection_close_it_instead_of_answering_the_next_request() -> None:
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"
    async with canned_server([stray, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh"]) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as first:
            assert await first.read() == b"ok"
        await asyncio.sleep(0.05)  # the stray answer lands while the connection is idle
        async with client.request("GET", server.url + "/") as second:
            assert await second.read() == b"fresh"
        await client.close()


async def test_a_head_answer_has_no_body_whatever_its_content_length() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"]) as server:
        client = HTTPClient(read_timeout=5)
        async with client.request("HEAD", server.url + "/") as answer:
            assert (answer.status, await answer.read()) == (200, b"")
        await client.close()


async def test_a_body_framed_by_the_connection_closing_is_read_whole() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"], close_after=True) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as answer:
            assert await answer.read() == b"all of it"
        await client.close()


async def test_a_connection_dropped_mid_body_is_connection_lost() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"], close_after=True) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as answer:
            with pytest.raises(ConnectionLost):
                await answer.read()
        await client.close()


async def test_a_closed_connection_is_freed_at_once_without_the_cyclic_collector() -> None:
    """Its parser holds its methods: a cycle, left for a full collection unless broken at close (the proxy
    drops an upstream connection so each time a client leaves mid-stream)."""
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]) as server:
        client = HTTPClient()
        gc.disable()
        try:
            async with client.request("GET", server.url + "/") as answer:
                assert answer.status == 200
                ref = weakref.ref(answer._conn)
            del answer
            await asyncio.wait_for(server.until_open(0), 5)
            for _ in range(100):  # the transport tells the connection it is lost a loop turn or two later
                if ref() is None:
                    break
                await asyncio.sleep(0.01)
            assert ref() is None, gc.get_referrers(ref())
        finally:
            gc.enable()
            await client.close()


async def test_silence_is_a_read_timeout() -> None:
    async with canned_server([], silent=True) as server:
        client = HTTPClient(read_timeout=0.2)
        with pytest.raises(ReadTimeout):
            async with client.request("GET", server.url + "/"):
                pass
        await client.close()


async def test_nobody_listening_is_a_connect_error() -> None:
    client = HTTPClient()
    with pytest.raises(ConnectError) as caught:
        async with client.request("GET", f"http://127.0.0.1:{free_port()}/"):
            pass
    assert not isinstance(caught.value, ConnectTimeout)
    await client.close()


async def test_a_body_read_to_its_end_leaves_the_connection_for_the_next_request() -> None:
    async with canned_server([OK, OK]) as server:
        client = HTTPClient()
        for _ in range(2):
            async with client.request("GET", server.url + "/") as answer:
                assert await answer.read() == b"ok"
        assert server.connections == 1
        await client.close()


async def test_leaving_the_block_before_the_end_of_the_body_closes_the_connection() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as answer:
            assert answer.status == 200
        await asyncio.wait_for(server.until_open(0), 5)
        await client.close()


async def test_a_read_timeout_mid_body_closes_the_connection() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]) as server:
        client = HTTPClient(read_timeout=0.1)
        with pytest.raises(ReadTimeout):
            async with client.request("GET", server.url + "/") as answer:
                await answer.read()
        await asyncio.wait_for(server.until_open(0), 5)
        await client.close()


async def test_a_cancelled_read_closes_the_connection() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]) as server:
        client = HTTPClient()

        async def read() -> None:
            async with client.request("GET", server.url + "/") as answer:
                await answer.read()

        task = asyncio.create_task(read())
        await asyncio.wait_for(server.until_open(1), 5)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.until_open(0), 5)
        await client.close()


async def until_refused(url: str, client: HTTPClient) -> InvalidResponse:
    """The error entering a request to `url` raises, within 5 s (instead of the read timeout's 30)."""
    with pytest.raises(InvalidResponse) as caught:
        async with asyncio.timeout(5), client.request("GET", url):
            pass
    return caught.value


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * 200_000,  # one field that never ends
        b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 20_000,  # small fields without end
        b"HTTP/1.1 100 Continue\r\n\r\n" * 20_000,  # interim answers without end
        b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * (MAX_HEADERS + 1) + b"Content-Length: 0\r\n\r\n",
    ],
    ids=["endless-field", "endless-fields", "endless-interim", "too-many-fields"],
)
async def test_a_response_head_over_the_limits_is_refused_at_once_and_the_connection_closed(head: bytes) -> None:
    async with canned_server([head]) as server:
        client = HTTPClient(read_timeout=30)
        error = await until_refused(server.url + "/", client)
        assert "head over" in str(error) or "header fields" in str(error)
        await asyncio.wait_for(server.until_open(0), 5)
        await client.close()


@pytest.mark.parametrize(
    "status_line",
    [
        b"101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade",
        b"101 Switching Protocols",
        b"099 Too Low\r\nContent-Length: 0",
        b"600 Too High\r\nContent-Length: 0",
    ],
)
async def test_101_and_statuses_outside_100_599_are_refused_at_once(status_line: bytes) -> None:
    async with canned_server([b"HTTP/1.1 " + status_line + b"\r\n\r\nmore bytes"]) as server:
        client = HTTPClient(read_timeout=30)
        error = await until_refused(server.url + "/", client)
        assert f"status {int(status_line[:3])}" in str(error)
        await client.close()


async def test_trailer_fields_of_a_chunked_body_never_become_headers() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Cache: HIT\r\n\r\n"
    async with canned_server([chunked, OK]) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as answer:
            assert await answer.read() == b"ok"
            assert answer.header(b"x-cache") is None
            assert [name for name, _ in answer.headers] == [b"transfer-encoding"]
        async with client.request("GET", server.url + "/") as again:  # and the connection is still good
            assert await again.read() == b"ok"
        assert server.connections == 1
        await client.close()


@pytest.mark.parametrize(
    "header",
    [(b"x-a", b"1\r\nx-injected: 2"), (b"x-a", b"1\n"), (b"x-a", b"1\r"), (b"x-a", b"nul\0"), (b"x-a\r\nx-b", b"1")],
)
async def test_a_cr_lf_or_nul_in_a_header_is_refused_before_anything_is_sent(header: tuple[bytes, bytes]) -> None:
    async with canned_server([OK]) as server:
        client = HTTPClient()
        with pytest.raises(InvalidHeader, match=r"has a CR, LF or NUL"):
            async with client.request("GET", server.url + "/", headers=[(b"x-fine", b"ok"), header]):
                pass
        assert server.connections == 0
        await client.close()


async def test_read_refuses_a_body_over_max_response_bytes_and_streaming_has_no_such_limit() -> None:
    body = b"x" * 100
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + body
    async with canned_server([answer, answer, answer]) as server:
        client = HTTPClient(max_response_bytes=99)
        with pytest.raises(ResponseTooLarge, match=r"over 99 bytes"):
            async with client.request("GET", server.url + "/") as first:
                await first.read()
        async with client.request("GET", server.url + "/") as second:
            assert b"".join([chunk async for chunk in second.iter_chunks()]) == body
        client.max_response_bytes = 100
        async with client.request("GET", server.url + "/") as third:
            assert await third.read() == body
        await client.close()


@pytest.mark.parametrize(
    ("answer", "by_close"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", False),
    ],
)
async def test_a_body_that_ends_with_the_connection_is_marked_framed_by_close(answer: bytes, by_close: bool) -> None:
    async with canned_server([answer], close_after=True) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as response:
            await response.read()
            assert response.framed_by_close is by_close
        await client.close()


async def test_a_kept_connection_the_server_closed_while_idle_is_replaced_and_the_request_sent_again() -> None:
    # The first connection answers once, then takes the next request and closes without answering:
    # as a server does when its keep-alive timeout strikes just as the request arrives.
    async with canned_server([OK, None, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh"]) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as first:
            assert await first.read() == b"ok"
        async with client.request("GET", server.url + "/") as second:
            assert await second.read() == b"fresh"
        assert server.connections == 2
        assert len(server.heads) == 3  # the request was sent twice: once on each connection
        await client.close()


async def test_at_most_max_idle_connections_are_kept_per_origin() -> None:
    async with canned_server([OK] * 4) as server:
        client = HTTPClient(max_idle=2)

        async def one() -> None:
            async with client.request("GET", server.url + "/") as answer:
                await answer.read()
                await asyncio.sleep(0.05)  # all four are in use at once

        await asyncio.gather(*(one() for _ in range(4)))
        assert server.connections == 4
        await asyncio.wait_for(server.until_open(2), 5)  # two closed, two kept
        await client.close()
        await asyncio.wait_for(server.until_open(0), 5)


async def test_a_consumer_slower_than_the_server_holds_at_most_max_buffer_unread() -> None:
    size = 16 * MAX_BUFFER
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size
    async with canned_server([answer]) as server:
        client = HTTPClient()
        async with client.request("GET", server.url + "/") as response:
            received, paused = 0, False
            async for chunk in response.iter_chunks():
                received += len(chunk)
                await asyncio.sleep(0.002)  # slower than loopback: the client must stop reading the socket
                paused = paused or response._conn.paused
                # what sits unread in the client: at most MAX_BUFFER plus the one read that crossed it
                assert response._conn.buffered <= MAX_BUFFER + 256 * 1024
            assert received == size
            assert paused  # the socket was paused, then resumed to the end
        await client.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    return context


async def test_https_to_a_server_whose_ca_the_client_trusts_works_and_keeps_the_connection(ca: trustme.CA) -> None:
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    async with canned_server([OK, OK], tls=server_context(ca)) as server:
        assert server.url.startswith("https://localhost:")
        client = HTTPClient(ssl_context=trusting)
        for _ in range(2):
            async with client.request("GET", server.url + "/") as answer:
                assert (answer.status, await answer.read()) == (200, b"ok")
        assert server.connections == 1
        await client.close()


async def test_https_to_a_certificate_the_client_does_not_trust_is_a_connect_error(ca: trustme.CA) -> None:
    async with canned_server([OK], tls=server_context(ca)) as server:
        client = HTTPClient()  # the system's CAs: not this one
        with pytest.raises(ConnectError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            async with client.request("GET", server.url + "/"):
                pass
        await client.close()
