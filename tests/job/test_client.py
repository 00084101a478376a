"""app.job.client: ProxyJob against a real proxy on a loopback port (in this event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.http.client import ConnectError, ConnectionLost, HTTPClient, ReadTimeout
from app.job.client import ProxyJob, ProxyJobError
from app.service.app import create_app, create_server
from app.service.asgi import send_bytes
from app.service.settings import Settings
from tests.canned import canned_server
from tests.job.conftest import Env
from tests.servers import free_port, serve_in_loop


async def test_service_errors_arrive_as_proxy_job_errors(env: Env) -> None:
    job = ProxyJob(env.proxy, rank=1)
    await job.write_documents([{"id": f"x{i}", "text": "t"} for i in range(4)], 0)
    with pytest.raises(ProxyJobError, match="409: chunk 0 is already complete") as caught:
        await job.write_documents([{"id": "late", "text": "t"}], 0)
    assert caught.value.status == 409
    await job.close()


async def test_a_retry_after_a_lost_answer_that_completed_the_chunk_counts_as_done(env: Env) -> None:
    from app.http.client import ConnectionLost

    job = ProxyJob(env.proxy)
    real_request = job._client.request
    lost = False

    @contextlib.asynccontextmanager
    async def answer_lost_once(method: str, url: str, **kwargs: Any) -> AsyncIterator[Any]:
        nonlocal lost
        async with real_request(method, url, **kwargs) as response:
            if url.endswith("/documents") and not lost:
                lost = True
                await response.read()
                raise ConnectionLost("the proxy died before answering", before_response=True)
            yield response

    job._client.request = answer_lost_once  # type: ignore[method-assign]
    answer = await job.write_documents([{"id": f"d{i}", "text": "t"} for i in range(4)], 0)
    assert answer["duplicates"] == 4
    assert (await job.resume()).last_chunk_index == 0
    await job.close()


async def test_documents_written_together_go_in_few_requests_and_each_caller_learns_its_own_fate(
    tmp_path: Path,
) -> None:
    seen: list[int] = []  # documents per POST /documents the proxy got

    class Counting:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/documents":
                body = b""
                while True:
                    message = await receive()
                    body += message.get("body", b"")
                    if not message.get("more_body"):
                        break
                seen.append(len(json.loads(body)))
                sent = False

                async def replay() -> dict[str, Any]:
                    nonlocal sent
                    if sent:
                        return {"type": "http.disconnect"}
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}

                await self.app(scope, replay, send)
                return
            await self.app(scope, receive, send)

    settings = Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=tmp_path / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=100,
    )
    async with serve_in_loop(Counting(create_app(settings))) as proxy:
        job = ProxyJob(proxy)
        good = [{"id": f"d{i}", "text": "t"} for i in range(42)]
        await asyncio.gather(*(job.write_document(d, 0) for d in good[:40]))
        assert seen == [40]  # written together: one request, one fsync at the proxy
        bad = {"id": "", "text": "an empty id is refused"}
        results = await asyncio.gather(
            *(job.write_document(d, 0) for d in [good[40], bad, good[41]]), return_exceptions=True
        )
        assert results[0] is None
        assert results[2] is None
        refused = results[1]
        assert isinstance(refused, ProxyJobError)
        assert refused.status == 400
        assert "id must be a non-empty string" in refused.message
        state = await job.resume()
        await job.close()
    assert state.processed_ids == frozenset(d["id"] for d in good)
    # the proxy takes a batch whole or not at all: refused, its documents went again one by one
    assert seen == [40, 3, 1, 1, 1]


async def test_a_call_whose_answer_stops_midway_closes_its_connection_on_the_read_timeout() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]) as upstream:
        job = ProxyJob(upstream.url, client=HTTPClient(read_timeout=0.2))
        with pytest.raises(ReadTimeout):
            await job.resume()
        await asyncio.wait_for(upstream.until_open(0), 5)
        await job.close()


@contextlib.asynccontextmanager
async def proxy_holding_writes(tmp_path: Path) -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event, list[str]]]:
    """A proxy whose POST /documents waits for `release` once `arrived`; `answered` notes each answer sent."""
    arrived, release = asyncio.Event(), asyncio.Event()
    answered: list[str] = []
    settings = Settings(
        upstream=["http://127.0.0.1:9"], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out")
    )
    app = create_app(settings)

    async def holding(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/documents":
            arrived.set()
            await release.wait()
            await app(scope, receive, send)
            answered.append("documents")
            return
        await app(scope, receive, send)

    async with serve_in_loop(holding) as proxy:
        try:
            yield proxy, arrived, release, answered
        finally:
            release.set()  # or the server's shutdown waits for the held request


async def test_close_waits_for_the_documents_on_their_way_and_sends_no_more(tmp_path: Path) -> None:
    async with proxy_holding_writes(tmp_path) as (proxy, arrived, release, answered):
        job = ProxyJob(proxy)
        sent = asyncio.create_task(job.write_document({"id": "sent", "text": "t"}, 0))
        await arrived.wait()
        queued = asyncio.create_task(job.write_document({"id": "queued", "text": "t"}, 0))
        await asyncio.sleep(0)  # queued behind the batch on its way
        closing = asyncio.create_task(job.close())
        await asyncio.sleep(0)
        release.set()
        await closing
        # answered before close() returned: nothing of this job reaches the proxy after it
        assert answered == ["documents"]
        assert sent.done()
        assert sent.exception() is None
        assert queued.cancelled()
        later = ProxyJob(proxy)
        assert (await later.resume()).processed_ids == {"sent"}
        await later.close()


async def test_close_gives_up_on_documents_unanswered_after_its_grace(tmp_path: Path) -> None:
    async with proxy_holding_writes(tmp_path) as (proxy, arrived, _, answered):
        job = ProxyJob(proxy)
        sent = asyncio.create_task(job.write_document({"id": "sent", "text": "t"}, 0))
        await arrived.wait()
        await job.close(grace_s=0.05)
        with pytest.raises(asyncio.CancelledError):
            await sent
        assert answered == []


def restarting_settings(tmp_path: Path, port: int) -> Settings:
    return Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=tmp_path / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=4,
        host="127.0.0.1",
        port=port,
    )


async def test_a_document_sent_while_its_proxy_restarts_is_written_once_it_is_back(tmp_path: Path) -> None:
    """A refused connection was retried 5 times 0.2 s apart, doubling: 6.2 s, where a proxy restarted by its
    supervisor (and checking its output as it starts) takes longer; the task then failed."""
    port = free_port()
    first = create_server(restarting_settings(tmp_path, port))
    await first.start()
    job = ProxyJob(f"http://127.0.0.1:{port}")
    await job.write_documents([{"id": "d0", "text": "t"}], 0)
    await first.shutdown()  # it restarts: back 7 s later
    restarted: list[Any] = []

    async def restart() -> None:
        await asyncio.sleep(7)
        second = create_server(restarting_settings(tmp_path, port))
        await second.start()
        restarted.append(second)

    back = asyncio.create_task(restart())
    try:
        await job.write_documents([{"id": "d1", "text": "t"}], 0)
        assert (await job.resume()).processed_ids == {"d0", "d1"}
    finally:
        await back
        await job.close()
        for server in restarted:
            await server.shutdown()


async def test_a_proxy_never_reached_fails_the_call_after_its_retries(tmp_path: Path) -> None:
    """The wait for a restart is for a proxy the job has reached before: one never reached is a wrong URL."""
    job = ProxyJob(f"http://127.0.0.1:{free_port()}", retries=2)
    with pytest.raises(ConnectError):
        await job.resume()
    await job.close()


async def test_an_answer_lost_then_a_503_then_409_for_the_chunk_it_completed_counts_as_written(tmp_path: Path) -> None:
    """The 409 was taken for a refusal once a 503 came between the lost answer and it: each document of the
    batch, written and published, then failed (run_job died; the datatrove runner logged each as lost)."""
    app = create_app(restarting_settings(tmp_path, 0))
    documents_seen = 0

    async def refusing_once(scope: Any, receive: Any, send: Any) -> None:
        nonlocal documents_seen
        if scope["type"] == "http" and scope["path"] == "/documents":
            documents_seen += 1
            if documents_seen == 2:  # the retry meets the restarted proxy's 503 (its output not listable yet)
                await send_bytes(send, 503, [(b"retry-after", b"0")], b'{"error": {"message": "x", "code": 503}}')
                return
        await app(scope, receive, send)

    async with serve_in_loop(refusing_once) as proxy:
        job = ProxyJob(proxy)
        real_request, lost = job._client.request, []

        @contextlib.asynccontextmanager
        async def answer_lost_once(method: str, url: str, **kwargs: Any) -> AsyncIterator[Any]:
            async with real_request(method, url, **kwargs) as response:
                if url.endswith("/documents") and not lost:
                    lost.append(True)
                    await response.read()  # written, durable, its chunk complete: then the proxy dies
                    raise ConnectionLost("the proxy died before answering", before_response=True)
                yield response

        job._client.request = answer_lost_once  # type: ignore[method-assign]
        try:
            answer = await job.write_documents([{"id": f"d{i}", "text": "t"} for i in range(4)], 0)
        finally:
            await job.close()
    assert (answer["chunk_index"], answer["duplicates"]) == (0, 4)
