"""The chaos suite's harness itself: what it leaves behind is found in whichever test collects it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import warnings

import pytest

from tests.chaos.harness import Forwarder


async def test_a_forwarder_closed_under_open_connections_leaves_no_socket_and_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As at the end of a run that failed: connections piped to a backend that holds them open, others
    just accepted (their pipe not yet begun, or connecting to the backend) when the front is closed."""
    held: list[asyncio.StreamWriter] = []
    reached = asyncio.Event()

    async def holding(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(1)
        reached.set()
        await reader.read()  # until the forwarder closes its side

    backend = await asyncio.start_server(holding, "127.0.0.1", 0)
    front = Forwarder(backend.sockets[0].getsockname()[1])
    await front.start()
    clients: list[asyncio.StreamWriter] = []
    try:
        _, piped = await asyncio.open_connection("127.0.0.1", front.port)
        clients.append(piped)
        piped.write(b"x")
        await reached.wait()
        for _ in range(8):  # closed before their pipes have run, or have reached the backend
            clients.append((await asyncio.open_connection("127.0.0.1", front.port))[1])
        await front.close()
    finally:
        for writer in [*clients, *held]:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        backend.close()
        await backend.wait_closed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("steps", range(12))
async def test_a_forwarder_closed_while_its_pipes_shut_their_sockets_waits_for_them(steps: int) -> None:
    """The backend closes the connection, and the front is closed `steps` turns of the loop later: at
    some of them the pipe is waiting for its sockets to close (`close` must neither cancel that wait
    into an error of its own nor leave a socket)."""
    bye = asyncio.Event()

    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()
        await writer.wait_closed()
        bye.set()

    backend = await asyncio.start_server(closing, "127.0.0.1", 0)
    front = Forwarder(backend.sockets[0].getsockname()[1])
    await front.start()
    reader, client = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        client.write(b"x")
        await bye.wait()
        for _ in range(steps):
            await asyncio.sleep(0)
        await front.close()
        assert await reader.read() == b""
    finally:
        client.close()
        with contextlib.suppress(OSError):
            await client.wait_closed()
        backend.close()
        await backend.wait_closed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
