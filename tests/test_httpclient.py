"""app.http.client against hand-written HTTP answers from a raw asyncio server on loopback."""

from __future__ import annotations

import asyncio

import pytest

from app.http.client import ConnectError, ConnectionLost, ConnectTimeout, HTTPClient, ReadTimeout
from tests.canned import canned_server
from tests.servers import free_port

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_an_interim_100_continue_is_skipped_for_the_real_answer() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
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
