"""A client that leaves stops the upstream's work: on answers nobody keeps (routes forwarded without caching,
`forward_uncached`; a cacheable request without `X-Doc-Id` or with `no-store`), and on a cached stream
whose upstream is silent between two events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from app.service.asgi import Receive, Scope, Send, lifespan_noop
from app.service.settings import Settings
from tests.servers import serve_in_loop, serve_proxy

# Under both servers: the upstream must be let go under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")


class SlowUpstream:
    """An upstream that generates slowly on `/v1/slow` (events every 50 ms for 20 s, or silence first with
    `?silent` or on `/v1/chat/completions`, as a non-streamed generation; on `/v1/completions`, silence for
    20 s after the first event) and records when it hears that the proxy let its connection go."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.let_go = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan_noop(receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/models":  # the proxy's start-up probe: answered as a real upstream would
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": b'{"data": []}'})
            return
        watcher = asyncio.create_task(self._watch(receive))
        self.started.set()
        try:
            if scope["query_string"] == b"silent" or scope["path"] == "/v1/chat/completions":
                with contextlib.suppress(TimeoutError):  # thinking, before any byte of the answer
                    await asyncio.wait_for(self.let_go.wait(), 20)
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for n in range(400):
                if self.let_go.is_set():
                    return
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % n, "more_body": True})
                if n == 0 and scope["path"] == "/v1/completions":
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.let_go.wait(), 20)
                else:
                    await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            watcher.cancel()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.let_go.set()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[tuple[str, SlowUpstream]]:
    upstream = SlowUpstream()
    async with serve_in_loop(upstream) as url:
        settings = Settings(upstream=[url], checkpoints_dir=tmp_path / "ckpt", retry_backoff_s=0.001)
        async with serve_proxy(settings) as proxy_url:
            yield proxy_url, upstream


async def open_request(
    proxy_url: str, target: str, body: bytes = b'{"model": "m", "input": "hi", "stream": true}', headers: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"POST {target} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + headers.encode() + b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def test_a_client_that_leaves_mid_stream_stops_the_upstream_of_an_uncached_route(
    proxy: tuple[str, SlowUpstream],
) -> None:
    proxy_url, upstream = proxy
    reader, writer = await open_request(proxy_url, "/v1/slow")
    async with asyncio.timeout(5):
        await reader.readuntil(b"data: 0")
    writer.close()
    # The upstream would go on generating for 20 s; the proxy lets its connection go at once.
    async with asyncio.timeout(3):
        await upstream.let_go.wait()


async def test_a_client_that_leaves_before_the_upstream_answers_stops_the_upstream_of_an_uncached_route(
    proxy: tuple[str, SlowUpstream],
) -> None:
    proxy_url, upstream = proxy
    _, writer = await open_request(proxy_url, "/v1/slow?silent")
    async with asyncio.timeout(5):
        await upstream.started.wait()
    writer.close()
    async with asyncio.timeout(3):
        await upstream.let_go.wait()


@pytest.mark.parametrize(
    "headers", ["", "X-Doc-Id: d\r\nCache-Control: no-store\r\n"], ids=["without-doc-id", "no-store"]
)
async def test_a_client_that_leaves_a_non_streamed_answer_nobody_keeps_stops_the_upstream(
    proxy: tuple[str, SlowUpstream], headers: str
) -> None:
    """Sent straight to vLLM, such a request is cancelled when its client leaves: through the proxy too."""
    proxy_url, upstream = proxy
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false}'
    _, writer = await open_request(proxy_url, "/v1/chat/completions", body, headers)
    async with asyncio.timeout(5):
        await upstream.started.wait()
    writer.close()
    async with asyncio.timeout(3):
        await upstream.let_go.wait()


async def test_a_client_that_leaves_a_stream_while_the_upstream_is_silent_stops_the_upstream_at_once(
    proxy: tuple[str, SlowUpstream],
) -> None:
    """vLLM's server may send nothing for seconds between two events (a CPU engine running ahead of it sends
    the rest at its end): the upstream is let go when the client leaves, not when its next event comes."""
    proxy_url, upstream = proxy
    body = b'{"model": "m", "prompt": "hi", "stream": true}'
    reader, writer = await open_request(proxy_url, "/v1/completions", body, "X-Doc-Id: left\r\n")
    async with asyncio.timeout(5):
        await reader.readuntil(b"data: 0")
    writer.close()
    async with asyncio.timeout(3):  # the upstream is silent for 20 s
        await upstream.let_go.wait()
    async with httpx.AsyncClient() as client:
        lookup = await client.post(proxy_url + "/lookup", json=[{"doc_id": "left", "body": orjson.loads(body)}])
    assert lookup.json() == [None]  # nothing stored
