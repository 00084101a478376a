"""app.http.client against hand-written HTTP answers from a raw asyncio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from app.http.client import ConnectError, ConnectionLost, ConnectTimeout, HTTPClient, ReadTimeout
from tests.servers import free_port


@asynccontextmanager
async def raw_server(answers: list[bytes], *, close_after: bool = False, silent: bool = False) -> AsyncIterator[str]:
    """Answers each request (read up to its blank line + body) with the next canned bytes."""

    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            if silent:
                await reader.read()  # never answers; returns when the client gives up
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(answers.pop(0))
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.01)  # let the handlers and transports finish closing


async def test_an_interim_100_continue_is_skipped_for_the_real_answer() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with raw_server([answer, b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\ntwo"]) as url:
        client = HTTPClient()
        first = await client.request("POST", url + "/x", body=b"{}")
        assert (first.status, await first.read()) == (200, b"ok")
        first.release()
        second = await client.request("POST", url + "/x", body=b"{}")
        assert (second.status, await second.read()) == (200, b"two")
        second.release()
        await client.close()


async def test_bytes_arriving_on_an_idle_connection_close_it_instead_of_answering_the_next_request() -> None:
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"
    async with raw_server([stray, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh"]) as url:
        client = HTTPClient()
        first = await client.request("GET", url + "/")
        assert await first.read() == b"ok"
        first.release()
        await asyncio.sleep(0.05)  # the stray answer lands while the connection is idle
        second = await client.request("GET", url + "/")
        assert await second.read() == b"fresh"
        second.release()
        await client.close()


async def test_a_head_answer_has_no_body_whatever_its_content_length() -> None:
    async with raw_server([b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"]) as url:
        client = HTTPClient(read_timeout=5)
        answer = await client.request("HEAD", url + "/")
        assert (answer.status, await answer.read()) == (200, b"")
        answer.release()
        await client.close()


async def test_a_body_framed_by_the_connection_closing_is_read_whole() -> None:
    async with raw_server([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"], close_after=True) as url:
        client = HTTPClient()
        answer = await client.request("GET", url + "/")
        assert await answer.read() == b"all of it"
        answer.release()
        await client.close()


async def test_a_connection_dropped_mid_body_is_connection_lost() -> None:
    async with raw_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"], close_after=True) as url:
        client = HTTPClient()
        answer = await client.request("GET", url + "/")
        with pytest.raises(ConnectionLost):
            await answer.read()
        await client.close()


async def test_silence_is_a_read_timeout() -> None:
    async with raw_server([], silent=True) as url:
        client = HTTPClient(read_timeout=0.2)
        with pytest.raises(ReadTimeout):
            await client.request("GET", url + "/")
        await client.close()


async def test_nobody_listening_is_a_connect_error() -> None:
    client = HTTPClient()
    with pytest.raises(ConnectError) as caught:
        await client.request("GET", f"http://127.0.0.1:{free_port()}/")
    assert not isinstance(caught.value, ConnectTimeout)
    await client.close()
