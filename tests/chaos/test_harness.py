"""The chaos suite's harness itself: what it leaves behind is found in whichever test collects it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import warnings
from pathlib import Path

import pytest

from tests.chaos.harness import Forwarder, ProxyProcess, RankJob, UpstreamProcess, chaos_run
from tests.chaos.invariants import Ledger


async def close_all(writers: list[asyncio.StreamWriter], backend: asyncio.Server) -> None:
    """The test's own connections and backend, closed, so that any socket left is the forwarder's."""
    for writer in writers:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    backend.close()
    await backend.wait_closed()


def unclosed_sockets() -> list[str]:
    """The ResourceWarnings of what the garbage collector finds unclosed now."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


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
        await close_all([*clients, *held], backend)
    assert unclosed_sockets() == []
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
        await close_all([client], backend)
    assert unclosed_sockets() == []


@pytest.mark.chaos
async def test_a_hand_over_that_fails_leaves_no_proxy_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The standby a hand-over took is neither the run's proxy nor a standby until the switch: when the
    wait for a publication failed, that process was left running after the test (and its port taken)."""
    monkeypatch.setattr(ProxyProcess, "slowed", lambda self: False)  # no publication is ever under way
    upstream = UpstreamProcess(tmp_path)
    upstream.start()
    front = Forwarder(0)
    proxies: list[ProxyProcess] = []
    try:
        await upstream.ready()
        await front.start()
        shared = {"checkpoints": tmp_path / "checkpoints", "output": tmp_path / "output"}
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            proxies.append(ProxyProcess(tmp_path / name, [upstream.url], "--records-per-chunk=10", **shared))
        ledger = Ledger({0: ["doc-0", "doc-1"]}, 10, replay_window_s=1.0)
        jobs = [RankJob(front.url, ledger, 0, restarts=False)]
        with pytest.raises(AssertionError, match="the jobs ended before a publication"):
            async with chaos_run(proxies[0], ledger, jobs, standby=proxies[1:], front=front) as run:
                await run.hand_over(1.0)
        assert [proxy.url for proxy in proxies if proxy.running()] == []
    finally:
        for proxy in proxies:
            proxy.close()
        await front.close()
        upstream.close()
