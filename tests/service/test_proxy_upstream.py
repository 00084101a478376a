"""The proxy in front of upstreams that misbehave or are large: what it passes on, what it stores."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.http.client import HTTPClient
from app.http.client_connection import ClientConnection
from app.service.affinity import ranking
from app.service.asgi import Message, Receive, Scope, Send
from app.service.routes.proxy import stream_through
from app.service.settings import Settings
from app.service.upstream import Replica, UpstreamPool, UpstreamResponse
from app.tools.fake_upstream import FakeUpstream
from tests.canned import canned_server
from tests.factories import chat_request, doc_headers
from tests.servers import fake_upstream, free_port, proxy_client, serve_in_loop, serve_proxy

ANSWER = orjson.dumps({"object": "chat.completion", "choices": [{"message": {"content": "hi"}}]})


def settings(tmp_path: Path, upstream: str, **overrides: Any) -> Settings:
    defaults: dict[str, Any] = {"retry_backoff_s": 0.001, "checkpoints_dir": tmp_path / "ckpt"}
    return Settings(upstream=[upstream], **{**defaults, **overrides})


async def test_an_answer_framed_by_the_connection_closing_is_passed_on_but_never_cached(tmp_path: Path) -> None:
    close_delimited = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n" + ANSWER
    async with (
        canned_server([close_delimited, close_delimited], close_after=True) as upstream,
        proxy_client(settings(tmp_path, upstream.url)) as client,
    ):
        first = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        second = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
    assert (first.status_code, first.content) == (200, ANSWER)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "MISS")
    assert upstream.connections == 2


async def test_an_answer_over_max_response_bytes_is_a_502_and_nothing_is_stored(tmp_path: Path) -> None:
    async with (
        fake_upstream() as (url, upstream),
        proxy_client(settings(tmp_path, url, max_response_bytes=100)) as client,
    ):
        answers = [
            await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers()) for _ in range(2)
        ]
    assert [a.status_code for a in answers] == [502, 502]
    assert "max_response_bytes" in answers[0].json()["error"]["message"]
    assert upstream.generations == 2  # nothing was stored to answer the second


async def test_a_stream_over_max_response_bytes_is_passed_on_whole_but_not_stored(tmp_path: Path) -> None:
    request = chat_request(stream=True, max_tokens=50)
    async with (
        fake_upstream() as (url, upstream),
        proxy_client(settings(tmp_path, url, max_response_bytes=300)) as client,
    ):
        first = await client.post("/v1/chat/completions", json=request, headers=doc_headers())
        second = await client.post("/v1/chat/completions", json=request, headers=doc_headers())
    assert first.status_code == 200
    assert len(first.content) > 300
    assert first.content.rstrip().endswith(b"data: [DONE]")
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "MISS")
    assert upstream.generations == 2


async def test_a_101_from_the_upstream_is_a_502_at_once(tmp_path: Path) -> None:
    switching = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
    async with (
        canned_server([switching] * 4) as upstream,
        proxy_client(settings(tmp_path, upstream.url, read_timeout_s=60)) as client,
    ):
        async with asyncio.timeout(10):  # instead of read_timeout_s
            answer = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
    assert answer.status_code == 502
    assert "status 101" in answer.json()["error"]["message"]
    assert upstream.connections == 1  # not retried


async def test_credentials_in_the_upstream_url_reach_it_as_basic_auth(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream):
        with_credentials = url.replace("http://", "http://user:s3cret@")
        async with proxy_client(settings(tmp_path, with_credentials)) as client:
            answer = await client.post("/v1/chat/completions", json=chat_request())
            stats = await client.get("/stats")
    assert answer.status_code == 200
    assert upstream.last_headers["authorization"] == "Basic " + base64.b64encode(b"user:s3cret").decode()
    assert "s3cret" not in stats.text


async def test_credentials_in_an_unreachable_upstream_url_are_never_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    down = f"http://user:s3cret@127.0.0.1:{free_port()}"
    async with proxy_client(settings(tmp_path, down, upstream_retries=0)) as client:
        answers = [
            await client.post("/v1/chat/completions", json=chat_request()),
            await client.get("/readyz"),
            await client.get("/stats"),
        ]
    assert [a.status_code for a in answers] == [502, 503, 200]
    for answer in answers:
        assert "s3cret" not in answer.text
        assert "***@127.0.0.1" in answer.text
    assert "***@127.0.0.1" in caplog.text  # the start-up lines name the upstream
    assert "s3cret" not in caplog.text


async def _warnings(caplog: pytest.LogCaptureFixture, count: int) -> list[str]:
    """The WARNING lines logged so far, once there are `count` of them (the probe runs in the background)."""
    found: list[str] = []
    for _ in range(1000):
        found = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if len(found) >= count:
            break
        await asyncio.sleep(0.01)
    return found


async def test_an_upstream_that_does_not_answer_at_start_is_a_warning_naming_it_without_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    dead = f"127.0.0.1:{free_port()}"
    async with fake_upstream() as (alive, _):
        both = settings(tmp_path, alive).model_copy(update={"upstream": [alive, f"http://user:s3cret@{dead}"]})
        async with serve_proxy(both):
            warnings = await _warnings(caplog, 1)
            await asyncio.sleep(0.2)  # room for a wrong second line about the live upstream
            warnings = await _warnings(caplog, 1)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"upstream http://***@{dead} does not answer GET /v1/models (")
    assert "s3cret" not in caplog.text


async def test_an_upstream_that_never_answers_neither_delays_the_start_nor_the_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, never answers
        upstream = f"http://127.0.0.1:{silent.getsockname()[1]}"
        async with proxy_client(settings(tmp_path, upstream)) as client:
            assert (await client.get("/healthz")).status_code == 200
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the probe still waits
    # the stop cancelled the probe: no line about it, and no error from it
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_client_that_leaves_as_its_stream_ends_never_drops_a_connection_another_request_took() -> None:
    """`stream_through` drops the upstream's connection from a callback once the client is gone. A client
    that leaves in the loop turn its stream ends has that callback run a turn later, once the connection is
    back in the pool: it must not drop it under the request that took it meanwhile (that request was sent
    twice). The three steps are released together, so that asyncio runs them in that order."""
    stream = b"data: 1\n\ndata: [DONE]\n\n"
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (len(stream), stream)
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    loop = asyncio.get_running_loop()
    left: asyncio.Future[Message] = loop.create_future()
    sent: asyncio.Future[None] = loop.create_future()
    next_request: asyncio.Future[None] = loop.create_future()
    sending = asyncio.Event()
    async with canned_server([sse, plain, plain]) as upstream:
        client = HTTPClient()

        async def receive() -> Message:
            return await left

        async def send(message: Message) -> None:
            if message.get("body") and connection[0].complete:  # its last piece: held until the test lets it go
                sending.set()
                await sent

        async def streamed() -> bytes | None:
            async with client.request("POST", upstream.url + "/v1/completions") as raw:
                connection.append(raw._conn)
                answer = UpstreamResponse(raw, Replica(upstream.url), 1 << 20)
                return await stream_through(answer, receive, send, [], 1 << 20)

        async def another() -> bytes:
            await next_request
            async with client.request("POST", upstream.url + "/v1/other") as raw:
                return await raw.read()

        connection: list[ClientConnection] = []
        streaming, other = asyncio.create_task(streamed()), asyncio.create_task(another())
        try:
            async with asyncio.timeout(10):
                await sending.wait()
                left.set_result({"type": "http.disconnect"})
                sent.set_result(None)
                next_request.set_result(None)
                assert await streaming == stream
                assert await other == b"{}"
        finally:
            streaming.cancel()
            other.cancel()
            await client.close()
    assert (upstream.connections, len(upstream.heads)) == (1, 2)  # sent once, on the connection the stream had


async def test_identical_requests_waiting_on_a_timed_out_one_get_its_504_and_are_not_sent_again(
    tmp_path: Path,
) -> None:
    # A read timeout is not retried (the GPU may still be working on it), and identical requests in flight
    # cost one generation: the leader's 504 landed its flight empty, and each follower in turn sent the
    # request again and waited a read_timeout_s of its own (a review: 4 sent, the last answered after 2 s).
    body = chat_request(fake_upstream={"latency_ms": 3000})  # silent far past read_timeout_s
    async with (
        fake_upstream() as (url, upstream),
        proxy_client(settings(tmp_path, url, read_timeout_s=0.5)) as client,
    ):
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body, headers=doc_headers()) for _ in range(4))
        )
        sent = upstream.requests
        totals = (await client.get("/stats")).json()["totals"]
    assert sorted((a.status_code, a.headers["x-cache"]) for a in answers) == [
        (504, "COALESCED"),
        (504, "COALESCED"),
        (504, "COALESCED"),
        (504, "MISS"),
    ]
    assert {a.json()["error"]["type"] for a in answers} == {"upstream_timeout"}
    assert sent == 1
    assert totals["coalesced"] == 0  # no generation saved


async def test_an_identical_request_sharing_an_upstream_429_gets_its_retry_after(tmp_path: Path) -> None:
    # An upstream 429 is passed on as it came, with its Retry-After: the follower's answer was rebuilt from
    # the stored form, which has no Retry-After, and counted as coalesced, a generation saved.
    body = chat_request(fake_upstream={"status": 429, "retry_after": 7, "latency_ms": 300})
    async with fake_upstream() as (url, upstream), proxy_client(settings(tmp_path, url, upstream_retries=0)) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body, headers=doc_headers()) for _ in range(2))
        )
        totals = (await client.get("/stats")).json()["totals"]
    assert sorted((a.status_code, a.headers["x-cache"]) for a in answers) == [(429, "COALESCED"), (429, "MISS")]
    assert [a.headers.get("retry-after") for a in answers] == ["7", "7"]
    assert upstream.requests == 1
    assert totals["coalesced"] == 0


async def test_an_identical_request_sharing_a_kept_answer_is_counted_coalesced(tmp_path: Path) -> None:
    body = chat_request(fake_upstream={"latency_ms": 300})
    async with fake_upstream() as (url, upstream), proxy_client(settings(tmp_path, url)) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body, headers=doc_headers()) for _ in range(2))
        )
        totals = (await client.get("/stats")).json()["totals"]
    assert sorted((a.status_code, a.headers["x-cache"]) for a in answers) == [(200, "COALESCED"), (200, "MISS")]
    assert answers[0].content == answers[1].content
    assert (upstream.requests, totals["coalesced"], totals["misses"]) == (1, 1, 1)


class SlowModels:
    """A working replica (the fake upstream, answering as model `slow`) whose `GET /v1/models` takes
    `delay_s`, as a busy engine's API server may."""

    def __init__(self, delay_s: float) -> None:
        self.fake = FakeUpstream(model="slow")
        self.delay_s = delay_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            await asyncio.sleep(self.delay_s)
        await self.fake(scope, receive, send)


async def test_readyz_takes_no_replica_out_of_the_routing(tmp_path: Path) -> None:
    # Only a request's failure takes a replica out (a refused connection, a 502/503): /readyz's 2 s probe
    # marked a replica slow to list its models unhealthy, and its documents moved to the other replica.
    async with (
        serve_in_loop(SlowModels(2.5)) as slow,
        fake_upstream(model="fast") as (fast, _),
        proxy_client(
            Settings(upstream=[slow, fast], retry_backoff_s=0.001, checkpoints_dir=tmp_path / "ckpt")
        ) as client,
    ):
        replicas = UpstreamPool([slow, fast]).replicas
        doc = next(f"doc-{i}" for i in range(100) if ranking(f"doc-{i}".encode(), replicas)[0].url == slow)
        before = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Doc-Id": doc})
        assert before.json()["model"] == "slow"  # its home replica
        ready = await client.get("/readyz")
        assert (ready.status_code, ready.json()["upstreams"]) == (200, {slow: False, fast: True})
        healthy = {u["url"]: u["healthy"] for u in (await client.get("/stats")).json()["upstreams"]}
        after = await client.post("/v1/completions", json={"prompt": "y"}, headers={"X-Doc-Id": doc})
    assert healthy == {slow: True, fast: True}
    assert after.json()["model"] == "slow"


async def test_an_identical_request_sharing_a_2xx_error_the_cache_does_not_keep_is_not_counted_coalesced(
    tmp_path: Path,
) -> None:
    # A 2xx whose body is an error envelope is passed on and never stored: sharing it saved no generation.
    body = chat_request(fake_upstream={"error_with_status": 200, "latency_ms": 300})
    async with fake_upstream() as (url, _), proxy_client(settings(tmp_path, url)) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body, headers=doc_headers()) for _ in range(2))
        )
        again = await client.post("/v1/chat/completions", json=body, headers=doc_headers())
        totals = (await client.get("/stats")).json()["totals"]
    assert sorted((a.status_code, a.headers["x-cache"]) for a in answers) == [(200, "COALESCED"), (200, "MISS")]
    assert again.headers["x-cache"] == "MISS"  # not kept: generated again
    assert totals["coalesced"] == 0
