"""The upstream pool: retries, streaming and credentials against the fake upstream in memory
(`app.http.memory`, no socket); what only a misbehaving server sends, against canned bytes."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import orjson
import pytest

from app.http.client import ConnectionLost, HTTPClient, Origin
from app.http.memory import ASGIConnector
from app.service.errors import UpstreamUnreachable
from app.service.upstream import UpstreamPool, response_headers
from app.tools.fake_upstream import FakeUpstream
from tests.canned import canned_server
from tests.factories import chat_request
from tests.servers import fake_upstream, free_port

JSON = [(b"content-type", b"application/json")]


@contextmanager
def in_memory(upstream: FakeUpstream, **options: object) -> Iterator[tuple[UpstreamPool, ASGIConnector]]:
    connector = ASGIConnector(upstream)
    client = HTTPClient(connector=connector, read_timeout=5)
    roots = options.pop("roots", ["http://upstream:8000"])
    yield UpstreamPool(roots, backoff_s=0.001, client=client, **options), connector  # type: ignore[arg-type]


def body(**fields: object) -> bytes:
    return orjson.dumps(chat_request(**fields))


async def test_a_503_is_retried_until_the_upstream_answers_and_the_last_connection_is_kept() -> None:
    fake = FakeUpstream()
    with in_memory(fake) as (pool, connector):
        payload = body(fake_upstream={"status": 503, "fail_times": 2, "retry_after": 0})
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=payload) as answer:
            assert answer.status == 200
            assert orjson.loads(await answer.read())["object"] == "chat.completion"
        assert fake.requests == 3
        assert connector.connections == 3  # each retried answer, left unread, closed its connection
        await asyncio.sleep(0)
        assert connector.open == 1  # the one read to its end is kept for the next request
        await pool.close()


async def test_a_refused_connection_is_retried_on_a_new_one() -> None:
    fake = FakeUpstream()
    memory = ASGIConnector(fake)
    refusals = 2

    async def refusing_twice(origin: Origin, protocol: asyncio.Protocol) -> asyncio.BaseTransport:
        nonlocal refusals
        if refusals:
            refusals -= 1
            raise ConnectionRefusedError(111, "Connection refused")
        return await memory(origin, protocol)

    pool = UpstreamPool(["http://upstream:8000"], backoff_s=0.001, client=HTTPClient(connector=refusing_twice))
    async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()) as answer:
        assert answer.status == 200
        await answer.read()
    assert (fake.requests, refusals) == (1, 0)
    assert not pool.replicas[0].healthy  # skipped until a probe passes
    assert await pool.probe(pool.replicas[0])
    assert pool.replicas[0].healthy
    await pool.close()


async def test_a_stream_arrives_event_by_event_and_ends_with_done() -> None:
    with in_memory(FakeUpstream()) as (pool, _):
        payload = body(stream=True, fake_upstream={"chunk_delay_ms": 1})
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=payload) as answer:
            assert answer.content_type.startswith("text/event-stream")
            assert not answer.framed_by_close
            events = [chunk async for chunk in answer.iter_chunks()]
        assert len(events) > 3
        assert all(event.startswith(b"data: ") for event in events)
        assert events[-1] == b"data: [DONE]\n\n"
        await pool.close()


async def test_a_stream_the_upstream_cuts_raises_connection_lost_and_the_connection_is_gone() -> None:
    with in_memory(FakeUpstream()) as (pool, connector):
        payload = body(stream=True, fake_upstream={"disconnect_after_chunks": 2})
        events: list[bytes] = []

        async def stream() -> None:
            async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=payload) as answer:
                async for chunk in answer.iter_chunks():
                    events.append(chunk)

        with pytest.raises(ConnectionLost):
            await stream()
        assert b"".join(events).count(b"data: ") == 2  # what came before the cut got through
        await asyncio.sleep(0)
        assert connector.open == 0
        await pool.close()


async def test_a_client_that_leaves_mid_stream_stops_the_upstream() -> None:
    with in_memory(FakeUpstream()) as (pool, connector):
        payload = body(stream=True, fake_upstream={"chunk_delay_ms": 1})
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=payload) as answer:
            async for _ in answer.iter_chunks():
                answer.abort()
                break
        await asyncio.sleep(0)
        assert connector.open == 0
        await pool.close()


async def test_a_body_over_max_response_bytes_is_a_502_naming_the_setting() -> None:
    with in_memory(FakeUpstream(), max_response_bytes=100) as (pool, _):
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()) as answer:
            with pytest.raises(UpstreamUnreachable, match=r"over max_response_bytes \(100 bytes\)"):
                await answer.read()
        await pool.close()


async def test_credentials_in_the_upstream_url_are_sent_as_basic_auth_and_shown_as_stars() -> None:
    fake = FakeUpstream()
    with in_memory(fake, roots=["http://us%40er:p%3Ass@upstream:8000"]) as (pool, _):
        assert pool.replicas[0].url == "http://***@upstream:8000"
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()) as answer:
            await answer.read()
        expected = "Basic " + base64.b64encode(b"us@er:p:ss").decode()
        assert fake.last_headers["authorization"] == expected
        assert fake.last_headers["host"] == "upstream:8000"
        assert await pool.probe(pool.replicas[0])  # the probe is sent with them too
        assert fake.last_headers["authorization"] == expected
        await pool.close()


async def test_an_upstream_api_key_wins_over_credentials_in_the_url() -> None:
    fake = FakeUpstream()
    with in_memory(fake, roots=["http://user:secret@upstream:8000"], api_key="KEY") as (pool, _):
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()) as answer:
            await answer.read()
        assert fake.last_headers["authorization"] == "Bearer KEY"
        await pool.close()


async def test_the_credentials_of_an_unreachable_upstream_are_never_in_the_error() -> None:
    pool = UpstreamPool([f"http://user:s3cret@127.0.0.1:{free_port()}"], retries=1, backoff_s=0.001)
    with pytest.raises(UpstreamUnreachable) as caught:
        async with pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()):
            pass
    assert "s3cret" not in caught.value.message
    assert "***@127.0.0.1" in caught.value.message
    await pool.close()


def test_headers_a_connection_header_names_are_not_forwarded_either_way() -> None:
    pool = UpstreamPool(["http://upstream:8000"])
    sent = pool.upstream_headers(
        [
            (b"connection", b"keep-alive, X-Hop"),
            (b"x-hop", b"1"),
            (b"connection", b"x-other"),
            (b"x-other", b"2"),
            (b"x-kept", b"3"),
        ]
    )
    assert [name for name, _ in sent] == [b"x-kept", b"accept-encoding"]
    passed = response_headers([(b"connection", b"close, x-mine"), (b"x-mine", b"1"), (b"x-request-id", b"7")])
    assert passed == [(b"x-request-id", b"7")]


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 5000 + b"\r\n",
    ],
    ids=["101", "too-many-headers"],
)
async def test_an_invalid_answer_is_a_502_at_once_without_retries(answer: bytes) -> None:
    async with canned_server([answer] * 4) as server:
        pool = UpstreamPool([server.url], retries=3, backoff_s=0.001, read_timeout_s=30)
        with pytest.raises(UpstreamUnreachable, match="invalid answer"):
            async with (
                asyncio.timeout(5),
                pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()),
            ):
                pass
        assert server.connections == 1
        assert pool.replicas[0].healthy  # it answers: the fault is in what it says
        await pool.close()


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ({"status": 503, "retry_afetr": 1}, "unknown fault 'retry_afetr'; the faults are latency_ms, status,"),
        ({"latency_ms": "200"}, "latency_ms must be a number from 0 to 3,600,000, not '200'"),
        ({"latency_ms": 1e300}, "latency_ms must be a number from 0 to 3,600,000, not 1e+300"),
        ({"disconnect_after_chunks": True}, "disconnect_after_chunks must be an integer from 0 to"),
        ({"disconnect_after_chunks": 1.5}, "disconnect_after_chunks must be an integer from 0 to"),
        ({"status": 99}, "status must be an integer from 200 to 599, not 99"),
        ({"error_with_status": 1000}, "error_with_status must be an integer from 200 to 599, not 1000"),
        ([{"status": 503}], "fake_upstream must be an object of faults (latency_ms, status,"),
        ({"disconnect_after_chunks": 2}, "disconnect_after_chunks act(s) on streamed answers only"),
        ({"error_with_status": 204}, "error_with_status 204 cannot carry the error it injects"),
        ({"error_with_status": 304}, "error_with_status 304 cannot carry the error it injects"),
        ({"chunk_delay_ms": 5, "latency_ms": 1}, "chunk_delay_ms act(s) on streamed answers only"),
    ],
)
async def test_the_fake_upstream_refuses_a_fault_it_does_not_know_rather_than_answer_without_it(
    fault: object, says: str
) -> None:
    # A test asking for a misspelt fault would get a healthy answer, and pass without testing anything.
    async with fake_upstream() as (url, fake), httpx.AsyncClient(base_url=url) as client:
        answer = await client.post("/v1/chat/completions", json=chat_request(fake_upstream=fault))
    assert answer.status_code == 400
    assert says in answer.json()["error"]["message"]
    assert fake.generations == 0


async def test_the_fake_upstreams_injected_304_has_no_body_to_spill_into_the_next_answer() -> None:
    """A fault allowed (200-599) must give a well-formed answer: under uvicorn, a 304 written with its
    error body left those bytes on the connection, where the client read them as the next answer."""
    async with fake_upstream() as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        for fault in ({"status": 304}, {"status": 304, "fail_times": 5}):
            body = orjson.dumps(chat_request(fake_upstream=fault))
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            writer.write(head + b"content-length: %d\r\n\r\n%b" % (len(body), body))
            status_line = await reader.readline()
            assert status_line.startswith(b"HTTP/1.1 304"), status_line
            headers = (await reader.readuntil(b"\r\n\r\n")).lower()
            assert b"content-length" not in headers
            assert b"transfer-encoding" not in headers
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200"), "the 304's body was read as the next answer"
        writer.close()


@pytest.mark.parametrize("fault", [[], 0, False, ""])
async def test_the_fake_upstream_refuses_a_fake_upstream_that_is_empty_but_not_an_object(fault: object) -> None:
    async with fake_upstream() as (url, fake), httpx.AsyncClient(base_url=url) as client:
        answer = await client.post("/v1/chat/completions", json=chat_request(fake_upstream=fault))
    assert answer.status_code == 400
    assert "fake_upstream must be an object of faults" in answer.json()["error"]["message"]
    assert fake.generations == 0


@pytest.mark.parametrize("value", ["nan", "NaN", "-nan"])
async def test_a_retry_after_of_nan_is_ignored_not_slept_on(value: str) -> None:
    """float() takes "nan": asyncio.sleep(nan) never wakes under asyncio (the request stalls, holding its
    slot), and raises ValueError under uvloop (a 500 in place of the retry)."""
    busy = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %b\r\nContent-Length: 2\r\n\r\n{}" % value.encode()
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    async with canned_server([busy, ok]) as server:
        pool = UpstreamPool([server.url], retries=3, backoff_s=0.001, read_timeout_s=30)
        async with (
            asyncio.timeout(10),
            pool.request("POST", "/v1/chat/completions", headers=JSON, body=body()) as answer,
        ):
            assert answer.status == 200
        await pool.close()
